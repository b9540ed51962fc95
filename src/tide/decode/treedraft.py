"""Lossless tree drafts: the exit head's k best tokens for the next position, verified together in one pass.

A chain draft is accepted only when the exit head's top-1 is the full model's token; the full model's token is
often among its top few (docs/benchmarks.md). One cycle here, for the last emitted token x:

1. x runs through the shallow layers 0..E (as a chain draft would) and the exit head at E gives k candidates.
2. The k candidates run through layers 0..E side by side, all at x's position + 1, each seeing the context
   and itself but not the other candidates (a tree attention mask).
3. The deep layers E+1..L-1 run over x and the k candidates at once, with the same mask; the final head
   gives the full model's logits at x and at each candidate.
4. If the full model's next token (greedy, after the logits processors) is a candidate, the cache keeps that
   candidate's positions and it is handed to the decode loop as an already verified draft (its logits are those
   of step 3, so the loop's acceptance test and bonus token run unchanged); otherwise every candidate is
   dropped and x's logits give the next token.

The tree mask is the mask the backbone builds for the chunk [x, candidates], with the candidate-to-candidate
entries blocked; the candidates' shallow calls are the same calls without x's row (one capture per cycle). Where no 4-D mask tensor reaches the layers, or a cache layer is neither a plain `DynamicLayer`
nor a full-attention static layer (sliding windows keep their own bookkeeping), or a static cache has no room
for x and the k candidates, the cycle falls back to a chain draft. Families whose
positions live in the mask rather than in `position_ids` (alibi) never get here (`ArchSpec.tree_drafts`).
"""

from __future__ import annotations

import time

import torch

from ..layers.args import new_positions
from ..layers.calls import LayerCall, additive_masks, capture_layer_calls, map_calls
from ..layers.fewrows import few_row_linears
from ..models.compat import (
    LengthView,
    grouped_query_attention_in_place,
    is_static_layer,
    keep_one_of_tail,
    layer_length,
    plain_dynamic_layers,
)
from .processors import process
from .records import Draft

__all__ = ["TreeDrafter", "tree_mask_calls", "without_first_position"]


def tree_mask_calls(calls: list[LayerCall], blocked: torch.Tensor) -> list[LayerCall] | None:
    """Copies of `calls` whose 4-D attention masks also block `blocked` [Q, Q] (query row, chunk key column).

    The chunk's keys are the mask's last Q columns. None when a call carries no 4-D mask for Q queries."""
    q = blocked.shape[0]

    def patched(call: LayerCall) -> LayerCall | None:
        args, kwargs, found = list(call.args), dict(call.kwargs), False
        for where, value in [*enumerate(args), *kwargs.items()]:
            if not (isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[-2] == q
                    and value.shape[-1] >= q):
                continue
            mask = value.clone()
            chunk = mask[..., -q:]
            if mask.dtype == torch.bool:
                chunk.masked_fill_(blocked.to(mask.device), False)
            else:
                chunk.masked_fill_(blocked.to(mask.device), torch.finfo(mask.dtype).min)
            if isinstance(where, int):
                args[where] = mask
            else:
                kwargs[where] = mask
            found = True
        return LayerCall(tuple(args), kwargs) if found else None

    return map_calls(calls, patched)


def without_first_position(calls: list[LayerCall], q: int) -> list[LayerCall] | None:
    """The calls for a chunk of `q` positions turned into calls for its last `q - 1` positions (same keys).

    Per-position arguments lose their first query: the hidden states and rotary tables [B, q, ...] (3-D),
    position ids [B, q], cache positions [q], and 4-D masks [B, h, q, K] (rows). None when a tensor has a
    dimension of size q anywhere else, which this cannot place."""

    def cut(value):
        if isinstance(value, (tuple, list)):
            parts = [cut(v) for v in value]
            return _UNPLACED if any(p is _UNPLACED for p in parts) else type(value)(parts)
        if not isinstance(value, torch.Tensor) or q not in value.shape:
            return value
        if value.dim() == 4 and value.shape[-2] == q and q not in (value.shape[0], value.shape[1], value.shape[-1]):
            return value[..., 1:, :]
        if value.dim() in (2, 3) and value.shape[1] == q and q not in (value.shape[0], *value.shape[2:]):
            return value[:, 1:]
        if value.dim() == 1:
            return value[1:]
        return _UNPLACED

    def sliced(call: LayerCall) -> LayerCall | None:
        args = [cut(v) for v in call.args]
        kwargs = {name: cut(v) for name, v in call.kwargs.items()}
        return None if any(v is _UNPLACED for v in [*args, *kwargs.values()]) else LayerCall(tuple(args), kwargs)

    return map_calls(calls, sliced)


_UNPLACED = object()


def _siblings_blocked(k: int, lead: int) -> torch.Tensor:
    """[lead + k, lead + k]: True where candidate a would see candidate b != a (the `lead` rows see no candidate)."""
    blocked = torch.zeros(lead + k, lead + k, dtype=torch.bool)
    blocked[lead:, lead:] = ~torch.eye(k, dtype=torch.bool)
    return blocked


