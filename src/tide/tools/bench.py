"""`tide bench`: one model, one process, side by side: base `generate`, exit mode over a threshold
sweep, both KV strategies, lossless mode over a draft-threshold sweep.

Speed is decode tokens/s of greedy `generate` on the prompts (median over interleaved repeats);
quality is teacher-forced top-1 agreement and perplexity on held-out text (`evaluate.py`); the
oracle bound is the speedup in layers a perfect router would reach with the same checkpoints.
Writes a JSON of the results and a PNG plot of the quality/speed curve.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from ..calibration.measure import measure_costs
from ..calibration.evaluate import oracle_depths, teacher_forced
from ..calibration.run import operating_point
from ..hub.card import (batches_text, draft_scheme_text, exit_timing_text, loop_extras_text, timings_text,
                        verify_extras_text)
from ..decode.baseline import compiled_static_decoder
from ..layers import fewrows
from ..layers.calls import capture_layer_calls, write_kv_only
from ..layers.kvfill import fill_kv, fused_available
from ..layers.kvprobe import kv_plan

__all__ = ["run_bench", "plot_bench", "kv_fill_costs", "kv_fill_costs_text"]

DEFAULT_SWEEP = (0.8, 0.85, 0.9, 0.95, 0.97)  # calibration targets (chosen from the held-out scores as calibrate does)


def _variants(model, sweep) -> tuple[dict[str, dict | None], dict[str, dict]]:
    """(variants {name: tide_config or None}, {name: how calibration chose a target row's thresholds})."""
    variants: dict[str, dict | None] = {"base": None}
    if model.config.thresholds:
        variants["exit calibrated (propagate)"] = {"mode": "exit", "kv_strategy": "propagate"}
        variants["exit calibrated (recompute)"] = {"mode": "exit", "kv_strategy": "recompute"}
    chosen = {}
    if getattr(model, "heldout_selection", None) is not None:
        for target in sweep:
            point = operating_point(model, target)  # what tide.calibrate(target_agreement=target) would keep
            name = f"exit target {target}"
            variants[name] = {"mode": "exit", "thresholds": point.thresholds}
            chosen[name] = {"exits": point.exits, "exit_timing": point.exit_timing, "validation": point.validation,
                            "expected_speedup": point.expected_speedup}
    variants["lossless"] = {"mode": "lossless"}
    return variants, chosen


def _choice_text(choice: dict) -> str:
    """How calibration chose a target row's thresholds, in words."""
    check, timing, expected = choice["validation"], choice["exit_timing"], choice["expected_speedup"]
    words = [] if expected is None else [f"expected x{expected:.3f} in layer work"]
    if check:
        words.append(f"decode check: agreement {check['agreement']:.3f} (lower bound {check['lower_bound']:.3f})")
    if timing:
        realised = ("" if expected is None
                    else f" (the lower timing is {timing['measured'] / expected:.0%} of the expected speed-up)")
        words.append(exit_timing_text(timing) + realised)
    elif not choice["exits"]:
        words.append("no checkpoint pays at this target: no exits")
    return "; ".join(words)


def device_name(device) -> str:
    """The accelerator's or the CPU's own name, as the machine reports it."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({torch.get_num_threads()} threads)"


def _decode_seconds(fn, ids, new_tokens: int) -> float:
    start = time.perf_counter()
    fn(ids, 1)
    one = time.perf_counter() - start
    start = time.perf_counter()
    fn(ids, new_tokens + 1)
    return time.perf_counter() - start - one


COMPILED_BASE = "base static+compile"  # the second baseline: the base model's compiled static-cache decode


def run_bench(model, tokenizer, prompts: list[str], heldout: list[str], *, sweep=DEFAULT_SWEEP, new_tokens: int = 48,
              repeats: int = 3, max_eval_tokens: int = 128, batch_size: int = 16, compiled_baseline: bool = True,
              progress=print) -> dict:
    """Measure every variant; returns the results as a JSON-ready dict. Each row's speed is a ratio to base
    `generate` and, with `compiled_baseline`, to the base model's compiled static-cache decode (what a speed-minded
    user runs; `decode.baseline`), whose first call's compile time is reported."""
    base = model.base
    variants, chosen = _variants(model, sweep)
    token_lists = [tokenizer(t)["input_ids"][:max_eval_tokens] for t in heldout]
    prompt_ids = [tokenizer(p, return_tensors="pt")["input_ids"].to(base.device) for p in prompts]
    gen_kwargs = dict(do_sample=False, pad_token_id=base.generation_config.pad_token_id or 0)

    def run_config(cfg):
        if cfg is None or "thresholds" not in cfg:
            return cfg
        return model.config.resolve_generation(cfg)

    compiled_decode = None
    if compiled_baseline:
        compiled_decode = compiled_static_decoder(base, max(p.shape[1] for p in prompt_ids) + new_tokens + 1)
        variants = {"base": None, COMPILED_BASE: None, **{k: v for k, v in variants.items() if k != "base"}}

    def generate(cfg, name=None):
        if name == COMPILED_BASE:
            return compiled_decode
        if cfg is None:
            return lambda ids, n: base.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen_kwargs)
        return lambda ids, n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, tide_config=run_config(cfg),
                                             **gen_kwargs)

    num_layers = model.parts.num_layers
    results = {"machine": f"{device_name(base.device)}, torch {torch.__version__}",
               "model": base.config.name_or_path or type(base).__name__, "num_layers": num_layers,
               "checkpoints": model.checkpoints, "exit_head": model.config.exit_head,
               "draft_head": model.config.draft_head, "new_tokens": new_tokens,
               "repeats": repeats, "variants": {}}
    with torch.inference_mode():
        costs = measure_costs(model)
        results["kv_fill"] = kv_fill_costs(model)
        oracle = {}
        for name, lens in (("lens", True), ("exits", False)):
            depths = oracle_depths(model, token_lists, lens=lens).float()
            oracle[name] = num_layers / float(depths.mean())
        every = oracle_depths(model, token_lists, list(range(num_layers - 1)), lens=True).float()
        oracle["lens_every_layer"] = num_layers / float(every.mean())
    results["costs"] = costs.as_dict()
    results["oracle"] = oracle
    results["few_row_layouts"] = fewrows.layouts(model.parts)
    progress(f"costs on {results['machine']}: consulted checkpoint {costs.checkpoint:.2f} layer, skipped layer's K/V "
             f"{costs.skipped_layer:.2f} layer, head {costs.head:.2f} layer, step set-up {costs.capture:.2f} layer "
             f"({'one per window of positions in' if costs.windowed else 'per pass in'} Tide's passes), "
             f"{verify_extras_text(results['costs'])}, "
             f"{loop_extras_text(results['costs']) or 'generate not timed'} (linears over "
             f"{fewrows.layouts_text(results['few_row_layouts'])})")
    progress(kv_fill_costs_text(results["kv_fill"]))
    draft = (model.config.calibration or {}).get("draft_selection")
    if draft:
        results["draft_selection"] = draft
        for trial in draft.get("trials", []):
            progress(f"calibration timed lossless {draft_scheme_text(trial)}: estimated x{trial['estimate']:.3f}, "
                     f"{timings_text(trial)}")
        kept_scheme = model.config.generation_config
        progress(f"calibration kept lossless {draft_scheme_text(kept_scheme)}" if kept_scheme.max_draft else
                 "calibration kept no drafting scheme: lossless mode runs the base model")
    progress(f"oracle bound with checkpoints {model.checkpoints}: x{oracle['exits']:.3f} through the "
             f"{model.config.exit_head} exit heads, x{oracle['lens']:.3f} through the logit lens "
             f"(x{oracle['lens_every_layer']:.3f} lens with every layer)")

    times: dict[str, list[float]] = {name: [] for name in variants}
    extra: dict[str, dict] = {name: {} for name in variants}
    outputs: dict[str, list] = {}
    with torch.inference_mode():
        if compiled_decode is not None:
            start = time.perf_counter()
            compiled_decode(prompt_ids[0], 2)
            results["compile_s"] = time.perf_counter() - start
            progress(f"{COMPILED_BASE}: first call (compiling) {results['compile_s']:.1f} s")
        for name, cfg in variants.items():
            outputs[name] = [generate(cfg, name)(ids, new_tokens + 1)[0, ids.shape[1]:] for ids in prompt_ids]
        names = list(variants)
        for repeat in range(repeats):
            # The order turns each repeat: the variant timed first in a repeat ran about 0.7% slower (measured
            # with four variants that all ran the base model).
            for name in names[repeat % len(names):] + names[: repeat % len(names)]:
                cfg = variants[name]
                times[name].append(sum(_decode_seconds(generate(cfg, name), ids, new_tokens) for ids in prompt_ids))
                if cfg is not None and model.last_stats is not None:
                    s = model.last_stats
                    layers = s.layer_passes_per_token if s.mode == "lossless" else s.mean_layers
                    extra[name] = {"mean_layers": layers, "layer_passes_per_token": s.layer_passes_per_token}
                    if s.mode == "lossless":
                        extra[name].update(acceptance_rate=s.acceptance_rate, drafted=s.drafted, accepted=s.accepted,
                                           verify_passes=s.verify_passes,
                                           mean_draft=s.drafted / max(s.verify_passes, 1), draft_topk=s.draft_topk)
    total_tokens = new_tokens * len(prompt_ids)
    for name, cfg in variants.items():
        tps = total_tokens / statistics.median(times[name])
        # Each repeat times every variant once, interleaved: the ratio is the median of per-repeat ratios, and
        # its range over the repeats shows the machine's noise (a variant that runs the base model is an A/A check).
        ratios = [b / t for b, t in zip(times["base"], times[name])]
        row = {"tide_config": cfg, "decode_tokens_per_s": tps, "ratio_to_base": statistics.median(ratios),
               "ratio_range": [min(ratios), max(ratios)], **extra[name]}
        if compiled_decode is not None:
            compiled_ratios = [c / t for c, t in zip(times[COMPILED_BASE], times[name])]
            row.update(ratio_to_compiled=statistics.median(compiled_ratios),
                       ratio_to_compiled_range=[min(compiled_ratios), max(compiled_ratios)])
        same = [bool(torch.equal(a, b)) for a, b in zip(outputs[name], outputs["base"])]
        matched = sum(int((a == b).sum()) for a, b in zip(outputs[name], outputs["base"]))
        row.update(greedy_identical=all(same), greedy_token_match=matched / sum(len(b) for b in outputs["base"]))
        if cfg is not None and cfg.get("mode") == "lossless":
            scheme = model.config.resolve_generation(cfg)
            ran = extra[name].get("draft_topk", scheme.draft_topk)  # 1 where the tree fell back to a chain
            row["draft"] = ({"draft_layer": scheme.resolve_draft_layer(model.checkpoints, model.parts.num_layers),
                             "max_draft": scheme.max_draft, "draft_topk": ran,
                             "draft_vocab_size": scheme.draft_vocab_size, "draft_ngram": scheme.draft_ngram,
                             "head_drafts": scheme.head_drafts}
                            if scheme.max_draft else None)  # None: base generate
        if name != COMPILED_BASE and (cfg is None or cfg.get("mode") != "lossless"):
            with torch.inference_mode():
                q = teacher_forced(model, token_lists, run_config(cfg) if cfg is not None else {"exit_threshold": 1.0})
            row.update(agreement=q.agreement, ppl=q.ppl_tide, ppl_base=q.ppl_base, ppl_delta=q.ppl_delta,
                       eval_mean_layers=q.mean_layers, eval_tokens=q.tokens)
        if name in chosen:
            row["calibration_choice"] = chosen[name]
        results["variants"][name] = row
        progress(_line(name, row) + (f"\n{'':32s}{_choice_text(chosen[name])}" if name in chosen else ""))
    exits_on = model.config.resolve_generation({"mode": "exit"}).has_operating_point
    timing = (model.config.calibration or {}).get("exit_timing")
    if model.config.thresholds and not exits_on:
        progress("exit mode: calibration turned its exits off"
                 + (f" (measured x{timing['measured']:.3f} against the base model)" if timing else "")
                 + ", so it runs the base model")
    progress(f"default generate(): mode={model.config.generation_config.mode!r}"
             + (f" (lossless at batch size 1, {batches_text(model.config)})"
                if model.config.generation_config.mode == "auto" else ""))
    results["default_mode"] = model.config.generation_config.mode
    if exits_on and batch_size > 1:
        results["batch"] = batch_throughput(model, tokenizer, heldout, batch_size, new_tokens, repeats)
        b = results["batch"]
        progress(f"batch {batch_size} (calibrated thresholds): base {b['base_tokens_per_s']:.1f} tok/s, Tide "
                 f"{b['tide_tokens_per_s']:.1f} tok/s, x{b['ratio_to_base']:.3f} [{b['ratio_range'][0]:.2f}-"
                 f"{b['ratio_range'][1]:.2f}], mean layers {b['mean_layers']:.2f}"
                 + ("" if b["exits_ran"] else " (calibration turned exits off for batches: the base model ran)"))
    if exits_on:
        results["prefill_exit"] = _prefill_effect(model, token_lists)
        progress("prefill_exit (first half of each text as the prompt): agreement "
                 f"{results['prefill_exit']['agreement_full_prefill']:.3f} with a full prefill, "
                 f"{results['prefill_exit']['agreement_prefill_exit']:.3f} with prompt tokens exiting too")
    return results


