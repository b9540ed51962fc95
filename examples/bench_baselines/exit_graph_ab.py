"""Compiled exit mode, two paths in one process: each step as one graph (`decode/exits/walkgraph.py`: `torch.cond` at
every consulted checkpoint) and as compiled runs of layers with the tests read on the host between them (forced by
patching `ExitGraph.for_session` to decline), beside `generate` and the compiled static-cache base; interleaved per
prompt.

    python examples/bench_baselines/exit_graph_ab.py MODEL ROUTERS TEXT OUT.json [THRESHOLD [PROMPTS TOKENS]]
    (MODEL: a local folder, or "shipped"; TEXT: heldout, code or quote; 1 thread, greedy; THRESHOLD: every
    checkpoint's exit threshold, default 0.9; PROMPTS x TOKENS: default 6 x 40)
"""
import json
import statistics
import sys
from pathlib import Path

from tide.decode.exits.walkgraph import ExitGraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_baselines import baseline_ratios, side_bench, time_interleaved  # noqa: E402

size = dict(prompts=int(sys.argv[6]), tokens=int(sys.argv[7])) if len(sys.argv) > 7 else {}
bench = side_bench(sys.argv[1:], **size)
model, prompts, n, g = bench.model, bench.prompts, bench.tokens, bench.greedy
config = {"mode": "exit", "compile": True, "exit_threshold": float(sys.argv[5]) if len(sys.argv) > 5 else 0.9}
for_session = ExitGraph.for_session


def spans(ids):
    ExitGraph.for_session = classmethod(lambda cls, session: None)
    try:
        return model.generate(ids, **g, tide_config=config)
    finally:
        ExitGraph.for_session = for_session


rows = {**bench.base_rows, "exit mode, runs of layers (before)": spans,
        "exit mode, one graph a step (after)": lambda ids: model.generate(ids, **g, tide_config=config)}
med, same = time_interleaved(rows, prompts, repeats=3)
res = {}
print(f"{bench.model_dir} {bench.text}: {len(prompts)} prompts x {n} tokens, median of 3, 1 thread; {config}")
for k, v in med.items():
    r = baseline_ratios(med, k)
    stats = None
    if "exit" in k:
        rows[k](prompts[0])
        stats = {"layers_per_token": model.last_stats.layer_passes / max(model.last_stats.decode_steps, 1),
                 "exits": dict(model.last_stats.exits)}
    res[k] = {"ms_per_token": statistics.median(v) / n * 1e3, "identical_to_generate": same[k], "stats": stats,
              **{f"vs {b}": [statistics.median(r[b]), r[b][0], r[b][-1]] for b in r}}
    print(f"{k:38s} {res[k]['ms_per_token']:7.2f} ms/token  vs generate x{statistics.median(r['generate']):.2f} "
          f"[{r['generate'][0]:.2f}-{r['generate'][-1]:.2f}]  "
          f"vs compiled x{statistics.median(r['static+compile']):.2f} "
          f"[{r['static+compile'][0]:.2f}-{r['static+compile'][-1]:.2f}]  "
          f"same as generate {same[k]:.2f}  {stats or ''}")
a = statistics.median(x / y for x, y in zip(med["exit mode, runs of layers (before)"],
                                            med["exit mode, one graph a step (after)"]))
print(f"one graph against runs of layers: x{a:.3f} (median of per-prompt ratios)")
res["graph_vs_spans"] = a
Path(sys.argv[4]).write_text(json.dumps({"model": bench.model_dir, "text": bench.text, "config": config,
                                         "rows": res}, indent=1))