class TreeDrafter:
    """Greedy lossless drafting with `session.draft_topk` candidates per cycle (used by `LosslessSession`)."""

    def __init__(self, session, chain):
        self.session, self.chain = session, chain  # chain: the session's chain drafter (prefill, masks, stopping)
        self.k = session.draft_topk
        self.usable = None  # known at the first call: the cache can be compacted and the layers take a tree mask

    def verified(self, accepted: int) -> None:
        self.chain.verified(accepted)

    def draft(self, input_ids: torch.LongTensor) -> Draft:
        session, chain, stats = self.session, self.chain, self.session.stats
        start = time.perf_counter()
        chain._prefill(input_ids)
        continuation = chain.ngram_continuation(input_ids)
        if continuation:  # an earlier occurrence's next tokens: a chain that costs no head
            draft = chain.ngram_draft(input_ids, continuation)
            stats.decode_time_s += time.perf_counter() - start
            return draft
        cache = chain.cache
        if self.usable is None:
            self.usable = plain_dynamic_layers(cache) or all(is_static_layer(layer) for layer in cache.layers)
        if not self.usable or chain.max_length - input_ids.shape[1] < 2 or not _room_for(cache, self.k + 1):
            stats.decode_time_s += time.perf_counter() - start
            if not self.usable:
                stats.draft_topk = 1
            return chain.draft(input_ids)  # a cache the tree cannot compact, or no room for a draft
        x = input_ids[:, -1:]
        with torch.no_grad():
            state = session.shallow_step(x, cache, session.grown_mask(input_ids.shape[1]))
            logits, _ = session.model.draft_logits(session.draft_layer, state[:, -1], session.context,
                                                   session.draft_vocab_size)
            draft_scores = process(chain.logits_processor, input_ids, logits.float())
            candidates = draft_scores.topk(self.k, dim=-1).indices  # [1, k]
            logits = self._verify(candidates, cache, session.grown_mask(input_ids.shape[1]))
        chain.drafted = 1
        stats.drafted += 1
        if logits is None:  # no tree mask reached the layers: a chain draft of one (the session verifies it)
            if layer_length(cache, 0) > 1:  # (a one-token context may get no mask: causal attention needs none)
                self.usable, stats.draft_topk = False, 1  # this model's attention takes none: chains from here on
            stats.decode_time_s += time.perf_counter() - start
            return Draft(torch.cat([input_ids, candidates[:, :1]], 1), 1)
        # (a copy: processors may work in place, and transformers applies them to these logits itself)
        target = process(chain.logits_processor, input_ids, logits[:, 0].to(torch.float32, copy=True)).argmax(-1, keepdim=True)
        hits = (candidates[0] == target[0]).nonzero()
        stops = chain.stops(torch.cat([input_ids, target], 1), logits[:, 0])
        keep = int(hits[0]) if len(hits) and not stops else None  # a stopping token comes from x's logits
        for layer in range(session.parts.num_layers):
            keep_one_of_tail(cache, layer, self.k, keep)
        rows = [0] if keep is None else [0, 1 + keep]
        session.verified_contexts = session.verified_contexts[:, rows]
        out = input_ids if keep is None else torch.cat([input_ids, target], 1)
        stats.decode_time_s += time.perf_counter() - start
        return Draft(out, len(rows) - 1, verified=logits[:, rows])

    def _verify(self, candidates: torch.Tensor, cache, mask) -> torch.Tensor | None:
        """Full-model logits [1, 1 + k, V] at the pending token x and at each candidate; None if no tree mask."""
        session, parts, k = self.session, self.session.parts, candidates.shape[1]
        x_ids, x_state = session.pending_ids, session.pending_states  # [1, 1], [1, 1, H]
        have = layer_length(cache, 0)  # shallow layers hold x; deep layers do not yet
        inputs = new_positions(mask, have - 1, k + 1)  # the chunk [x, candidates]: the mask grown over it
        x_position = inputs["position_ids"][:, :1]
        inputs["position_ids"] = torch.cat([x_position, (x_position + 1).expand(1, k)], 1)  # candidates: x's + 1
        deep = capture_layer_calls(parts, input_ids=torch.cat([x_ids, candidates], 1),
                                   past_key_values=LengthView(cache, have - 1), use_cache=True, **inputs)
        deep = tree_mask_calls(deep, _siblings_blocked(k, 1))
        if deep is None:
            return None
        deep = additive_masks(parts, deep)
        # The candidates' chunk for the shallow layers is the same chunk without x: same keys (x is cached
        # there), same positions. Sliced from the deep calls where every per-position argument is recognised,
        # else captured.
        shallow = without_first_position(deep[: session.draft_layer + 1], k + 1)
        if shallow is None:
            inputs["position_ids"] = inputs["position_ids"][:, 1:]
            shallow = tree_mask_calls(capture_layer_calls(parts, input_ids=candidates, use_cache=True, **inputs,
                                                          past_key_values=LengthView(cache, have)), _siblings_blocked(k, 0))
            shallow = additive_masks(parts, shallow)
        with few_row_linears(parts), grouped_query_attention_in_place():  # k and 1 + k positions: the CPU layouts
            states = session.spans.run(0, session.draft_layer + 1, shallow[0].hidden, shallow)  # compiled or eager
            states = session.spans.run(session.draft_layer + 1, parts.num_layers, torch.cat([x_state, states], 1), deep)
            session.verified_contexts = parts.final_norm(states)
            logits = parts.logits_from_normed(session.verified_contexts)
        session.pending_ids = session.pending_states = None
        session.stats.layer_passes += parts.num_layers  # the candidates' shallow layers and everything's deep ones
        session.stats.verify_passes += 1
        session.stats.decode_steps += 1
        return logits


def _room_for(cache, positions: int) -> bool:
    """Whether every layer of a static cache has `positions` free slots past its length (a tree writes x and all
    its candidates before it keeps one); always on a dynamic cache."""
    return all(not is_static_layer(layer) or layer.max_cache_len - int(layer.get_seq_length()) >= positions
               for layer in cache.layers)
