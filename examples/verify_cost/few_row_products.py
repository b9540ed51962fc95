"""Products over 1-8 rows compiled on a CPU: aten's (the library's) against Tide's lowering
(`tide.layers.rowproducts.CPU_INDUCTOR_OPTIONS`: one reduction per row over the same weight), on eight SmolLM2-shaped
MLP layers (576 -> 1,536 -> 576): microseconds a layer, the largest difference from eager, and whether rows computed
together equal rows computed alone.

    python examples/verify_cost/few_row_products.py --dtype float32 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from tide.layers.rowproducts import CPU_INDUCTOR_OPTIONS

LAYERS = 8


def _bench(fn, x, repeats: int) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / LAYERS * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    mlps = nn.Sequential(*[nn.Sequential(nn.Linear(576, 1536, bias=False), nn.SiLU(), nn.Linear(1536, 576))
                           for _ in range(LAYERS)]).to(dtype)
    rows_out = []
    with torch.no_grad():
        for rows in args.rows:
            x = torch.randn(1, rows, 576, dtype=dtype)
            reference = mlps(x)
            row = {"rows": rows}
            for name, options in (("aten", {}), ("lowered", {"options": CPU_INDUCTOR_OPTIONS})):
                torch._dynamo.reset()
                compiled = torch.compile(mlps, fullgraph=True, dynamic=False, **options)
                out = compiled(x)
                row[f"{name}_us"] = round(_bench(compiled, x, args.repeats), 1)
                row[f"{name}_max_rel_diff"] = float((out - reference).abs().max() / reference.abs().max())
            if rows > 1:  # (the lowered graph: rows together against each row alone)
                alone = torch.cat([compiled(x[:, i:i + 1]) for i in range(rows)], 1)
                row["lowered_rows_equal_alone"] = bool(torch.equal(alone, compiled(x)))
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "threads": args.threads, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
