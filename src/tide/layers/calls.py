"""Driving a model's decoder layers one at a time, with the model's own arguments.

`capture_layer_calls` runs the backbone once while every decoder layer records the `(args, kwargs)` the
backbone passes it (masks per layer type, rotary embeddings, alibi, the cache) and hands its input straight
through. The real layers are then called by the engine with those arguments. `write_kv_only` runs a layer
with a cache proxy whose `update()` stores K/V and stops the layer there: every architecture's own input
norm, k/v projections, k-norm and rotary fill the cache, and attention, o_proj and the MLP never run (nor
whatever `kvprobe` found not to reach the K/V: a query projection, a fused projection's query rows; without
a probe, the table's `query_proj`). Recording and query skipping are scoped to the caller's
context (`contextvars`), so concurrent forwards on the same model are unaffected. `calltransforms` turns calls
into others (masks made additive, a tree's non-ancestors blocked, positions cut). Nothing here decides anything.
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
           "capture_outputs", "write_kv_only", "run_to_cache_write"]


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
