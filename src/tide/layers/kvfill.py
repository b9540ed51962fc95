"""K/V for the layers a token skips, all of them in one batched computation.

With `propagate`, every layer after a token's exit sees the same exit state, so their K/V can be computed
together: normalise the state once (RMS, without weight), one matmul against a stack of every layer's
k_proj and v_proj with that layer's input-norm weight folded in (Gemma: 1 + w), the per-head k-norm where
the family has one (Qwen3; batched over layers), llama-style rotary (rotate_half with the calls'
`position_embeddings`) on all layers' keys at once, then each layer's own `cache.update(k, v, layer)`, so
sliding-window cache layers keep their own behaviour.

Which layers take this path: families whose table entry describes their K/V projections
(`ArchSpec.kv_projections`), in groups of one attention type (`parts.layer_types`) whose layer calls share
one `position_embeddings` object. Everything else (other families, a group with its own rotary, a model
whose layers cannot be stacked: input norms with a bias or differing eps, layers on several devices) is
filled by `kvprobe.write_kv` per layer, which runs each layer's own code up to its cache write, computing
only the linear outputs that reach the K/V (the probe's plan: no query projection, the K/V rows of a fused qkv).
`fill_kv(..., layerwise=True)` or the environment variable `TIDE_KV_FILL=layerwise` forces that path.

Memory: the stack is a copy of every layer's k_proj and v_proj weights (and biases), i.e. the size of all
k/v projections, e.g. 2 * L * H * H_kv * D elements. It is folded in fp32, stored in the states' dtype on
their device, built lazily once per (layers, device, dtype), freed with the model (weak keys) and rebuilt
when a folded parameter is modified in place (its version counter). After replacing parameters in another
way (e.g. a dtype round trip), call `clear_stacks()`.

This module decides nothing about exits and never runs attention or MLPs; it only writes the cache.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

from .calls import LayerCall
from .kvprobe import write_kv

__all__ = ["fill_kv", "fused_available", "clear_stacks"]

# layers ModuleList -> {(device, dtype): _Stack, or None when its layers cannot be stacked}
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def fill_kv(parts, calls: list[LayerCall], layers: list[int], hidden: torch.Tensor, cache,
            layerwise: bool | None = None) -> None:
    """Write K/V computed from `hidden` [B, T, H] into the cache of each layer in `layers` (ascending).

    `calls[i]` is layer i's `LayerCall`; `layerwise=True` (or `TIDE_KV_FILL=layerwise`) forces the
    per-layer path.
    """
    if not layers:
        return
    stack = None if _forced_layerwise(parts, layerwise) else _stack(parts, hidden.device, hidden.dtype)
    for group in _by_attention_type(parts, layers):
        rotary = _shared_rotary(calls, group)
        if stack is None or rotary is None:
            for i in group:
                write_kv(calls[i], parts, i, hidden, cache)
            continue
        keys, values = stack.kv(group, hidden, rotary)  # [m, B, H_kv, T, D] each
        for i, k, v in zip(group, keys.unbind(0), values.unbind(0)):
            cache.update(k, v, i)


def fused_available(parts, calls: list[LayerCall], layers: list[int], hidden: torch.Tensor) -> bool:
    """True when every layer in `layers` would be filled by the batched path for states like `hidden`."""
    if _forced_layerwise(parts, None) or _stack(parts, hidden.device, hidden.dtype) is None:
        return False
    return all(_shared_rotary(calls, group) is not None for group in _by_attention_type(parts, layers))


def clear_stacks() -> None:
    """Forget every stacked weight (they are rebuilt on the next fill)."""
    _STACKS.clear()


def _forced_layerwise(parts, layerwise: bool | None) -> bool:
    if layerwise is None:
        layerwise = os.environ.get("TIDE_KV_FILL", "").lower() == "layerwise"
    return layerwise or parts.spec.kv_projections is None


def _by_attention_type(parts, layers: list[int]) -> list[list[int]]:
    """`layers` split by attention type, each group ascending."""
    types = parts.layer_types
    if not types or len({types[i] for i in layers}) == 1:
        return [layers]
    groups: dict[str, list[int]] = {}
    for i in layers:
        groups.setdefault(types[i], []).append(i)
    return list(groups.values())


def _shared_rotary(calls: list[LayerCall], group: list[int]):
    """The (cos, sin) object every call in `group` receives, or None if they differ or have none."""
    rotary = calls[group[0]].kwargs.get("position_embeddings")
    if rotary is None or any(calls[i].kwargs.get("position_embeddings") is not rotary for i in group):
        return None
    return rotary


def _stack(parts, device: torch.device, dtype: torch.dtype) -> _Stack | None:
    per_model = _STACKS.setdefault(parts.layers, {})
    key = (device, dtype)
    if key not in per_model or (per_model[key] is not None and per_model[key].stale()):
        per_model[key] = _Stack.build(parts, device, dtype)
    return per_model[key]


class _Stack:
    """Every layer's folded k/v projections, stacked; `kv` computes a group of layers' K/V from one state."""

    def __init__(self, weight, bias, k_norm, eps: float, k_norm_eps: float | None, head_dim: int, params):
        self.weight, self.bias = weight, bias  # [L, 2 * H_kv * D, H], [L, 2 * H_kv * D]
        self.k_norm = k_norm  # [L, D] fp32, or None
        self.eps, self.k_norm_eps, self.head_dim = eps, k_norm_eps, head_dim
        self._params = params  # the folded parameters, to notice in-place changes
        self._versions = self._current_versions()

    def _current_versions(self) -> tuple:
        return tuple(p._version for p in self._params)

    def stale(self) -> bool:
        return self._versions != self._current_versions()

    def kv(self, group: list[int], hidden: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [m, B, H_kv, T, D] in `hidden`'s dtype for the m layers of `group`, from `hidden`."""
        rows = _rows(group)
        weight, bias = self.weight[rows], self.bias[rows]  # [m, 2 * H_kv * D, H], [m, 2 * H_kv * D]
        batch, length, width = hidden.shape
        x = F.rms_norm(hidden.float(), (width,), eps=self.eps).to(weight.dtype)  # [B, T, H]
        out = F.linear(x, weight.flatten(0, 1), bias.flatten()).float()  # [B, T, m * 2 * H_kv * D]
        out = out.view(batch, length, len(group), 2, -1, self.head_dim).permute(3, 2, 0, 4, 1, 5)
        keys, values = out[0], out[1]  # [m, B, H_kv, T, D]
        if self.k_norm is not None:
            keys = F.rms_norm(keys, (self.head_dim,), eps=self.k_norm_eps) * self.k_norm[rows][:, None, None, None]
        cos, sin = (t.float()[None, :, None] for t in rotary)  # [1, B, 1, T, D]
        keys = keys * cos + _rotate_half(keys) * sin
        return keys.to(hidden.dtype), values.to(hidden.dtype)

    @classmethod
    def build(cls, parts, device: torch.device, dtype: torch.dtype) -> _Stack | None:
        """Fold and stack every layer's projections, or None when the layers do not fit the batched path."""
        spec = parts.spec.kv_projections
        try:
            mods = [[layer.get_submodule(p) for p in (spec.input_norm, spec.k_proj, spec.v_proj)]
                    for layer in parts.layers]
            k_norms = [layer.get_submodule(spec.k_norm) for layer in parts.layers] if spec.k_norm else []
            head_dim = int(parts.layers[0].get_submodule(spec.k_proj.rpartition(".")[0]).head_dim)
        except AttributeError:
            return None
        norms = [norm for norm, _, _ in mods]
        eps, k_norm_eps = _one_eps(norms), _one_eps(k_norms)
        params = [p for group in mods + [k_norms] for m in group for p in m.parameters(recurse=False)]
        if eps is None or (k_norms and k_norm_eps is None) or not _stackable(mods, params):
            return None
        shift = 1.0 if spec.gemma_norm else 0.0
        weights, biases = zip(*(_folded(norm.weight.float() + shift, k, v) for norm, k, v in mods))
        k_norm = torch.stack([n.weight.float() + shift for n in k_norms]).to(device) if k_norms else None
        weight = torch.stack(weights).to(device=device, dtype=dtype)
        bias = torch.stack(biases).to(device=device, dtype=dtype)
        return cls(weight, bias, k_norm, eps, k_norm_eps, head_dim, params)


