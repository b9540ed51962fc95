"""Products over a few rows, lowered to inductor's own reductions on a CPU: an inductor graph pass.

A decode step multiplies one row by each weight, and a verification pass a few rows. aten's matrix product hands
both to the BLAS library, which on the CPU measured below ran one row at less than half the speed of inductor's own
reduction, and 2-4 rows at 1.4-1.8 times one row's cost. Written as one reduction per row over the same weight
(`(x[i] * W).sum(-1)` for each row i), inductor fuses the rows into one loop over the weight's rows with one
accumulator per input row: each weight is read once, whatever the row count.

Measured on one thread of an AMD EPYC (AVX-512), float32, eight SmolLM2-shaped MLP layers (576 -> 1,536 -> 576),
microseconds a layer for 1 / 2 / 3 / 4 rows (`examples/verify_cost/few_row_products.py`; docs/benchmarks.md,
"Few-row products lowered by default on a CPU"):

- aten's product: 539 / 826 / 964 / 760;
- lowered, one reduction per row: 228 / 281 / 471 / 567.

At 8 rows the lowered form was the slower (1,015 against 891 in a first probe).

Single products whose weight is bigger than the cache (the same thread, milliseconds for 1 / 2 / 3 / 4 rows, aten's
product against the lowered one; `examples/verify_cost/product_shapes.py`, docs/results/product_shapes_*):

| weight (inputs -> outputs) | dtype | aten's product | lowered |
|---|---|---|---|
| 576 -> 49,152 (SmolLM2's head) | float32 | 10.2 / 24.7 / 35.2 / 17.6 | 5.8 / 6.0 / 7.0 / 9.3 |
| | bfloat16 | 7.0 / 9.2 / 9.8 / 7.5 | 3.3 / 5.4 / 5.9 / 7.6 |
| 640 -> 262,144 (a head) | float32 | 58 / 128 / 193 / 115 | 25 / 29 / 34 / 38 |
| | bfloat16 | 40 / 39 / 40 / 43 | 16 / 24 / 33 / 45 |
| 2,048 -> 128,256 (a head) | float32 | 58 / 117 / 172 / 183 | 36 / 55 / 90 / 109 |
| | bfloat16 | 52 / 39 / 43 / 44 | 23 / 36 / 49 / 67 |
| 2,048 -> 8,192 | float32 | 4.0 / 7.9 / 11.9 / 10.3 | 3.1 / 3.9 / 6.5 / 7.8 |
| | bfloat16 | 3.6 / 2.4 / 2.7 / 3.7 | 1.6 / 2.6 / 3.7 / 5.0 |
| 8,192 -> 2,048 | float32 | 3.4 / 6.4 / 9.8 / 7.0 | 5.1 / 8.9 / 9.6 / 10.5 |

The number of outputs does not matter (a vocabulary's head gains most), the length of a row does (8,192 inputs lost
at 1-2 rows), and in half precision the library's cost is flat in rows while the lowered one grows with them. So the
pass takes products of at most `MAX_ROWS` rows of at most `MAX_INPUTS` inputs, in half precision also at most
`HALF_MAX_ELEMENTS` rows x inputs; the others stay with the library. Each product
lowered is counted in dynamo's `counters["tide"]["few_row_products"]`. The sums are
accumulated in float32 for half-precision inputs, as the library does. A row's sum is the same code whether it is
computed alone or beside others, so in float32 a verification pass computes each position's products exactly as a
lowered decode step does (tested).

`CPU_INDUCTOR_OPTIONS` is what Tide's compiled graphs take on a CPU (`spans.compile_options`); a user can pass the
same options to their own `torch.compile` (inductor's `post_grad_custom_post_pass`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import Arg, CallFunction, Match, PatternMatcherPass, register_graph_pattern

__all__ = ["FewRowProducts", "CPU_INDUCTOR_OPTIONS", "MAX_ROWS", "MAX_INPUTS", "HALF_MAX_ELEMENTS", "lowers"]

MAX_ROWS = 4  # rows a product may have to be lowered (at 8 rows the library was faster, above)
MAX_INPUTS = 2048  # the most inputs a row may have (a longer reduction was slower at 1-2 rows, above)
HALF_MAX_ELEMENTS = 3072  # half precision: the most rows x inputs (the library's cost is flat in rows there, above)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
aten = torch.ops.aten
_PATTERNS = PatternMatcherPass(pass_name="tide_few_row_products")


def _lowered(rows: torch.fx.Node, weight: torch.fx.Node) -> bool:
    """Whether mm(rows [M, K], weight [K, N]) on a CPU is one to lower."""
    values = [node.meta.get("val") for node in (rows, weight)]
    if not all(isinstance(value, torch.Tensor) for value in values):
        return False
    a, b = values
    if a.dim() != 2 or b.dim() != 2 or b.device != a.device or b.dtype != a.dtype:
        return False
    sizes = (*a.shape, b.shape[1])
    if not all(isinstance(size, int) for size in sizes):  # (a dynamic dimension: left to the library)
        return False
    return lowers(*sizes, a.dtype, a.device)


def lowers(rows: int, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the pass lowers a product of `rows` rows through an `in_features` -> `out_features` weight (any
    number of outputs: a vocabulary's head too)."""
    if torch.device(device).type != "cpu" or dtype not in _DTYPES or not 1 <= rows <= MAX_ROWS:
        return False
    return in_features <= MAX_INPUTS and (dtype == torch.float32 or rows * in_features <= HALF_MAX_ELEMENTS)


