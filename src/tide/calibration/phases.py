"""What every phase of a calibration shares: `Context` (the model, tokenizer, options and processes), the phase
clock (`PhaseTimes`: each phase's seconds, for the record) and the timing trials' budget (`TrialBudget`)."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

from ..config import TideConfig
from ..modeling import TideForCausalLM
from .distributed import Processes
from .options import CalibrationOptions

__all__ = ["Context", "PhaseTimes", "TrialBudget", "AUTO_TRIAL_SHARE", "AUTO_TRIAL_FLOOR_S"]


class PhaseTimes:
    """Seconds spent in each phase of a calibration, in this process: `with phases("training"): ...`, and
    `phases.counted("data", batches)` for the time an iterator spends making its items (reading, tokenising)."""

    NAMES = ("data", "generation", "training", "held-out scoring", "thresholds", "decode validation",
             "cost measurement", "timing trials")

    def __init__(self):
        self.seconds = dict.fromkeys(self.NAMES, 0.0)
        self._since = {}  # {phase: start} of the phases under way

    @contextmanager
    def __call__(self, name: str):
        outer = name not in self._since  # a phase entered again inside itself is counted once, by the outer entry
        if outer:
            self._since[name] = time.perf_counter()
        try:
            yield
        finally:
            if outer:
                self.seconds[name] += time.perf_counter() - self._since.pop(name)

    def elapsed(self, name: str) -> float:
        """Seconds spent in `name` so far, the part under way included."""
        since = self._since.get(name)
        return self.seconds[name] + (time.perf_counter() - since if since is not None else 0.0)

    def counted(self, name: str, items):
        items = iter(items)
        while True:
            with self(name):
                item = next(items, _DONE)
            if item is _DONE:
                return
            yield item

    def rounded(self) -> dict:
        return {name: round(seconds, 2) for name, seconds in self.seconds.items()}


_DONE = object()

AUTO_TRIAL_SHARE = 1 / 3  # "auto" budget: of the other phases' seconds (so the trials take a quarter of the whole)
AUTO_TRIAL_FLOOR_S = 30.0  # "auto" budget: at least this, so that a fast calibration still times its best scheme


class TrialBudget:
    """`timing_budget_s`: a timing trial starts only while the timing trials have taken less than `seconds`, and
    the drafting schemes' first timings only while room for them and a confirmation is left (`left`,
    `trials.choose_draft`); `cut` names the trials that did not start. Decided on the main process (it times).
    "auto": `AUTO_TRIAL_SHARE` of the seconds the other phases have taken so far, at least `AUTO_TRIAL_FLOOR_S`."""

    def __init__(self, budget: float | str | None, phases: PhaseTimes):
        self.budget, self.phases, self.cut = budget, phases, []

    @property
    def seconds(self) -> float | None:
        if self.budget != "auto":
            return self.budget
        others = sum(self.phases.elapsed(name) for name in self.phases.NAMES if name != "timing trials")
        return max(AUTO_TRIAL_FLOOR_S, AUTO_TRIAL_SHARE * others)

    def left(self) -> float:
        """The seconds the budget has left (negative once overrun; infinite without a budget)."""
        seconds = self.seconds
        return math.inf if seconds is None else seconds - self.phases.elapsed("timing trials")

    def spent(self) -> bool:
        return self.left() <= 0

    def allows(self, trial: str) -> bool:
        """False (and `trial` recorded as cut) once the budget is spent."""
        if self.spent():
            self.cut.append(trial)
            return False
        return True


@dataclass
class Context:
    """What every phase of one calibration reads: the model it calibrates, the tokenizer, the options, the
    processes (one, or those `accelerate launch` started: each takes a shard), the phase clock and the timing
    trials' budget."""

    tide: TideForCausalLM
    tokenizer: object
    opts: CalibrationOptions
    procs: Processes
    phases: PhaseTimes
    budget: TrialBudget

    @classmethod
    def start(cls, tide: TideForCausalLM, tokenizer, opts: CalibrationOptions) -> "Context":
        """A new calibration of `tide`: its processes, a fresh phase clock and `opts.timing_budget_s`."""
        phases = PhaseTimes()
        return cls(tide, tokenizer, opts, Processes.current(tide.base.device, opts.pin_cores), phases,
                   TrialBudget(opts.timing_budget_s, phases))

    @property
    def cfg(self) -> TideConfig:
        return self.tide.config

    @property
    def num_layers(self) -> int:
        return self.tide.parts.num_layers
