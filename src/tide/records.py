"""What a calibration recorded, as typed records: per checkpoint, the measured costs, timings, the draft selection,
the check through the decode step, and the whole summary (`CalibrationRecord`).

`TideConfig.calibration` keeps the saved description (the dict in config.json). `CalibrationRecord.from_dict`
reads it, older layouts included (a field a repo does not hold is None; keys a newer Tide wrote are ignored),
and `to_dict` writes the same layout back. `tide.calibrate` builds the record; the model card and the
calibration table (`hub/card.py`) read it.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
__all__ = ["CheckpointRecord", "CostsRecord", "Timing", "BatchTiming", "ExitTiming", "NgramTiming", "DraftRecord",
           "DraftSelection", "Validation", "TimingBudget", "CalibrationRecord", "as_record"]


class _Record:
    """`to_dict` / `from_dict` for a dataclass of plain values. `from_dict` ignores unknown keys and raises
    `KeyError` for a missing field that has no default; `to_dict` leaves out the fields in `OMIT_IF_NONE` that
    are None (keys older or other layouts do not hold)."""

    OMIT_IF_NONE: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in self.OMIT_IF_NONE:
                continue
            out[f.name] = value.to_dict() if isinstance(value, _Record) else value
        return out

    @classmethod
    def from_dict(cls, data: dict):
        kwargs = {}
        for f in fields(cls):
            if f.name in data:
                kwargs[f.name] = data[f.name]
            elif f.default is MISSING and f.default_factory is MISSING:
                raise KeyError(f.name)
        return cls(**kwargs)


def as_record(value, cls):
    """`value` as a `cls` record: a record is kept, a dict read with `cls.from_dict`, None stays None."""
    return value if value is None or isinstance(value, cls) else cls.from_dict(value)


@dataclass
class CheckpointRecord(_Record):
    """One checkpoint's held-out result (`thresholds.CheckpointCalibration`)."""

    label_rate: float  # held-out tokens whose label was positive here
    exit_rate: float  # held-out tokens that exit here in the cascade
    threshold: float | None = None
    heldout_agreement: float | None = None  # top-1 agreement of the tokens that exit here (None: none exit)
    exits: int | None = None
    errors: int | None = None  # exiting tokens whose top-1 differs from the full model's

    OMIT_IF_NONE = ("threshold", "exits", "errors")


@dataclass
class CostsRecord(_Record):
    """A decode step's measured costs as saved (`StepCosts.as_dict()`): seconds, and the same relative to one
    decoder layer. Older repos hold fewer fields (no `verify_extras`, no `generate` extras): those are None."""

    device: str | None = None
    layer_s: float | None = None
    checkpoint_s: float | None = None
    skipped_layer_s: float | None = None
    head_s: float | None = None
    capture_s: float | None = None
    verify_extra_s: dict | None = None  # {positions: seconds} a verification over p positions adds
    step_extra_s: float | None = None
    cycle_extra_s: float | None = None
    windowed: bool | None = None
    checkpoint: float | None = None
    skipped_layer: float | None = None
    head: float | None = None
    capture: float | None = None
    step_extra: float | None = None
    cycle_extra: float | None = None
    verify_extra: float | None = None
    wide_verify_extra: float | None = None
    verify_extras: dict | None = None  # {positions: layers}; keys are strings in a saved repo

    OMIT_IF_NONE = tuple(__annotations__)  # every field


@dataclass
class Timing(_Record):
    """A mode timed against a baseline on this machine (`trials.kept`): the lower timing, each timing, and
    whether it was kept. Older repos hold no `timings`."""

    measured: float
    active: bool
    timings: list[float] | None = None

    OMIT_IF_NONE = ("timings",)


@dataclass
class BatchTiming(Timing):
    """Exit mode timed on a batch of `rows` sequences."""

    rows: int = 0


