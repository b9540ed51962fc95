"""Lossless mode: self-speculative decoding from a checkpoint's exit head (the loop is `decode.lossless`).

Drafting runs each token through the shallow layers 0..E only (E = the draft layer), on the model's own
cache (`shallow.py`): those layers' K/V are exactly what the full model writes. The exit head at E drafts the
next token. Verification (`verifier.py`) runs the last draft through the shallow layers, then the deep layers
E+1..L-1 over all the drafted positions at once (their layer-E states were kept), which makes the cache even
again and gives the full model's logits for every position. Acceptance (`accept.py`: the longest greedy prefix,
the speculative-sampling rule, a tree's walk), cache cropping, logits processors, stopping criteria, streaming of
accepted tokens and the counters are the decode loop's (`loop.py`). Batch size 1. No router or
threshold is involved: a wrong draft costs time, never output. Drafts read the full model's final normed state at the
position before the drafted token (the "context") when the draft layer has a draft head
(`TideForCausalLM.draft_logits`); verification computes that state for every position it checks, and the
accepted count picks the next draft's.

`LosslessSession` is a call's configuration and shared resources; `start` makes the call's `ShallowPasses`,
`Verifier` and drafter. `ChainDrafter` drafts chains from the head, or the n-gram continuation where there is one
(`ngram.NgramDrafter`); with `draft_topk` > 1, `tree.TreeDrafter` drafts one tree instead (the head's
candidates and the n-gram continuation as a deeper branch). Drafters only propose: the loop's backend verifies
a chain or a tree and `accept.py` decides what is kept. Drafters check the call's stopping criteria through one
`Stops`.
"""
from __future__ import annotations

import torch

from ...layers.args import LayerArgs, grown_mask
from ...layers.spans import SpanRunner
from ..dispatch import base_forward
from ..stats import GenerationStats
from .chain import ChainDrafter
from .drafts import Drafter, Stops
from .ngram import NgramDrafter, NgramLookup
from .shallow import ShallowPasses
from .tree import TreeDrafter
from .verifier import Verifier

__all__ = ["LosslessSession"]


class LosslessSession:
    """One lossless `generate` call: its configuration and the resources its drafters and verifier share (the
    model's parts and layer runs, the layer arguments, the counters; from `start`, the call's cache, mask and
    verifier)."""

    def __init__(self, model, config, spans: SpanRunner | None = None):
        self.model, self.base, self.parts = model, model.base, model.parts
        self.spans = spans or SpanRunner(self.parts)  # the shallow and the deep layers' runs (compiled or eager)
        self.draft_layer = config.resolve_draft_layer(model.checkpoints, self.parts.num_layers)
        # drafts run the draft layer's heads on its states: they must share its device and dtype
        model.routers.check_placement(self.draft_layer, next(self.parts.layers[self.draft_layer].parameters()))
        self.options = config  # the call's options (`TideGenerationConfig`), read where they are used
        self.draft_topk = config.draft_topk if self.parts.spec.tree_drafts else 1  # (trees where the family takes them)
        self.stats = GenerationStats(self.parts.num_layers, [self.draft_layer], mode="lossless", kv_strategy="exact",
                                     draft_vocab_size=config.draft_vocab_size, switches=config.switches)
        self.original_forward = base_forward(model.base)
        self.layer_args = LayerArgs(self.parts)  # drafted tokens' and verification's layer arguments
        self.fused_chain_first = False  # a compiled call drafts greedy chains as one graph a cycle where it can,
        #   whatever tree or n-gram scheme its config names (`graph.py`)
        self.cache = self.mask = None  # the call's, from `start`: its KV cache, the prompt's mask (None: no padding)
        self.verifier: Verifier | None = None

    @property
    def context(self) -> torch.Tensor | None:
        """[1, H] the full model's final normed state before the next drafted token (the verifier's)."""
        return self.verifier.context

    def start(self, generation_config, logits_processor, stopping_criteria, cache, mask) -> Drafter:
        """The call's verifier (`self.verifier`) and its drafter: a chain, or a tree of `draft_topk` candidates
        (greedy or sampling)."""
        self.cache, self.mask = cache, mask
        shallow = ShallowPasses(self, cache)
        self.verifier = Verifier(self, cache, shallow)
        stops = Stops(stopping_criteria, generation_config.max_length)
        sample = bool(generation_config.do_sample)
        ngrams = (NgramDrafter(self, NgramLookup(self.options.draft_ngram), shallow, self.verifier, stops, sample)
                  if self.options.draft_ngram else None)
        chain = ChainDrafter(self, shallow, self.verifier, stops, ngrams, logits_processor, sample)
        if self.draft_topk > 1 and self.options.head_drafts:
            return TreeDrafter(self, shallow, self.verifier, stops, ngrams, chain, logits_processor)
        return chain

    def grown_mask(self, length: int):
        """The prompt's mask grown to a sequence of `length` tokens (None: no padding)."""
        return grown_mask(self.mask, length)
