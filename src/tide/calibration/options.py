"""`tide.calibrate`'s options: `CalibrationOptions`, checked when made, and the keyword arguments that set them."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = ["CalibrationOptions", "options_from", "FEATURE_DTYPES"]

FEATURE_DTYPES = ("auto", "bfloat16", "float16", "float32")  # `feature_dtype`'s values, besides None


@dataclass
class CalibrationOptions:
    num_samples: int = 512
    # the training stream's budget in tokens (a conversation's answer positions; a plain text's tokens): the first
    # shuffled training texts that hold it are read. "auto": `num_samples` x `max_length`, what as many plain texts
    # of the longest length hold (conversations are read in windows of `max_length`, so a few hold as much); None:
    # every training text
    train_tokens: int | str | None = "auto"
    max_length: int = 256
    batch_size: int = 8
    heldout_fraction: float = 0.2
    # with a training budget (`train_tokens`), the held-out texts' positions are cut in proportion to it, and to at
    # most this many (None: in proportion alone). Scoring them cost SmolLM2-135M as much a token as training did, and
    # at 16,384 a checkpoint where a third of them exit and 0.995 agree bounds that agreement to within 0.002 (95%),
    # while the check through the decode step that decides the target reads 1,024
    heldout_tokens: int | None = 16384
    # training tokens kept for minibatches, over all processes (None: up to 32768 within ~1 GiB)
    buffer_size: int | None = None
    minibatch: int = 256
    # the dtype of the base model's forward passes over the training stream: "bfloat16" or "float16" run them on a
    # half-precision copy of the weights (kept for the training pass; on a CPU with bfloat16 matrix instructions it
    # read SmolLM2-135M's text 2.4x faster than float32; with bfloat16 the heads' steps take their products in it too,
    # under autocast), while the heads and routers keep float32 weights and optimizer state, and
    # held-out scoring, costs and trials run the model as given; None: the model's own dtype; "auto": bfloat16 where
    # the model is float32, of hidden size 512 or more, and its matrix products time at least 1.5x faster in
    # bfloat16 here (`forward.stream_dtype`), else the model's own
    feature_dtype: str | None = "auto"
    # Adam steps of the exit and draft heads, spread over the training stream (None: HEAD_STEPS[candidate loss],
    # 200 over the whole vocabulary, 1000 over candidates, whose steps cost far less, or HEAD_PASSES[candidate loss]
    # minibatches' rows a training token where that is more: 3 over candidates, 0.5 over the whole vocabulary)
    head_steps: int | None = None
    head_lr: float = 1e-3
    # training-time test: the share of the draft heads' rows trained on the context a chain's later drafts read (the
    # head's own draft at the position before) instead of the full model's state there (0: never). On SmolLM2-135M at
    # the defaults, 0.5 raised the layer-3 head's later drafts' held-out top-1 from 0.257 to 0.298 and lowered its
    # first drafts' from 0.354 to 0.339 (docs/benchmarks.md): no more tokens a chain's cycle by their product, and
    # fewer for the trees calibration keeps there, so it is off by default
    training_time_test: float = 0.0
    passes: int = 4  # router training sweeps over the buffered tokens, after the exit heads are trained
    lr: float = 1e-3  # router learning rate
    seed: int = 0
    measure_costs: bool = True  # time checkpoints and layers here; drop checkpoints that do not pay; pick drafts
    validation_tokens: int = 1024  # held-out tokens decoded through the decode step to check the target (0: skip)
    draft_trials: int = 3  # lossless drafting schemes timed against the base model (best estimates first; 0: skip)
    compiled_trials: bool = False  # also time the kept mode compiled against the base model's compiled decode
    # the CPU threads decoding will run on: costs, the decode check and the timing trials run with that many (what a
    # scheme costs against a base step depends on it), training and held-out scoring with the process's own; None:
    # the process's own throughout
    decode_threads: int | None = None
    # several CPU processes on one machine (`accelerate launch --cpu`): each takes its own share of the cores
    # (`distributed.Processes.pin_to_own_cores`); False leaves the launcher's affinity as it is
    pin_cores: bool = True
    # cap on the timing trials' seconds, later trials cut: "auto" (a third of the other phases' seconds, at least
    # AUTO_TRIAL_FLOOR_S: a quarter of the calibration), a number, or None (no cap)
    timing_budget_s: float | str | None = "auto"
    prompt_new_tokens: int = 128  # with `prompts`: tokens the base model writes after each prompt
    # with `prompts`: sampled continuations of each prompt, besides the greedy one (6 rather than 2 raised SmolLM2's
    # held-out draft top-1 from 0.31-0.33 to 0.34-0.35: docs/benchmarks.md)
    prompt_samples: int = 6
    prompt_chat: bool | None = None  # with `prompts`: strings go through the chat template (None: where there is one)
    progress: bool = True

    @property
    def train_budget(self) -> int | None:
        """`train_tokens` as a number of tokens (None: every training text)."""
        return self.num_samples * self.max_length if self.train_tokens == "auto" else self.train_tokens

    def __post_init__(self):
        for name in ("num_samples", "max_length", "batch_size", "minibatch", "head_steps", "passes",
                     "validation_tokens", "draft_trials", "seed"):
            value = getattr(self, name)
            if name == "head_steps" and value is None:
                continue
            minimum = 1 if name in ("num_samples", "max_length", "batch_size", "minibatch") else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"calibrate: {name} must be an integer >= {minimum}, got {value!r}.")
        tokens = self.train_tokens
        if tokens not in (None, "auto") and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f"calibrate: train_tokens must be a positive integer, \"auto\" or None, got "
                             f"{self.train_tokens!r}.")
        for name in ("decode_threads", "buffer_size", "heldout_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"calibrate: {name} must be a positive integer or None, got {value!r}.")
        if not isinstance(self.heldout_fraction, (int, float)) or not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"calibrate: heldout_fraction must be between 0 and 1 (exclusive), "
                             f"got {self.heldout_fraction!r}.")
        budget = self.timing_budget_s
        if budget is not None and budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                                         or not math.isfinite(budget) or budget < 0):
            raise ValueError(f"calibrate: timing_budget_s must be \"auto\", a finite number >= 0 or None, "
                             f"got {budget!r}.")
        if self.feature_dtype is not None and self.feature_dtype not in FEATURE_DTYPES:
            raise ValueError(f"calibrate: feature_dtype must be one of {list(FEATURE_DTYPES)} or None, "
                             f"got {self.feature_dtype!r}.")
        share = self.training_time_test
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ValueError(f"calibrate: training_time_test must be a share between 0 and 1, got {share!r}.")
        for name in ("head_lr", "lr"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0.0:
                raise ValueError(f"calibrate: {name} must be a positive number, got {value!r}.")


def options_from(options: dict) -> CalibrationOptions:
    """`CalibrationOptions` from `calibrate`'s extra keyword arguments (an unknown one is an error that lists them)."""
    known = {f.name for f in fields(CalibrationOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"calibrate: unknown option(s) {unknown}; the options are {sorted(known)}.")
    return CalibrationOptions(**options)
