"""Layer calls turned into others (`calls.LayerCall`), computed once per distinct call object: boolean masks made
additive (`additive_masks`), a tree's non-ancestors blocked (`tree_mask_calls`, for tree drafts), a chunk's calls
cut to some of its positions (`positions_of`, `without_first_position`). Nothing here runs a layer."""

from __future__ import annotations

import torch

from ..models.architectures import ModelParts
from .calls import LayerCall

__all__ = ["map_calls", "additive_mask", "additive_masks", "tree_mask_calls", "without_first_position",
           "positions_of"]

_UNPLACED = object()  # an argument with no position axis to cut


def map_calls(calls: list[LayerCall], transform) -> list[LayerCall] | None:
    """`transform(call)` for each call, computed once per distinct call object (`capture_layer_calls` hands one
    call to every layer of a uniform model, and the results stay shared the same way); None if any is None.

    Arguments the calls share stay shared too: where calls of different layers received one tensor (or tuple of
    tensors: the rotary `position_embeddings` of a layer type), the results hold the first call's transform of
    it, so the batched K/V fill still sees one rotary per layer type. `transform` must treat each argument on its
    own (as `rowsplit.sliced_call` and `additive_masks` do)."""
    done: dict[int, LayerCall] = {}
    shared: dict[int, tuple] = {}  # id of an argument -> (the argument, what the first call made of it)

    def share(old, new):
        if not isinstance(old, (torch.Tensor, tuple)):
            return new
        first = shared.setdefault(id(old), (old, new))
        return first[1]

    for call in calls:
        if id(call) not in done:
            new = transform(call)
            if new is None:
                return None
            args = tuple(share(o, n) if j else n for j, (o, n) in enumerate(zip(call.args, new.args)))
            kwargs = {k: share(call.kwargs[k], v) if k in call.kwargs and k != "hidden_states" else v
                      for k, v in new.kwargs.items()}
            done[id(call)] = LayerCall(args + new.args[len(args):], kwargs)
    return [done[id(call)] for call in calls]


def additive_masks(parts: ModelParts, calls: list[LayerCall]) -> list[LayerCall]:
    """`calls` with every 4-D boolean attention mask given as the additive mask SDPA makes of it (0 where a query
    sees a key, -inf elsewhere, in the hidden states' dtype), for models whose attention is SDPA.

    SDPA converts a boolean mask on every call, i.e. in every layer of a pass; converted once per pass, the same
    values reach the same kernel (0.01 ms a layer on the 12-layer demo model, docs/benchmarks.md). Other
    attention implementations, and calls without such a mask, are returned unchanged."""
    if getattr(parts.backbone.config, "_attn_implementation", None) != "sdpa":
        return calls
    converted: dict[int, torch.Tensor] = {}

    def convert(value, dtype):
        if not (isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 4):
            return value
        if id(value) not in converted:
            converted[id(value)] = additive_mask(value, dtype)
        return converted[id(value)]

    def with_additive(call: LayerCall) -> LayerCall:
        dtype = call.hidden.dtype
        return LayerCall(tuple(convert(v, dtype) for v in call.args),
                         {name: convert(v, dtype) for name, v in call.kwargs.items()})

    return map_calls(calls, with_additive)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of a boolean mask [B, h, Q, K]. On CUDA its rows start 16-element aligned (a view of a buffer
    whose last dimension is padded), as SDPA's memory-efficient kernel pads a bias it is given: cuDNN's attention
    failed on an H200 (`mha_graph.execute(...).is_good()`, then misaligned addresses) on Tide's single-token passes,
    whose masks have odd key lengths."""
    keys = mask.shape[-1]
    width = -(-keys // 16) * 16 if mask.is_cuda else keys
    additive = torch.zeros(*mask.shape[:-1], width, dtype=dtype, device=mask.device)[..., :keys]
    return additive.masked_fill_(mask.logical_not(), float("-inf"))


def tree_mask_calls(calls: list[LayerCall], blocked: torch.Tensor, start: int | None = None) -> list[LayerCall] | None:
    """Copies of `calls` whose 4-D attention masks also block `blocked` [Q, Q] (query row, chunk key column).

    The chunk's keys are the mask's columns `start..start+Q-1` (the cached positions before the chunk: a static
    cache's masks span the whole preallocated cache), or its last Q columns where `start` is None. None when a
    call carries no 4-D mask for Q queries."""
    q = blocked.shape[0]

    def patched(call: LayerCall) -> LayerCall | None:
        args, kwargs, found = list(call.args), dict(call.kwargs), False
        for where, value in [*enumerate(args), *kwargs.items()]:
            if not (isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[-2] == q):
                continue
            first = value.shape[-1] - q if start is None else start
            if first < 0 or first + q > value.shape[-1]:
                continue
            mask = value.clone()
            chunk = mask[..., first:first + q]
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
    """The calls for a chunk of `q` positions turned into calls for its last `q - 1` positions (same keys)."""
    return positions_of(calls, q, 1, q - 1)


def positions_of(calls: list[LayerCall], q: int, first: int, count: int) -> list[LayerCall] | None:
    """The calls for a chunk of `q` positions turned into calls for its positions first..first+count-1 (same keys).

    Per-position arguments keep those queries: the hidden states and rotary tables [B, q, ...] (3-D), position ids
    [B, q], cache positions [q], and 4-D masks [B, h, q, K] (rows). None when a tensor has a dimension of size q
    anywhere else, which this cannot place."""

    def cut(value):
        if isinstance(value, (tuple, list)):
            parts = [cut(v) for v in value]
            return _UNPLACED if any(p is _UNPLACED for p in parts) else type(value)(parts)
        if not isinstance(value, torch.Tensor) or q not in value.shape:
            return value
        if value.dim() == 4 and value.shape[-2] == q and q not in (value.shape[0], value.shape[1], value.shape[-1]):
            return value.narrow(-2, first, count)
        if value.dim() in (2, 3) and value.shape[1] == q and q not in (value.shape[0], *value.shape[2:]):
            return value.narrow(1, first, count)
        if value.dim() == 1:
            return value.narrow(0, first, count)
        return _UNPLACED

    def sliced(call: LayerCall) -> LayerCall | None:
        args = [cut(v) for v in call.args]
        kwargs = {name: cut(v) for name, v in call.kwargs.items()}
        return None if any(v is _UNPLACED for v in [*args, *kwargs.values()]) else LayerCall(tuple(args), kwargs)

    return map_calls(calls, sliced)