def batch_throughput(model, tokenizer, texts: list[str], batch_size: int, new_tokens: int, repeats: int,
                     prompt_tokens: int = 12) -> dict:
    """Decode tokens/s of one left-padded batch (prompts: the start of `batch_size` texts), base `generate`
    against Tide with the model's calibrated thresholds, interleaved over `repeats`."""
    base = model.base
    rows = [tokenizer(t)["input_ids"][:prompt_tokens] for t in texts[:batch_size]]
    width = max(len(r) for r in rows)
    pad = base.generation_config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=base.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=base.device)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=pad)
    runs = {
        "base": lambda i, n: base.generate(i, max_new_tokens=n, min_new_tokens=n, **kwargs),
        "tide": lambda i, n: model.generate(i, max_new_tokens=n, min_new_tokens=n, tide_config={"mode": "exit"},
                                            **kwargs),
    }
    times = {name: [] for name in runs}
    with torch.inference_mode():
        for fn in runs.values():
            fn(ids, 2)
        for _ in range(repeats):
            for name, fn in runs.items():
                times[name].append(_decode_seconds(fn, ids, new_tokens))
        stats = model.last_stats  # None where calibration turned exits off for batches: the base model ran
    tokens = new_tokens * ids.shape[0]
    ratios = [b / t for b, t in zip(times["base"], times["tide"])]
    return {"batch_size": ids.shape[0], "base_tokens_per_s": tokens / statistics.median(times["base"]),
            "tide_tokens_per_s": tokens / statistics.median(times["tide"]), "ratio_to_base": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)], "exits_ran": stats is not None,
            "mean_layers": stats.mean_layers if stats else model.parts.num_layers,
            "exits": stats.exits if stats else {}}


