"""Linears over a few rows on CPU, for the multi-position passes Tide adds (lossless verification, recompute).

Speculative verification pays only if a pass over a few positions costs little more than a decode step. On
CPU that fails for the plain layout: `F.linear(x, W)` with 2-16 rows leaves the single-row kernel (GEMV)
for a GEMM path that, measured with PyTorch 2.13's MKL on 2 cores, costs 2-3x the single row even for
weights far larger than the cache (768 x 32000: 7.8 ms for 1 row, 17 ms for 2, 24 ms for 4). Computing the
transposed product `W @ x.T` reads the weight once for all the rows (5.8 ms for 2 rows, 7.1 ms for 4).
A whole 12-layer Llama forward (hidden 768) over 2 / 4 / 8 positions then costs x0.91 / x0.96 / x1.43 of one
position instead of x1.78 / x2.14 / x2.06 (docs/benchmarks.md, `examples/verify_cost`).

Inside `few_row_linears()`, the plain `nn.Linear` modules given to `install` take that layout on CPU for 2
to `MAX_ROWS` rows. Both layouts compute the same product; only the order of floating-point sums may
differ. Outside the context, on other devices, for one row or more than `MAX_ROWS`, and for subclasses of
`nn.Linear` (quantized layers), nothing changes. (Timing the two layouts on one weight in isolation picked
the wrong one: in a real pass the weights are not in cache.)
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["install", "few_row_linears", "MAX_ROWS"]

MAX_ROWS = 16
_ACTIVE: ContextVar = ContextVar("tide_few_row_linears", default=False)


@contextmanager
def few_row_linears():
    """Let installed linears take the few-row layout, in this context only."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def install(modules) -> None:
    """Give every plain `nn.Linear` in `modules` (once for its lifetime) the dispatching forward."""
    for module in modules:
        for linear in module.modules():
            own = linear.__dict__.get("forward")  # e.g. accelerate's hooks, or ours: kept
            # (an unpickled copy holds the class's forward, which may be replaced)
            if type(linear) is nn.Linear and (own is None or getattr(own, "__func__", None) is nn.Linear.forward):
                # A bound method (not a closure) so that a deep copy dispatches for the copy; named `forward` so
                # that pickling it refers to the module's forward.
                object.__setattr__(linear, "forward", types.MethodType(forward, linear))


def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward, with the few-row layout inside `few_row_linears()`."""
    if _ACTIVE.get() and x.device.type == "cpu" and x.dim() >= 2:
        rows = x.numel() // x.shape[-1]
        if 2 <= rows <= MAX_ROWS:
            return _transposed(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def _transposed(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (weight @ x.T).T. x [..., K], weight [N, K] -> [..., N]."""
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    out = torch.mm(weight, flat.t()).t()  # [M, N], a transposed view
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])
