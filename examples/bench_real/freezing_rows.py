"""SmolLM2 decoding with and without inductor's `freezing`: the compiled static-cache base and Tide's `compile=True`
call, each given the same compile options, in one process.

On a CPU, freezing folds the weights into the compiled graphs as constants and prepacks them for oneDNN's kernels;
in bfloat16 that nearly halved one compiled forward of SmolLM2 on an AMD EPYC (`examples/verify_cost/freezing.py`).
A speed figure against a compiled base is only fair if the base gets the same treatment: this script times four rows
on the same held-out prompts, interleaved, greedy: the compiled base and Tide's default `compile=True` call, each
plain and frozen (Tide through generate's `compile_config`), plus `generate` for reference.

    python examples/bench_real/freezing_rows.py --dtype bfloat16 --prompts 4 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import realmodel
import torch
from bench_real import prompts_for
from transformers import CompileConfig

import tide
from tide.decode.baseline import compiled_static_decoder

FROZEN = {"freezing": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", default="routers-smollm2")
    parser.add_argument("--workload", default="sharegpt")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base, tok = realmodel.load("cpu", args.dtype)
    model = tide.TideForCausalLM.from_pretrained(args.routers, base_model=base)
    prompts = prompts_for(args.workload, tok, args.prompts)
    n, longest = args.tokens, max(prompts, key=lambda p: p.shape[1])
    greedy = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n)
    plain = compiled_static_decoder(base, longest.shape[1] + n)
    frozen = compiled_static_decoder(base, longest.shape[1] + n,
                                     dict(fullgraph=True, dynamic=False, options=FROZEN))
    rows = {
        "generate": lambda ids: base.generate(ids, **greedy),
        "compiled base": lambda ids: plain(ids, n),
        "compiled base, frozen": lambda ids: frozen(ids, n),
        "tide compile=True": lambda ids: model.generate(ids, **greedy, tide_config={"compile": True}),
        "tide compile=True, frozen": lambda ids: model.generate(ids, **greedy, tide_config={"compile": True},
                                                                compile_config=CompileConfig(options=FROZEN)),
    }
    first, plans = {}, {}
    with torch.no_grad():
        for name, fn in rows.items():  # the first calls compile
            start = time.perf_counter()
            fn(longest)
            first[name] = round(time.perf_counter() - start, 1)
            if name.startswith("tide"):
                plans[name] = model.last_stats.plan
            print(f"first call of {name}: {first[name]} s", flush=True)
        times = {name: [] for name in rows}
        same = dict.fromkeys(rows, 0)
        accepted = {}
        for ids in prompts:
            ref = None
            for name, fn in rows.items():
                start = time.perf_counter()
                out = fn(ids)
                times[name].append(time.perf_counter() - start)
                ref = out if ref is None else ref
                same[name] += bool(torch.equal(out[:, : ref.shape[1]], ref))
                if name.startswith("tide"):
                    stats = model.last_stats
                    accepted.setdefault(name, []).append(stats.accepted / max(stats.verify_passes, 1))
    result = {"dtype": args.dtype, "prompts": len(prompts), "tokens": n, "threads": args.threads, "first_call_s": first,
              "plans": plans, "rows": {}}
    for name, t in times.items():
        ratios = {b: sorted(x / y for x, y in zip(times[b], t)) for b in ("generate", "compiled base",
                                                                            "compiled base, frozen")}
        row = {"ms_per_token": round(statistics.median(t) / n * 1e3, 2), "identical": same[name] / len(prompts),
               **{f"vs {b}": [round(statistics.median(r), 3), round(r[0], 3), round(r[-1], 3)]
                  for b, r in ratios.items()}}
        if name in accepted:
            row["accepted_per_cycle"] = round(statistics.mean(accepted[name]), 3)
        result["rows"][name] = row
        print(f"{name:28s} {json.dumps(row)}", flush=True)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
