"""`kv_strategy="recompute"`: skipped layers' K/V are recomputed by the next step that runs deep.

When a token exits at checkpoint c, layers after c get a placeholder K/V for its position (propagated
from its state, so the cache stays even) and the position is *pending*: its K/V is exact up to layer
`valid[b, q]` and its hidden state there is kept. The next decode step processes, from the shallowest
layer with a stale entry on, a chunk made of the pending positions plus the new token. At each layer
the chunk's stale entries are recomputed from exact inputs and overwrite the placeholders in the same
batched pass (FREE / EE-LLM style); entries that are already exact are left untouched. A stale entry
is therefore never read before it is exact, up to `MAX_PENDING` positions; older ones keep their
placeholder. Sliding-window caches are not supported (their evicted keys cannot be rewritten).
"""

from __future__ import annotations

import torch

from .layercalls import capture_layer_calls, write_kv_only

__all__ = ["RecomputeState", "MAX_PENDING"]

MAX_PENDING = 64


class _LengthView:
    """The cache as the backbone must see it to build masks for a chunk starting at position `start`."""

    def __init__(self, cache, start: int):
        self._cache, self._start = cache, start

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._start

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._start

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self._start + query_length, 0

    def __getattr__(self, name):
        return getattr(self._cache, name)


class _MergeTail:
    """Cache proxy for a chunk of `pending + 1` positions whose first `pending` are already stored.

    `update()` overwrites the stored tail only where `stale` [B, P] is set, appends the new position,
    and returns the full K/V for attention.
    """

    def __init__(self, cache, stale: torch.Tensor):
        self._cache, self._stale = cache, stale

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        pending = self._stale.shape[1]
        layer = self._cache.layers[layer_idx]
        stale = self._stale.to(key_states.device)[:, None, :, None]  # [B, 1, P, 1]
        layer.keys[:, :, -pending:] = torch.where(stale, key_states[:, :, :pending], layer.keys[:, :, -pending:])
        layer.values[:, :, -pending:] = torch.where(stale, value_states[:, :, :pending], layer.values[:, :, -pending:])
        return self._cache.update(key_states[:, :, pending:], value_states[:, :, pending:], layer_idx, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._cache, name)


