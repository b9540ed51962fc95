"""Compiled greedy chains, two paths in one process: the fused cycle (`decode/lossless/graph.py`: a draft graph, a
verification graph, one host read) and the general loop (forced by patching `graph_cycles` to decline), beside
`generate`, the compiled static-cache base and the repo's own scheme compiled; interleaved per prompt.

    python examples/bench_baselines/fused_ab.py MODEL ROUTERS TEXT OUT.json [CHAIN_JSON]
    (MODEL: a local folder, or "shipped"; TEXT: heldout, code or quote; 6 prompts x 40 tokens, 1 thread;
    CHAIN_JSON: the chain's tide_config fields, e.g. '{"draft_layer": 3, "max_draft": 4}')
    python examples/bench_baselines/fused_ab.py MODEL ROUTERS TEXT OUT.json CHAIN_JSON '[{"max_draft": 2}, ...]'
    (the base rows and one fused row per variant of CHAIN_JSON; median of 3)
"""
import json
import statistics
import sys
from pathlib import Path

import tide.decode.lossless.loop as loop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_baselines import accepted_per_cycle, baseline_ratios, side_bench, time_interleaved  # noqa: E402

bench = side_bench(sys.argv[1:])
model_dir, text, model, prompts = bench.model_dir, bench.text, bench.model, bench.prompts
n, g = bench.tokens, bench.greedy
chain = {"mode": "lossless", "compile": True, "draft_topk": 1, "draft_ngram": 0,
         **(json.loads(sys.argv[5]) if len(sys.argv) > 5 else {})}
fused = loop.graph_cycles


def general_loop(ids):
    loop.graph_cycles = lambda *args, **kwargs: "forced"
    try:
        return model.generate(ids, **g, tide_config=chain)
    finally:
        loop.graph_cycles = fused


rows = {**bench.base_rows,
        "repo's scheme, compile=True": lambda ids: model.generate(ids, **g, tide_config={"compile": True}),
        "chain, general loop (before)": general_loop,
        "chain, fused cycle (after)": lambda ids: model.generate(ids, **g, tide_config=chain)}
if len(sys.argv) > 6:  # more chains, fused only: '[{"max_draft": 2}, ...]' (each over CHAIN_JSON)
    rows = {**bench.base_rows, **{f"chain {extra}, fused": (lambda cfg: lambda ids: model.generate(
        ids, **g, tide_config=cfg))({**chain, **extra}) for extra in json.loads(sys.argv[6])}}
med, same = time_interleaved(rows, prompts, repeats=5 if len(sys.argv) <= 6 else 3)
res = {}
print(f"{model_dir} {text}: {len(prompts)} prompts x {n} tokens, median of 5, 1 thread; chain {chain}")
for k, v in med.items():
    r = baseline_ratios(med, k)
    accepted = accepted_per_cycle(rows[k], prompts[:2], model) if "chain" in k or "scheme" in k else None
    res[k] = {"ms_per_token": statistics.median(v) / n * 1e3, "identical": same[k], "accepted_per_cycle": accepted,
              "fused_cycles": model.last_stats.fused_cycles if accepted is not None else None,
              "host_share": (model.last_stats.fused_host_share if accepted is not None and model.last_stats.fused_cycles
                             else None),
              **{f"vs {b}": [statistics.median(r[b]), r[b][0], r[b][-1]] for b in r}}
    print(f"{k:32s} {res[k]['ms_per_token']:6.2f} ms/token  "
          f"vs generate x{statistics.median(r['generate']):.2f} "
          f"[{r['generate'][0]:.2f}-{r['generate'][-1]:.2f}]  "
          f"vs compiled x{statistics.median(r['static+compile']):.2f} "
          f"[{r['static+compile'][0]:.2f}-{r['static+compile'][-1]:.2f}]  identical {res[k]['identical']:.2f}"
          f"  accepted/cycle {accepted}" + (f"  host {res[k]['host_share']:.1%}" if res[k]["host_share"] else ""))
json.dump({"model": model_dir, "text": text, "chain": chain, "rows": res}, open(sys.argv[4], "w"), indent=1)
