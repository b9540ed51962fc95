"""Tide's fused router exit: norm -> down -> SiLU -> up -> sigmoid -> threshold, in one CUDA launch."""

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
    return ops.router_exit(
        hidden, norm_weight, norm_bias, int(norm_kind), float(eps),
        down_weight, down_bias, up_weight, up_bias, float(threshold),
    )


__all__ = ["GEMMA_RMS_NORM", "LAYER_NORM", "RMS_NORM", "ops", "router_exit"]
