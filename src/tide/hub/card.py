"""A calibration in words: the router repo's model card (`model_card`), the calibration table `tide calibrate`
prints (`calibration_table`), and the phrases both use, also in `tide bench`'s report.

Each phrase takes a record of `tide.records` or its saved dict (as `config.calibration` holds it, or as a
trial returns it).
"""

from __future__ import annotations

from huggingface_hub import ModelCard, ModelCardData

from ..config import TideConfig
from ..records import CalibrationRecord

__all__ = ["model_card", "calibration_table", "draft_scheme_text", "timings_text", "exit_timing_text",
           "compiled_timing_text", "compiled_chains_text", "phases_text", "work_text", "budget_text", "batches_text",
           "verify_extras_text", "loop_extras_text"]

# What a verification over 4 and 8 positions adds: the two points repos calibrated before the others hold.
_OLDER_VERIFY_POINTS = (4, 8)


def _plain(value) -> dict:
    """A record (or a `TideGenerationConfig`) as its saved dict; a dict as it is."""
    return value.to_dict() if hasattr(value, "to_dict") else value


# ---------------------------------------------------------------------- phrases
def draft_scheme_text(scheme) -> str:
    """A drafting scheme's shape in words: a `DraftRecord`, generation options, or a dict with draft_layer,
    max_draft and (optionally) draft_topk, draft_vocab_size, draft_ngram and head_drafts.

    'chain of 4 from layer 0', 'chain of 4 from layer 0 with n-gram drafts', 'tree of 3 head candidates from
    layer 2', 'tree of 3 head candidates + n-gram branches up to 4 deep, from layer 2' (drafts restricted to a
    draft vocabulary add 'over the 64 most predicted tokens'), or 'n-gram drafts only, ...'."""
    scheme = _plain(scheme)
    ngram, layer = scheme.get("draft_ngram"), scheme.get("draft_layer")
    if scheme.get("head_drafts") is False:
        return f"n-gram drafts only, up to {scheme['max_draft']} per verification, where the last " \
               f"{ngram} tokens (down to 2) occurred before; plain steps elsewhere"
    source = "from the default draft layer" if layer is None else f"from layer {layer}"
    vocab = f"over the {scheme['draft_vocab_size']} most predicted tokens" if scheme.get("draft_vocab_size") else ""
    topk = scheme.get("draft_topk") or 1
    if topk > 1 and ngram:
        head = f"tree of {topk} head candidates" + (f" {vocab}" if vocab else "")
        return f"{head} + n-gram branches up to {scheme['max_draft']} deep, {source}"
    text = f"tree of {topk} head candidates {source}" if topk > 1 else f"chain of {scheme['max_draft']} {source}"
    text += f", {vocab}" if vocab else ""
    return text + ((", with" if vocab else " with") + " n-gram drafts" if ngram else "")


def timings_text(entry) -> str:
    """'measured x1.172' or, for a mode timed again before it was kept, 'measured x1.172, then x1.150'."""
    entry = _plain(entry)
    timings = entry.get("timings") or [entry["measured"]]
    return "measured " + ", then ".join(f"x{t:.3f}" for t in timings)


def exit_timing_text(timing) -> str:
    """Calibration's timing of exit mode against the base model (`exit_timing` of the calibration record), in
    words: what was measured, for one sequence and for a batch, and what was kept."""
    timing = _plain(timing)
    text = timings_text(timing) + " against the base model"
    if not timing["active"]:
        return text + "; not faster by calibration's margin, so its exits are off (exit mode runs the base model)"
    batch = timing.get("batch")
    if batch:
        text += f"; on a batch of {batch['rows']}: {timings_text(batch)}"
        text += "" if batch["active"] else ", not faster, so batches run the base model"
    return text