class RecomputeState:
    """Pending positions of one generation and the decode step that recomputes them."""

    def __init__(self, session):
        self.session, self.parts = session, session.parts
        self.ids = self.positions = self.valid = self.states = None  # [B, P], [B, P], [B, P], [B, P, H]

    @property
    def pending(self) -> int:
        return 0 if self.ids is None else self.ids.shape[1]

    def after_prefill(self, input_ids, cache) -> None:
        self.check_cache(cache)
        self.reset()

    @staticmethod
    def check_cache(cache) -> None:
        layer_types = getattr(cache, "is_sliding", None) or []
        if any(layer_types):
            raise ValueError(
                "kv_strategy='recompute' and mode='lossless' need full-attention KV caches, and this model has "
                "sliding-window layers (their evicted keys cannot be rewritten). Use mode='exit' with "
                "kv_strategy='propagate'."
            )

    # ------------------------------------------------------------------ one decode step
    def decode_step(self, input_ids, cache, kwargs, allow_exit: bool = True, keep_pending: bool = False):
        """input_ids: [B, 1] -> (logits [B, 1, V] from each row's exit state, exit layers [B]).

        `allow_exit=False` runs the new token through every layer (recomputing all pending positions);
        `keep_pending=True` keeps positions that became exact in `states` (for lossless verification).
        """
        session, stats, num_layers = self.session, self.session.stats, self.parts.num_layers
        past = cache.get_seq_length()  # before this step writes anything
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.full_like(input_ids, past)
        mask = kwargs.get("attention_mask")
        single = capture_layer_calls(self.parts, input_ids=input_ids, past_key_values=cache, use_cache=True,
                                     position_ids=position_ids, attention_mask=mask)
        start = int(self.valid.min()) + 1 if self.pending else num_layers  # first layer with a stale entry
        chain = single[0].hidden  # [B, 1, H]: the new token's exact state, whatever its exit
        current = chain  # per-row exit state, for the logits
        rows = chain.shape[0]
        exited = torch.zeros(rows, dtype=torch.bool, device=chain.device)
        exit_layer = torch.full((rows,), num_layers - 1, dtype=torch.long, device=chain.device)
        chunk = running = valid = None
        deepest, everyone_left, recomputed = -1, False, 0
        for i in range(num_layers):
            if everyone_left:
                break
            if i == start:
                chunk, running, valid = self._open_chunk(input_ids, position_ids, mask, cache, chain, past - self.pending)
            if chunk is None:
                chain = single[i].run(self.parts, i, chain)
            else:
                running = torch.where((valid == i - 1)[..., None], self.states_with(chain), running)
                stale = valid[:, :-1] < i
                recomputed = recomputed + stale.sum()
                running = chunk[i].run(self.parts, i, running, cache=_MergeTail(cache, stale))
                chain = running[:, -1:]
            stats.layer_passes += 1
            deepest = i
            current = torch.where(exited[:, None, None], current, chain)
            if allow_exit and i in session.thresholds:
                exits, state = session.exits_at(i, current)
                leaving = exits[:, -1] & ~exited
                current = torch.where(leaving[:, None, None], state, current)
                exit_layer = torch.where(leaving, torch.full_like(exit_layer, i), exit_layer)
                exited |= leaving
                everyone_left = bool(exited.all())  # the one host sync per checkpoint
        for i in range(deepest + 1, num_layers):  # placeholders for the new position
            if chunk is None:
                write_kv_only(single[i], self.parts, i, chain, cache)
            else:
                stale = torch.zeros_like(valid[:, :-1], dtype=torch.bool)
                write_kv_only(chunk[i], self.parts, i, running, _MergeTail(cache, stale))
            stats.kv_only_passes += 1
        self._update_pending(input_ids, position_ids, chain, chunk, running, valid, deepest, keep_pending)
        stats.recomputed_positions += int(recomputed)
        return session.logits(current), exit_layer

    def states_with(self, chain: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.states.to(chain.device), chain], dim=1)

    def _open_chunk(self, input_ids, position_ids, mask, cache, chain, first: int):
        """Layer calls, inputs and validity for the chunk [pending positions + the new token]."""
        ids = torch.cat([self.ids.to(input_ids.device), input_ids], dim=1)
        positions = torch.cat([self.positions.to(position_ids.device), position_ids], dim=1)
        chunk = capture_layer_calls(self.parts, input_ids=ids, position_ids=positions, attention_mask=mask,
                                    past_key_values=_LengthView(cache, first), use_cache=True)
        running = self.states_with(chain)
        rows = ids.shape[0]
        valid = torch.cat([self.valid.to(chain.device), torch.full((rows, 1), -2, device=chain.device, dtype=torch.long)], 1)
        return chunk, running, valid

    def _update_pending(self, input_ids, position_ids, chain, chunk, running, valid, deepest, keep_pending) -> None:
        rows = input_ids.shape[0]
        new_valid = torch.full((rows, 1), deepest, dtype=torch.long, device=chain.device)
        if chunk is not None:  # entries recomputed up to `deepest` now hold their state there
            old_valid = valid[:, :-1]
            recomputed = old_valid < deepest
            self.states = torch.where(recomputed[..., None], running[:, :-1], self.states.to(running.device))
            self.valid = torch.where(recomputed, torch.full_like(old_valid, deepest), old_valid)
        if self.pending:
            self.ids = torch.cat([self.ids, input_ids.to(self.ids.device)], 1)
            self.positions = torch.cat([self.positions, position_ids.to(self.positions.device)], 1)
            self.valid = torch.cat([self.valid.to(chain.device), new_valid], 1)
            self.states = torch.cat([self.states.to(chain.device), chain], 1)
        else:
            self.ids, self.positions, self.valid, self.states = input_ids, position_ids, new_valid, chain
        if not keep_pending:
            self._trim()

    def drop_last(self, cache) -> None:
        """Forget the newest pending position, in the cache (every layer) and here."""
        cache.crop(-1)
        if self.pending <= 1:
            self.reset()
        else:
            self.ids, self.positions = self.ids[:, :-1], self.positions[:, :-1]
            self.valid, self.states = self.valid[:, :-1], self.states[:, :-1]

    def reset(self) -> None:
        self.ids = self.positions = self.valid = self.states = None

    def _trim(self) -> None:
        """Drop leading positions that are exact everywhere, and the oldest beyond MAX_PENDING."""
        done = (self.valid >= self.parts.num_layers - 1).all(0)
        keep_from = int(done.long().cumprod(0).sum())  # leading exact positions
        keep_from = max(keep_from, self.pending - MAX_PENDING)
        if keep_from:
            self.ids, self.positions = self.ids[:, keep_from:], self.positions[:, keep_from:]
            self.valid, self.states = self.valid[:, keep_from:], self.states[:, keep_from:]
        if self.pending == 0:
            self.ids = self.positions = self.valid = self.states = None
