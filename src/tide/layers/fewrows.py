"""Linears over a few rows on CPU, for the multi-position passes Tide adds (lossless verification, recompute).

Speculative verification pays only if a pass over a few positions costs little more than a decode step. With
PyTorch's plain `F.linear` that depends on the CPU and on the row count, because MKL picks a different kernel:

- 2 cores of an AMD EPYC: 2-16 rows leave the single-row kernel (GEMV) for a GEMM path that costs 2-3x the
  single row even for weights far larger than the cache (768 x 32000: 7.8 ms for 1 row, 17 ms for 2, 24 ms
  for 4). The transposed product `W @ x.T` reads the weight once for all the rows (5.8 ms for 2, 7.1 ms for 4).
- 2 cores of an Intel Xeon (Sapphire Rapids): the plain layout costs about one row up to 3 rows, then reads
  the weights again: a 12-layer hidden-1024 Llama's forward over 4 positions costs x1.75 of one position. The
  transposed layout is worse there (x1.8-2.2). MKL's packed weights (`torch.ops.mkl._mkl_linear` on a copy packed
  once by `_mkl_reorder_linear_weight`) read the weights once: x1.32 for 4 positions, x1.54 for 8 against x2.29.

So the layout is measured, not assumed (docs/benchmarks.md, `examples/verify_cost`). Inside
`few_row_linears(parts)`, the plain `nn.Linear` modules given to `install` (the model's, on the first pass whose
measured layout is not plain: where plain wins everywhere, no linear is ever touched) compute 2 to `MAX_ROWS` rows on
CPU in the layout measured fastest for that row count, for this model on this machine (once per model and
process: `layouts`; `few_row_linears(parts, layout)`, a generate call's `few_row_layout`, forces one). All
layouts compute F.linear's product; only the order of floating-point sums may differ. Outside the context, on
other devices, for one row or more than `MAX_ROWS`, for subclasses of `nn.Linear` (quantized layers), and under
`torch.compile` (dynamo traces nn.Linear's own product), nothing changes.

The packed layout needs float32 weights and PyTorch built with MKL, and it keeps a packed copy of each weight
it has computed with (about the weight's size again): it is a candidate only where a copy of all the model's
linears fits into half the memory available, and a copy is made again when its weight changes in place.
(Timing the layouts on one weight in isolation picked the wrong one: in a real pass the weights are not in
cache. The measurement runs the model's own linears in order, as a pass does.)
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

__all__ = ["install", "few_row_linears", "layouts", "layouts_text", "LAYOUTS", "MAX_ROWS", "MEASURED_ROWS"]

LAYOUTS = ("plain", "transposed", "packed")
MAX_ROWS = 16
# Measured row counts; a pass of r rows takes the choice measured at the largest of these <= r. Trees verify
# 1 + k positions, chains 2-9, recompute's chunks up to MAX_ROWS.
MEASURED_ROWS = (2, 4, 8, 16)
MEASURED_BYTES = 256 * 2**20  # the model's first linears up to this many weight bytes (all of a small model)
MARGIN = 0.95  # a layout other than plain must be this much faster than plain to be chosen
PACK_ROWS = 4  # the row count MKL packs a weight for (the packed copy serves any row count)
# Inside `few_row_linears`: the layout for each row count 0..MAX_ROWS (None below 2 rows); outside: None.
_ACTIVE: ContextVar = ContextVar("tide_few_row_linears", default=None)
_CHOICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # parts.layers -> choice, once per process
_INSTALLED: weakref.WeakSet = weakref.WeakSet()  # modules whose linears were walked (a copy is walked again)
_PACKED: dict = {}  # id(weight) -> (weakref to it, its copy_key, packed copy); dropped with the weight


@contextmanager
def few_row_linears(parts=None, layout: str = "auto"):
    """Let installed linears take the few-row layout in this context: `layout` for every row count, or with
    "auto" the ones measured fastest for the model `parts` (its `ModelParts`)."""
    if layout == "auto" and parts is None:
        raise ValueError("few_row_linears needs the model's parts (measured layouts) or a layout.")
    if layout != "auto" and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {(*LAYOUTS, 'auto')}, got {layout!r}.")
    choice = dict.fromkeys(MEASURED_ROWS, layout) if layout != "auto" else layouts(parts)
    if all(name == "plain" for name in choice.values()):
        # F.linear everywhere: leave the dispatch off, so that each linear's call costs what it does outside
        # (checking the row count costs about 3 us a linear: 0.25 ms a pass on the 12-layer demo model)
        yield
        return
    if getattr(parts, "layers", None) is not None:  # the model's linears get the dispatching forward once a
        install([*parts.layers, parts.lm_head])  # layout other than plain pays
    token = _ACTIVE.set(_by_rows(choice))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _by_rows(choice: dict) -> tuple:
    """{measured row count: layout} -> the layout of each row count 0..MAX_ROWS: that of the largest measured
    count not above it (None below the smallest)."""
    return tuple(choice[max(m for m in MEASURED_ROWS if m <= rows)] if rows >= MEASURED_ROWS[0] else None
                 for rows in range(MAX_ROWS + 1))


def install(modules) -> None:
    """Give every plain `nn.Linear` in `modules` (once for its lifetime) the dispatching forward."""
    for module in modules:
        if module in _INSTALLED:  # (walking a model's modules costs ~0.4 ms a pass)
            continue
        _INSTALLED.add(module)
        for linear in module.modules():
            own = linear.__dict__.get("forward")  # e.g. accelerate's hooks, or ours: kept
            # (an unpickled copy holds the class's forward, which may be replaced)
            if type(linear) is nn.Linear and (own is None or getattr(own, "__func__", None) is nn.Linear.forward):
                # A bound method (not a closure) so that a deep copy dispatches for the copy; named `forward` so
                # that pickling it refers to the module's forward.
                object.__setattr__(linear, "forward", types.MethodType(forward, linear))


def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward, with the few-row layout inside `few_row_linears()`."""
    by_rows = None if torch.compiler.is_compiling() else _ACTIVE.get()  # compiled: nn.Linear's own (no ContextVar)
    if by_rows is not None and x.is_cpu and x.dim() >= 2:
        rows = x.numel() // x.shape[-1]
        if rows <= MAX_ROWS:
            layout = by_rows[rows]
            if layout == "transposed":
                return _transposed(x, self.weight, self.bias)
            if layout == "packed" and _packable(self.weight):
                return _packed(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def _transposed(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (weight @ x.T).T. x [..., K], weight [N, K] -> [..., N]."""
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    out = torch.mm(weight, flat.t()).t()  # [M, N], a transposed view
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


def _packable(weight: torch.Tensor) -> bool:
    """MKL's packed product applies: float32 on CPU, PyTorch built with MKL, and no gradient to carry (the
    packed op has none)."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and _HAS_MKL_PACK
            and not (torch.is_grad_enabled() and weight.requires_grad))


