"""K/V for the layers a token skips, all of them in one batched computation.

With `propagate`, every layer after a token's exit sees the same exit state, so their K/V can be computed
together: normalise the state once (RMS or LayerNorm, without affine), one matmul against a stack of every
layer's K/V weights with that layer's input-norm affine folded in (RMS: W * g, Gemma's 1 + g; LayerNorm:
W * g and bias W @ beta + b), the per-head k-norm where the layers have one (RMS or LayerNorm, batched over
layers), rotary on all layers' keys at once (llama-style rotate_half with the calls' `position_embeddings`,
on the first `cos.shape[-1]` dims of a head: partial rotary as in phi, stablelm, gpt_neox; none where the
calls carry no `position_embeddings` or carry alibi), then each layer's own `cache.update(k, v, layer)`, so
sliding-window cache layers keep their own behaviour.

What is stacked comes from the probe (`kvprobe.kv_plan`), not from names: per layer, which linear outputs
reach the written keys and which the written values (separate k_proj/v_proj, or only the K/V rows of a fused
qkv projection such as GPT-2's `c_attn`, GPT-NeoX's and Falcon's `query_key_value`, Phi-3's `qkv_proj`, in
the written head order; heads repeated as Falcon's new decoder architecture broadcasts them), the module whose
output those linears read (the input norm, or the layer's input itself), and the written heads and head
size. The k-norm is the attention module's `k_norm`/`k_layernorm` (or the table's `KVProjections.k_norm`).
Norms are recognised by what they compute (on one random input), not by their class.

Which layers take this path: every model whose `ArchSpec.kv_projections` is not None (the default, for the
table's families and the types `probe_spec` describes), when every layer's K/V linears are `nn.Linear`-like
or `Conv1D` and read one module's output, the layers' input norms (and k-norms) are of one kind with one eps,
and all their parameters are on one device. The stack is then checked once against what each layer's own code
wrote in the probe (`LayerPlan.sample`); where it differs (e.g. rotary on interleaved pairs as in GPT-J and
Cohere, a k-norm over all heads at once as in OLMo 2, layers without rotary among rotary ones), the model fills
layer by layer. A fill is batched per group of one attention type (`parts.layer_types`; sliding and full layers
apart, each stacked contiguously) whose calls share one `position_embeddings` object or carry none. Everything
else is filled by `kvprobe.write_kv` per layer, which runs each layer's own code up to its cache write,
computing only the linear outputs that reach the K/V. `fill_kv(..., layerwise=True)` forces that path (a generate
call's `kv_fill="layerwise"`).

A batched fill calls no module of the skipped layers: only the stacked weights, the calls' rotary and
`cache.update`. Building the stack (once per model, device and dtype) calls each input norm and k-norm once on a
random input, to recognise it, and retakes a layer's sample only if its parameters changed since the probe.

Memory: the stack is a copy of every layer's K/V weights (and biases), i.e. the size of all k/v projections,
e.g. 2 * L * H * H_kv * D elements. It is folded in fp32, stored in the states' dtype on their device, built
lazily once per (layers, device, dtype), freed with the model (weak keys) and rebuilt when a folded parameter
is modified in place (its version counter). After replacing parameters in another way (e.g. a dtype round
trip), call `clear_stacks()`.

This module decides nothing about exits and never runs attention or MLPs; it only writes the cache.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .calls import LayerCall
from .kvprobe import kv_plan, write_kv

__all__ = ["fill_kv", "fused_available", "clear_stacks"]

# layers ModuleList -> {(device, dtype): _Stack, or None when its layers cannot be stacked}
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_K_NORM_NAMES = ("k_norm", "k_layernorm", "key_norm")


@torch.no_grad()
def fill_kv(parts, calls: list[LayerCall], layers: list[int], hidden: torch.Tensor, cache,
            layerwise: bool = False) -> None:
    """Write K/V computed from `hidden` [B, T, H] into the cache of each layer in `layers` (ascending).

    `calls[i]` is layer i's `LayerCall`; `layerwise=True` forces the per-layer path.
    """
    if not layers:
        return
    stack = None if layerwise or parts.spec.kv_projections is None else _stack(parts, hidden.device, hidden.dtype)
    for group in _by_attention_type(parts, layers):
        positions = None if stack is None else _positions(calls, group)
        if positions is None:
            for i in group:
                write_kv(calls[i], parts, i, hidden, cache)
            continue
        keys, values = stack.kv(group, hidden, positions.rotary)  # [m, B, H_kv, T, D] each
        for i, k, v in zip(group, keys.unbind(0), values.unbind(0)):
            cache.update(k, v, i)


@torch.no_grad()
def fused_available(parts, calls: list[LayerCall], layers: list[int], hidden: torch.Tensor) -> bool:
    """True when every layer in `layers` would be filled by the batched path for states like `hidden`."""
    if parts.spec.kv_projections is None:
        return False
    stack = _stack(parts, hidden.device, hidden.dtype)
    if stack is None:
        return False
    return all(_positions(calls, group) is not None for group in _by_attention_type(parts, layers))


def clear_stacks() -> None:
    """Forget every stacked weight (they are rebuilt on the next fill)."""
    _STACKS.clear()


def _by_attention_type(parts, layers: list[int]) -> list[list[int]]:
    """`layers` split by attention type, each group ascending."""
    types = parts.layer_types
    if not types or len({types[i] for i in layers}) == 1:
        return [layers]
    groups: dict[str, list[int]] = {}
    for i in layers:
        groups.setdefault(types[i], []).append(i)
    return list(groups.values())


@dataclass(frozen=True)
class _Positions:
    rotary: tuple | None  # the (cos, sin) every call of a group receives, or None: the keys are not rotated


def _positions(calls: list[LayerCall], group: list[int]) -> _Positions | None:
    """How a group's keys get their positions: one shared rotary, none (learned positions, alibi), or None when
    the calls differ (each layer has its own rotary)."""
    def rotary_of(call):
        if call.kwargs.get("alibi") is not None:  # alibi biases the scores; Falcon passes rotary anyway
            return None
        return call.kwargs.get("position_embeddings")

    rotary = rotary_of(calls[group[0]])
    if any(rotary_of(calls[i]) is not rotary for i in group):
        return None
    if rotary is not None and not (isinstance(rotary, tuple) and len(rotary) == 2):  # e.g. Llama 4's complex freqs
        return None
    return _Positions(rotary)


def _stack(parts, device: torch.device, dtype: torch.dtype) -> _Stack | None:
    per_model = _STACKS.setdefault(parts.layers, {})
    key = (device, dtype)
    if key not in per_model or (per_model[key] is not None and per_model[key].stale()):
        per_model[key] = _Stack.build(parts, device, dtype)
    return per_model[key]


@dataclass(frozen=True)
class _Norm:
    """What a norm computes: `kind` ("rms", "layer") without affine, then * scale (+ shift); fp32 [width]."""

    kind: str
    eps: float
    scale: torch.Tensor | None
    shift: torch.Tensor | None

    @classmethod
    def of(cls, module: nn.Module, width: int) -> _Norm | None:
        """The norm `module` computes over its last `width` features, recognised on one random input; None when
        it is none of RMS (weight w or Gemma's 1 + w) and LayerNorm (with or without weight and bias)."""
        eps = next((getattr(module, n) for n in ("variance_epsilon", "eps", "epsilon") if hasattr(module, n)), None)
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if any(isinstance(p, torch.Tensor) and p.device.type == "meta" for p in (weight, bias)):
            return None
        # a norm that keeps no eps (OLMo's parameter-free LayerNorm hard-codes 1e-5): the usual values are tried
        epsilons = [float(eps)] if isinstance(eps, (int, float)) else [1e-5, 1e-6]
        weight = weight.detach().float() if isinstance(weight, torch.Tensor) else None
        bias = bias.detach().float() if isinstance(bias, torch.Tensor) else None
        candidates = []
        for eps in epsilons:
            candidates += [cls("layer", eps, weight, bias)]
            if bias is None:
                candidates += [cls("rms", eps, weight, None)]
                if weight is not None:
                    candidates += [cls("rms", eps, 1.0 + weight, None)]
        probe = next(module.parameters(), None)
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(0))
        x = x.to(probe.device, probe.dtype) if probe is not None else x
        try:
            own = module(x).float()
        except (RuntimeError, ValueError, TypeError):  # e.g. a k-norm over all heads at once (OLMo 2)
            return None
        tol = dict(atol=1e-5, rtol=1e-4) if x.dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        return next((c for c in candidates if torch.allclose(c(x.float()), own, **tol)), None)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """The norm without its affine, over the last dimension (fp32 in, fp32 out)."""
        if self.kind == "rms":
            return F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return F.layer_norm(x, (x.shape[-1],), eps=self.eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self.normalise(x)
        x = x if self.scale is None else x * self.scale.to(x.device)
        return x if self.shift is None else x + self.shift.to(x.device)


@dataclass
class _LayerKV:
    """One layer's K/V weights as the probe found them: keys = k_norm(weight[:n] @ norm(h) + bias[:n]) in
    heads of `head_dim` (each repeated `repeat` times), values likewise from weight[n:]."""

    weight: torch.Tensor  # [2n, H] fp32, the input norm's affine folded in
    bias: torch.Tensor  # [2n] fp32
    norm: _Norm | None  # the input norm, without affine (None: the layer's input is read as is)
    k_norm: _Norm | None
    head_dim: int
    repeat: int
    params: list  # the parameters folded in

    @classmethod
    def of(cls, parts, index: int, plan) -> _LayerKV | None:
        """Layer `index`'s K/V weights from its probe plan (`kvprobe.LayerPlan`), or None where they do not fit."""
        layer = parts.layers[index]
        if plan.kv_input is None or plan.key_shape is None or plan.key_shape != plan.value_shape:
            return None
        heads, head_dim = plan.key_shape
        pieces = [_rows_of(layer.get_submodule(name), rows) for name, rows in plan.key_rows.items()]
        pieces += [_rows_of(layer.get_submodule(name), rows) for name, rows in plan.value_rows.items()]
        if not plan.key_rows or not plan.value_rows or any(p is None for p in pieces):
            return None
        n_keys = len(plan.key_rows)
        key_w, value_w = torch.cat([w for w, _ in pieces[:n_keys]]), torch.cat([w for w, _ in pieces[n_keys:]])
        key_b, value_b = torch.cat([b for _, b in pieces[:n_keys]]), torch.cat([b for _, b in pieces[n_keys:]])
        n, width = key_w.shape
        if value_w.shape != key_w.shape or n % head_dim or (heads * head_dim) % n:
            return None
        weight, bias = torch.cat([key_w, value_w]), torch.cat([key_b, value_b])
        params = [p for name in {**plan.key_rows, **plan.value_rows} for p in layer.get_submodule(name).parameters()]
        norm = None
        if plan.kv_input:
            module = layer.get_submodule(plan.kv_input)
            norm = _Norm.of(module, width)
            if norm is None:
                return None
            params += list(module.parameters(recurse=False))
            if norm.shift is not None:
                bias = bias + weight @ norm.shift
            if norm.scale is not None:
                weight = weight * norm.scale
        k_norm, k_norm_module = None, _k_norm_module(parts, layer, next(iter(plan.key_rows)))
        if k_norm_module is not None:
            k_norm = _Norm.of(k_norm_module, head_dim)
            if k_norm is None:
                return None
            params += list(k_norm_module.parameters(recurse=False))
        return cls(weight, bias, norm, k_norm, head_dim, heads * head_dim // n, params)


def _rows_of(module: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight [n, in], bias [n]) fp32 of the outputs `rows` of a linear module (one the probe found `nn.Linear`-like
    or `Conv1D`), or None if its weight is not loaded."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if weight is None or weight.device.type == "meta":
        return None
    weight = weight.detach().float()
    weight = weight.T if type(module).__name__ == "Conv1D" else weight
    rows = rows.to(weight.device)
    bias = torch.zeros(weight.shape[0], device=weight.device) if bias is None else bias.detach().float()
    return weight.index_select(0, rows), bias.index_select(0, rows)


def _k_norm_module(parts, layer: nn.Module, key_linear: str) -> nn.Module | None:
    """The table's k-norm, else a child of the key projection's parent named like one."""
    named = parts.spec.kv_projections.k_norm if parts.spec.kv_projections is not None else None
    if named:
        return _submodule(layer, named)
    attention = _submodule(layer, key_linear.rpartition(".")[0]) if "." in key_linear else layer
    return next((getattr(attention, n) for n in _K_NORM_NAMES if isinstance(getattr(attention, n, None), nn.Module)),
                None)


def _submodule(layer: nn.Module, path: str) -> nn.Module | None:
    try:
        return layer.get_submodule(path)
    except AttributeError:
        return None


class _Stack:
    """Every layer's folded K/V weights, stacked; `kv` computes a group of layers' K/V from one state."""

    def __init__(self, layers: list[_LayerKV], device: torch.device, dtype: torch.dtype, types: list | None):
        # stacked by attention type, then layer: the layers a token skips (the last ones of each type) are then a
        # contiguous range of the stack, read as a view
        order = sorted(range(len(layers)), key=lambda i: (types.index(types[i]) if types else 0, i))
        self.position = {layer: row for row, layer in enumerate(order)}
        layers = [layers[i] for i in order]
        first = layers[0]
        self.weight = torch.stack([s.weight for s in layers]).to(device=device, dtype=dtype)  # [L, 2n, H]
        self.bias = torch.stack([s.bias for s in layers]).to(device=device, dtype=dtype)  # [L, 2n]
        self.norm, self.head_dim, self.repeat = first.norm, first.head_dim, first.repeat
        self.k_norm, self.k_scale, self.k_shift = first.k_norm, None, None
        if self.k_norm is not None:  # per layer [L, D] fp32
            self.k_scale = _stacked([s.k_norm.scale for s in layers], device)
            self.k_shift = _stacked([s.k_norm.shift for s in layers], device)
        self._params = [p for s in layers for p in s.params]  # the folded parameters, to notice in-place changes
        self._versions = self._current_versions()

    def _current_versions(self) -> tuple:
        return tuple(p._version for p in self._params)

    def stale(self) -> bool:
        return self._versions != self._current_versions()

    def kv(self, group: list[int], hidden: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [m, B, heads, T, D] in `hidden`'s dtype for the m layers of `group`, from `hidden`."""
        rows = _rows([self.position[i] for i in group])
        weight, bias = self.weight[rows], self.bias[rows]  # [m, 2n, H], [m, 2n]
        batch, length, _ = hidden.shape
        x = hidden.float() if self.norm is None else self.norm.normalise(hidden.float())
        out = F.linear(x.to(weight.dtype), weight.flatten(0, 1), bias.flatten()).float()  # [B, T, m * 2n]
        out = out.view(batch, length, len(group), 2, -1, self.head_dim).permute(3, 2, 0, 4, 1, 5)
        keys, values = out[0], out[1]  # [m, B, n / D, T, D]
        if self.k_norm is not None:
            keys = self.k_norm.normalise(keys)
            if self.k_scale is not None:
                keys = keys * self.k_scale[rows][:, None, None, None]
            if self.k_shift is not None:
                keys = keys + self.k_shift[rows][:, None, None, None]
        if rotary is not None:
            keys = _rotated(keys, *rotary)
        if self.repeat > 1:  # Falcon's new decoder architecture broadcasts each K/V head to its query heads
            keys, values = keys.repeat_interleave(self.repeat, 2), values.repeat_interleave(self.repeat, 2)
        return keys.to(hidden.dtype), values.to(hidden.dtype)

    def matches(self, samples: list) -> bool:
        """Each layer's batched K/V equal what its own code wrote in the probe (`kvprobe.KVSample`)."""
        for i, sample in enumerate(samples):
            if sample is None or (positions := _positions([sample.call], [0])) is None:
                return False
            hidden = sample.hidden.to(self.weight.device, self.weight.dtype)
            rotary = positions.rotary  # recorded where the probe ran: the model may have moved since
            rotary = None if rotary is None else tuple(t.to(self.weight.device) for t in rotary)
            keys, values = self.kv([i], hidden, rotary)
            low = self.weight.dtype != torch.float32 or sample.keys.dtype != torch.float32
            tol = dict(atol=5e-2, rtol=5e-2) if low else dict(atol=1e-4, rtol=1e-3)
            for mine, own in ((keys[0], sample.keys), (values[0], sample.values)):
                own = own.to(mine.device)
                if mine.shape != own.shape or not torch.allclose(mine.float(), own.float(), **tol):
                    return False
        return True

    @classmethod
    def build(cls, parts, device: torch.device, dtype: torch.dtype) -> _Stack | None:
        """Fold and stack every layer's K/V weights, or None when the layers do not fit the batched path."""
        plan = kv_plan(parts)
        if plan.reason is not None or len(plan.layers) != parts.num_layers:
            return None
        layers = [_LayerKV.of(parts, i, layer) for i, layer in enumerate(plan.layers)]
        if any(s is None for s in layers) or not _alike(layers):
            return None
        stack = cls(layers, device, dtype, parts.layer_types)
        samples = [layer.sample and layer.sample.current(parts, i) for i, layer in enumerate(plan.layers)]
        return stack if stack.matches(samples) else None


def _alike(layers: list[_LayerKV]) -> bool:
    """One weight shape, one kind of input norm and of k-norm (with one eps), every parameter on one device."""
    def kind(norm):
        return None if norm is None else (norm.kind, norm.eps, norm.scale is None, norm.shift is None)

    return (len({(s.weight.shape, s.head_dim, s.repeat, kind(s.norm), kind(s.k_norm)) for s in layers}) == 1
            and len({p.device for s in layers for p in s.params}) == 1)


def _stacked(tensors: list, device) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.stack(tensors).to(device)


def _rows(rows: list[int]):
    """Index of `rows` into the stack: a slice (a view) when they are contiguous and ascending, else the list."""
    first, last = rows[0], rows[-1] + 1
    return slice(first, last) if last - first == len(rows) and rows == sorted(rows) else rows


def _rotated(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama-style rotary on the first cos.shape[-1] dims of each head (the rest pass through). keys [m, B, h, T, D],
    cos/sin [B, T, d]."""
    cos, sin = (t.float()[None, :, None] for t in (cos, sin))  # [1, B, 1, T, d]
    dims = cos.shape[-1]
    if dims == keys.shape[-1]:
        return keys * cos + _rotate_half(keys) * sin
    part, rest = keys[..., :dims], keys[..., dims:]
    return torch.cat([part * cos + _rotate_half(part) * sin, rest], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