def _prefill_effect(model, token_lists) -> dict:
    """Agreement of the decode tokens after a prompt (half of each text) prefilled fully vs with exits."""
    prefix = max(1, min(len(t) for t in token_lists) // 2)
    with torch.inference_mode():
        full = teacher_forced(model, token_lists, {"prefill_exit": False}, prefix=prefix)
        skipped = teacher_forced(model, token_lists, {"prefill_exit": True}, prefix=prefix)
    return {"prompt_tokens": prefix, "agreement_full_prefill": full.agreement,
            "agreement_prefill_exit": skipped.agreement,
            "ppl_full_prefill": full.ppl_tide, "ppl_prefill_exit": skipped.ppl_tide}


def _line(name: str, row: dict) -> str:
    low, high = row["ratio_range"]
    parts = [f"{name:30s} {row['decode_tokens_per_s']:8.1f} tok/s  x{row['ratio_to_base']:.3f} [{low:.2f}-{high:.2f}]"]
    if "ratio_to_compiled" in row:
        low, high = row["ratio_to_compiled_range"]
        parts[0] += f" (compiled base: x{row['ratio_to_compiled']:.3f} [{low:.2f}-{high:.2f}])"
    parts += [
              "greedy output = base" if row["greedy_identical"]
              else f"greedy tokens = base {row['greedy_token_match']:.0%}"]
    if "mean_layers" in row:
        parts.append(f"layers {row['mean_layers']:.2f}")
    if "agreement" in row:
        parts.append(f"agreement {row['agreement']:.3f}")
    if "ppl_delta" in row and row.get("ppl") is not None:
        parts.append(f"ppl {row['ppl']:.2f} ({row['ppl_delta']:+.2f})")
    if "draft" in row:
        draft = row["draft"]
        parts.append(draft_scheme_text(draft) if draft else "no draft pays here: the base model's generate")
    if "acceptance_rate" in row:
        parts.append(f"acceptance {row['acceptance_rate']:.2f}, mean draft {row['mean_draft']:.2f}")
    return "  ".join(parts)


def save_results(results: dict, path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=2, default=str))


