"""`kv_strategy="recompute"`: skipped layers' K/V are recomputed by the next step that runs deep.

When a token exits at checkpoint c, layers after c get a placeholder K/V for its position (propagated
from its state, so the cache stays even) and the position is *pending*: its K/V is exact up to layer
`exact_through[b, q]` and its hidden state there is kept. The next decode step processes, from the shallowest
layer with a stale entry on, a chunk made of the pending positions plus the new token. At each layer
the chunk's stale entries are recomputed from exact inputs and overwrite the placeholders in the same
batched pass (FREE / EE-LLM style); entries that are already exact are left untouched. A stale entry
is therefore never read before it is exact, up to `MAX_PENDING` positions; older ones keep their
placeholder. Sliding-window caches are not supported (their evicted keys cannot be rewritten).
"""

from __future__ import annotations

import torch

from ..models.compat import LengthView, grouped_query_attention_in_place, has_sliding_layers, layer_kv
from .calls import capture_layer_calls
from .calltransforms import additive_masks
from .fewrows import few_row_linears
from .kvprobe import write_kv

__all__ = ["RecomputeState", "RecomputeSteps", "MAX_PENDING"]

MAX_PENDING = 64
_NEW_POSITION = -2  # `exact_through` of the step's own token inside a chunk: its state comes from the walk


class _MergeTail:
    """Cache proxy for a chunk of `pending + 1` positions whose first `pending` are already stored.

    `update()` overwrites the stored tail only where `stale` [B, P] is set, appends the new position,
    and returns the full K/V for attention.
    """

    def __init__(self, cache, stale: torch.Tensor):
        self._cache, self._stale = cache, stale

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        pending = self._stale.shape[1]
        keys, values = layer_kv(self._cache, layer_idx)
        stale = self._stale.to(key_states.device)[:, None, :, None]  # [B, 1, P, 1]
        keys[:, :, -pending:] = torch.where(stale, key_states[:, :, :pending], keys[:, :, -pending:])
        values[:, :, -pending:] = torch.where(stale, value_states[:, :, :pending], values[:, :, -pending:])
        return self._cache.update(key_states[:, :, pending:], value_states[:, :, pending:], layer_idx, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._cache, name)


class RecomputeState:
    """The pending positions of one generation: tokens whose K/V is exact only up to some layer.

    Per pending position (row b, position q): its token `ids`, `positions`, `exact_through[b, q]` (the last
    layer whose K/V for it is exact) and `states[b, q]` (its output there). Each decode step gets its
    `RecomputeSteps` from `steps()` and hands the walk's result back to `after_step()`.
    """

    def __init__(self, parts, few_row_layout: str = "auto"):
        self.parts, self.few_row_layout = parts, few_row_layout  # the chunks' CPU linear layout (`fewrows`)
        self.ids = self.positions = self.exact_through = self.states = None  # [B, P], [B, P], [B, P], [B, P, H]

    @property
    def pending(self) -> int:
        return 0 if self.ids is None else self.ids.shape[1]

    def after_prefill(self, cache) -> None:
        if cache is not None and has_sliding_layers(cache):
            raise ValueError(
                "kv_strategy='recompute' needs full-attention KV caches, and this model has sliding-window layers "
                "(their evicted keys cannot be rewritten). Use kv_strategy='propagate'."
            )
        self.reset()

    def steps(self, input_ids, cache, inputs: dict) -> "RecomputeSteps":
        return RecomputeSteps(self, input_ids, cache, inputs)

    def after_step(self, steps: "RecomputeSteps", walk) -> None:
        """Record what the walk made exact, append the step's token, and trim."""
        deepest = walk.full_passes - 1  # the last layer that ran for the step's token
        rows = steps.input_ids.shape[0]
        device = steps.token_state.device
        new_exact = torch.full((rows, 1), deepest, dtype=torch.long, device=device)
        if steps.chunk_calls is not None:  # entries recomputed up to `deepest` now hold their state there
            old = steps.exact_through[:, :-1]
            recomputed = old < deepest
            self.states = torch.where(recomputed[..., None], steps.chunk_states[:, :-1], self.states.to(device))
            self.exact_through = torch.where(recomputed, torch.full_like(old, deepest), old)
        if self.pending:
            self.ids = torch.cat([self.ids, steps.input_ids.to(self.ids.device)], 1)
            self.positions = torch.cat([self.positions, steps.position_ids.to(self.positions.device)], 1)
            self.exact_through = torch.cat([self.exact_through.to(device), new_exact], 1)
            self.states = torch.cat([self.states.to(device), steps.token_state], 1)
        else:
            self.ids, self.positions, self.exact_through, self.states = (
                steps.input_ids, steps.position_ids, new_exact, steps.token_state)
        self._trim()

    def reset(self) -> None:
        self.ids = self.positions = self.exact_through = self.states = None

    def _trim(self) -> None:
        """Drop leading positions that are exact everywhere, and the oldest beyond MAX_PENDING."""
        done = (self.exact_through >= self.parts.num_layers - 1).all(0)
        keep_from = int(done.long().cumprod(0).sum())  # leading exact positions
        keep_from = max(keep_from, self.pending - MAX_PENDING)
        if keep_from:
            self.ids, self.positions = self.ids[:, keep_from:], self.positions[:, keep_from:]
            self.exact_through, self.states = self.exact_through[:, keep_from:], self.states[:, keep_from:]
        if self.pending == 0:
            self.reset()