def _rows_times(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [M, K] @ weight [K, N] as one float32 reduction per row over the weight's rows (its transpose [N, K]):
    inductor fuses them into one pass over the weight."""
    by_rows = weight.t().float()
    return torch.stack([(rows[i].float() * by_rows).sum(-1) for i in range(rows.shape[0])])


def _mm(rows, weight):
    return _rows_times(rows, weight).to(rows.dtype)


def _addmm(bias, rows, weight):
    return (_rows_times(rows, weight) + bias.float()).to(rows.dtype)


@register_graph_pattern(CallFunction(aten.mm, Arg(), Arg()), pass_dict=_PATTERNS)
def _lower_mm(match: Match, rows: torch.fx.Node, weight: torch.fx.Node):
    if _lowered(rows, weight):
        match.replace_by_example(_mm, [rows, weight])
        counters["tide"]["few_row_products"] += 1


@register_graph_pattern(CallFunction(aten.addmm, Arg(), Arg(), Arg()), pass_dict=_PATTERNS)
def _lower_addmm(match: Match, bias: torch.fx.Node, rows: torch.fx.Node, weight: torch.fx.Node):
    bias_value = bias.meta.get("val")
    if _lowered(rows, weight) and isinstance(bias_value, torch.Tensor) and bias_value.dtype == rows.meta["val"].dtype:
        match.replace_by_example(_addmm, [bias, rows, weight])
        counters["tide"]["few_row_products"] += 1


class FewRowProducts(CustomGraphPass):
    """The pass: products of 1-`MAX_ROWS` rows on a CPU that `lowers` takes, lowered to one reduction per row
    (module docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        _PATTERNS.apply(graph)

    def uuid(self) -> str:  # inductor's caches key compiled graphs by this: the pass's source and bounds
        bounds = f"{MAX_ROWS}:{MAX_INPUTS}:{HALF_MAX_ELEMENTS}"
        return hashlib.sha256(Path(__file__).read_bytes() + bounds.encode()).hexdigest()

    def __repr__(self) -> str:  # (in the options' key: the same pass compares equal across processes)
        return f"FewRowProducts(rows<={MAX_ROWS}, inputs<={MAX_INPUTS}, half rows x inputs<={HALF_MAX_ELEMENTS})"

    def __eq__(self, other) -> bool:
        return isinstance(other, FewRowProducts)

    def __hash__(self) -> int:
        return hash(FewRowProducts)


CPU_INDUCTOR_OPTIONS = {"post_grad_custom_post_pass": FewRowProducts()}
