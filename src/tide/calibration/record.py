"""What a calibration found, as saved in the config (`TideConfig.calibration`): `build_record` assembles the
`records.CalibrationRecord` from every phase's results (held-out summary, costs, the operating point, the draft
selection and the timings, phase seconds, each process's share of the work, what the timing budget cut)."""

from __future__ import annotations

import warnings

import torch

from ..hub.card import draft_scheme_text
from ..records import (
    CalibrationRecord,
    CheckpointRecord,
    DraftSelection,
    ExitTiming,
    Timing,
    TimingBudget,
    Validation,
    as_record,
)
from .costs import layer_cost_of_cascade
from .distributed import Processes
from .heldout import Heldout
from .operating import OperatingPoint
from .phases import Context, TrialBudget
from .texts import Texts
from .thresholds import CheckpointCalibration, auc, oracle_depth
from .trials import KEEP_SPEEDUP

__all__ = ["build_record"]


def build_record(ctx: Context, dataset: str, *, texts: Texts, trainer, held: Heldout, held_local: tuple[int, int],
                 costs, point: OperatingPoint, draft_selection: DraftSelection | None,
                 compiled_timing: Timing | None, compiled_chains: list[dict] | None = None,
                 timing_machine: str | None = None) -> CalibrationRecord:
    """What the calibration found, as saved in the config (`TideConfig.calibration`): `dataset` is the data in
    words, `trainer` the training phase's (its tokens and head-step rows), `held_local` this process's held-out
    (texts, tokens)."""
    procs, phases, budget, num_layers = ctx.procs, ctx.phases, ctx.budget, ctx.num_layers
    selection = point.selection
    train_tokens = int(procs.sum([trainer.train_tokens])[0])
    record = _summary(selection, held, ctx.cfg, num_layers, dataset, texts.num_texts, train_tokens)
    record.feature_dtype = trainer.feature_dtype
    record.costs = costs.record() if costs else None
    record.dropped_checkpoints = {str(k): why for k, why in point.dropped.items()}
    record.expected_layer_cost = layer_cost_of_cascade(selection.checkpoints, held.num_tokens, num_layers,
                                                       costs) if costs else None
    record.draft_selection = draft_selection
    record.exit_timing = as_record(point.exit_timing, ExitTiming)
    record.compiled_timing = compiled_timing
    record.compiled_chains = compiled_chains
    record.decode_validation = as_record(point.validation, Validation)
    record.phase_seconds = phases.rounded()
    record.timing_machine = timing_machine
    record.work_per_rank = _work_per_rank(procs, (len(texts.train_texts), trainer.train_tokens), held_local,
                                          getattr(ctx.tide.heldout_selection, "decoded_per_rank", None),
                                          trainer.head_rows)
    if procs.world > 1:
        per_rank = procs.per_rank(list(phases.seconds.values()))
        record.phase_seconds_per_rank = {name: [round(r[i], 2) for r in per_rank]
                                         for i, name in enumerate(phases.NAMES)}
    if budget.seconds is not None:
        record.timing_budget = TimingBudget(round(budget.seconds, 2),
                                            round(phases.seconds["timing trials"], 2),
                                            procs.broadcast(_cut_trials(budget, draft_selection)))
        if record.timing_budget.cut and procs.is_main:
            warnings.warn(f"Calibration's timing budget ({budget.seconds:.0f} s, timing_budget_s) cut "
                          f"{len(record.timing_budget.cut)} timing trials: {'; '.join(record.timing_budget.cut)}. "
                          "The repo keeps the fastest of those timed; pass timing_budget_s=None (or more seconds) "
                          "to time them all.", stacklevel=3)
    return record


