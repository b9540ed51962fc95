"""K/V for the layers a token skips, all of them in one batched computation.

With `propagate`, every layer after a token's exit sees the same exit state, so their K/V can be computed
together: normalise the state once (RMS, without weight), one matmul against a stack of every layer's
k_proj and v_proj with that layer's input-norm weight folded in, the per-head k-norm where the family has
one (batched over layers), rotary on all layers' keys at once, then each layer's cache update. Families
whose table entry describes their K/V projections (`ArchSpec.kv_projections`) take this path; the others,
and layers whose calls do not share one rotary embedding, fall back to `layercalls.write_kv_only` per layer
(which runs each layer's own code up to its cache write). The stack is a copy of every layer's k/v
projection weights (folded in fp32, stored in the states' dtype), built once per model, device and dtype:
its memory is that of all k/v projections. `TIDE_KV_FILL=layerwise` forces the per-layer path.

This module decides nothing about exits; it only writes the cache.
"""

from __future__ import annotations

import os

import torch

from .layercalls import LayerCall, write_kv_only

__all__ = ["fill_kv", "fused_available"]

_STACKS: dict = {}  # (id(layers), device, dtype) -> (layers ModuleList, stacked tensors)


def fused_available(parts, calls: list[LayerCall], layers: list[int]) -> bool:
    """True when `layers` can be filled in one batched computation."""
    if parts.spec.kv_projections is None or os.environ.get("TIDE_KV_FILL", "").lower() == "layerwise":
        return False
    rotary = {id(calls[i].kwargs.get("position_embeddings")) for i in layers}
    return len(rotary) == 1 and calls[layers[0]].kwargs.get("position_embeddings") is not None


@torch.no_grad()
def fill_kv(parts, calls: list[LayerCall], layers: list[int], hidden: torch.Tensor, cache) -> None:
    """Write K/V computed from `hidden` [B, T, H] into the cache of each layer in `layers` (ascending)."""
    if not layers:
        return
    if not fused_available(parts, calls, layers):
        for i in layers:
            write_kv_only(calls[i], parts, i, hidden, cache)
        return
    stack = _stack(parts, hidden.device, hidden.dtype)
    keys, values = _batched_kv(stack, layers, hidden, calls[layers[0]].kwargs["position_embeddings"])
    for j, i in enumerate(layers):
        cache.update(keys[:, :, j].transpose(1, 2), values[:, :, j].transpose(1, 2), i)


def _batched_kv(stack: dict, layers: list[int], hidden: torch.Tensor, rotary):
    """keys, values [B, T, m, H_kv, D] for the m layers `layers` (a contiguous run), from one state."""
    first, last = layers[0], layers[-1] + 1
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + stack["eps"])  # [B, T, H]
    weight, bias = stack["weight"][first:last], stack["bias"][first:last]  # [m, 2*H_kv*D, H], [m, 2*H_kv*D]
    m, width = weight.shape[:2]
    out = torch.nn.functional.linear(x.to(weight.dtype), weight.reshape(m * width, -1), bias.reshape(-1)).float()
    out = out.view(*x.shape[:2], m, 2, -1, stack["head_dim"])  # [B, T, m, 2, H_kv, D]
    keys, values = out[:, :, :, 0], out[:, :, :, 1]
    if "k_norm" in stack:
        keys = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + stack["k_norm_eps"])
        keys = keys * stack["k_norm"][first:last, None, :]  # [m, 1, D]
    cos, sin = (t.float()[:, :, None, None, :] for t in rotary)  # [B, T, 1, 1, D]
    half = keys.shape[-1] // 2
    rotated = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    keys = keys * cos + rotated * sin
    return keys.to(hidden.dtype), values.to(hidden.dtype)


def _stack(parts, device, dtype) -> dict:
    key = (id(parts.layers), device, dtype)
    cached = _STACKS.get(key)
    if cached is not None and cached[0] is parts.layers:
        return cached[1]
    stack = _build_stack(parts, device, dtype)
    _STACKS[key] = (parts.layers, stack)
    return stack


def _build_stack(parts, device, dtype) -> dict:
    spec = parts.spec.kv_projections
    weights, biases, k_norms = [], [], []
    eps = None
    for layer in parts.layers:
        norm = layer.get_submodule(spec.input_norm)
        scale = norm.weight.float() + (1.0 if spec.gemma_norm else 0.0)  # [H]
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        k, v = layer.get_submodule(spec.k_proj), layer.get_submodule(spec.v_proj)
        weights.append(torch.cat([k.weight.float(), v.weight.float()]) * scale)  # [2*H_kv*D, H]
        zeros = torch.zeros(k.weight.shape[0], device=k.weight.device)
        biases.append(torch.cat([k.bias.float() if k.bias is not None else zeros,
                                 v.bias.float() if v.bias is not None else zeros]))
        if spec.k_norm:
            k_norm = layer.get_submodule(spec.k_norm)
            k_norms.append(k_norm.weight.float() + (1.0 if spec.gemma_norm else 0.0))
            k_norm_eps = getattr(k_norm, "variance_epsilon", getattr(k_norm, "eps", None))
    head_dim = getattr(parts.layers[0].get_submodule(spec.k_proj.rpartition(".")[0]), "head_dim")
    stack = {
        "weight": torch.stack(weights).to(device=device, dtype=dtype),  # [L, 2*H_kv*D, H]
        "bias": torch.stack(biases).to(device=device, dtype=dtype),
        "eps": float(eps),
        "head_dim": int(head_dim),
    }
    if k_norms:
        stack["k_norm"] = torch.stack(k_norms).to(device=device, dtype=torch.float32)
        stack["k_norm_eps"] = float(k_norm_eps)
    return stack
