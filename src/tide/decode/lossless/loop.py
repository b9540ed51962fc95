"""The lossless decode loop: draft, verify, accept, repeat, over one of two cycle backends; Tide's own, behind
`generate`.

The loop owns the sequence, the stopping criteria, the streamer and what `generate` returns (`emit.Emitted`), the
cache's K/V after a stop, and the call's counters: each cycle's (`GenerationStats.record_cycle`, from the `Cycle`
its backend gives) and, at the end, the layer calls and prompt tokens the passes counted (`ShallowPasses.layer_calls`,
`Verifier.layer_calls`, `Verifier.prefilled`). A backend runs a cycle:

- draft and verify (`DraftVerify`): a drafter (`drafts.Drafter`: `chain.ChainDrafter`, or
  `tree.TreeDrafter` for tree drafts) proposes tokens after the sequence, a chain or a trie, and decides
  nothing; the call's verifier (`verifier.Verifier`) gives the full model's logits at every drafted position and
  the one after (a trie's nodes in one pass with a tree mask, `Verifier.verify_tree`; where no tree mask reaches
  the layers, the head's top candidate alone, as a chain of one); logits processors run on each position as
  transformers applies them (a trie's on each node's own prefix); `accept.py` decides (a chain's verdict, or a
  trie's walk: the kept path and the token after it); the cache drops what was rejected (a trie's: the path's K/V
  moved right after the last emitted token, `Verifier.keep_path`); the verifier takes the next context and the
  drafter hears what was accepted. Drafts end at a token that stops generation, and nothing follows one that is
  accepted (a trie's walk ends at such a child); the stopping criteria run on the sequence (with the cycle's
  scores where the call keeps them).
- the graph (`graph.GraphCycles`): a compiled cycle as one graph and one host read (the accepted count and the
  tokens); the stopping criteria run on the host's list of tokens, one at a time (`graphparts.Stops`), and the
  loop drops the tokens after the first that stops, with their K/V.

The backend is chosen once, after the prompt is prefilled: the graph where the call fits it (`graph.graph_cycles`,
which otherwise says why not), else draft and verify. `return_dict_in_generate` scores and logits come from draft
and verify. Batch size 1. Nothing here knows the model's architecture or how drafts are made.
"""

from __future__ import annotations

import functools
import time

import torch

from ...models.compat import crop_cache
from ..emit import Emitted
from ..graphparts import Stops
from ..processors import process
from .accept import certain_scores, greedy_verdict, sampling_verdict, tree_verdict
from .drafts import Cycle, Draft, Verdict
from .drafts import Stops as DraftStops  # (the drafters' view of the criteria; `Stops` above: the graph's tokens)
from .graph import graph_cycles

__all__ = ["DraftVerify", "lossless_decode"]


@torch.no_grad()
def lossless_decode(session, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                    model_kwargs: dict):
    """Generate from `input_ids` [1, n] until a stopping criterion fires; returns what `generate` returns."""
    cache = model_kwargs.get("past_key_values")
    if cache is None:
        raise RuntimeError("Tide lossless mode decodes on the KV cache; generate made none (was use_cache=False?).")
    if hasattr(cache, "activate_past_recording"):  # sliding-window layers keep evicted positions for rollback
        cache.activate_past_recording()
    drafter = session.start(generation_config, logits_processor, stopping_criteria, cache,
                            model_kwargs.get("attention_mask"))
    verifier, stats, emitted = session.verifier, session.stats, Emitted(generation_config, streamer)
    cycles = graph_cycles(session, input_ids, generation_config, logits_processor, cache,
                          model_kwargs.get("attention_mask"), emitted)
    if isinstance(cycles, str):  # (the reason the call drafts and verifies instead)
        cycles = DraftVerify(session, drafter, logits_processor, stopping_criteria, generation_config, emitted)
        stops = None
    else:  # (the criteria on the host's tokens)
        stops, listed = Stops(stopping_criteria, generation_config, input_ids.device), input_ids[0].tolist()
    while True:
        start = time.perf_counter()
        cycle = cycles.cycle(input_ids)
        tokens = cycle.tokens
        if stops is not None:  # the graph's: the criteria on the host's tokens, one at a time; those after a stop
            kept, done = stops.emitted(listed, cycle.read)  # are dropped
            listed += cycle.read[:kept]
            tokens = tokens[:, :kept]
        input_ids = torch.cat([input_ids, tokens], 1)
        emitted.add(tokens, cycle.scores, cycle.raw)
        if stops is None:  # draft and verify's: the criteria on the sequence
            done = bool(stopping_criteria(input_ids, emitted.scores).any())
        kept = tokens.shape[1]  # (counted as emitted: tokens computed past a stop and dropped are not)
        stats.record_cycle(cycle.drafted, min(cycle.accepted, kept), kept, time.perf_counter() - start,
                           draft_topk=cycle.topk, ngram_drafted=cycle.ngram_drafted,
                           ngram_accepted=min(cycle.ngram_accepted, kept), tree=cycle.tree, merged=cycle.merged,
                           later_children=cycle.later_children, layer_passes=cycle.layer_passes,
                           graph_s=cycle.graph_s)
        if done:
            crop_cache(cache, cycle.tokens.shape[1] - kept)  # the K/V of tokens after the one that stopped
            stats.record_passes(verifier.layer_calls + verifier.shallow.layer_calls, verifier.prefilled)
            return emitted.finish(input_ids, cache)