def compiled_timing_text(timing) -> str:
    """Calibration's timing of the default mode compiled against the base model's compiled static-cache decode
    (`compiled_timing` of the calibration record), in words."""
    timing = _plain(timing)
    text = timings_text(timing) + " against the base model's compiled static-cache decode"
    if timing["active"]:
        return text + "; calls with compile=True run it compiled"
    return text + "; not faster by calibration's margin, so calls with compile=True run that decode"


def compiled_chains_text(chains: list, chosen: dict | None) -> str:
    """Calibration's timings of greedy chains compiled (`compiled_chains` of the calibration record), in words."""
    parts = [f"{', '.join(f'{k}={v}' for k, v in c['chain'].items())}: {timings_text(c)}" for c in chains]
    verdict = (f"calls with compile=True draft the chain {chosen}" if chosen
               else "none faster by calibration's margin")
    return "; ".join(parts) + f" against the base model's compiled static-cache decode; {verdict}"


def phases_text(seconds: dict) -> str:
    """'143.2 s: data 3.1, training 80.4, ...' for a calibration's `phase_seconds` (phases under 0.05 s left out)."""
    parts = [f"{name} {value:.1f}" for name, value in seconds.items() if value >= 0.05]
    return f"{sum(seconds.values()):.1f} s" + (": " + ", ".join(parts) if parts else "")


def work_text(work: dict) -> str:
    """'training 2,048/2,040 tokens, held-out scoring 512/498 tokens, ...' for a calibration's `work_per_rank`
    (each process's share, in rank order)."""
    parts = []
    for phase in ("training", "held-out scoring", "decode validation"):
        tokens = (work.get(phase) or {}).get("tokens")
        if tokens and any(tokens):
            parts.append(f"{phase} " + "/".join(f"{t:,}" for t in tokens) + " tokens")
    return ", ".join(parts) or "none"


def budget_text(budget) -> str:
    """Calibration's `timing_budget` in words: the budget, the seconds the trials took and the trials it cut."""
    budget = _plain(budget)
    text = f"budget {budget['seconds']:g} s, took {budget['spent']:.1f} s"
    return text + ("; cut: " + "; ".join(budget["cut"]) if budget["cut"] else "; none cut")


def batches_text(config: TideConfig) -> str:
    """What a plain `generate` on a batch runs with these routers' calibrated defaults: 'exit mode for batches' or
    'the base model for batches' (no exit, or exits that calibration timed no faster on a batch)."""
    exits = config.resolve_generation().has_operating_point and config.generation_config.batch_exits
    return "exit mode for batches" if exits else "the base model for batches"


def loop_extras_text(costs) -> str:
    """'generate's own work +2.64 layer a base token, +8.54 layer a lossless cycle' from measured costs (a
    `CostsRecord` or `StepCosts.as_dict()`; '' where not measured, as in repos calibrated before it was)."""
    costs = _plain(costs)
    if not costs.get("step_extra_s") and not costs.get("cycle_extra_s"):
        return ""
    return (f"generate's own work +{costs['step_extra']:.2f} layer a base token, +{costs['cycle_extra']:.2f} layer a "
            "lossless cycle")


def verify_extras_text(costs) -> str:
    """'verifying 2 / 3 / 4 positions instead of 1: +0.1 / +0.3 / +2.0 layer' from measured costs (a `CostsRecord`
    or `StepCosts.as_dict()`, also as saved in a router repo, where the keys are strings; older repos hold only
    the 4 and 8 positions)."""
    costs = _plain(costs)
    extras = {int(p): v for p, v in (costs.get("verify_extras") or {}).items()}
    if not extras and "verify_extra" in costs:
        narrow, wide = _OLDER_VERIFY_POINTS
        extras = {narrow: costs["verify_extra"], wide: costs.get("wide_verify_extra", float("nan"))}
    if not extras:
        return ""
    points = sorted(extras)
    return (f"verifying {' / '.join(map(str, points))} positions instead of 1: "
            + " / ".join(f"+{extras[p]:.2f}" for p in points) + " layer")


def _record(config: TideConfig) -> CalibrationRecord | None:
    return CalibrationRecord.from_dict(config.calibration) if config.calibration else None


