"""Exit mode's operating point for an agreement target (`operating_point`): thresholds selected on the held-out
scores with checkpoints pruned by the measured costs, the check through the decode step (`validation`), then exit
mode timed against the base model (`trials.time_exit`). The held-out scores stay on the model, in memory
(`_HeldoutSelection`), so that other targets can be selected later in the same process (`thresholds_for_target`,
`tide bench`). Calibration's phases here: cost measurement (`cost_measurement`, which also prepares what the check
and the timing trials read) and threshold selection for the configured target (`choose_thresholds`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .costs import layer_cost_of_cascade, prune_checkpoints
from .distributed import Processes
from .heldout import Heldout
from .measure import measure_costs
from .phases import Context, PhaseTimes, TrialBudget
from .texts import Texts
from .thresholds import calibrate_cascade, kept_nothing_message
from .trials import time_exit, timing_batch, timing_prompts
from .validation import SavesTooLittle, validate, validation_tokens

__all__ = ["operating_point", "OperatingPoint", "thresholds_for_target", "Measured", "cost_measurement",
           "choose_thresholds"]


@dataclass
class Measured:
    """What cost measurement leaves for the later phases."""

    costs: object  # StepCosts, or None (`measure_costs=False`: no checkpoint pruned, no drafting scheme timed)
    validation_tokens: list | None  # this process's held-out token lists for the check through the decode step
    prompts: list | None  # prompts that time exit mode (and the other modes) against the base model
    batch: torch.Tensor | None  # [rows, T] one batch that times exit mode on several sequences


def cost_measurement(ctx: Context, texts: Texts) -> Measured:
    """Time a decode step's pieces (main process), and prepare what the check and the timing trials read."""
    tide, opts, procs, device = ctx.tide, ctx.opts, ctx.procs, ctx.tide.base.device
    with ctx.phases("cost measurement"):
        costs = procs.on_main(lambda: measure_costs(tide) if opts.measure_costs else None)
    with ctx.phases("data"):
        # this process's share of the token lists one process would check, balanced by length (possibly none,
        # but every process takes part in the check when there are any)
        tokens = validation_tokens(texts.all_held, ctx.tokenizer, opts) if opts.validation_tokens else None
        checked = procs.shard_by_size(tokens, [len(ids) for ids in tokens]) if tokens else None
        timed = costs is not None
        prompts = (timing_prompts(ctx.tokenizer, texts.timing_texts or texts.all_held, device,
                                  whole=texts.timing_texts is not None) if timed else None)
        batch = timing_batch(ctx.tokenizer, texts.all_held, device) if timed else None
    return Measured(costs, checked, prompts, batch)


def choose_thresholds(ctx: Context, held: Heldout, measured: Measured, heldout_texts: int) -> "OperatingPoint":
    """Exit mode's thresholds for the target: selection, the check through the decode step, timing. The held-out
    scores stay on the model (`heldout_selection`); `heldout_texts` (all processes') goes into the warning where
    nothing exits."""
    tide, cfg = ctx.tide, ctx.cfg
    layers = cfg.generation_config.consulted_checkpoints(tide.checkpoints)
    tide.heldout_selection = _HeldoutSelection(layers, held.scores(), held.agree(), held.labels(), held.num_tokens,
                                               ctx.num_layers, cfg.confidence, measured.costs,
                                               measured.validation_tokens, measured.prompts, measured.batch)
    point = operating_point(tide, cfg.target_agreement, ctx.procs, ctx.phases, ctx.budget)
    cfg.thresholds = point.thresholds
    saving = [why for why in point.dropped.values() if isinstance(why, SavesTooLittle)]
    if saving:  # exits that pay too little: not checked further, nor timed
        warnings.warn(f"Calibration kept no exits: {saving[0]}; exit mode runs the base model.", stacklevel=3)
    elif point.selection.exit_error_budget == 0.0:  # no threshold held the bound on these held-out tokens
        warnings.warn(kept_nothing_message(layers, held.scores(), held.agree(), held.labels(), cfg.target_agreement,
                                           cfg.confidence, heldout_texts, ctx.opts.heldout_fraction))
    cfg.set_generation_defaults(batch_exits=point.batch_exits)
    return point


