"""Lossless mode: self-speculative decoding from a checkpoint's exit head (the loop is `decode.lossless`).

Drafting runs each token through the shallow layers 0..E only (E = the draft layer), on the model's own
cache (`shallow.py`): those layers' K/V are exactly what the full model writes. The exit head at E drafts the
next token. Verification (`verifier.py`) runs the last draft through the shallow layers, then the deep layers
E+1..L-1 over all the drafted positions at once (their layer-E states were kept), which makes the cache even
again and gives the full model's logits for every position. Acceptance (`accept.py`: the longest greedy prefix,
the speculative-sampling rule, a tree's walk), cache cropping, logits processors, stopping criteria, streaming of
accepted tokens and the counters are the decode loop's (`decode/lossless.py`). Batch size 1. No router or
threshold is involved: a wrong draft costs time, never output. Drafts read the full model's final normed state at the
position before the drafted token (the "context") when the draft layer has a draft head
(`TideForCausalLM.draft_logits`); verification computes that state for every position it checks, and the
accepted count picks the next draft's.

`LosslessSession` is a call's configuration and shared resources; `start` makes the call's `ShallowPasses`,
`Verifier` and drafter. `ChainDrafter` drafts chains from the head, or the n-gram continuation where there is one
(`ngram.NgramDrafter`); with `draft_topk` > 1, `treedraft.TreeDrafter` drafts one tree instead (the head's
candidates and the n-gram continuation as a deeper branch). Drafters only propose: the loop's backend verifies
a chain or a tree and `accept.py` decides what is kept. Drafters check the call's stopping criteria through one
`Stops`.
"""

from __future__ import annotations

import torch

from ..layers.args import LayerArgs, grown_mask
from ..layers.spans import SpanRunner
from .dispatch import base_forward
from .drafts import Draft, Drafter
from .ngram import NgramDrafter, NgramLookup
from .processors import process
from .shallow import ShallowPasses
from .stats import GenerationStats
from .treedraft import TreeDrafter
from .verifier import LosslessUnavailable, Verifier, check_rollback

__all__ = ["LosslessSession", "ChainDrafter", "LosslessUnavailable", "Stops", "check_rollback", "next_cap"]


def next_cap(cap: int, drafted: int, accepted: int, max_draft: int) -> int:
    """The chain's draft cap after a verification: one more after a fully accepted draft (up to `max_draft`),
    the accepted count + 1 after a rejection, unchanged when nothing was drafted."""
    if not drafted:
        return cap
    return min(cap + 1, max_draft) if accepted >= drafted else max(1, accepted + 1)


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
        #   whatever tree or n-gram scheme its config names (`decode/fused.py`)
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


class Stops:
    """The call's stopping criteria (EOS, length, stop strings, the caller's; generate builds the EOS criterion from
    the generation config) as drafting checks them, and the tokens its length limit leaves to draft."""

    def __init__(self, stopping_criteria, max_length: int):
        self.criteria, self.max_length = stopping_criteria, max_length

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor) -> bool:
        """Whether a criterion fires on `tokens` [1, T] (`scores`: the last token's, for the criteria)."""
        return bool(self.criteria(tokens, scores).any())

    def first(self, input_ids: torch.Tensor, drafted: torch.Tensor, scores: torch.Tensor) -> tuple[int, bool]:
        """(how many of the drafts [1, k] to keep, whether the last kept one stops generation): up to and including
        the first after which a criterion fires (`scores` [1, k, V]: the drafts' scores, for the criteria)."""
        for i in range(drafted.shape[1]):
            if self(torch.cat([input_ids, drafted[:, : i + 1]], 1), scores[:, i]):
                return i + 1, True
        return drafted.shape[1], False

    def room(self, input_ids: torch.Tensor) -> int:
        """Tokens that may be drafted after `input_ids`: the length limit keeps one for the token after them."""
        return self.max_length - input_ids.shape[1] - 1