# ---------------------------------------------------------------------- the calibration table
def calibration_table(config: TideConfig) -> str:
    """A readable summary of a calibration: thresholds, exits, dropped checkpoints, measured costs, drafts."""
    cal = _record(config)
    lines = ["checkpoint  threshold  label rate  exit rate  agreement of exits"]
    for layer, row in (cal.checkpoints if cal else {}).items():
        agreement = "n/a" if row.heldout_agreement is None else f"{row.heldout_agreement:.3f}"
        lines.append(f"{layer:>10}  {row.threshold:9.4f}  {row.label_rate:10.3f}  {row.exit_rate:9.3f}  "
                     f"{agreement:>18}")
    if cal is None:
        return "\n".join(lines)
    active = [k for k, t in (config.thresholds or {}).items() if t < 1.0]
    lines.append(f"exit head: {cal.exit_head or 'lens'}; active checkpoints (consulted): {', '.join(active) or 'none'}")
    for layer, why in (cal.dropped_checkpoints or {}).items():
        lines.append(f"  checkpoint {layer} dropped: {why}")
    lines.append(f"expected agreement {cal.expected_agreement:.4f} (lower bound {cal.agreement_lower_bound or 0:.4f}), "
                 f"mean layers {cal.expected_mean_layers:.2f} of {config.base_num_layers} "
                 f"(oracle {cal.oracle_mean_layers:.2f})")
    costs = cal.costs
    if costs:
        lines.append(f"measured on {costs.device}: a consulted checkpoint costs {costs.checkpoint:.2f} layer, "
                     f"a skipped layer's K/V {costs.skipped_layer:.2f} layer, the head {costs.head:.2f} layer"
                     + "".join(f", {text}" for text in (verify_extras_text(costs), loop_extras_text(costs)) if text))
        lines.append(f"expected cost per token {cal.expected_layer_cost:.2f} layers -> "
                     f"x{config.base_num_layers / cal.expected_layer_cost:.3f} in layer work")
    if cal.exit_timing:
        lines.append(f"exit mode at these thresholds: {exit_timing_text(cal.exit_timing)}")
    draft = cal.draft_selection
    if draft:
        for trial in draft.trials:
            lines.append(f"lossless {draft_scheme_text(trial)}: estimated x{trial.estimate:.3f}, {timings_text(trial)}")
        for scheme in draft.untimed:
            lines.append(f"lossless {draft_scheme_text(scheme)}: estimated x{scheme.estimate:.3f}, not timed "
                         "(too slow by the measured costs)")
        if draft.ngram_only:
            lines.append(f"no head scheme pays; n-gram drafts alone (plain steps elsewhere): "
                         f"{timings_text(draft.ngram_only)}, " + ("kept" if draft.ngram_only.active else "not kept"))
        if draft.ngram:
            drafts = (f"n-gram branches up to {draft.ngram.max_draft} deep" if draft.ngram.max_draft
                      else "n-gram drafts")
            lines.append(f"the chosen scheme with {drafts} (draft_ngram={draft.ngram.draft_ngram}): "
                         f"{timings_text(draft.ngram)}, "
                         + ("kept" if draft.ngram.active else "slower than the scheme alone, not kept"))
        generation = config.generation_config
        lines.append(f"lossless mode: {draft_scheme_text(generation)}" if generation.max_draft
                     else "lossless mode: no draft pays on this model and machine (it decodes plainly)")
        lines.append("default mode: " + (f"auto (lossless, measured faster than exit mode; {batches_text(config)})"
                                         if generation.mode == "auto" else "exit"))
    if cal.compiled_timing:
        lines.append(f"default mode compiled: {compiled_timing_text(cal.compiled_timing)}")
    if cal.compiled_chains:
        lines.append("chains compiled: " + compiled_chains_text(cal.compiled_chains,
                                                               config.generation_config.compiled_chain))
    if cal.phase_seconds:
        lines.append(f"calibration took {phases_text(cal.phase_seconds)}")
    if cal.processes > 1:
        lines.append(f"on {cal.processes} processes, each one's share: {work_text(cal.work_per_rank)}")
    if cal.timing_budget:
        lines.append(f"timing trials: {budget_text(cal.timing_budget)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the model card
def model_card(config: TideConfig, custom_generate: bool = True) -> str:
    """The router repo's README.md: what the routers are, what calibration found, how to use and reproduce them;
    `custom_generate`: the repo holds `custom_generate/generate.py`, and the card shows it in use too."""
    base = config.base_model_name_or_path or "(unnamed base model)"
    cal = _record(config)
    lines = [
        f"# Tide routers for {base}",
        "",
        "Learned per-token early-exit routers for use with [Tide](https://pypi.org/project/tide-transformers/). "
        "This repo holds only the routers and their configuration; the base model is loaded from its own repo.",
        "",
        f"- Base model: `{base}` ({config.base_model_type}, {config.base_num_layers} layers, "
        f"hidden {config.base_hidden_size})",
        f"- Checkpoints (0-based layer indices): {config.resolve_checkpoints()}",
        f"- Router: hidden -> {config.router_hidden_size} -> 1, label rule `{config.label}`",
        f"- Exit head: `{config.exit_head}`" + (f" (rank {config.exit_head_rank})" if config.exit_head_rank else "")
        + (" (a learned affine map per checkpoint before the model's own final norm and head)"
           if config.exit_head == "tuned" else
           " (the model's own final norm and head on the raw state)"),
        f"- Draft head: `{config.draft_head}`{_draft_head_text(config)}",
        f"- Quality target: top-1 agreement >= {config.target_agreement} with confidence {config.confidence}",
    ]
    if cal:
        lines += _calibration_lines(config, cal)
    lines += [
        "",
        "## Use",
        "```python",
        "import tide",
        "from transformers import AutoTokenizer",
        "model = tide.TideForCausalLM.from_pretrained(\"<this repo>\")",
        f"tok = AutoTokenizer.from_pretrained(\"{base}\")",
        "out = model.generate(**tok(\"Hello\", return_tensors=\"pt\"), max_new_tokens=32)",
        "```",
        "",
        *(_custom_generate_lines(base) if custom_generate else []),
        "## Reproduce",
        "```python",
        "import tide",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"base = AutoModelForCausalLM.from_pretrained(\"{base}\")",
        f"tok = AutoTokenizer.from_pretrained(\"{base}\")",
        f"model = tide.calibrate(base, tok, dataset={cal.dataset if cal else None!r}, "
        f"num_samples={cal.num_samples if cal else None},",
        f"                       config=tide.TideConfig(checkpoint_layers={config.resolve_checkpoints()}, "
        f"target_agreement={config.target_agreement}, label={config.label!r}))",
        "model.save_pretrained(\"routers\")",
        "```",
        "",
    ]
    data = ModelCardData(library_name="tide-transformers", base_model=config.base_model_name_or_path or None,
                         tags=["tide", "early-exit"] + (["custom_generate"] if custom_generate else []))
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n" + "\n".join(lines)))


def _custom_generate_lines(base: str) -> list[str]:
    """The card's second way of use: the base model's own `generate` with this repo as its `custom_generate`."""
    return [
        "Or, with `tide-transformers` installed, from the base model itself (the repo's `custom_generate/generate.py` "
        "loads the routers onto it once and runs Tide's decoding; `tide_config={...}` sets a call's options):",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline",
        f"base = AutoModelForCausalLM.from_pretrained(\"{base}\")",
        f"tok = AutoTokenizer.from_pretrained(\"{base}\")",
        "out = base.generate(**tok(\"Hello\", return_tensors=\"pt\"), max_new_tokens=32,",
        "                    custom_generate=\"<this repo>\", trust_remote_code=True)",
        "text = pipeline(\"text-generation\", model=base, tokenizer=tok)(\"Hello\", custom_generate=\"<this repo>\",",
        "                                                               trust_remote_code=True)",
        "```",
        "",
    ]


def _calibration_lines(config: TideConfig, cal: CalibrationRecord) -> list[str]:
    """The model card's account of a calibration: data, per-checkpoint results, costs, timings, drafts."""
    lines = [
        f"- Calibration data: `{cal.dataset}`, {cal.num_samples} samples, "
        f"{cal.train_tokens} training tokens, {cal.heldout_tokens} held-out tokens",
        "",
        "| checkpoint | threshold | label rate | held-out agreement of exits | expected exit rate |",
        "|---|---|---|---|---|",
    ]
    for layer, row in cal.checkpoints.items():
        lines.append(f"| {layer} | {(config.thresholds or {}).get(str(layer), 1.0):.4f} | {row.label_rate:.3f} | "
                     f"{_fmt(row.heldout_agreement)} | {row.exit_rate:.3f} |")
    lines += ["", f"Expected overall held-out top-1 agreement: {_fmt(cal.expected_agreement)}; "
              f"expected mean layers per token: {_fmt(cal.expected_mean_layers)}."]
    for layer, why in (cal.dropped_checkpoints or {}).items():
        lines.append(f"Checkpoint {layer} is not consulted: {why}.")
    if cal.costs:
        lines.append(f"Costs measured on {cal.costs.device} at calibration: a consulted checkpoint "
                     f"{cal.costs.checkpoint:.2f} decoder layer, "
                     f"a skipped layer's K/V {cal.costs.skipped_layer:.2f} layer.")
    if cal.exit_timing:
        lines.append(f"Exit mode at these thresholds, at calibration: {exit_timing_text(cal.exit_timing)}.")
    generation = config.generation_config
    if generation.draft_layer is not None or (generation.max_draft and not generation.head_drafts):
        lines.append(f"Lossless mode: {draft_scheme_text(generation)}.")
    elif cal.draft_selection and cal.draft_selection.trials and not generation.max_draft:
        lines.append("Lossless mode: no drafting scheme timed faster than the base model at calibration; it runs the "
                     "base model.")
    elif cal.draft_selection and cal.draft_selection.untimed and not generation.max_draft:
        best = max(scheme.estimate for scheme in cal.draft_selection.untimed)
        lines.append(f"Lossless mode: the measured costs estimated every drafting scheme too slow to time (the best "
                     f"at x{best:.3f} of the base model); it runs the base model.")
    if generation.mode == "auto":
        lines.append(f"Default mode: `auto` (lossless, timed faster than exit mode at calibration; "
                     f"{batches_text(config)}).")
    if cal.phase_seconds:
        lines.append(f"Calibration took {phases_text(cal.phase_seconds)} (seconds per phase, main process).")
    if cal.processes > 1:
        lines.append(f"Calibrated on {cal.processes} processes; each one's share: {work_text(cal.work_per_rank)}.")
    if cal.timing_budget:
        lines.append(f"Timing trials, capped by `timing_budget_s`: {budget_text(cal.timing_budget)}.")
    if cal.compiled_timing:
        lines.append(f"The default mode compiled (`tide_config={{\"compile\": True}}`), at calibration: "
                     f"{compiled_timing_text(cal.compiled_timing)}.")
    if cal.compiled_chains:
        lines.append("Greedy chains compiled, each cycle one graph, at calibration: "
                     f"{compiled_chains_text(cal.compiled_chains, generation.compiled_chain)}.")
    return lines


def _draft_head_text(config: TideConfig) -> str:
    if config.draft_head != "context":
        return " (lossless drafts from the exit heads)"
    term = f" plus a two-layer term of width {config.draft_head_mlp}" if config.draft_head_mlp else ""
    return (f" (layers {config.draft_head_layers()}: affine in the token's state there and the full model's state at "
            f"the position before it{term})")


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"