class RecomputeSteps:
    """How one decode step's walk runs layers with `kv_strategy="recompute"`.

    The step's token runs alone until the shallowest layer with a stale pending entry; from there the walk
    runs a chunk [pending positions + the token], recomputing stale entries in place (`_MergeTail`). The
    token's own state keeps going through every layer that runs, exited or not (its K/V there is exact);
    layers after everyone left get placeholders from it (`kvprobe.write_kv`: K/V only).
    """

    def __init__(self, state: RecomputeState, input_ids, cache, inputs: dict):
        self.state, self.parts, self.cache = state, state.parts, cache
        past = cache.get_seq_length()  # before this step writes anything
        self.input_ids = input_ids
        self.position_ids = inputs.get("position_ids")
        if self.position_ids is None:
            self.position_ids = torch.full_like(input_ids, past)
        self.mask = inputs.get("attention_mask")
        self.token_calls = capture_layer_calls(self.parts, input_ids=input_ids, past_key_values=cache, use_cache=True,
                                               position_ids=self.position_ids, attention_mask=self.mask)
        self.hidden = self.token_calls[0].hidden  # [B, 1, H]
        self.token_state = self.hidden  # the token's exact state after the last layer that ran
        # the first layer with a stale entry (none: never)
        self.first_stale = int(state.exact_through.min()) + 1 if state.pending else self.parts.num_layers
        self.chunk_start = past - state.pending
        self.chunk_calls = self.chunk_states = self.exact_through = None  # set once the chunk opens
        self.recomputed = 0

    def run(self, i: int, hidden: torch.Tensor, exited) -> torch.Tensor:
        """The token's state after layer i (all rows: an exited row's state still feeds its K/V)."""
        if i == self.first_stale:
            self._open_chunk()
        if self.chunk_calls is None:
            self.token_state = self.token_calls[i].run(self.parts, i, self.token_state)
            return self.token_state
        # positions exact through layer i - 1 enter the chunk with their stored state
        entering = (self.exact_through == i - 1)[..., None]
        self.chunk_states = torch.where(entering, self._with_token(self.token_state), self.chunk_states)
        stale = self.exact_through[:, :-1] < i
        self.recomputed = self.recomputed + stale.sum()
        with few_row_linears(self.parts, self.state.few_row_layout), grouped_query_attention_in_place():
            self.chunk_states = self.chunk_calls[i].run(self.parts, i, self.chunk_states,
                                                        cache=_MergeTail(self.cache, stale))
        self.token_state = self.chunk_states[:, -1:]
        return self.token_state

    def rows_left(self, layer: int, leaving: torch.Tensor, hidden: torch.Tensor) -> None:
        """Exited rows keep running here: their state still feeds their exact K/V."""

    def fill_kv(self, layers: list[int], hidden: torch.Tensor) -> None:
        """Placeholders for the step's token (from its own state) in the layers no token reached."""
        for i in layers:
            if self.chunk_calls is None:
                write_kv(self.token_calls[i], self.parts, i, self.token_state, self.cache)
            else:
                untouched = torch.zeros_like(self.exact_through[:, :-1], dtype=torch.bool)
                write_kv(self.chunk_calls[i], self.parts, i, self.chunk_states, _MergeTail(self.cache, untouched))

    def _with_token(self, token_state: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.state.states.to(token_state.device), token_state], dim=1)

    def _open_chunk(self) -> None:
        """Layer calls, states and exactness for the chunk [pending positions + the step's token]."""
        state, device = self.state, self.input_ids.device
        ids = torch.cat([state.ids.to(device), self.input_ids], dim=1)
        positions = torch.cat([state.positions.to(self.position_ids.device), self.position_ids], dim=1)
        self.chunk_calls = additive_masks(self.parts, capture_layer_calls(
            self.parts, input_ids=ids, position_ids=positions, attention_mask=self.mask,
            past_key_values=LengthView(self.cache, self.chunk_start), use_cache=True))
        self.chunk_states = self._with_token(self.token_state)
        rows = ids.shape[0]
        token_device = self.token_state.device
        new = torch.full((rows, 1), _NEW_POSITION, device=token_device, dtype=torch.long)
        self.exact_through = torch.cat([state.exact_through.to(token_device), new], 1)