@dataclass
class ExitTiming(Timing):
    """Exit mode at the calibrated thresholds against the base model; `batch`: also on a batch (where kept)."""

    batch: BatchTiming | None = None

    OMIT_IF_NONE = ("timings", "batch")

    @classmethod
    def from_dict(cls, data: dict) -> "ExitTiming":
        timing = super().from_dict(data)
        timing.batch = as_record(timing.batch, BatchTiming)
        return timing


@dataclass
class NgramTiming(Timing):
    """The chosen drafting scheme with n-gram drafts (`draft_ngram`) timed against the base model; a tree's
    n-gram branches went up to `max_draft` deep (None: a chain, whose continuations are up to its own length)."""

    draft_ngram: int = 0
    max_draft: int | None = None

    OMIT_IF_NONE = ("timings", "max_draft")


@dataclass
class DraftRecord(_Record):
    """A drafting scheme calibration estimated or timed (a trial, a cut one, or the chosen one)."""

    draft_layer: int | None  # None: n-gram drafts only
    max_draft: int  # a chain's length; a tree's n-gram branches' depth (1: a tree of head candidates only)
    draft_topk: int = 1  # > 1: one verification tree of this many head candidates
    estimate: float | None = None  # estimated speed-up (`costs.draft_candidates`)
    draft_vocab_size: int | None = None
    measured: float | None = None  # the timing (the lower one where timed twice)
    timings: list[float] | None = None
    draft_ngram: int | None = None  # > 0: n-gram drafts (a chain's alternative; a tree's branches)
    head_drafts: bool | None = None  # False: n-gram drafts only
    accepted_per_cycle: float | None = None  # drafts accepted a cycle in its timings (`decode/machinecheck.py`)
    verified_per_cycle: float | None = None  # positions a cycle verified in its timings (likewise)
    # what a cycle cost in base steps by the check's measurement, on the machine that timed it (likewise)
    cycle_steps: float | None = None

    OMIT_IF_NONE = ("estimate", "draft_vocab_size", "measured", "timings", "draft_ngram", "head_drafts",
                    "accepted_per_cycle", "verified_per_cycle", "cycle_steps")


@dataclass
class DraftSelection(_Record):
    """Lossless mode's drafting schemes timed at calibration (`trials.choose_draft`) and the one kept."""

    trials: list[DraftRecord] = field(default_factory=list)
    chosen: DraftRecord | None = None
    ngram: NgramTiming | None = None  # the chosen scheme with n-gram drafts
    ngram_only: Timing | None = None  # n-gram drafts alone, where no head scheme paid
    cut: list[DraftRecord] = field(default_factory=list)  # schemes the timing budget cut
    ngram_cut: bool = False  # the budget cut the n-gram timing
    unavailable: str | None = None  # why lossless mode cannot run here
    schemes_timed_per_rank: list[int] | None = None  # where processes shared the trials: the timings each made
    # schemes the trials would have timed, not timed: the measured costs estimated them below
    # `timing.MIN_TIMED_ESTIMATE` of the base model's speed
    untimed: list[DraftRecord] = field(default_factory=list)

    OMIT_IF_NONE = ("ngram", "ngram_only", "unavailable", "schemes_timed_per_rank")

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["trials"] = [t.to_dict() for t in self.trials]
        out["cut"] = [c.to_dict() for c in self.cut]
        out["untimed"] = [u.to_dict() for u in self.untimed]
        for key in ("cut", "ngram_cut", "untimed"):  # written only where set
            if not out[key]:
                del out[key]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "DraftSelection":
        selection = super().from_dict(data)
        selection.trials = [as_record(t, DraftRecord) for t in selection.trials]
        selection.cut = [as_record(c, DraftRecord) for c in selection.cut]
        selection.untimed = [as_record(u, DraftRecord) for u in selection.untimed]
        selection.chosen = as_record(selection.chosen, DraftRecord)
        selection.ngram = as_record(selection.ngram, NgramTiming)
        selection.ngram_only = as_record(selection.ngram_only, Timing)
        return selection


