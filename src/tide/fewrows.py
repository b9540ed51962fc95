"""Linears over a few rows on CPU, for the multi-position passes Tide adds (lossless verification, recompute).

Speculative verification pays only if a pass over a few positions costs little more than a decode step. On
some CPUs that fails for the plain layout: with PyTorch 2.13's MKL on 2 cores of an AMD EPYC, `F.linear(x, W)`
with 2-16 rows leaves the single-row kernel (GEMV) for a GEMM path that costs 2-3x the single row even for
weights far larger than the cache (768 x 32000: 7.8 ms for 1 row, 17 ms for 2, 24 ms for 4). Computing the
transposed product `W @ x.T` reads the weight once for all the rows (5.8 ms for 2 rows, 7.1 ms for 4). On
2 cores of an Intel Xeon (Sapphire Rapids) it is the other way round: the plain layout costs x1.04 / x1.26 of
one position for 2 / 4 rows on a 12-layer hidden-192 Llama, the transposed one x1.78 / x1.83
(docs/benchmarks.md, `examples/verify_cost`). So the layout is measured, not assumed.

Inside `few_row_linears(parts)`, the plain `nn.Linear` modules given to `install` take the transposed layout
on CPU for 2 to `MAX_ROWS` rows, where it was measured faster for this model on this machine (once per model
and process: `transposed_pays`; `TIDE_FEW_ROW_LAYOUT=on|off` forces the choice). `few_row_linears()` with
no model always takes it. Both layouts compute the same product; only the order of floating-point sums may
differ. Outside the context, on other devices, for one row or more than `MAX_ROWS`, and for subclasses of
`nn.Linear` (quantized layers), nothing changes. (Timing the two layouts on one weight in isolation picked
the wrong one: in a real pass the weights are not in cache. The measurement runs the model's own linears in
order, as a pass does.)
"""

from __future__ import annotations

import os
import statistics
import time
import types
import weakref
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["install", "few_row_linears", "transposed_pays", "MAX_ROWS"]

MAX_ROWS = 16
MEASURED_ROWS = 4  # a tree of 3 candidates and the token before them; chains verify 2-9 positions
MEASURED_BYTES = 256 * 2**20  # the model's first linears up to this many weight bytes (all of a small model)
_ACTIVE: ContextVar = ContextVar("tide_few_row_linears", default=False)
_CHOICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # parts.layers -> bool, once per process


@contextmanager
def few_row_linears(parts=None):
    """Let installed linears take the few-row layout, in this context only: always without `parts`, else where
    `transposed_pays(parts)`."""
    token = _ACTIVE.set(parts is None or transposed_pays(parts))
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


def transposed_pays(parts) -> bool:
    """Whether the transposed layout is faster than `F.linear` for `MEASURED_ROWS` rows through this model's
    linears (`parts`: its `ModelParts`) on this machine. Measured on the first call and kept for the model's
    lifetime; False where the weights are not on CPU. `TIDE_FEW_ROW_LAYOUT=on|off` overrides."""
    forced = os.environ.get("TIDE_FEW_ROW_LAYOUT", "auto").lower()
    if forced in ("on", "off"):
        return forced == "on"
    if forced != "auto":
        raise ValueError(f"TIDE_FEW_ROW_LAYOUT must be 'on', 'off' or 'auto', got {forced!r}.")
    if parts.layers not in _CHOICES:
        _CHOICES[parts.layers] = _measure([*parts.layers, parts.lm_head])
    return _CHOICES[parts.layers]


@torch.no_grad()
def _measure(modules, repeats: int = 7) -> bool:
    """Time a pass of `MEASURED_ROWS` rows through the modules' plain linears in order (the first
    `MEASURED_BYTES` of weights), in both layouts, interleaved; the transposed one must win by 5%."""
    linears, size = [], 0
    for module in modules:
        for linear in module.modules():
            if type(linear) is nn.Linear and size < MEASURED_BYTES:
                linears.append(linear)
                size += linear.weight.numel() * linear.weight.element_size()
    if not linears or any(linear.weight.device.type != "cpu" for linear in linears):
        return False
    inputs = [torch.randn(1, MEASURED_ROWS, linear.in_features, dtype=linear.weight.dtype) for linear in linears]

    def plain():
        for linear, x in zip(linears, inputs):
            F.linear(x, linear.weight, linear.bias)

    def transposed():
        for linear, x in zip(linears, inputs):
            _transposed(x, linear.weight, linear.bias)

    times = {plain: [], transposed: []}
    for i in range(repeats + 2):
        for run in (plain, transposed):
            start = time.perf_counter()
            run()
            if i >= 2:  # two warm-ups
                times[run].append(time.perf_counter() - start)
    return statistics.median(times[transposed]) < 0.95 * statistics.median(times[plain])
