"""Sampled compiled trees, two paths in one process: one graph a cycle (`decode/lossless/graphtree.py`) and the general
loop (forced by patching `graph_cycles` to decline), beside a fused sampled chain and both baselines sampling with the
same warpers (`generate`, and the compiled static-cache base); every row seeded alike per prompt, interleaved.

    python examples/bench_baselines/sampled_trees.py MODEL ROUTERS TEXT OUT.json [TREE_JSON]
    (MODEL: a local folder, or "shipped"; TEXT: heldout, code or quote; 6 prompts x 40 tokens, 1 thread;
    temperature 0.7, top-p 0.9; TREE_JSON: the tree's tide_config fields, default '{"draft_topk": 2, "max_draft": 1}')
"""
import json
import statistics
import sys
from pathlib import Path

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

import tide.decode.lossless.loop as loop
from tide.decode.baseline import compiled_static_decoder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_baselines import accepted_per_cycle, baseline_ratios, side_bench, time_interleaved  # noqa: E402

bench = side_bench(sys.argv[1:])
model, base, prompts, n = bench.model, bench.base, bench.prompts, bench.tokens
warpers = (TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9))
sample = dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=n, min_new_tokens=n)
tree = {"mode": "lossless", "compile": True, "draft_topk": 2, "max_draft": 1,
        **(json.loads(sys.argv[5]) if len(sys.argv) > 5 else {})}
chain = {"mode": "lossless", "compile": True, "draft_topk": 1, "draft_ngram": 0}
compiled = compiled_static_decoder(base, max(p.shape[1] for p in prompts) + n,
                                   warp=lambda s: warpers[1](None, warpers[0](None, s)))
fused = loop.graph_cycles


def seeded(fn):
    def run(ids):
        torch.manual_seed(ids.shape[1])  # the same draws for every row of a prompt
        return fn(ids)
    return run


def general_loop(ids):
    loop.graph_cycles = lambda *args, **kwargs: "forced"
    try:
        return model.generate(ids, **sample, tide_config=tree)
    finally:
        loop.graph_cycles = fused


rows = {name: seeded(fn) for name, fn in {
    "generate": lambda ids: base.generate(ids, **sample),
    "static+compile": lambda ids: compiled(ids, n),
    "tree, general loop (before)": general_loop,
    "tree, one graph a cycle (after)": lambda ids: model.generate(ids, **sample, tide_config=tree),
    "chain, one graph a cycle": lambda ids: model.generate(ids, **sample, tide_config=chain)}.items()}
med, _ = time_interleaved(rows, prompts, repeats=3)
res = {}
print(f"{bench.model_dir} {bench.text}: {len(prompts)} prompts x {n} tokens sampled (temperature 0.7, top-p 0.9), "
      f"median of 3, 1 thread; tree {tree}")
for k, v in med.items():
    r = baseline_ratios(med, k)
    accepted = accepted_per_cycle(rows[k], prompts[:2], model) if "tree" in k or "chain" in k else None
    res[k] = {"ms_per_token": statistics.median(v) / n * 1e3, "accepted_per_cycle": accepted,
              **{f"vs {b}": [statistics.median(r[b]), r[b][0], r[b][-1]] for b in r}}
    print(f"{k:34s} {res[k]['ms_per_token']:6.2f} ms/token  vs generate x{statistics.median(r['generate']):.2f} "
          f"[{r['generate'][0]:.2f}-{r['generate'][-1]:.2f}]  "
          f"vs compiled x{statistics.median(r['static+compile']):.2f} "
          f"[{r['static+compile'][0]:.2f}-{r['static+compile'][-1]:.2f}]  accepted/cycle {accepted}")
Path(sys.argv[4]).write_text(json.dumps({"model": bench.model_dir, "text": bench.text, "tree": tree, "rows": res},
                                        indent=1))
