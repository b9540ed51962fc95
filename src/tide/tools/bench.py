"""`tide bench`: one model, one process, side by side: base `generate`, exit mode over a threshold
sweep, both KV strategies, lossless mode over a draft-threshold sweep.

Speed is decode tokens/s of greedy `generate` on the prompts (median over interleaved repeats);
quality is teacher-forced top-1 agreement and perplexity on held-out text (`evaluate.py`); the
oracle bound is the speedup in layers a perfect router would reach with the same checkpoints.
Writes a JSON of the results and a PNG plot of the quality/speed curve.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch

from ..calibration.measure import measure_costs
from ..calibration.evaluate import oracle_depths, teacher_forced
from ..calibration.run import operating_point
from ..hub.card import (batches_text, draft_scheme_text, exit_timing_text, loop_extras_text, timings_text,
                        verify_extras_text)
from ..decode.baseline import compiled_static_decoder
from ..layers import fewrows
from .benchkv import device_name, kv_cost_main, kv_fill_costs, kv_fill_costs_text

__all__ = ["run_bench", "plot_bench", "kv_fill_costs", "kv_fill_costs_text"]

DEFAULT_SWEEP = (0.8, 0.85, 0.9, 0.95, 0.97)  # calibration targets (chosen from the held-out scores as calibrate does)


def _variants(model, sweep) -> tuple[dict[str, dict | None], dict[str, dict]]:
    """(variants {name: tide_config or None}, {name: how calibration chose a target row's thresholds})."""
    variants: dict[str, dict | None] = {"base": None}
    # (none where calibration turned exits off: exit mode then runs the base model, which the first row times)
    if model.config.resolve_generation({"mode": "exit"}).has_operating_point:
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


def _decode_seconds(fn, ids, new_tokens: int) -> float:
    """A call's seconds for `new_tokens` beyond its first token: the whole call less a one-token call (the faster of
    two: one slow prefill, a pause of the machine, made a decode's seconds negative)."""
    one = math.inf
    for _ in range(2):
        start = time.perf_counter()
        fn(ids, 1)
        one = min(one, time.perf_counter() - start)
    start = time.perf_counter()
    fn(ids, new_tokens + 1)
    return time.perf_counter() - start - one


COMPILED_BASE = "base static+compile"  # the second baseline: the base model's compiled static-cache decode
# on a CPU, the same with the products of a few rows lowered as Tide's own CPU graphs lower them
# (`layers/rowproducts.py`): a speed-minded user can pass the same inductor options
COMPILED_BASE_LOWERED = "base static+compile lowered"
COMPILED_LOSSLESS = "lossless compile=True"  # Tide's lossless mode compiled, timed beside that baseline
TIDE_COMPILE_CONFIG = None  # the compiled Tide row's `compile_config` for generate (None: transformers' default)


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
    decoders = {}
    if compiled_baseline:
        length = max(p.shape[1] for p in prompt_ids) + new_tokens + 1
        decoders[COMPILED_BASE] = compiled_static_decoder(base, length)
        if base.device.type == "cpu":
            decoders[COMPILED_BASE_LOWERED] = compiled_static_decoder(base, length, lowered=True)
        variants = {"base": None, **dict.fromkeys(decoders), **{k: v for k, v in variants.items() if k != "base"},
                    COMPILED_LOSSLESS: {"mode": "lossless", "compile": True}}
    results = {"machine": f"{device_name(base.device)}, torch {torch.__version__}",
               "model": base.config.name_or_path or type(base).__name__, "num_layers": model.parts.num_layers,
               "checkpoints": model.checkpoints, "exit_head": model.config.exit_head,
               "draft_head": model.config.draft_head, "new_tokens": new_tokens,
               "repeats": repeats, "variants": {}}
    _measure(model, token_lists, results, progress)
    times, extra, outputs = _time_variants(model, variants, _runner(model, decoders), prompt_ids, new_tokens,
                                           repeats, results, progress)
    for name, cfg in variants.items():
        row = _variant_row(model, cfg, times, name, extra[name], outputs, new_tokens * len(prompt_ids), token_lists)
        if name in chosen:
            row["calibration_choice"] = chosen[name]
        results["variants"][name] = row
        progress(_line(name, row) + (f"\n{'':32s}{_choice_text(chosen[name])}" if name in chosen else ""))
    _defaults_and_batches(model, tokenizer, heldout, token_lists, batch_size, new_tokens, repeats, results, progress)
    return results


def _run_config(model, cfg):
    """What a variant passes as `tide_config`: a target row's thresholds resolved against the repo's defaults."""
    if cfg is None or "thresholds" not in cfg:
        return cfg
    return model.config.resolve_generation(cfg)


def _runner(model, decoders: dict):
    """`generate(cfg, name)`: a variant's decode function `fn(ids, new_tokens)` (`decoders`: the compiled bases'
    by name)."""
    base = model.base
    gen_kwargs = dict(do_sample=False, pad_token_id=base.generation_config.pad_token_id or 0)

    def generate(cfg, name=None):
        if name in decoders:
            return decoders[name]
        if cfg is None:
            return lambda ids, n: base.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen_kwargs)
        compiled = {"compile_config": TIDE_COMPILE_CONFIG} if cfg.get("compile") and TIDE_COMPILE_CONFIG else {}
        return lambda ids, n: model.generate(ids, max_new_tokens=n, min_new_tokens=n,
                                             tide_config=_run_config(model, cfg), **compiled, **gen_kwargs)

    return generate


def _measure(model, token_lists, results: dict, progress) -> None:
    """The step's costs, the K/V fill's, the oracle bounds and the linears' layouts into `results`, and what
    calibration timed and kept, reported."""
    num_layers = model.parts.num_layers
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


def _time_variants(model, variants: dict, generate, prompt_ids, new_tokens: int, repeats: int, results: dict,
                   progress) -> tuple[dict, dict, dict]:
    """(seconds per repeat, the last run's stats, the greedy outputs), each by variant: every variant timed once a
    repeat, in an order that turns each repeat (the variant timed first in a repeat runs a little slower)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    extra: dict[str, dict] = {name: {} for name in variants}
    outputs: dict[str, list] = {}
    with torch.inference_mode():
        for name, key in ((COMPILED_BASE, "compile_s"), (COMPILED_BASE_LOWERED, "compile_lowered_s")):
            if name in variants:
                start = time.perf_counter()
                generate(None, name)(prompt_ids[0], 2)
                results[key] = time.perf_counter() - start
                progress(f"{name}: first call (compiling) {results[key]:.1f} s")
        # The greedy outputs, longest prompt first (the warm-up calls compile what the timed calls will run)
        order = sorted(range(len(prompt_ids)), key=lambda i: -prompt_ids[i].shape[1])
        for name, cfg in variants.items():
            start, ran, compiling = time.perf_counter(), {}, [0.0, 0, 0]
            for i in order:
                ran[i] = generate(cfg, name)(prompt_ids[i], new_tokens + 1)[0, prompt_ids[i].shape[1]:]
                if cfg is not None and model.last_stats is not None and model.last_stats.compiled:
                    stats = model.last_stats
                    compiling = [compiling[0] + stats.compile_s, compiling[1] + stats.graphs_compiled,
                                 compiling[2] + stats.recompiles]
            outputs[name] = [ran[i] for i in range(len(prompt_ids))]
            if name == COMPILED_LOSSLESS:
                results["tide_compile_s"] = time.perf_counter() - start
                results["tide_compiling"] = dict(zip(("compile_s", "graphs_compiled", "recompiles"), compiling))
                progress(f"{COMPILED_LOSSLESS}: first calls ({len(prompt_ids)} prompts) "
                         f"{results['tide_compile_s']:.1f} s, of which compiling {compiling[0]:.1f} s: "
                         f"{compiling[1]} graphs compiled, {compiling[2]} recompiles")
        names = list(variants)
        for repeat in range(repeats):
            for name in names[repeat % len(names):] + names[: repeat % len(names)]:
                cfg = variants[name]
                times[name].append(sum(_decode_seconds(generate(cfg, name), ids, new_tokens) for ids in prompt_ids))
                if cfg is not None and model.last_stats.mode != "base":
                    extra[name] = _stats_extra(model.last_stats)
    return times, extra, outputs


def _stats_extra(s) -> dict:
    """What a variant's row takes from its last run's stats."""
    layers = s.layer_passes_per_token if s.mode == "lossless" else s.mean_layers
    extra = {"mean_layers": layers, "layer_passes_per_token": s.layer_passes_per_token}
    if s.mode == "lossless":
        extra.update(acceptance_rate=s.acceptance_rate, drafted=s.drafted, accepted=s.accepted,
                     verify_passes=s.verify_passes, mean_draft=s.drafted / max(s.verify_passes, 1),
                     draft_topk=s.draft_topk)
    if s.compiled:  # (a timed call: compiling here would be a graph the warm-up calls did not make)
        extra.update(graphs_compiled=s.graphs_compiled, recompiles=s.recompiles)
    return extra


def _variant_row(model, cfg, times: dict, name: str, extra: dict, outputs: dict, total_tokens: int,
                 token_lists) -> dict:
    """A variant's row: its speed against the baselines, its greedy output against the base model's, its draft
    scheme (lossless) or its teacher-forced quality (the others)."""
    tps = total_tokens / statistics.median(times[name])
    # Each repeat times every variant once, interleaved: the ratio is the median of per-repeat ratios, and
    # its range over the repeats shows the machine's noise (a variant that runs the base model is an A/A check).
    ratios = [b / t for b, t in zip(times["base"], times[name])]
    row = {"tide_config": cfg, "decode_tokens_per_s": tps, "ratio_to_base": statistics.median(ratios),
           "ratio_range": [min(ratios), max(ratios)], **extra}
    if COMPILED_BASE in times:
        compiled_ratios = [c / t for c, t in zip(times[COMPILED_BASE], times[name])]
        row.update(ratio_to_compiled=statistics.median(compiled_ratios),
                   ratio_to_compiled_range=[min(compiled_ratios), max(compiled_ratios)])
    if COMPILED_BASE_LOWERED in times:
        lowered = [c / t for c, t in zip(times[COMPILED_BASE_LOWERED], times[name])]
        row.update(ratio_to_compiled_lowered=statistics.median(lowered),
                   ratio_to_compiled_lowered_range=[min(lowered), max(lowered)])
    same = [bool(torch.equal(a, b)) for a, b in zip(outputs[name], outputs["base"])]
    matched = sum(int((a == b).sum()) for a, b in zip(outputs[name], outputs["base"]))
    row.update(greedy_identical=all(same), greedy_token_match=matched / sum(len(b) for b in outputs["base"]))
    if cfg is not None and cfg.get("mode") == "lossless":
        scheme = model.config.resolve_generation(cfg)
        ran = extra.get("draft_topk", scheme.draft_topk)  # 1 where the tree fell back to a chain
        row["draft"] = ({"draft_layer": scheme.resolve_draft_layer(model.checkpoints, model.parts.num_layers),
                         "max_draft": scheme.max_draft, "draft_topk": ran,
                         "draft_vocab_size": scheme.draft_vocab_size, "draft_ngram": scheme.draft_ngram,
                         "head_drafts": scheme.head_drafts}
                        if scheme.max_draft else None)  # None: base generate
    if name not in (COMPILED_BASE, COMPILED_BASE_LOWERED) and (cfg is None or cfg.get("mode") != "lossless"):
        with torch.inference_mode():
            q = teacher_forced(model, token_lists, _run_config(model, cfg) if cfg is not None else
                               {"exit_threshold": 1.0})
        row.update(agreement=q.agreement, ppl=q.ppl_tide, ppl_base=q.ppl_base, ppl_delta=q.ppl_delta,
                   eval_mean_layers=q.mean_layers, eval_tokens=q.tokens)
    return row


def _defaults_and_batches(model, tokenizer, heldout, token_lists, batch_size: int, new_tokens: int, repeats: int,
                          results: dict, progress) -> None:
    """What a plain call runs (the default mode, exits kept or not), a batch's throughput and prefill exits' effect
    where exits are kept, into `results`."""
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
        stats = model.last_stats  # mode "base" where calibration turned exits off for batches: the base model ran
    tokens = new_tokens * ids.shape[0]
    ratios = [b / t for b, t in zip(times["base"], times["tide"])]
    return {"batch_size": ids.shape[0], "base_tokens_per_s": tokens / statistics.median(times["base"]),
            "tide_tokens_per_s": tokens / statistics.median(times["tide"]), "ratio_to_base": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)], "exits_ran": stats.mode != "base",
            "mean_layers": stats.mean_layers if stats.mode != "base" else model.parts.num_layers,
            "exits": stats.exits if stats.mode != "base" else {}}


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
        parts[0] += f" (compiled base: x{row['ratio_to_compiled']:.3f} [{low:.2f}-{high:.2f}]"
        if "ratio_to_compiled_lowered" in row:
            low, high = row["ratio_to_compiled_lowered_range"]
            parts[0] += f"; lowered: x{row['ratio_to_compiled_lowered']:.3f} [{low:.2f}-{high:.2f}]"
        parts[0] += ")"
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


if __name__ == "__main__":
    import sys

    sys.exit(kv_cost_main())
