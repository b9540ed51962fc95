"""Tide's fused exit tests, one CUDA launch each after the exit head's GEMM.

- `router_exit`: final norm -> router (down, SiLU, up) -> sigmoid -> threshold, on the raw state (logit lens).
- `checkpoint_test`: the same on the tuned exit head's state, with the norm's weight folded into the router
  (what Tide's decode loop calls at every consulted checkpoint), returning the exit state too.
"""

from typing import Optional, Tuple

import torch

from ._ops import ops
from . import _meta  # noqa: F401,E402  (registers the fake implementation torch.compile traces with)

RMS_NORM = 0  # x * rsqrt(mean(x^2) + eps) * w            (Llama, Mistral, Qwen, Phi-3, ...)
GEMMA_RMS_NORM = 1  # x * rsqrt(mean(x^2) + eps) * (1 + w)  (Gemma 1/2/3)
LAYER_NORM = 2  # (x - mean) * rsqrt(var + eps) * w + b    (GPT-2, GPT-NeoX, OPT, Phi, Falcon)


def router_exit(
    hidden: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: Optional[torch.Tensor],
    norm_kind: int,
    eps: float,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor,
    up_weight: torch.Tensor,
    up_bias: torch.Tensor,
    threshold: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exit scores and decisions for one router checkpoint.

    hidden [B, H] (float32, float16 or bfloat16, rows contiguous); norm_weight [H]; norm_bias [H] or None;
    down_weight [R, H]; down_bias [R]; up_weight [1, R]; up_bias [1], all in hidden's dtype and on its device.
    Returns scores float32 [B] = sigmoid(up(silu(down(norm(hidden))))) and exit_mask bool [B] = scores > threshold.
    """
    _check_router_inputs(hidden, norm_weight, norm_bias, norm_kind, down_weight, down_bias, up_weight, up_bias)
    return ops.router_exit(
        hidden, norm_weight, norm_bias, int(norm_kind), float(eps),
        down_weight, down_bias, up_weight, up_bias, float(threshold),
    )


def checkpoint_test(
    hidden: torch.Tensor,
    translate_weight: Optional[torch.Tensor],
    translate_bias: Optional[torch.Tensor],
    down_bias: torch.Tensor,
    down_weight: torch.Tensor,
    up_bias: torch.Tensor,
    up_weight: torch.Tensor,
    layer_norm: bool,
    eps: float,
    threshold: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One checkpoint's exit test on the exit head's state.

    hidden [N, H] (float32, float16 or bfloat16). The exit head: translate_weight [H, H] (its weight transposed)
    and translate_bias [H], both float32; or a state it already translated, float32 [N, H], in translate_weight's
    place with translate_bias None; or neither (logit lens). The router with the final norm's weight folded in,
    all float32: down_bias [R], down_weight [H, R], up_bias [1], up_weight [R, 1]. layer_norm: centre before
    the RMS. Returns scores float32 [N], exits bool [N] (scores > threshold) and the exit states [N, H] in
    hidden's dtype.
    """
    _check_checkpoint_inputs(hidden, translate_weight, translate_bias, down_bias, down_weight, up_bias, up_weight)
    return ops.checkpoint_test(
        hidden, translate_weight, translate_bias, down_bias, down_weight, up_bias, up_weight, bool(layer_norm),
        float(eps), float(threshold),
    )


# The ops check their inputs too; these checks raise in Python first, with the same messages.
def _check_router_inputs(hidden, norm_weight, norm_bias, norm_kind, down_weight, down_bias, up_weight, up_bias):
    if hidden.dim() != 2:
        raise ValueError(f"router_exit: hidden must be [B, H], got {tuple(hidden.shape)}")
    if int(norm_kind) not in (RMS_NORM, GEMMA_RMS_NORM, LAYER_NORM):
        raise ValueError(f"router_exit: norm_kind must be 0 (RMSNorm), 1 (Gemma RMSNorm) or 2 (LayerNorm), got {norm_kind}")
    named = {"norm_weight": norm_weight, "norm_bias": norm_bias, "down_weight": down_weight, "down_bias": down_bias,
             "up_weight": up_weight, "up_bias": up_bias}
    for name, t in named.items():
        if t is not None and (t.dtype != hidden.dtype or t.device != hidden.device):
            raise ValueError(f"router_exit: {name} has dtype {t.dtype} on {t.device}, hidden has {hidden.dtype} on "
                             f"{hidden.device}")
    if down_weight.dim() != 2 or down_weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"router_exit: down_weight must be [R, H] with H = {hidden.shape[1]}, got "
                         f"{tuple(down_weight.shape)}")


def _check_checkpoint_inputs(hidden, translate_weight, translate_bias, down_bias, down_weight, up_bias, up_weight):
    if hidden.dim() != 2:
        raise ValueError(f"checkpoint_test: hidden must be [N, H], got {tuple(hidden.shape)}")
    rows, size = hidden.shape
    if down_weight.dim() != 2 or down_weight.shape[0] != size:
        raise ValueError(f"checkpoint_test: down_weight must be [H, R] with H = {size}, got {tuple(down_weight.shape)}")
    bottleneck = down_weight.shape[1]
    shapes = {"translate_weight": (size * size if translate_bias is not None else rows * size),
              "translate_bias": size, "down_bias": bottleneck, "down_weight": size * bottleneck,
              "up_bias": 1, "up_weight": bottleneck}
    named = {"translate_weight": translate_weight, "translate_bias": translate_bias, "down_bias": down_bias,
             "down_weight": down_weight, "up_bias": up_bias, "up_weight": up_weight}
    for name, t in named.items():
        if t is None:
            continue
        if t.dtype != torch.float32 or t.device != hidden.device:
            raise ValueError(f"checkpoint_test: {name} must be float32 on {hidden.device}, got {t.dtype} on {t.device}")
        if t.numel() != shapes[name]:
            raise ValueError(f"checkpoint_test: {name} has {t.numel()} elements, expected {shapes[name]}")


__all__ = ["GEMMA_RMS_NORM", "LAYER_NORM", "RMS_NORM", "checkpoint_test", "ops", "router_exit"]
