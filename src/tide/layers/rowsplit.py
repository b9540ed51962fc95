"""Per-row skipping in batched decode steps: rows that have exited stop riding through the layers.

When a row leaves at a checkpoint, the K/V of every layer after it is computed at once from its exit state
(`kvfill.fill_kv` on that row alone) and held by `RowSplitCache`; the layers that still run take only the
running rows, with their per-row inputs (masks, rotary embeddings, positions) sliced by `sliced_call`. When a
layer's running rows write their K/V, the cache proxy assembles the full batch in row order, makes the one real
`cache.update` for that layer, and hands attention the K/V of the running rows only.

A layer call can be sliced when each of its batch-dimension tensors has the batch size (or 1, broadcast) as its
first dimension; otherwise (e.g. alibi biases laid out [batch x heads, ...]) the whole batch keeps running, as
before. Nothing here decides exits.
"""

from __future__ import annotations

import torch

from .calls import LayerCall

__all__ = ["RowSplitCache", "sliced_call", "can_slice"]


def _tensors(call: LayerCall, skip_first: bool = True):
    values = list(call.args[1:] if skip_first and call.args else call.args) + [
        v for k, v in call.kwargs.items() if not (k == "hidden_states" and skip_first)]
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def can_slice(call: LayerCall, batch: int) -> bool:
    """True when every tensor argument of `call` is per-row ([batch, ...]) or shared (a first dimension of 1, or
    not a multiple of the batch: positions, lengths)."""
    for tensor in _tensors(call):
        if tensor.dim() and tensor.shape[0] != batch and tensor.shape[0] % batch == 0 and tensor.shape[0] > 1:
            return False
    return True


def _slice(value, rows: torch.Tensor, batch: int):
    if isinstance(value, torch.Tensor):
        return value.index_select(0, rows.to(value.device)) if value.dim() and value.shape[0] == batch else value
    if isinstance(value, tuple):
        return tuple(_slice(v, rows, batch) for v in value)
    if isinstance(value, list):
        return [_slice(v, rows, batch) for v in value]
    return value


def sliced_call(call: LayerCall, rows: torch.Tensor, batch: int) -> LayerCall:
    """`call` for the rows `rows` (long [R]) of a batch of `batch` rows."""
    return LayerCall(tuple(_slice(a, rows, batch) for a in call.args),
                     {k: _slice(v, rows, batch) for k, v in call.kwargs.items()})


class RowSplitCache:
    """Cache proxy for a decode step whose rows run different numbers of layers.

    `rows` is the long [R] tensor of the rows the current layer call (or K/V fill) covers. Each layer's K/V
    arrives in parts; when the parts cover the batch, the real cache is updated once with the assembled
    tensors, and the K/V of the rows that completed it are returned for attention.
    """

    def __init__(self, cache, batch: int):
        self._cache, self._batch = cache, batch
        self._parts: dict[int, list] = {}  # layer -> [(rows, keys, values)]
        self.rows: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        parts = self._parts.setdefault(layer_idx, [])
        parts.append((self.rows, key_states, value_states))
        covered = sum(rows.numel() for rows, _, _ in parts)
        if covered < self._batch:
            return None  # a fill for exited rows: nothing reads it back
        del self._parts[layer_idx]
        keys = key_states.new_empty((self._batch, *key_states.shape[1:]))
        values = value_states.new_empty((self._batch, *value_states.shape[1:]))
        for rows, k, v in parts:
            keys.index_copy_(0, rows.to(keys.device), k)
            values.index_copy_(0, rows.to(values.device), v)
        all_keys, all_values = self._cache.update(keys, values, layer_idx, *args, **kwargs)
        rows = self.rows.to(all_keys.device)
        return all_keys.index_select(0, rows), all_values.index_select(0, rows)

    def check_complete(self) -> None:
        if self._parts:
            raise RuntimeError(f"Tide: layers {sorted(self._parts)} got K/V for only some rows of the batch.")

    def __getattr__(self, name):
        return getattr(self._cache, name)
