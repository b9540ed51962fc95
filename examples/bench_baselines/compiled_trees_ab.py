"""Compiled tree verification, two paths in one process: through the backbone's compiled forward (what runs) and
through two compiled spans after a capture (the path before it, forced by patching `Verifier._through_backbone`),
beside `generate`, the compiled static-cache base and Tide's eager default; interleaved per prompt.

    python examples/bench_baselines/compiled_trees_ab.py MODEL ROUTERS TEXT OUT.json
    (MODEL: a local folder, or "shipped"; TEXT: heldout, code or quote; 6 prompts x 40 tokens, 1 thread)
"""
import json
import statistics
import sys
from pathlib import Path

import tide.decode.lossless.verifier as verifier

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_baselines import baseline_ratios, side_bench, time_interleaved  # noqa: E402

bench = side_bench(sys.argv[1:])
model_dir, text, model, prompts = bench.model_dir, bench.text, bench.model, bench.prompts
n, g = bench.tokens, bench.greedy
real = verifier.Verifier._through_backbone
cfg = {"mode": "lossless", "compile": True}


def tide_old(ids):
    verifier.Verifier._through_backbone = lambda self: False
    try:
        return model.generate(ids, **g, tide_config=cfg)
    finally:
        verifier.Verifier._through_backbone = real


rows = {**bench.base_rows, "tide default (eager)": lambda ids: model.generate(ids, **g),
        "lossless compiled, spans (before)": tide_old,
        "lossless compiled, backbone (after)": lambda ids: model.generate(ids, **g, tide_config=cfg)}
med, same = time_interleaved(rows, prompts)
res = {}
print(f"{model_dir} {text}: {len(prompts)} prompts x {n} tokens, median of 3, 1 thread")
for k, v in med.items():
    r = baseline_ratios(med, k)
    res[k] = {"ms_per_token": statistics.median(v) / n * 1e3, "identical": same[k],
              **{f"vs {b}": [statistics.median(r[b]), r[b][0], r[b][-1]] for b in r}}
    print(f"{k:38s} {res[k]['ms_per_token']:6.2f} ms/token  vs generate x{statistics.median(r['generate']):.2f} "
          f"[{r['generate'][0]:.2f}-{r['generate'][-1]:.2f}]"
          f"  vs compiled x{statistics.median(r['static+compile']):.2f} "
          f"[{r['static+compile'][0]:.2f}-{r['static+compile'][-1]:.2f}]  identical {res[k]['identical']:.2f}")
json.dump({"model": model_dir, "text": text, "rows": res}, open(sys.argv[4], "w"), indent=1)