def _folded(scale: torch.Tensor, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """[k; v] weight [2 * H_kv * D, H] with the input-norm scale [H] folded into its columns, and its bias."""
    weight = torch.cat([k.weight.float(), v.weight.float()]) * scale
    zeros = torch.zeros(k.weight.shape[0], device=k.weight.device)
    bias = torch.cat([zeros if m.bias is None else m.bias.float() for m in (k, v)])
    return weight, bias


def _stackable(mods, params) -> bool:
    """Input norms without a bias, k/v projections of one shape, every parameter on one device."""
    return (all(getattr(norm, "bias", None) is None for norm, _, _ in mods)
            and len({(k.weight.shape, v.weight.shape) for _, k, v in mods}) == 1
            and len({p.device for p in params}) == 1)


def _one_eps(norms) -> float | None:
    """The epsilon every norm in `norms` uses, or None if they differ (or have none)."""
    eps = {getattr(n, "variance_epsilon", getattr(n, "eps", None)) for n in norms}
    return float(eps.pop()) if len(eps) == 1 and None not in eps else None


def _rows(group: list[int]):
    """Index of `group` into the stack: a slice (a view) when it is contiguous, else the list itself."""
    first, last = group[0], group[-1] + 1
    return slice(first, last) if last - first == len(group) else group


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