@dataclass
class Validation(_Record):
    """The check of the agreement target through the decode step (teacher-forced, summed over processes)."""

    agreement: float
    tokens: int
    lower_bound: float
    exit_error_budget: float
    mean_layers: float
    tokens_per_rank: list[int] | None = None  # tokens each process decoded, all rounds
    stopped_early: bool | None = None  # the last round stopped once it could no longer pass (True; else omitted)

    OMIT_IF_NONE = ("tokens_per_rank", "stopped_early")


@dataclass
class TimingBudget(_Record):
    """`timing_budget_s`: the budget, the seconds the timing trials took, and the trials it cut (in words)."""

    seconds: float
    spent: float
    cut: list[str] = field(default_factory=list)


# The summary's fields that hold records, and their types.
_NESTED = {"costs": CostsRecord, "draft_selection": DraftSelection, "exit_timing": ExitTiming,
           "compiled_timing": Timing, "decode_validation": Validation, "timing_budget": TimingBudget}


@dataclass
class CalibrationRecord(_Record):
    """A calibration's summary (`TideConfig.calibration`, see docs/router-repo-format.md)."""

    dataset: str | None = None
    num_samples: int | None = None
    train_tokens: int | None = None
    feature_dtype: str | None = None  # the training stream's forward dtype, where not the model's own
    heldout_tokens: int | None = None
    expected_agreement: float | None = None
    agreement_lower_bound: float | None = None
    exit_error_budget: float | None = None
    exit_head: str | None = None  # None: written before exit heads ("lens")
    expected_mean_layers: float | None = None
    oracle_mean_layers: float | None = None
    checkpoints: dict[str, CheckpointRecord] = field(default_factory=dict)  # keyed by layer, as a string
    router_auc: dict[str, float] | None = None
    # held-out first drafts whose top-1 is the full model's, {layer: {"0": over the whole vocabulary, "n": over the
    # n most-predicted tokens}} (the draft head where the checkpoint has one, else its exit head)
    draft_top1: dict[str, dict[str, float]] | None = None
    draft_chain_top1: dict[str, dict[str, float]] | None = None  # the same for a chain's later drafts
    costs: CostsRecord | None = None
    dropped_checkpoints: dict[str, str] = field(default_factory=dict)  # {layer: why it is not consulted}
    expected_layer_cost: float | None = None  # mean decoder layers per token by the measured costs
    draft_selection: DraftSelection | None = None
    exit_timing: ExitTiming | None = None
    compiled_timing: Timing | None = None  # the default mode compiled against the compiled base decode
    # greedy chains compiled against the compiled base decode: [{"chain": {...}, "measured", "timings", "active",
    #   "accepted_per_cycle", "verified_per_cycle", "cycle_steps"}]
    compiled_chains: list[dict] | None = None
    decode_validation: Validation | None = None
    phase_seconds: dict[str, float] | None = None  # {phase: seconds} on the main process
    # the processor and CPU threads costs, the decode check and the trials ran on (`decode.machinecheck.machine_name`)
    timing_machine: str | None = None
    work_per_rank: dict | None = None  # {"processes": n, phase: {"texts"/"tokens"/...: [per process]}}
    phase_seconds_per_rank: dict[str, list[float]] | None = None  # several processes only
    timing_budget: TimingBudget | None = None  # with `timing_budget_s` only

    OMIT_IF_NONE = ("phase_seconds_per_rank", "timing_budget", "compiled_chains", "draft_top1", "feature_dtype",
                    "draft_chain_top1")

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["checkpoints"] = {layer: row.to_dict() for layer, row in self.checkpoints.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "CalibrationRecord":
        record = super().from_dict(data)
        record.checkpoints = {str(k): as_record(row, CheckpointRecord) for k, row in record.checkpoints.items()}
        for name, kind in _NESTED.items():
            setattr(record, name, as_record(getattr(record, name), kind))
        return record

    @property
    def processes(self) -> int:
        """How many processes calibrated (1 where not recorded)."""
        return (self.work_per_rank or {}).get("processes", 1)
