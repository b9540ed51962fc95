"""How long a fresh process's first `compile=True` call takes on SmolLM2, and what it compiles.

    python examples/bench_real/first_compiled_call.py --routers ROUTERS [--cover] [--save] [--json OUT]

Loads the model and the router repo, then times one greedy call (the first held-out chat question, 64 new tokens)
with `tide_config={"compile": True, "machine_check": False}`: the repo's compiled lossless call, whatever this
machine's pay check would say. It prints the call's seconds, the seconds it spent compiling, the graphs compiled and
the recompiles (`GenerationStats`). `--cover` then runs the other held-out questions, so that every graph the repo's
calls take is made (each width of the chain, the n-gram pass), and counts what they compiled; `--save` runs the calls
precompiling (`tide.decode.precompiled.precompiling`: each cycle graph saved whole, trace included) and then writes
what torch compiled in this process to Tide's cache folder (`tide.decode.compilecache.save`), as `tide warmup` does,
where the next process's first compiled call loads them. The precompiled graphs' files are listed.
Run it in fresh processes with `TORCHINDUCTOR_CACHE_DIR` and `TIDE_CACHE` set to the folders to start from (the
converted model is read from `$TIDE_CACHE` too).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_real  # noqa: E402
import realmodel  # noqa: E402

CONFIG = {"compile": True, "machine_check": False}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", default=str(HERE / "routers-smollm2"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--cover", action="store_true", help="then the other held-out questions")
    parser.add_argument("--save", action="store_true", help="then persist the compiled work")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    import contextlib

    import tide
    from tide.decode import compilecache
    from tide.decode.precompiled import precompiling
    from tide.layers.spans import compile_options

    torch.set_num_threads(1)
    started = time.perf_counter()
    base, tok = realmodel.load()
    model = tide.TideForCausalLM.from_pretrained(args.routers, base_model=base)
    prompts = bench_real.prompts_for("chat", tok, 24)
    greedy = dict(do_sample=False, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    saving = precompiling if args.save else contextlib.nullcontext
    with saving():
        result = {"load_s": round(time.perf_counter() - started, 1), "first": _call(model, prompts[0], greedy)}
    print("first call:", result["first"], flush=True)
    if args.cover:
        with saving():
            calls = [_call(model, ids, greedy) for ids in prompts[1:]]
        result["cover"] = {"calls": len(calls), "seconds": round(sum(c["seconds"] for c in calls), 1),
                           "identical": all(c["identical"] for c in calls), "graphs": sum(c["graphs"] for c in calls),
                           "recompiles": sum(c["recompiles"] for c in calls),
                           "compile_s": round(sum(c["compile_s"] for c in calls), 1)}
        print("the other questions:", result["cover"], flush=True)
    if args.save:
        start = time.perf_counter()
        path = compilecache.save(model, compile_options(None, model.base.device.type), model.base.device)
        result["saved"] = {"file": str(path), "bytes": path.stat().st_size if path else 0,
                           "seconds": round(time.perf_counter() - start, 1)}
        print("saved:", result["saved"], flush=True)
    result["precompiled"] = sorted(path.name for path in compilecache.cache_folder().glob("*.aot"))
    print("precompiled graphs:", result["precompiled"], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def _call(model, ids, greedy: dict) -> dict:
    start = time.perf_counter()
    out = model.generate(ids, **greedy, tide_config=CONFIG)
    seconds = time.perf_counter() - start
    stats = model.last_stats
    same = torch.equal(out, model.base.generate(ids, **greedy))
    return {"seconds": round(seconds, 2), "compile_s": round(stats.compile_s, 1), "graphs": stats.graphs_compiled,
            "recompiles": stats.recompiles, "mode": stats.mode, "fused_cycles": stats.fused_cycles,
            "prompt_tokens": ids.shape[1], "identical": same}


if __name__ == "__main__":
    main()
