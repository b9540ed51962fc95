"""One product of 1-4 rows through a weight of a given shape, on a CPU: aten's (the library's) against the form
`tide.layers.rowproducts` lowers it to (one reduction per row over the same weight, compiled by inductor), whatever
the pass's bounds say. Milliseconds a product, medians; the bounds (`MAX_INPUTS`, `HALF_MAX_ELEMENTS`) come from these.

    python examples/verify_cost/product_shapes.py --dtype float32 --shapes 576x49152 2048x8192 8192x2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def lowered(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [M, K] through weight [N, K] as the pass writes it: one float32 reduction per row."""
    by_rows = weight.float()
    return torch.stack([(rows[i].float() * by_rows).sum(-1) for i in range(rows.shape[0])]).to(rows.dtype)


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--shapes", nargs="+", default=["576x49152", "640x262144", "2048x8192", "8192x2048"],
                        help="weights as INPUTSxOUTPUTS")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    results = []
    for shape in args.shapes:
        inputs, outputs = (int(side) for side in shape.split("x"))
        weight = torch.randn(outputs, inputs, dtype=dtype) * 0.02
        compiled = torch.compile(lowered, fullgraph=True, dynamic=False)
        repeats = max(5, min(50, int(2e8 / weight.numel())))
        row = {"inputs": inputs, "outputs": outputs, "dtype": args.dtype}
        for rows in args.rows:
            x = torch.randn(rows, inputs, dtype=dtype)
            with torch.no_grad():
                row[f"aten_{rows}"] = _median_ms(lambda: F.linear(x, weight), repeats)
                row[f"lowered_{rows}"] = _median_ms(lambda: compiled(x, weight), repeats)
        print(f"{inputs} -> {outputs}: aten " + " / ".join(str(row[f"aten_{r}"]) for r in args.rows) + " ms, lowered "
              + " / ".join(str(row[f"lowered_{r}"]) for r in args.rows) + " ms", flush=True)
        results.append(row)
        torch._dynamo.reset()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