_HAS_MKL_PACK = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def copy_key(tensor: torch.Tensor) -> tuple:
    """What a copy derived from `tensor` (a packed weight, a head's rows) must be made again on: its storage,
    dtype and in-place version counter."""
    try:
        version = tensor._version
    except RuntimeError:  # an inference tensor (made in inference mode) has no version counter
        version = None
    return tensor.data_ptr(), tensor.dtype, version


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight's MKL-packed copy, made once and again when the weight changes in place."""
    key = copy_key(weight)
    held = _PACKED.get(id(weight))
    if held is None or held[0]() is not weight:  # first use of this weight
        weakref.finalize(weight, _PACKED.pop, id(weight), None)
        held = None
    if held is None or held[1] != key:
        held = (weakref.ref(weight), key, _new_pack(weight))
        _PACKED[id(weight)] = held
    return held[2]


def _new_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_ROWS)


def _packed(x: torch.Tensor, weight: torch.Tensor, bias, packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) through MKL's packed weight. x [..., K], weight [N, K] -> [..., N]."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    packed = _pack(weight) if packed is None else packed
    # The last argument is the row count the op computes with the packed copy (any other falls back to F.linear).
    out = torch.ops.mkl._mkl_linear(flat, packed, weight, bias, flat.shape[0])
    return out.view(*x.shape[:-1], weight.shape[0])


def layouts(parts) -> dict:
    """{row count in `MEASURED_ROWS`: the layout measured fastest for this model's linears (`parts`: its
    `ModelParts`) on this machine}. Measured on the first call and kept for the model's lifetime; plain where
    the weights are not on CPU."""
    if parts.layers not in _CHOICES:
        _CHOICES[parts.layers] = _measure([*parts.layers, parts.lm_head])
    return _CHOICES[parts.layers]


def layouts_text(choice: dict) -> str:
    """`layouts`' choice in words: '2+ rows: plain, 4+ rows: packed, ...'."""
    return ", ".join(f"{rows}+ rows: {layout}" for rows, layout in choice.items())


def _available_bytes() -> int | None:
    """Memory available to new allocations (Linux's MemAvailable counts reclaimable page cache); None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on this platform
        return None


@torch.no_grad()
def _measure(modules, repeats: int = 7) -> dict:
    """Time passes of each `MEASURED_ROWS` row count through the modules' plain linears in order (the first
    `MEASURED_BYTES` of weights) in each candidate layout, interleaved; a layout other than plain must win by
    `MARGIN`."""
    plain_linears = [linear for module in modules for linear in module.modules() if type(linear) is nn.Linear]
    linears, size = [], 0
    for linear in plain_linears:
        if size < MEASURED_BYTES:
            linears.append(linear)
            size += linear.weight.numel() * linear.weight.element_size()
    choice = dict.fromkeys(MEASURED_ROWS, "plain")
    if not linears or any(linear.weight.device.type != "cpu" for linear in linears):
        return choice
    runs = {"plain": lambda x, linear, packed: F.linear(x, linear.weight, linear.bias),
            "transposed": lambda x, linear, packed: _transposed(x, linear.weight, linear.bias)}
    packs = [None] * len(linears)
    total = sum(linear.weight.numel() * linear.weight.element_size() for linear in plain_linears)
    available = _available_bytes()
    if all(_packable(linear.weight) for linear in linears) and (available is None or total <= available / 2):
        runs["packed"] = lambda x, linear, packed: _packed(x, linear.weight, linear.bias, packed)
        packs = [_new_pack(linear.weight) for linear in linears]  # the measurement's own, dropped after it
    for rows in MEASURED_ROWS:
        inputs = [torch.randn(rows, linear.in_features, dtype=linear.weight.dtype) for linear in linears]
        times = {name: [] for name in runs}
        for i in range(repeats + 2):
            for name, run in runs.items():
                start = time.perf_counter()
                for linear, x, packed in zip(linears, inputs, packs):
                    run(x, linear, packed)
                if i >= 2:  # two warm-ups
                    times[name].append(time.perf_counter() - start)
        median = {name: statistics.median(values) for name, values in times.items()}
        best = min(median, key=median.get)
        choice[rows] = best if median[best] < MARGIN * median["plain"] else "plain"
    return choice