class ChainDrafter:
    """Drafts a chain of tokens from the draft layer's head on the main model's own cache, or the n-gram
    continuation where there is one (`ngrams`); keeps the chain's draft cap."""

    topk = 1  # the candidates it drafts for the next position (`drafts.Drafter`): a chain

    def __init__(self, session: LosslessSession, shallow: ShallowPasses, verifier: Verifier, stops: Stops,
                 ngrams: NgramDrafter | None, logits_processor, sample: bool):
        self.session, self.shallow, self.verifier, self.stops, self.ngrams = session, shallow, verifier, stops, ngrams
        self.logits_processor, self.do_sample = logits_processor, sample
        self.cap = session.options.max_draft  # the longest chain the head drafts next
        self.drafted = 0  # the head's drafts in the last chain (n-gram drafts: none, they leave the cap)

    def draft(self, input_ids: torch.LongTensor) -> Draft:
        self.drafted = 0
        continuation = self.ngrams.continuation(input_ids) if self.ngrams is not None else []
        if continuation:
            return self.ngrams.draft(input_ids, continuation)
        session, verifier = self.session, self.verifier
        budget = min(self.cap, self.stops.room(input_ids)) if session.options.head_drafts else 0
        tokens, draft_scores, stops = input_ids, [], False
        token, context = input_ids[:, -1:], verifier.context
        with torch.no_grad():
            draft = self._chain_in_one_call(input_ids, budget)
            if draft is not None:
                return draft
            while len(draft_scores) < budget:
                hidden, (logits, context) = self.shallow.head(token, session.grown_mask(tokens.shape[1]), context)
                verifier.keep(token, hidden)
                scores = process(self.logits_processor, tokens, logits.float())
                token = self._choose(scores)
                tokens = torch.cat([tokens, token], 1)
                draft_scores.append(scores)
                # A draft that would stop generation ends the chain. It is verified like any other (dropping a
                # draft because of its value would bias sampling); the loop emits nothing after it if accepted.
                stops = self.stops(tokens, scores)
                if stops:
                    break
        self.drafted = len(draft_scores)
        scores = torch.stack(draft_scores, 1) if (draft_scores and self.do_sample) else None
        return Draft(tokens, self.drafted, scores, stops=stops)

    def drafted_one(self) -> None:
        """The last draft was one token from the head that another drafter drafted (a tree's top candidate, verified
        alone where no tree mask reached the layers): counted as this drafter's, for the cap."""
        self.drafted = 1

    def verified(self, accepted: int, tree_mask: bool = True) -> None:
        """After the loop accepted `accepted` of the drafts: the cap (of head drafts: n-gram drafts leave it).
        (`tree_mask`: for tree drafts, which this drafter never drafts.)"""
        self.cap = next_cap(self.cap, self.drafted, accepted, self.session.options.max_draft)

    def _chain_in_one_call(self, input_ids: torch.LongTensor, budget: int) -> Draft | None:
        """A greedy chain of `budget` drafts in one compiled call (`ShallowPasses.chain`), cut after the first that
        would stop generation; None where the call samples, has logits processors, drafts fewer than two, or the
        model cannot run a chain that way."""
        processors = self.logits_processor
        if budget < 2 or self.do_sample or not isinstance(processors, (list, tuple)) or len(processors):
            return None
        token = input_ids[:, -1:]
        out = self.shallow.chain(token, self.session.grown_mask(input_ids.shape[1]), self.verifier.context, budget)
        if out is None:
            return None
        states, drafts, logits = out
        self.verifier.keep(torch.cat([token, drafts[:, :-1]], 1), states)
        count, stops = self.stops.first(input_ids, drafts, logits.float())
        if count < budget:  # the drafts after a stopping one: their shallow K/V and states go
            self.verifier.drop(budget - count)
        self.drafted = count
        return Draft(torch.cat([input_ids, drafts[:, :count]], 1), count, None, stops=stops)

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        if self.do_sample:
            return torch.multinomial(scores.softmax(-1), 1)
        return scores.argmax(-1, keepdim=True)
