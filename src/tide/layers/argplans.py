"""How `args.LayerArgs` slices a window's layer arguments for one request: which axes of each argument are the
positions' (read from two captures, one position apart), the cut, and the checks of a slice against the backbone's
own arguments."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache

from .calls import LayerCall

__all__ = ["AMBIGUOUS", "TensorPlan", "Cut", "call_arguments", "slicing_plan", "apply_plan", "mask_arguments",
           "visible_counts", "same_call", "passes_full_masks"]

AMBIGUOUS = object()


@dataclass(frozen=True)
class TensorPlan:
    query: int | None  # the axis over the window's positions
    key: int | None  # the mask's key axis (the last), cut to the request's key length


@dataclass
class Cut:
    first: int  # the request's first position, relative to the window's start
    length: int
    key_length: int | None  # None: keys are not cut (a static cache's masks span the whole cache)
    cache: object
    visible: dict
    none_when_full: bool  # a one-query mask that sees every key becomes None (not on compileable, static caches,
    # whose backbone always passes the mask, so that compiled layers see one kind of argument, nor where the
    # backbone was seen to pass such a mask: `LayerArgs` learns it from its first check)


def call_arguments(call: LayerCall):
    """A call's arguments but its hidden state: (positional after the first, keywords)."""
    return call.args[1:], {k: v for k, v in call.kwargs.items() if k != "hidden_states"}


def slicing_plan(value, wider, width: int):
    """How to slice `value` (captured for `width` positions) given the same argument captured for width + 1: the
    axes that grew by one are positional; with two, the first is the query axis and the last the key axis; with
    one, it is the query axis if it has the window's width and is not a mask's last axis of another size."""
    if isinstance(value, torch.Tensor):
        if not isinstance(wider, torch.Tensor) or wider.dim() != value.dim():
            return AMBIGUOUS
        grew = [a for a in range(value.dim()) if wider.shape[a] == value.shape[a] + 1]
        if any(wider.shape[a] != value.shape[a] for a in range(value.dim()) if a not in grew):
            return AMBIGUOUS
        if not grew:
            return None
        if len(grew) == 2 and grew[1] == value.dim() - 1 and value.shape[grew[0]] == width:
            return TensorPlan(grew[0], grew[1])
        if len(grew) == 1 and value.shape[grew[0]] == width and not (grew[0] == value.dim() - 1 and value.dim() >= 3):
            return TensorPlan(grew[0], None)
        if len(grew) == 1 and grew[0] == value.dim() - 1 and value.shape[grew[0]] != width:
            return TensorPlan(None, grew[0])  # keys only (e.g. alibi biases)
        return AMBIGUOUS
    if isinstance(value, (tuple, list)):
        if not isinstance(wider, (tuple, list)) or len(wider) != len(value):
            return AMBIGUOUS
        plans = [slicing_plan(v, w, width) for v, w in zip(value, wider)]
        return AMBIGUOUS if any(p is AMBIGUOUS for p in plans) else (type(value), plans)
    if isinstance(value, dict):
        if not isinstance(wider, dict) or wider.keys() != value.keys():
            return AMBIGUOUS
        plans = {k: slicing_plan(v, wider[k], width) for k, v in value.items()}
        return AMBIGUOUS if any(p is AMBIGUOUS for p in plans.values()) else (dict, plans)
    return None


def apply_plan(value, plan, cut: Cut):
    if isinstance(value, Cache):
        return cut.cache
    if plan is None:
        return value
    if isinstance(plan, TensorPlan):
        out = value
        if plan.key is not None and cut.key_length is not None:
            out = out.narrow(plan.key, 0, cut.key_length)
        if plan.query is not None:
            out = out.narrow(plan.query, cut.first, cut.length)
            if plan.key is not None and cut.length == 1 and cut.none_when_full:
                fewest, most = cut.visible[id(value)]
                keys = out.shape[plan.key]
                if fewest[cut.first] == most[cut.first] == keys:  # sees every key: what the backbone passes is None
                    return None
        return out
    kind, plans = plan
    if kind is dict:
        return {k: apply_plan(v, plans[k], cut) for k, v in value.items()}
    return kind(apply_plan(v, p, cut) for v, p in zip(value, plans))


def mask_arguments(call: LayerCall, plan) -> list[tuple[torch.Tensor, TensorPlan]]:
    """The arguments of `call` that have both a query and a key axis (attention masks)."""
    found = []

    def walk(value, plan):
        if isinstance(plan, TensorPlan):
            if plan.query is not None and plan.key is not None:
                found.append((value, plan))
        elif plan is not None:
            kind, plans = plan
            items = zip(value.values(), plans.values()) if kind is dict else zip(value, plans)
            for v, p in items:
                walk(v, p)

    walk(call_arguments(call), plan)
    return found


def visible_counts(mask: torch.Tensor, plan: TensorPlan) -> tuple[list[int], list[int]]:
    """For each query row of a mask (boolean, or additive with 0 where a key is seen): the fewest and the most
    keys it sees over the other axes (one host sync per window)."""
    seen = mask if mask.dtype == torch.bool else mask == 0
    counts = seen.sum(plan.key).movedim(plan.query, -1)  # the key axis is the last, after the query axis
    counts = counts.reshape(-1, counts.shape[-1])
    return counts.amin(0).tolist(), counts.amax(0).tolist()


def same_call(a: LayerCall, b: LayerCall) -> bool:
    return _same(call_arguments(a), call_arguments(b))


def _same(a, b) -> bool:
    """Does the slice's argument `a` serve the layer as the backbone's `b` does? A sliced mask that sees every key
    stands for the backbone's None; a None stands only for None (a layer may add the mask unconditionally)."""
    if isinstance(a, Cache) and isinstance(b, Cache):
        return True
    if b is None:
        return a is None or (isinstance(a, torch.Tensor) and _sees_all(a))
    if a is None:
        return False
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality
        return a is b


def passes_full_masks(calls: list[LayerCall], fresh: list[LayerCall]) -> bool:
    """The slice gave None where the backbone passed a mask that sees every key."""
    found = []

    def walk(a, b):
        if a is None and isinstance(b, torch.Tensor):
            found.append(_sees_all(b))
        elif isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
            for x, y in zip(a, b):
                walk(x, y)
        elif isinstance(a, dict) and isinstance(b, dict):
            for k in a.keys() & b.keys():
                walk(a[k], b[k])

    for mine, theirs in zip(calls, fresh):
        walk(call_arguments(mine), call_arguments(theirs))
    return any(found)


def _sees_all(mask: torch.Tensor) -> bool:
    """A mask with one query row that sees every key (what the backbone would pass as None)."""
    if mask.dim() < 2 or mask.shape[-2] != 1:
        return False
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())
