"""Driving a model's decoder layers one at a time, with the model's own arguments.

`capture_layer_calls` runs the backbone once with every decoder layer swapped for a recorder that keeps
the `(args, kwargs)` the backbone passes (masks per layer type, rotary embeddings, alibi, the cache) and
hands its input straight through. The real layers are then called by the engine with those arguments.
`write_kv_only` runs a layer with a cache proxy whose `update()` stores K/V and stops the layer there:
every architecture's own input norm, k/v projections, k-norm and rotary fill the cache, and attention,
o_proj and the MLP never run. Nothing here decides anything.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .architectures import ModelParts

__all__ = ["LayerCall", "capture_layer_calls", "capture_outputs", "write_kv_only"]


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


class _Recorder(nn.Module):
    def __init__(self, store: dict, index: int, returns_tuple: bool):
        super().__init__()
        self.store, self.index, self.returns_tuple = store, index, returns_tuple

    def forward(self, *args, **kwargs):
        self.store[self.index] = LayerCall(args, kwargs)
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden,) if self.returns_tuple else hidden


@contextmanager
def _recording(parts: ModelParts):
    store: dict[int, LayerCall] = {}
    originals = list(parts.layers)
    for i in range(len(originals)):
        parts.layers[i] = _Recorder(store, i, parts.spec.returns_tuple)
    try:
        yield store
    finally:
        for i, layer in enumerate(originals):
            parts.layers[i] = layer


@torch.no_grad()
def capture_layer_calls(parts: ModelParts, **backbone_inputs) -> list[LayerCall]:
    """The arguments the backbone would pass to each decoder layer for these inputs.

    When every layer receives the same arguments (`parts.uniform_layers`), the backbone is stopped at the
    first layer and its call serves them all; otherwise every layer's call is recorded.
    """
    if parts.uniform_layers:
        return [_first_layer_call(parts, backbone_inputs)] * parts.num_layers
    with _recording(parts) as store:
        parts.backbone(**backbone_inputs)
    if len(store) != parts.num_layers:
        raise RuntimeError(f"The backbone called {len(store)} of {parts.num_layers} decoder layers.")
    return [store[i] for i in range(parts.num_layers)]


class _Captured(Exception):
    pass


def _first_layer_call(parts: ModelParts, backbone_inputs: dict) -> LayerCall:
    store = []

    def stop(_module, args, kwargs):
        store.append(LayerCall(args, kwargs))
        raise _Captured

    hook = parts.layers[0].register_forward_pre_hook(stop, with_kwargs=True)
    try:
        parts.backbone(**backbone_inputs)
    except _Captured:
        pass
    finally:
        hook.remove()
    if not store:
        raise RuntimeError("The backbone returned without calling its first decoder layer.")
    return store[0]


@contextmanager
def capture_outputs(parts: ModelParts, layers: list[int]):
    """Collect the hidden state each of `layers` outputs during a forward: {layer: [B, T, H]}."""
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        parts.layers[k].register_forward_hook(lambda _m, _a, out, k=k: captured.__setitem__(k, parts.layer_output(out)))
        for k in layers
    ]
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


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


class _ZeroQuery(nn.Module):
    """Stands in for a query projection on K/V-only passes: the queries are never used."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out_features)


@functools.lru_cache(maxsize=None)
def _zero_query(out_features: int) -> _ZeroQuery:
    return _ZeroQuery(out_features)  # stateless: one per width, shared by every layer


@contextmanager
def _query_skipped(parts: ModelParts, index: int):
    path = parts.spec.query_proj
    if path is None:
        yield
        return
    owner_path, _, name = path.rpartition(".")
    owner = parts.layers[index].get_submodule(owner_path)
    original = getattr(owner, name)
    setattr(owner, name, _zero_query(original.out_features))
    try:
        yield
    finally:
        setattr(owner, name, original)


@torch.no_grad()
def write_kv_only(call: LayerCall, parts: ModelParts, index: int, hidden: torch.Tensor, cache) -> None:
    """Fill layer `index`'s cache for `hidden` (K/V through the layer's own norm/projections/rotary)."""
    try:
        with _query_skipped(parts, index):
            call.run(parts, index, hidden, cache=_WriteThenStop(cache))
    except _KVWritten:
        return
    raise RuntimeError(f"Decoder layer {index} ran to the end without writing its KV cache.")