def _summary(selection, held: Heldout, cfg, num_layers, dataset, num_samples, train_tokens) -> CalibrationRecord:
    """The held-out part of the record: data, per-checkpoint results, expected agreement and depth."""
    labels, chosen = held.labels(), {r.layer: r for r in selection.checkpoints}
    results = [chosen.get(k) or CheckpointCalibration(k, 1.0, float(labels[k].float().mean()), 0.0, None, 0, 0)
               for k in sorted(labels)]  # dropped checkpoints: never consulted
    agree = held.agree()
    exits = sum(r.exits for r in results)
    disagreements = sum(r.errors for r in results)
    total = held.num_tokens
    mean_layers = (sum(r.exits * (r.layer + 1) for r in results) + (total - exits) * num_layers) / max(total, 1)
    return CalibrationRecord(
        dataset=dataset,
        num_samples=num_samples,
        train_tokens=train_tokens,
        heldout_tokens=total,
        expected_agreement=1.0 - disagreements / max(total, 1),
        agreement_lower_bound=selection.agreement_bound,
        exit_error_budget=selection.exit_error_budget,
        exit_head=cfg.exit_head,
        expected_mean_layers=mean_layers,
        oracle_mean_layers=_oracle_mean_layers(agree, cfg.resolve_checkpoints(num_layers), num_layers),
        checkpoints={str(r.layer): CheckpointRecord(**r.as_dict()) for r in results},
        router_auc={str(k): auc(scores, agree[k]) for k, scores in held.scores().items()},
        draft_top1=_draft_top1(held),
        draft_chain_top1=_draft_top1(held, chained=True),
    )


def _draft_top1(held: Heldout, chained: bool = False) -> dict[str, dict[str, float]]:
    """{layer: {draft vocabulary size (0: the whole vocabulary): held-out first drafts (`chained`: a chain's later
    drafts, which read the previous draft's own state) whose top-1 is the full model's}}."""
    whole = held.chain_ranks() if chained else held.ranks()
    out = {str(k): {"0": round(float((ranks == 0).float().mean()), 4)} for k, ranks in whole.items()}
    for n, pair in sorted(held.restricted().items()):
        for k, ranks in pair[1 if chained else 0].items():
            out.setdefault(str(k), {})[str(n)] = round(float((ranks == 0).float().mean()), 4)
    return {k: out[k] for k in sorted(out, key=int)}


def _oracle_mean_layers(agree: dict[int, torch.Tensor], layers: list[int], num_layers: int) -> float:
    """Mean depth if every token left at the first checkpoint whose top-1 already matches the full model."""
    return float(oracle_depth(agree, layers, num_layers).mean())


def _cut_trials(budget: TrialBudget, draft: DraftSelection | None) -> list[str]:
    """The timing trials that `timing_budget_s` cut, in words, in the order they would have run."""
    draft = draft or DraftSelection()
    cut = [c for c in budget.cut if c == "exit mode"]
    cut += [f"lossless {draft_scheme_text(c)} (estimated x{c.estimate:.3f})" for c in draft.cut]
    if draft.chosen is None:  # timed faster once, not timed again: not kept
        cut += [f"second timing of lossless {draft_scheme_text(t)} (measured x{t.measured:.3f})"
                for t in draft.trials if t.timings is None and t.measured >= KEEP_SPEEDUP]
    if draft.ngram_cut:
        cut.append("the chosen scheme with n-gram drafts")
    return cut + [c for c in budget.cut if c != "exit mode"]


def _work_per_rank(procs: Processes, train: tuple[int, int], held: tuple[int, int], decoded: list[int] | None,
                   head_rows: int) -> dict:
    """Each process's share of the phases whose work grows with the data, in rank order: texts and tokens streamed
    for training and held-out scoring, rows of the exit and draft heads' minibatch steps, and tokens decoded in the
    check through the decode step (`decoded`: all its rounds, also where its last round left nothing to exit)."""
    mine = procs.per_rank([*train, *held, head_rows])
    out = {"processes": procs.world,
           "training": {"texts": [int(r[0]) for r in mine], "tokens": [int(r[1]) for r in mine],
                        "head_step_rows": [int(r[4]) for r in mine]},
           "held-out scoring": {"texts": [int(r[2]) for r in mine], "tokens": [int(r[3]) for r in mine]},
           "decode validation": {"tokens": decoded or [0] * procs.world}}
    return out
