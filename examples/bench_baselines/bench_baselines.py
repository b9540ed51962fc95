"""Tide against the two baselines a user compares it with, in one process, per prompt.

- `generate`: transformers' `generate` on the base model (greedy), what users run today;
- `static+compile`: the base model decoded by a plain loop on a `StaticCache` with
  `torch.compile(model.forward, fullgraph=True, dynamic=False)`, what a speed-minded user runs;
- Tide's rows: `TideForCausalLM.generate` with the repo's default mode and with forced lossless schemes.

Every row decodes the same prompts for the same number of tokens (greedy, `min_new_tokens` = `max_new_tokens`) and
is checked token for token against `generate` (lossless rows must match; exit rows report their agreement).
Prints, for each row, the median over prompts of the per-prompt speed ratio against each baseline and the
spread (min-max), and the compile time of the first compiled call.

    python examples/bench_baselines/bench_baselines.py --routers ROUTER_REPO [--tokens 48] [--prompts 8]

Without --routers the shipped model runs with fresh (uncalibrated) heads: lossless rows are exact but draft poorly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import tide
from tide.tools.demo import _load_base
from tide.decode.baseline import compiled_static_decoder
from tide.models.compat import CompileWatch
from tide.tools.demo_corpus import split_corpus


# the second compiled base on a CPU, beside the plain one: compiled with the inductor options Tide's CPU graphs take
LOWERED_BASE = "static+compile lowered"

# Random-weight shapes for costs and overheads on a GPU (drafts from fresh heads on random weights are
# rejected, so lossless rows there price a cycle, not a speed-up)
SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=4096),  # a smoke test of this path on any machine
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
}


def random_model(shape: str, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, eos_token_id=1, bos_token_id=2)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


CODE_MODULES = ("json.encoder", "textwrap", "string", "shlex", "fnmatch", "glob", "bisect", "heapq", "colorsys",
                "copy", "keyword", "numbers")


def prompt_texts(kind: str, count: int) -> list[str]:
    """Prompt texts of `kind` (see --text), from what any machine with Python has."""
    if kind == "code":
        import importlib
        import inspect

        sources = [inspect.getsource(importlib.import_module(name)) for name in CODE_MODULES[:count]]
        return [source[len(source) // 3:][:400] for source in sources]  # from a third of the way in, past the docstring
    _, heldout = split_corpus()
    if kind == "quote":
        return [f"{text[:300]}\n\n{text[:60]}" for text in heldout[:count]]
    return [text[:160] for text in heldout[:count]]


def timed(fn, *args):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def load_tide(model_dir: str, routers: str):
    """(base model, tokenizer, Tide model with the router repo `routers`) for a local model folder, or "shipped"."""
    if model_dir == "shipped":
        base, tok = _load_base()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    return base, tok, tide.TideForCausalLM.from_pretrained(routers, base_model=base)


def side_bench(argv: list[str], tokens: int = 40, prompts: int = 6):
    """What the side scripts of this folder share, from their `MODEL ROUTERS TEXT` arguments: 1 thread, the models,
    the prompts, greedy settings for `tokens` new tokens, and the base rows (`generate`, `static+compile`)."""
    from types import SimpleNamespace

    torch.set_num_threads(1)
    model_dir, routers, text = argv[:3]
    base, tok, model = load_tide(model_dir, routers)
    ids = [tok(t, return_tensors="pt").input_ids for t in prompt_texts(text, prompts)]
    greedy = dict(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens)
    compiled = compiled_static_decoder(base, max(p.shape[1] for p in ids) + tokens)
    rows = {"generate": lambda p: base.generate(p, **greedy), "static+compile": lambda p: compiled(p, tokens)}
    return SimpleNamespace(model_dir=model_dir, text=text, base=base, model=model, prompts=ids, tokens=tokens,
                           greedy=greedy, base_rows=rows)


def time_interleaved(rows: dict, prompts, repeats: int = 3) -> tuple[dict, dict]:
    """Every row on every prompt, interleaved per prompt, after a warm-up (the longest prompt first, so that a lent
    static cache is sized once): ({row: median seconds per prompt}, {row: the share of runs whose tokens equal the
    first row's})."""
    for ids in sorted(prompts, key=lambda ids: -ids.shape[1]) + list(prompts):
        for fn in rows.values():
            fn(ids)
    times = {k: [[] for _ in prompts] for k in rows}
    same = dict.fromkeys(rows, 0)
    for _ in range(repeats):
        for i, ids in enumerate(prompts):
            reference = None
            for k, fn in rows.items():
                seconds, out = timed(fn, ids)
                times[k][i].append(seconds)
                reference = out if reference is None else reference
                same[k] += int(torch.equal(out, reference))
    return ({k: [statistics.median(t) for t in v] for k, v in times.items()},
            {k: v / (repeats * len(prompts)) for k, v in same.items()})


def baseline_ratios(medians: dict, row: str) -> dict:
    """{baseline: the per-prompt speed ratios of `row` against it, sorted} for `time_interleaved`'s medians."""
    return {b: sorted(x / y for x, y in zip(medians[b], medians[row])) for b in ("generate", "static+compile")}


def accepted_per_cycle(fn, prompts, model) -> float | None:
    """Drafted tokens accepted per verification cycle over one untimed run of every prompt (lossless rows;
    None where the row ran no verification: exit mode, or the base model)."""
    accepted = cycles = 0
    for ids in prompts:
        fn(ids)
        stats = model.last_stats
        if stats is not None and stats.verify_passes:
            accepted, cycles = accepted + stats.accepted, cycles + stats.verify_passes
    return accepted / cycles if cycles else None


def bench_rows(base, model, prompts, tokens: int, configs: dict, repeats: int = 3, compile: bool = False,
               extra_rows: dict | None = None) -> dict:
    """Time `generate`, the compiled static-cache base, `extra_rows` ({name: fn(ids)}) and Tide with each of
    `configs` ({name: tide_config}) on every prompt, interleaved, greedy for `tokens` new tokens; print the table
    and return it as a dict (medians of per-prompt ratios against both baselines, their spread, identical runs,
    drafted tokens accepted per cycle)."""
    n = tokens
    greedy = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n)
    # The first calls compile, on the longest prompt: the static cache Tide lends compiled calls grows to the longest
    # call so far (as generate's own), and a shorter first call would have every graph made again at the next size.
    longest = max(prompts, key=lambda ids: ids.shape[1])
    compiled = compiled_static_decoder(base, longest.shape[1] + n)
    compile_s, _ = timed(compiled, longest, n)
    rows = {"generate": lambda ids: base.generate(ids, **greedy), "static+compile": lambda ids: compiled(ids, n)}
    compile_s = {"static+compile": compile_s}
    if compile and base.device.type == "cpu":  # the compiled base with the inductor options Tide's CPU graphs take
        lowered = compiled_static_decoder(base, longest.shape[1] + n, lowered=True)
        compile_s[LOWERED_BASE], _ = timed(lowered, longest, n)
        rows[LOWERED_BASE] = lambda ids: lowered(ids, n)
    rows.update(extra_rows or {})
    for name, config in configs.items():
        rows[name] = lambda ids, config=config: model.generate(ids, **greedy, tide_config=config)
    graphs = {}
    for name, config in configs.items() if compile else ():
        config = {**(config or {}), "compile": True}
        rows[f"{name} compiled"] = lambda ids, config=config: model.generate(ids, **greedy, tide_config=config)
        compile_s[f"{name} compiled"], _ = timed(rows[f"{name} compiled"], longest)
        stats = model.last_stats
        graphs[f"{name} compiled"] = {"graphs": stats.graphs_compiled, "recompiles": stats.recompiles,
                                      "compile_s": round(stats.compile_s, 1), "plan": stats.plan}
        print(f"first call of {name} compiled: {compile_s[f'{name} compiled']:.1f} s, {stats.compile_text()}",
              flush=True)
    # Two untimed rounds of every row once all are set up, on the longest prompt. Tide's compiled base steps and the
    # baseline's compile the same function (the base model's forward), so their graphs share one cache: the first
    # rounds add entries for each other's inputs (the caches' lengths, the forwards Tide installs on its first call),
    # none later. Everything compiled after the first calls is counted (graphs made, of which recompiles).
    with CompileWatch() as later:
        for _ in range(2):
            for fn in rows.values():
                fn(longest)
        times = _timed_rows(rows, prompts, repeats)
    print(f"compiled after the first calls: {later.graphs} graphs, {later.recompiles} recompiles", flush=True)
    graphs["after the first calls"] = {"graphs": later.graphs, "recompiles": later.recompiles}
    return _summary(rows, times, prompts, repeats, n, compile_s, graphs, model, extra_rows)


def _timed_rows(rows: dict, prompts, repeats: int) -> tuple[dict, dict]:
    """(seconds per row, over prompts and repeats; per row, the runs whose tokens equal `generate`'s)."""
    times = {name: [] for name in rows}
    same = {name: 0 for name in rows}
    for ids in prompts:
        ref = None
        for _ in range(repeats):
            for name, fn in rows.items():  # interleaved, so that load on the machine hits every row alike
                seconds, out = timed(fn, ids)
                times[name].append(seconds)
                ref = out if name == "generate" else ref
                same[name] += int(torch.equal(out, ref))
    return times, same


def _summary(rows, timed_rows, prompts, repeats, n, compile_s, graphs, model, extra_rows) -> dict:
    """Print the table and return it as a dict."""
    times, same = timed_rows
    per_prompt = {name: [statistics.median(t[i * repeats:(i + 1) * repeats]) for i in range(len(prompts))]
                  for name, t in times.items()}
    cycles = {name: accepted_per_cycle(rows[name], prompts, model) for name in rows
              if name not in ("generate", "static+compile", LOWERED_BASE) and name not in (extra_rows or {})}
    result = {"tokens": n, "prompts": len(prompts), "compile_s": {k: round(v, 1) for k, v in compile_s.items()},
              "graphs": graphs, "threads": torch.get_num_threads(), "rows": {}}
    print(f"{len(prompts)} prompts x {n} tokens, median of {repeats}; first compiled calls (s): "
          + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items()))
    print(f"{'row':<31}{'ms/token':>9}{'vs generate':>22}{'vs static+compile':>24}{'identical':>11}"
          f"{'accepted/cycle':>16}")
    for name, secs in per_prompt.items():
        row = {"ms_per_token": statistics.median(secs) / n * 1e3, "identical_runs": same[name] / len(times[name]),
               "accepted_per_cycle": cycles.get(name)}
        for baseline in (b for b in ("generate", "static+compile", LOWERED_BASE) if b in per_prompt):
            ratios = [b / s for b, s in zip(per_prompt[baseline], secs)]
            row[f"vs {baseline}"] = (statistics.median(ratios), min(ratios), max(ratios))
        result["rows"][name] = row
        cells = [f"x{m:.2f} [{lo:.2f}-{hi:.2f}]" for m, lo, hi in (row["vs generate"], row["vs static+compile"])]
        accepted = "" if row["accepted_per_cycle"] is None else f"{row['accepted_per_cycle']:.2f}"
        lowered = row.get(f"vs {LOWERED_BASE}")
        lowered = "" if lowered is None else f"  (vs lowered: x{lowered[0]:.2f} [{lowered[1]:.2f}-{lowered[2]:.2f}])"
        print(f"{name:<31}{row['ms_per_token']:>9.2f}{cells[0]:>22}{cells[1]:>24}{row['identical_runs']:>11.2f}"
              f"{accepted:>16}{lowered}")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", help="router repo for the shipped model")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timings per prompt and row (the median is kept)")
    parser.add_argument("--schemes", nargs="*", default=[], help="forced lossless schemes, e.g. 0:4 (layer:max_draft) "
                        "or 0:1:k3 (a tree of 3)")
    parser.add_argument("--compile", action="store_true", help="also time every Tide row with tide_config compile=True "
                        "(compiled runs of layers on a static cache)")
    parser.add_argument("--exit", type=float, nargs="*", default=[],
                        help="exit-mode rows at these exit_threshold values")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--model", help="a local causal LM folder (with its tokenizer) instead of the shipped model")
    parser.add_argument("--random-shape", choices=sorted(SHAPES), help="a random-weight Llama of this shape instead of "
                        "the shipped model (costs and overheads; fresh heads)")
    parser.add_argument("--costs", action="store_true",
                        help="also print Tide's cost table (tide.calibration.measure.measure_costs)")
    parser.add_argument("--text", choices=["heldout", "code", "quote"], default="heldout",
                        help="prompts: held-out prose; the start of Python standard-library source files (a code "
                        "continuation); or a held-out paragraph followed by its own opening (text that repeats)")
    parser.add_argument("--ngram", action="store_true", help="also time transformers' prompt lookup "
                        "(prompt_lookup_num_tokens=3) and Tide's default with and without n-gram drafts")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.random_shape:
        base = random_model(args.random_shape, args.device)
        prompts = [torch.randint(3, base.config.vocab_size, (1, 64), device=args.device) for _ in range(args.prompts)]
    else:
        if args.model:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            base = AutoModelForCausalLM.from_pretrained(args.model).eval()
            tok = AutoTokenizer.from_pretrained(args.model)
        else:
            base, tok = _load_base()
        base.to(args.device)
        prompts = [tok(text, return_tensors="pt").input_ids.to(args.device)
                   for text in prompt_texts(args.text, args.prompts)]
    model = (tide.TideForCausalLM.from_pretrained(args.routers, base_model=base) if args.routers
             else tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=1)))
    if args.costs:
        from tide.calibration.measure import measure_costs

        costs = measure_costs(model)
        print("cost table (layers):", {k: round(v, 3) for k, v in costs.as_dict().items() if isinstance(v, float)
                                       and not k.endswith("_s")})
    configs = {"tide default": None}
    if args.routers:
        configs["tide exit (calibrated)"] = {"mode": "exit"}
    for scheme in args.schemes:
        layer, draft, *tree = scheme.split(":")
        config = {"mode": "lossless", "draft_layer": int(layer), "max_draft": int(draft)}
        if tree:
            config["draft_topk"] = int(tree[0].lstrip("k"))
        configs[f"lossless {scheme}"] = config
    extra_rows = {}
    if args.ngram:
        greedy = dict(do_sample=False, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
        extra_rows["prompt lookup (transformers)"] = lambda ids: base.generate(ids, **greedy,
                                                                               prompt_lookup_num_tokens=3)
        configs["tide default, no n-gram"] = {"mode": "lossless", "draft_ngram": 0}
        configs["tide default + n-gram"] = {"mode": "lossless", "draft_ngram": 3}
        configs["tide n-gram only"] = {"mode": "lossless", "draft_ngram": 3, "max_draft": 4, "head_drafts": False}
        configs["tide tree k3, head only"] = {"mode": "lossless", "draft_topk": 3, "draft_ngram": 0}
        configs["tide tree k3 + n-gram, one tree"] = {"mode": "lossless", "draft_topk": 3, "draft_ngram": 3}
    for threshold in args.exit:
        configs[f"exit {threshold:g}"] = {"exit_threshold": threshold}
    result = bench_rows(base, model, prompts, args.tokens, configs, repeats=args.repeats, compile=args.compile,
                        extra_rows=extra_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
