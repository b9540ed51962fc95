"""Driving a model's decoder layers one at a time, with the model's own arguments.

`capture_layer_calls` runs the backbone once while every decoder layer records the `(args, kwargs)` the
backbone passes it (masks per layer type, rotary embeddings, alibi, the cache) and hands its input straight
through. The real layers are then called by the engine with those arguments. `write_kv_only` runs a layer
with a cache proxy whose `update()` stores K/V and stops the layer there: every architecture's own input
norm, k/v projections, k-norm and rotary fill the cache, and attention, o_proj and the MLP never run (nor
whatever `kvprobe` found not to reach the K/V: a query projection, a fused projection's query rows; without
a probe, the table's `query_proj`). Recording and query skipping are scoped to the caller's
context (`contextvars`), so concurrent forwards on the same model are unaffected. `map_calls` and the transforms
built on it turn calls into others: boolean masks made additive (`additive_masks`), a tree's non-ancestors blocked
(`tree_mask_calls`, for tree drafts), a chunk's calls cut to some of its positions (`positions_of`). Nothing here
decides anything.
"""

from __future__ import annotations

import functools
import types
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from ..models.architectures import ModelParts

__all__ = ["LayerCall", "PartialRows", "INNER_FORWARD", "call_own", "install_forward", "capture_layer_calls",
           "capture_outputs", "write_kv_only", "run_to_cache_write", "additive_mask", "additive_masks", "map_calls",
           "tree_mask_calls", "without_first_position", "positions_of"]


@dataclass
class LayerCall:
    args: tuple
    kwargs: dict

    def run(self, parts: ModelParts, index: int, hidden: torch.Tensor, cache=None) -> torch.Tensor:
        """Call decoder layer `index` on `hidden` (optionally with another cache object)."""
        args, kwargs = list(self.args), dict(self.kwargs)
        if args:
            args[0] = hidden
        else:
            kwargs["hidden_states"] = hidden
        if cache is not None:
            where = parts.spec.cache_arg
            if isinstance(where, int) and where < len(args):
                args[where] = cache
            else:
                kwargs[where if isinstance(where, str) else "past_key_values"] = cache
        return parts.layer_output(parts.layers[index](*args, **kwargs))

    @property
    def hidden(self) -> torch.Tensor:
        return self.args[0] if self.args else self.kwargs["hidden_states"]


# Capturing the backbone's layer calls, and K/V-only passes, never change the model per call: each decoder
# layer (and its query projection, where K/V-only passes skip it) gets, once, a forward that looks up the
# capture or the skip active in the caller's context. Other threads and plain forwards see the model as is, and
# so does `torch.compile`: under dynamo these forwards are the module's own, so the model compiles as one graph.
_CAPTURE: ContextVar = ContextVar("tide_layer_capture", default=None)
_QUERY_SKIP: ContextVar = ContextVar("tide_query_skip", default=None)
INNER_FORWARD = "_tide_inner_forward"


@dataclass
class _Capture:
    positions: dict  # id(layer module) -> layer index, for the model being captured
    returns_tuple: bool
    first_only: bool  # stop the backbone at the first layer (its call serves every layer)
    store: dict


class _Captured(Exception):
    pass


def call_own(module, cls, *args, **kwargs):
    """The module's own forward, called in a way dynamo traces (no bound-method construction)."""
    inner = module.__dict__.get(INNER_FORWARD)
    return inner(*args, **kwargs) if inner is not None else cls.forward(module, *args, **kwargs)


def install_forward(module, make) -> None:
    """Give `module`, once, the forward `make(type(module))` as a bound method (not a closure over the module, so a
    deep copy dispatches for the copy); a forward it already had as an attribute (e.g. accelerate's hooks) is kept
    as its own (`call_own`)."""
    if getattr(module, "_tide_dispatch_installed", False):
        return
    if "forward" in module.__dict__:  # e.g. accelerate's hooks
        object.__setattr__(module, INNER_FORWARD, module.__dict__["forward"])
    object.__setattr__(module, "forward", types.MethodType(make(type(module)), module))
    object.__setattr__(module, "_tide_dispatch_installed", True)