class DraftVerify:
    """The draft-and-verify backend: the drafter's draft, the verifier's logits, the call's processors on each
    position and acceptance on the host (`accept.py`); the cache keeps the accepted drafts' K/V."""

    def __init__(self, session, drafter, logits_processor, stopping_criteria, generation_config, emitted: Emitted):
        self.verifier, self.drafter, self.cache = session.verifier, drafter, session.cache
        self.processor, self.stops = logits_processor, DraftStops(stopping_criteria, generation_config.max_length)
        self.sample, self.head_rows = bool(generation_config.do_sample), session.model.num_head_rows
        self.keeps_outputs = emitted.keeps_outputs

    def cycle(self, input_ids) -> Cycle:
        """The cycle after `input_ids` [1, n]: its draft, verified and accepted."""
        verifier, drafter = self.verifier, self.drafter
        verifier.prefill(input_ids)  # (the first cycle: the cache gets the K/V of all but the last token)
        draft, tree_mask = drafter.draft(input_ids), True
        if draft.tree is not None:
            verified = verifier.verify_tree(draft.tree, input_ids.shape[1])
            if verified is not None:
                return self._tree_cycle(input_ids, draft, verified.logits)
            # no tree mask reached the layers: the head's top candidate alone, a chain of one (its state pending;
            # under sampling a draft certain of it)
            draft, tree_mask = self._top_candidate(input_ids, draft.tree), False
        raw = verifier.verify(draft.ids).logits.to(torch.float32, copy=True)  # [1, k + 1, V]
        scores = _processed(self.processor, draft.ids, raw)
        verdict = _decide(draft, scores, self.sample)
        # Drafts end at a token that stops generation (EOS included) and within the length budget, so the verdict
        # fits; if the stopping draft is accepted, generation ends there: no bonus token.
        tokens = verdict.tokens
        if draft.stops and verdict.accepted == draft.count:
            tokens = tokens[:, : draft.count]
        accepted = tokens.shape[1] - 1  # (a stopping draft that was accepted counts as the token after them)
        if draft.count > accepted:
            crop_cache(self.cache, draft.count - accepted)
        verifier.accepted(accepted)
        drafter.verified(accepted, tree_mask=tree_mask)
        return Cycle(tokens.to(input_ids.device), accepted, draft.count if draft.steps is None else draft.steps,
                     drafter.topk, ngram_drafted=draft.ngram, ngram_accepted=sum(draft.from_ngram[:accepted]),
                     scores=scores, raw=raw)

    def _tree_cycle(self, input_ids, draft: Draft, logits: torch.Tensor) -> Cycle:
        """The cycle of a verified tree draft (`logits` [1, N, V]: the full model's at x and each node): the walk's
        verdict (`accept.tree_verdict`; a child that would stop generation ends it, as its last token); the cache
        keeps the path's K/V. Its scores and logits are computed only where the call keeps them."""
        tree = draft.tree
        path, verdict = tree_verdict(tree, logits, input_ids, functools.partial(process, self.processor), self.stops,
                                     self.sample)
        path_logits, accepted = self.verifier.keep_path(path).logits, verdict.accepted
        raw = scores = None
        if self.keeps_outputs:
            raw = path_logits.to(torch.float32, copy=True)  # [1, accepted + 1, V]
            ids = torch.cat([input_ids, verdict.tokens[:, :accepted].to(input_ids.device)], 1)
            scores = _processed(self.processor, ids, raw)
        self.verifier.accepted(accepted)
        self.drafter.verified(accepted)
        return Cycle(verdict.tokens.to(input_ids.device), accepted, draft.steps, self.drafter.topk,
                     ngram_drafted=draft.ngram, ngram_accepted=sum(tree.ngram[node] for node in path[1:]), tree=True,
                     merged=draft.ngram > 0, later_children=tree.later_children(path), scores=scores, raw=raw)

    def _top_candidate(self, input_ids, tree) -> Draft:
        """A chain draft of the tree's top candidate (the head's best: its first node)."""
        top = torch.tensor([[tree.tokens[1]]], dtype=input_ids.dtype, device=input_ids.device)
        return Draft(torch.cat([input_ids, top], 1), 1, certain_scores(top, self.head_rows) if self.sample else None)


def _processed(logits_processor, ids: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Scores at each of the last k + 1 positions of `ids`, processed as if generated one at a time."""
    if not len(logits_processor):
        return raw
    scores, n, k1 = raw.clone(), ids.shape[1], raw.shape[1]
    for i in range(k1):
        scores[:, i] = process(logits_processor, ids[:, : n - k1 + 1 + i], scores[:, i])
    return scores


def _decide(draft: Draft, scores: torch.Tensor, sample: bool) -> Verdict:
    drafted = draft.ids[:, draft.ids.shape[1] - draft.count:]
    if sample:
        return sampling_verdict(drafted, draft.scores, scores)
    return greedy_verdict(drafted, scores)
