"""The compiled static-cache base decode of SmolLM2-135M on a CPU, with inductor's defaults against the options
Tide's CPU graphs take (`tide.layers.rowproducts.CPU_INDUCTOR_OPTIONS`: products of 1-4 rows lowered to inductor's
own reductions; the figures of docs/benchmarks.md's "One-row products" section came from inductor's own one-row
pass, `post_grad_fusion_options={"decompose_mm_pass": {}}`, which these options replaced): milliseconds a token, and
whether the tokens are eager `generate`'s.

Run each variant in its own process (inductor reads some of its options once a process):

    python examples/verify_cost/one_row_products.py --dtype float32 --variant plain --json plain.json
    python examples/verify_cost/one_row_products.py --dtype float32 --variant lowered --json lowered.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench_real"))

import realmodel  # noqa: E402

from tide.decode.baseline import compiled_static_decoder  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--variant", choices=["plain", "lowered"], required=True)
    parser.add_argument("--prompts", type=int, default=5, help="held-out chat questions")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base, tok = realmodel.load(dtype=args.dtype)
    decode = compiled_static_decoder(base, 512, lowered=args.variant == "lowered")
    _, held = realmodel.questions()
    ids = [tok(realmodel.chat_prompt(tok, q), return_tensors="pt", add_special_tokens=False).input_ids
           for q in held[:args.prompts]]
    start = time.perf_counter()
    decode(ids[0], 4)
    first = time.perf_counter() - start
    rows = []
    with torch.no_grad():
        for x in ids:
            start = time.perf_counter()
            decode(x, 1)
            one = time.perf_counter() - start
            start = time.perf_counter()
            out = decode(x, args.tokens + 1)
            compiled = time.perf_counter() - start - one
            start = time.perf_counter()
            eager = base.generate(x, max_new_tokens=args.tokens + 1, min_new_tokens=args.tokens + 1, do_sample=False)
            eager_s = time.perf_counter() - start
            rows.append({"compiled_ms": compiled / args.tokens * 1e3, "generate_ms": eager_s / (args.tokens + 1) * 1e3,
                         "same": bool(torch.equal(out, eager))})
            print(args.variant, rows[-1], flush=True)
    result = {"variant": args.variant, "dtype": args.dtype, "first_call_s": round(first, 1),
              "compiled_ms": statistics.median(r["compiled_ms"] for r in rows),
              "generate_ms": statistics.median(r["generate_ms"] for r in rows), "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