@functools.cache
def _layer_forward_for(cls):
    def forward(self, *args, **kwargs):
        capture = None if torch.compiler.is_compiling() else _CAPTURE.get()  # (dynamo reads no ContextVar)
        index = None if capture is None else capture.positions.get(id(self))
        if index is None:
            return call_own(self, cls, *args, **kwargs)
        capture.store[index] = LayerCall(args, kwargs)
        if capture.first_only:
            raise _Captured
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden,) if capture.returns_tuple else hidden

    return functools.update_wrapper(forward, cls.forward)


@functools.cache
def _query_forward_for(cls):
    def forward(self, x, *args, **kwargs):
        skips = None if torch.compiler.is_compiling() else _QUERY_SKIP.get()  # a K/V-only pass
        if skips is not None and self in skips:
            rows = skips[self]
            if rows is None:  # none of its outputs reaches the K/V
                return x.new_zeros(*x.shape[:-1], _out_features(self))
            if rows.ready(self):
                return rows(self, x)
        return call_own(self, cls, x, *args, **kwargs)

    return functools.update_wrapper(forward, cls.forward)


def _out_features(module) -> int:
    features = getattr(module, "out_features", None) or getattr(module, "nf", None)
    return int(features) if features is not None else int(module.weight.shape[0])


class PartialRows:
    """Computes only some outputs of a linear module (the K/V rows of a fused qkv projection), zeros elsewhere.

    `nn.Linear` (weight [out, in]) and transformers' `Conv1D` (weight [in, out]) only. Contiguous rows are a
    view of the weight; others are gathered into a copy, redone when the weight's storage or version changes.
    """

    def __init__(self, module, rows: torch.Tensor):
        self.conv = type(module).__name__ == "Conv1D"
        self.width = _out_features(module)
        first, last = int(rows[0]), int(rows[-1]) + 1
        self.rows = slice(first, last) if last - first == rows.numel() else rows
        self._copy, self._key = None, None

    @staticmethod
    def supports(module) -> bool:
        """A plain `nn.Linear`, transformers' `Conv1D`, or an `nn.Linear` subclass whose forward gives what
        `F.linear` gives (checked on one random input; e.g. Falcon's `FalconLinear`; not a quantized one)."""
        if type(module).__name__ == "Conv1D":
            return type(module).forward.__module__.startswith("transformers.")
        if not isinstance(module, torch.nn.Linear) or not module.weight.is_floating_point():
            return False
        if type(module).forward is torch.nn.Linear.forward:
            return True
        weight = module.weight
        with torch.no_grad():
            x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
            own = module(x)
            return (isinstance(own, torch.Tensor) and own.shape == (2, weight.shape[0])
                    and torch.allclose(own.float(), torch.nn.functional.linear(x, weight, module.bias).float(),
                                       atol=1e-5, rtol=1e-4))

    def ready(self, module) -> bool:
        """The weight is here (not offloaded to the meta device)."""
        return module.weight.device.type != "meta"

    def _weights(self, module):
        weight, bias = module.weight, module.bias
        if isinstance(self.rows, slice):
            return ((weight[:, self.rows] if self.conv else weight[self.rows]),
                    (None if bias is None else bias[self.rows]))
        key = (weight.data_ptr(), weight._version, weight.device, weight.dtype,
               None if bias is None else (bias.data_ptr(), bias._version))
        if key != self._key:
            rows = self.rows.to(weight.device)
            self._copy = (weight.index_select(1 if self.conv else 0, rows).contiguous(),
                          None if bias is None else bias.index_select(0, rows))
            self._key = key
        return self._copy

    def __call__(self, module, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._weights(module)
        if self.conv:
            flat = x.reshape(-1, x.shape[-1])
            part = (flat @ weight if bias is None else torch.addmm(bias, flat, weight)).view(*x.shape[:-1], -1)
        else:
            part = torch.nn.functional.linear(x, weight, bias)
        out = x.new_zeros(*x.shape[:-1], self.width, dtype=part.dtype)
        if isinstance(self.rows, slice):
            out[..., self.rows] = part
            return out
        return out.index_copy_(-1, self.rows.to(out.device), part)


def _install_hooks(parts: ModelParts) -> None:
    for layer in parts.layers:
        install_forward(layer, _layer_forward_for)


@contextmanager
def _capturing(parts: ModelParts, first_only: bool):
    _install_hooks(parts)
    capture = _Capture({id(layer): i for i, layer in enumerate(parts.layers)}, parts.spec.returns_tuple, first_only, {})
    token = _CAPTURE.set(capture)
    try:
        yield capture.store
    finally:
        _CAPTURE.reset(token)


@torch.no_grad()
def capture_layer_calls(parts: ModelParts, **backbone_inputs) -> list[LayerCall]:
    """The arguments the backbone would pass to each decoder layer for these inputs.

    When every layer receives the same arguments (`parts.uniform_layers`), the backbone is stopped at the
    first layer and its call serves them all; otherwise every layer's call is recorded (each layer hands its
    input straight through).
    """
    if parts.uniform_layers:
        with _capturing(parts, first_only=True) as store:
            try:
                parts.backbone(**backbone_inputs)
            except _Captured:
                pass
        if 0 not in store:
            raise RuntimeError("The backbone returned without calling its first decoder layer.")
        return [store[0]] * parts.num_layers
    with _capturing(parts, first_only=False) as store:
        parts.backbone(**backbone_inputs)
    if len(store) != parts.num_layers:
        raise RuntimeError(f"The backbone called {len(store)} of {parts.num_layers} decoder layers.")
    return [store[i] for i in range(parts.num_layers)]


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


_UNPLACED = object()


@contextmanager
def capture_outputs(parts: ModelParts, layers: list[int]):
    """Collect the hidden state each of `layers` outputs during a forward: {layer: [B, T, H]}."""
    captured: dict[int, torch.Tensor] = {}
    owner = ContextVar("tide_capture_outputs", default=None)  # only this context's forwards are collected
    token = owner.set(captured)

    def keep(k, output):
        if owner.get() is captured:
            captured[k] = parts.layer_output(output)

    hooks = [parts.layers[k].register_forward_hook(lambda _m, _a, out, k=k: keep(k, out)) for k in layers]
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()
        owner.reset(token)


class _KVWritten(Exception):
    pass


class _WriteThenStop:
    """Cache proxy: `update()` stores the new K/V in the real cache, then stops the layer."""

    def __init__(self, cache):
        self._cache = cache

    def update(self, *args, **kwargs):
        self._cache.update(*args, **kwargs)
        raise _KVWritten

    def __getattr__(self, name):
        return getattr(self._cache, name)


@contextmanager
def _query_skipped(parts: ModelParts, index: int, skips: dict | None):
    if skips is None:  # no probe: the table's query projection, if any
        path = parts.spec.query_proj
        skips = {parts.layers[index].get_submodule(path): None} if path is not None else {}
    if not skips:
        yield
        return
    for module in skips:
        install_forward(module, _query_forward_for)
    token = _QUERY_SKIP.set(skips)
    try:
        yield
    finally:
        _QUERY_SKIP.reset(token)


@torch.no_grad()
def write_kv_only(call: LayerCall, parts: ModelParts, index: int, hidden: torch.Tensor, cache,
                  skips: dict | None = None) -> None:
    """Fill layer `index`'s cache for `hidden` (K/V through the layer's own norm/projections/rotary).

    `skips` ({module: None, or PartialRows}): linear modules of the layer whose outputs do not reach the K/V
    (None: replaced by zeros) or reach it only in part (only those rows computed), from `kvprobe.kv_plan`;
    without it, the table's `query_proj` is skipped."""
    run_to_cache_write(call, parts, index, hidden, cache, skips)


def run_to_cache_write(call: LayerCall, parts: ModelParts, index: int, hidden: torch.Tensor, cache,
                       skips: dict | None = None) -> None:
    """`write_kv_only` in the caller's grad mode (the probe differentiates through it)."""
    try:
        with _query_skipped(parts, index, skips):
            call.run(parts, index, hidden, cache=_WriteThenStop(cache))
    except _KVWritten:
        return
    raise RuntimeError(f"Decoder layer {index} ran to the end without writing its KV cache.")