@dataclass
class _HeldoutSelection:
    """Held-out scores of a calibration, kept in memory (never saved) to select thresholds for other targets."""

    layers: list[int]
    scores: dict
    agree: dict
    labels: dict
    num_tokens: int
    num_layers: int
    confidence: float
    costs: object  # StepCosts or None

    validation_tokens: list | None = None  # this process's held-out token lists for the check through the decode
    # step (None: no check)
    timing_prompts: list | None = None  # prompts that time exit mode against the base model
    timing_batch: torch.Tensor | None = None  # [rows, T] one batch that times it on several sequences
    decoded_per_rank: list | None = None  # tokens each process decoded in the last check through the decode step

    def select(self, target: float, max_budget: float = 1.0):
        """(CascadeSelection, dropped checkpoints {layer: reason}) for `target` agreement."""

        def select(active):
            return calibrate_cascade(active, self.scores, self.agree, self.labels, target, self.confidence, max_budget)

        if self.costs is None:
            return select(self.layers), {}
        return prune_checkpoints(select, self.layers, self.num_tokens, self.num_layers, self.costs)

    def expected_speedup(self, selection) -> float | None:
        """The selection's speed-up in layer work by the measured costs (None: no costs)."""
        if self.costs is None:
            return None
        return self.num_layers / self._layer_cost(selection)

    def step_speedup(self, selection, mean_layers: float | None = None) -> float | None:
        """The selection's speed-up of a whole decode step, by the measured costs: its exits' layer work
        (`_layer_cost`), beside what every step pays whether or not a token exits (the head, the capture,
        `generate`'s own work). What a timing's keep margin compares (None: no costs)."""
        if self.costs is None:
            return None
        fixed = self.costs.step_fixed
        return (self.num_layers + fixed) / (self._layer_cost(selection, mean_layers) + fixed)

    def _layer_cost(self, selection, mean_layers: float | None = None) -> float:
        """A token's layer work under the selection, in layers: on the held-out scores, or (`mean_layers`) of exits
        that ran that many layers a token through the decode step, every token paying for consulting the active
        checkpoints and the skipped layers' K/V."""
        if mean_layers is None:
            return layer_cost_of_cascade(selection.checkpoints, self.num_tokens, self.num_layers, self.costs)
        consulted = sum(row.threshold < 1.0 for row in selection.checkpoints)
        return (mean_layers + (self.num_layers - mean_layers) * self.costs.skipped_layer
                + consulted * self.costs.checkpoint)

    @staticmethod
    def thresholds(selection, checkpoints) -> dict[str, float]:
        out = {str(k): 1.0 for k in checkpoints}  # never: not consulted
        out.update({str(r.layer): r.threshold for r in selection.checkpoints})
        return out


def thresholds_for_target(model, target_agreement: float) -> dict[str, float] | None:
    """Thresholds for another agreement target, chosen as calibration chooses them (`operating_point`), from
    the held-out scores of a calibration run in this process (None if the model was not calibrated here)."""
    if getattr(model, "heldout_selection", None) is None:
        return None
    return operating_point(model, target_agreement).thresholds


@dataclass
class OperatingPoint:
    """Exit-mode thresholds for one agreement target, and how calibration arrived at them."""

    target: float
    thresholds: dict  # {checkpoint: threshold}; all 1.0 when exit mode runs the base model
    selection: object  # the held-out CascadeSelection (before timing)
    dropped: dict  # {layer: why} checkpoints that cost more than they save
    validation: dict | None  # the check through the decode step (None: skipped or nothing exits)
    exit_timing: dict | None  # {"measured": ratio to the base model, "active": kept} (None: not timed)
    expected_speedup: float | None  # the selection's layer speed-up by the measured costs (None: no costs)

    @property
    def exits(self) -> bool:
        return any(t < 1.0 for t in self.thresholds.values())

    @property
    def batch_exits(self) -> bool:
        """False when the exits were timed no faster than the base model on a batch (batches then run it)."""
        return ((self.exit_timing or {}).get("batch") or {}).get("active", True)


def operating_point(model, target_agreement: float, procs: Processes | None = None,
                    phases: PhaseTimes | None = None, budget: TrialBudget | None = None) -> OperatingPoint:
    """Thresholds for `target_agreement` from the held-out scores of a calibration run in this process:
    selection with checkpoints pruned by measured cost, the check through the decode step, then exit mode
    timed against the base model here (`trials.time_exit`); exits not kept by two timings are turned off, so that exit
    mode runs the base model (never slower), and `batch_exits` says whether exits kept for one sequence paid on a
    batch. Calibration's own target goes through this, and so do `tide bench`'s rows."""
    held = getattr(model, "heldout_selection", None)
    if held is None:
        raise ValueError("operating_point needs a model calibrated in this process (tide.calibrate keeps its "
                         "held-out scores in memory; a loaded router repo does not have them).")
    procs, phases = procs or Processes(), phases or PhaseTimes()
    budget = budget or TrialBudget(None, phases)
    with phases("thresholds"):
        selection, dropped = held.select(target_agreement)
    validation = None
    if held.validation_tokens is not None:
        with phases("decode validation"):
            selection, dropped, validation = validate(model, held.validation_tokens, selection, dropped,
                                                      target_agreement, procs)
    thresholds = held.thresholds(selection, model.checkpoints)
    exit_timing = None
    if held.timing_prompts is not None and any(t < 1.0 for t in thresholds.values()):
        with phases("timing trials"):
            exit_timing = procs.on_main(lambda: time_exit(model, held.timing_prompts, held.timing_batch, thresholds)
                                        if budget.allows("exit mode") else None)
        if exit_timing is not None and not exit_timing["active"]:
            thresholds = dict.fromkeys(thresholds, 1.0)  # exit mode then runs the base model
    return OperatingPoint(target_agreement, thresholds, selection, dropped, validation, exit_timing,
                          held.expected_speedup(selection))

