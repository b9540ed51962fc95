"""Where a lossless cycle's time goes, and what a cycle with no host work at all would give: `generate`, the
compiled static-cache base and Tide's lossless mode (eager and `compile=True`) timed in one process, interleaved
per prompt; then one more pass of each Tide row with timers around the model's own passes.

A cycle's passes are the draft steps (the shallow layers and the draft head, one graph when compiled), the other
runs of layers (compiled spans, or eager layers: verification), the verification's pass of the backbone (compiled
trees), the final head on verified positions, the draft head where it runs alone, and the prompt's prefill
(which `generate` pays too). "host" is the rest of the cycle: Tide's own Python (arguments, masks, the tree,
the walk, cache crops, the loop). "no host work" is the row's measured speed over `generate` scaled by the cycle's
time over its passes' time: the most this model, these drafts and this acceptance allow.

    python examples/bench_baselines/cycle_split.py MODEL ROUTERS TEXT [OUT.json]
    (MODEL: a local folder, or "shipped"; TEXT: heldout, code or quote; 6 prompts x 40 tokens, 1 thread)
"""
import collections
import functools
import json
import statistics
import sys
import time
from pathlib import Path

from tide.decode.lossless import verifier
from tide.layers.spans import SpanRunner
from tide.models.architectures import ModelParts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_baselines import baseline_ratios, side_bench, time_interleaved  # noqa: E402

bench = side_bench(sys.argv[1:])
model_dir, text, model, prompts = bench.model_dir, bench.text, bench.model, bench.prompts
n, g = bench.tokens, bench.greedy
tide_rows = {"lossless, eager": {"mode": "lossless"}, "lossless, compile=True": {"mode": "lossless", "compile": True}}
rows = {**bench.base_rows, **{k: functools.partial(lambda cfg, ids: model.generate(ids, **g, tide_config=cfg), v)
                              for k, v in tide_rows.items()}}
med, same = time_interleaved(rows, prompts)

# Timers around the passes (one more pass of the prompts per Tide row).
spent = collections.defaultdict(float)
depth = [0]  # a pass inside a timed pass (the head inside the draft head) counts once, in the outer one


def timer(owner, name, label):
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        depth[0] += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            depth[0] -= 1
            if not depth[0]:
                spent[label] += time.perf_counter() - start
    setattr(owner, name, timed)


timer(SpanRunner, "run", "runs of layers")
timer(SpanRunner, "run_then", "draft steps (shallow layers + draft head)")
timer(SpanRunner, "backbone", "verification (backbone pass)")
timer(ModelParts, "logits_from_normed", "final head")
timer(verifier.Verifier, "prefill", "prefill")
timer(type(model), "draft_logits", "draft head")
result = {"model": model_dir, "text": text, "prompts": len(prompts), "tokens": n, "rows": {}, "split": {}}
for k, v in med.items():
    ratios = baseline_ratios(med, k)
    result["rows"][k] = {"ms_token": statistics.median(v) / n * 1e3, "identical": same[k],
                         **{f"vs_{b}": statistics.median(r) for b, r in ratios.items()}}
print(f"{model_dir} {text}: {len(prompts)} prompts x {n} tokens, median of 3, 1 thread")
print(f"{'row':26s} {'ms/token':>8s} {'vs generate':>12s} {'vs compiled':>12s} {'identical':>9s}")
for k, r in result["rows"].items():
    print(f"{k:26s} {r['ms_token']:8.2f} {r['vs_generate']:12.2f} {r['vs_static+compile']:12.2f} {r['identical']:9.2f}")
for k, cfg in tide_rows.items():
    spent.clear()
    cycles = tokens = 0
    start = time.perf_counter()
    for p in prompts:
        model.generate(p, **g, tide_config=cfg)
        cycles += model.last_stats.verify_passes
        tokens += n
    total = time.perf_counter() - start
    passes = sum(spent.values())
    split = {label: t / cycles * 1e3 for label, t in sorted(spent.items())}
    split["host"] = (total - passes) / cycles * 1e3
    split["cycle"] = total / cycles * 1e3
    split["tokens per cycle"] = tokens / cycles
    split["no host work: x vs generate"] = result["rows"][k]["vs_generate"] * total / passes
    result["split"][k] = split
    print(f"\n{k}: {split['cycle']:.2f} ms a cycle, {split['tokens per cycle']:.2f} tokens a cycle (timed pass)")
    for label, value in split.items():
        if label not in ("cycle", "tokens per cycle", "no host work: x vs generate"):
            print(f"  {label:30s} {value:6.2f} ms a cycle")
    print(f"  with no host work: x{split['no host work: x vs generate']:.2f} over generate")
if len(sys.argv) > 4:
    Path(sys.argv[4]).write_text(json.dumps(result, indent=1))