def plot_bench(results: dict, path) -> None:
    """Quality (agreement) against measured speedup, with the oracle bound marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, row in results["variants"].items():
        if "agreement" not in row:
            continue
        marker = "D" if name == "base" else "*" if "lossless" in name else ("s" if "calibrated" in name else "o")
        ax.scatter(row["ratio_to_base"], row["agreement"], marker=marker, s=60, label=name)
    oracle = results["oracle"]["exits"]
    ax.axvline(oracle, linestyle="--", color="gray",
               label=f"oracle bound x{oracle:.2f} (layers, {results['exit_head']} exits)")
    ax.legend(fontsize=7, loc="center right")
    ax.set_xlabel("decode tokens/s relative to the base model")
    ax.set_ylabel("top-1 agreement with the full model (held-out)")
    ax.set_title(f"Tide on {Path(str(results['model'])).name} ({results['machine']})", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


@torch.no_grad()
def kv_fill_costs(model, prompt_length: int = 32, repeats: int = 15) -> dict:
    """A skipped layer's K/V for one decode token, as a fraction of a decoder layer's time (medians over
    interleaved repeats, so every piece reads its weights from memory as in a real step), by each way Tide can
    fill it: `batched` (`kvfill`'s one matmul over every layer's stacked K/V projections; None where the family
    does not take it), `per_layer` (each layer's own code up to its cache write, computing only the outputs the
    probe found to reach the K/V: `kvprobe`), and `per_layer_everything` (the same pass computing every linear
    output before the cache write: the query projection, a fused projection's query rows; what that pass cost
    before the probe). Each is the time to fill every layer, divided by the number of layers. Also the probe's
    report (`kv_plan(...).report()`, its first layer)."""
    parts, base = model.parts, model.base
    device = next(parts.layers.parameters()).device
    vocab = base.config.get_text_config().vocab_size
    ids = torch.arange(3, prompt_length + 4, device=device).remainder(vocab)[None]
    cache = DynamicCache(config=base.config)
    base(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
    calls = capture_layer_calls(parts, input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    hidden, layers = calls[0].hidden, list(range(parts.num_layers))
    plan = kv_plan(parts)

    def run_layers():
        h = hidden
        for i in layers:
            h = calls[i].run(parts, i, h)
        cache.crop(-1)

    def fill(layerwise: bool):
        fill_kv(parts, calls, layers, hidden, cache, layerwise=layerwise)
        cache.crop(-1)

    def everything():
        for i in layers:
            write_kv_only(calls[i], parts, i, hidden, cache, skips={})
        cache.crop(-1)

    pieces = {"layer": run_layers, "per_layer": lambda: fill(True), "per_layer_everything": everything}
    if fused_available(parts, calls, layers, hidden):
        pieces["batched"] = lambda: fill(False)
    seconds = {name: [] for name in pieces}
    for fn in pieces.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in pieces.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[name].append(time.perf_counter() - start)
    layer_s = statistics.median(seconds["layer"]) / len(layers)
    out = {"layer_ms": layer_s * 1e3, "batched": None, "probe": plan.report().splitlines()[0] if plan.layers else "",
           "probe_complete": plan.complete}
    for name in pieces:
        if name != "layer":
            out[name] = statistics.median(seconds[name]) / len(layers) / layer_s
    return out


def kv_fill_costs_text(costs: dict) -> str:
    batched = "" if costs["batched"] is None else f"batched {costs['batched']:.3f}, "
    return (f"a skipped layer's K/V, as a fraction of a layer ({costs['layer_ms']:.2f} ms): {batched}"
            f"per-layer K/V-only pass {costs['per_layer']:.3f} (computing every linear output before the cache "
            f"write: {costs['per_layer_everything']:.3f}); probe: {costs['probe']}")


def _kv_cost_main(argv: list[str] | None = None) -> int:
    """`python -m tide.tools.bench TYPE [TYPE ...] --hidden 2048 --heads 32 --kv-heads 4`: the K/V cost of a skipped
    layer on random-init models of these model types and shape (no download), one table row each."""
    import argparse

    from transformers import AutoConfig, AutoModelForCausalLM

    from ..config import TideConfig
    from ..modeling import TideForCausalLM

    parser = argparse.ArgumentParser(description=_kv_cost_main.__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="+")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print("| model type | shape | layer (ms) | batched fill | per-layer K/V-only pass | that pass computing "
          "everything before the cache write |\n|---|---|---|---|---|---|")
    for model_type in args.model_types:
        torch.manual_seed(0)
        config = AutoConfig.for_model(
            model_type, hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            intermediate_size=args.intermediate, num_hidden_layers=args.layers, vocab_size=args.vocab,
            head_dim=args.hidden // args.heads,
            max_position_embeddings=512, pad_token_id=0)
        base = AutoModelForCausalLM.from_config(config).eval()
        model = TideForCausalLM.from_base(base, TideConfig(checkpoint_layers=[0]))
        costs = kv_fill_costs(model, repeats=args.repeats)
        kv = args.kv_heads if "num_key_value_heads" in type(config)().to_dict() else args.heads  # else MHA
        batched = "-" if costs["batched"] is None else f"{costs['batched']:.3f}"
        print(f"| `{model_type}` | hidden {args.hidden}, {args.heads} heads / {kv} KV heads, intermediate "
              f"{args.intermediate}, {args.layers} layers | {costs['layer_ms']:.2f} | {batched} | "
              f"{costs['per_layer']:.3f} | {costs['per_layer_everything']:.3f} |", flush=True)
        del model, base
    print(f"({device_name('cpu')}, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_kv_cost_main())
