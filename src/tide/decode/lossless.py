"""The lossless decode loop: draft, verify, accept, repeat; Tide's own, behind `generate`.

Each cycle a drafter (`drafts.Drafter`: `speculative.ChainDrafter`, or `treedraft.TreeDrafter` for tree drafts)
proposes tokens after the sequence; the call's verifier (`verifier.Verifier`) gives the full model's logits at every
drafted position and the one after (a tree draft brings them along); logits processors run on each position as
transformers applies them; `accept.py` decides (a sampled tree draft arrives decided: its walk drew the kept path
and the token after it); the cache drops what was rejected; the verifier takes the next context and the drafter
hears what was accepted. The call's counters are taken here, from each cycle's `Draft` and accepted count, and
the layer calls and prompt tokens the passes counted (`ShallowPasses.layer_calls`, `Verifier.layer_calls`,
`Verifier.prefilled`); the compiled cycles count their own (`fused.FusedChain`).
Stopping criteria (EOS, `max_length`, stop strings, the caller's), streamers (accepted tokens only) and
`return_dict_in_generate` scores and logits are served here. Batch size 1. Nothing here knows the model's
architecture or how drafts are made.
"""

from __future__ import annotations

import time

import torch

from ..models.compat import crop_cache
from .accept import greedy_verdict, sampling_verdict
from .drafts import Draft, Verdict
from .emit import Emitted
from .fused import fused_chain_for
from .processors import process

__all__ = ["lossless_decode"]


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
    verifier, stats = session.verifier, session.stats
    emitted = Emitted(generation_config, streamer)
    fused = fused_chain_for(session, input_ids, generation_config, logits_processor, cache,
                            model_kwargs.get("attention_mask"), emitted)
    if fused is not None:  # compiled greedy chains: one graph and one host read a cycle
        output = fused.decode(input_ids, stopping_criteria, generation_config, emitted)
        _count_passes(stats, verifier)
        return output
    sample = bool(generation_config.do_sample)
    while True:
        start = time.perf_counter()
        verifier.prefill(input_ids)  # (the first cycle: the cache gets the K/V of all but the last token)
        draft = drafter.draft(input_ids)
        # (a tree walk decided already: it judged each node on the way; a sampled one's acceptance is random and
        # depends on the path it took) Its scores and logits are computed here only where the call keeps them.
        verdict, raw, scores = draft.decided, None, None
        if verdict is None or emitted.keeps_outputs:
            raw = draft.verified if draft.verified is not None else verifier.verify(draft.ids).logits
            raw = raw.to(torch.float32, copy=True)  # [1, k + 1, V]
            scores = _processed(logits_processor, draft.ids, raw)
            verdict = verdict if verdict is not None else _decide(draft, scores, sample)
        # Drafts end at a token that stops generation (EOS included) and within the length budget, so the verdict
        # fits; if the stopping draft is accepted, generation ends there: no bonus token.
        tokens = verdict.tokens
        if draft.stops and verdict.accepted == draft.count:
            tokens = tokens[:, : draft.count]
        accepted = tokens.shape[1] - 1
        if draft.count > accepted:
            crop_cache(cache, draft.count - accepted)
        input_ids = torch.cat([input_ids, tokens.to(input_ids.device)], 1)
        emitted.add(tokens, scores, raw)
        verifier.accepted(accepted)
        drafter.verified(accepted)
        _count(stats, draft, accepted, drafter.topk, time.perf_counter() - start)
        if bool(stopping_criteria(input_ids, emitted.scores).any()):
            _count_passes(stats, verifier)
            return emitted.finish(input_ids, cache)


def _count(stats, draft: Draft, accepted: int, topk: int, seconds: float) -> None:
    """A cycle's counters: its draft, of which `accepted` tokens were kept (a stopping draft that was accepted
    counts as the token after them), its one verification, the drafter's scheme and the cycle's seconds."""
    stats.record_cycle(draft.count if draft.steps is None else draft.steps, min(accepted, draft.count), accepted + 1,
                       seconds, draft_topk=topk, ngram_drafted=draft.ngram,
                       ngram_accepted=sum(draft.from_ngram[:accepted]), tree=draft.tree,
                       merged=draft.tree and draft.ngram > 0, later_children=draft.later_children if draft.tree else 0)


def _count_passes(stats, verifier) -> None:
    """At the call's end: the layer calls the drafting and verification passes ran, and the prompt tokens the
    verifier prefilled."""
    stats.record_passes(verifier.layer_calls + verifier.shallow.layer_calls, verifier.prefilled)


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
