"""SmolLM2: the working tree's compiled chain loop (row "one graph") against an earlier commit's (row "graph per
width", loaded from git), the same repo and calls, both baselines in the same process. Run with the working tree at
fc91f21 (one graph: `max_draft` drafts every cycle, an n-gram continuation as the first of them) and at d1a926c
(a graph per width the cap takes, n-gram continuations in the widest), each against 7e1d5c3 (a graph per width and
one for n-gram drafts, the design kept): docs/benchmarks.md, "One graph a chain, measured".

    python examples/bench_real/one_graph_ab.py --before COMMIT [--routers ROUTERS] [--dtype bfloat16]
        [--workload sharegpt] [--prompts 6] [--tokens 128] [--repeats 2] [--json OUT]

The earlier loop is `src/tide/decode/lossless.py` and `fused.py` at COMMIT, their relative imports made absolute,
standing in for `lossless_decode` in the "graph per width" row; everything else is the working tree's. Both rows run
the repo's compiled call (`compile=True`, `machine_check` off). Each row's first call, on the longest prompt, is
timed and its graphs counted before the timed rounds; the two rows share inductor's cache in this process (their
layers' kernels are alike), so the first-call seconds here are not a fresh process's (`first_compiled_call.py`
measures those).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "bench_baselines")]

import bench_real  # noqa: E402
import realmodel  # noqa: E402
from bench_baselines import bench_rows  # noqa: E402

import tide  # noqa: E402
import tide.generation as generation  # noqa: E402

CONFIG = {"compile": True, "machine_check": False}


def earlier_loop(commit: str):
    """`tide.decode.lossless` as it was at `commit` (with that commit's `tide.decode.fused`), imported as modules of
    their own."""
    modules = {}
    for name in ("fused", "lossless"):
        source = subprocess.run(["git", "show", f"{commit}:src/tide/decode/{name}.py"], cwd=HERE, check=True,
                                capture_output=True, text=True).stdout
        source = re.sub(r"^from \.\.(\w+)", r"from tide.\1", source, flags=re.M)
        source = re.sub(r"^from \.fused ", f"from tide_fused_{commit} ", source, flags=re.M)
        source = re.sub(r"^from \.(\w+)", r"from tide.decode.\1", source, flags=re.M)
        path = Path(f"/tmp/tide_{name}_{commit}.py")
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"tide_{name}_{commit}", path)
        modules[name] = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    return modules["lossless"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit whose compiled chain loop is the 'before' row")
    parser.add_argument("--routers", default=str(HERE / "routers-smollm2"))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--workload", choices=["chat", "sharegpt"], default="sharegpt")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    before = earlier_loop(args.before)
    base, tok = realmodel.load("cpu", args.dtype)
    model = tide.TideForCausalLM.from_pretrained(args.routers, base_model=base)
    prompts = bench_real.prompts_for(args.workload, tok, args.prompts)
    greedy = dict(do_sample=False, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    one_graph = generation.lossless_decode

    def per_width(ids):
        generation.lossless_decode = before.lossless_decode
        try:
            return model.generate(ids, **greedy, tide_config=CONFIG)
        finally:
            generation.lossless_decode = one_graph

    rows = {"one graph": lambda ids: model.generate(ids, **greedy, tide_config=CONFIG), "graph per width": per_width}
    longest = max(prompts, key=lambda ids: ids.shape[1])
    first = {}
    for name, fn in rows.items():
        started = time.perf_counter()
        fn(longest)
        stats = model.last_stats
        first[name] = {"seconds": round(time.perf_counter() - started, 1), "graphs": stats.graphs_compiled,
                       "compile_s": round(stats.compile_s, 1), "plan": stats.plan}
        print(f"first call, {name}: {first[name]}", flush=True)
    result = bench_rows(base, model, prompts, args.tokens, {}, repeats=args.repeats, extra_rows=rows)
    for name, fn in rows.items():  # drafts accepted a cycle, and cycles, over one untimed run of the prompts
        cycles = accepted = 0
        for ids in prompts:
            fn(ids)
            cycles, accepted = cycles + model.last_stats.fused_cycles, accepted + model.last_stats.accepted
        result["rows"][name]["accepted_per_cycle"] = round(accepted / max(cycles, 1), 3)
        result["rows"][name]["cycles"] = cycles
        print(f"{name}: {accepted} drafts accepted over {cycles} cycles", flush=True)
    result.update(first_calls=first, before=args.before, dtype=args.dtype, workload=args.workload,
                  routers=args.routers)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
