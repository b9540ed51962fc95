"""Streaming router calibration: `tide.calibrate(model, tokenizer, dataset=..., config=...)`.

Pass 1 streams training batches: one base forward per batch (hooks capture the checkpoint layers'
outputs), labels computed on the fly, a bounded buffer per checkpoint, a few minibatch steps per batch.
Pass 2 streams held-out batches and keeps only (score, agree, label) scalars per token, then
`thresholds.calibrate_cascade` picks the thresholds. Memory is bounded by the batch and the buffer,
whatever the number of samples. This module does not generate text.
"""

from __future__ import annotations

import copy
import math
import random
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..config import MAX_DRAFT_TOPK, TideConfig
from ..heads.draftvocab import candidate_sizes, ranked_vocabulary, restricted_ranks
from ..hub.card import calibration_table, draft_scheme_text
from ..layers.calls import capture_outputs
from ..modeling import TideForCausalLM
from .costs import draft_candidates, layer_cost_of_cascade, prune_checkpoints
from .data import load_texts, take_samples
from .distributed import Processes
from .evaluate import teacher_forced
from .selftext import SelfText, generated_texts, prompt_texts
from .headloss import TEACHER_TOP, Candidates, draw_negatives, head_kl, uses_candidates
from .measure import measure_costs
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
from .thresholds import (
    EXIT_ERROR_BUDGETS,
    CheckpointCalibration,
    auc,
    binomial_upper_bound,
    calibrate_cascade,
    kept_nothing_message,
    oracle_depth,
)
from .trials import (
    KEEP_SPEEDUP,
    NGRAM,
    NGRAM_DEPTH,
    choose_draft,
    lossless_config,
    time_compiled,
    time_exit,
    timed_schemes,
    timing_batch,
    timing_prompts,
)

__all__ = ["calibrate", "calibration_table", "thresholds_for_target", "operating_point", "OperatingPoint",
           "CalibrationOptions"]


@dataclass
class CalibrationOptions:
    num_samples: int = 512
    max_length: int = 256
    batch_size: int = 8
    heldout_fraction: float = 0.2
    # training tokens kept for minibatches, over all processes (None: up to 32768 within ~1 GiB)
    buffer_size: int | None = None
    minibatch: int = 256
    # Adam steps of the exit and draft heads, spread over the training stream (None: HEAD_STEPS[candidate loss],
    # 200 over the whole vocabulary, 1000 over candidates, whose steps cost far less)
    head_steps: int | None = None
    head_lr: float = 1e-3
    passes: int = 4  # router training sweeps over the buffered tokens, after the exit heads are trained
    lr: float = 1e-3  # router learning rate
    seed: int = 0
    measure_costs: bool = True  # time checkpoints and layers here; drop checkpoints that do not pay; pick drafts
    validation_tokens: int = 1024  # held-out tokens decoded through the decode step to check the target (0: skip)
    draft_trials: int = 3  # lossless drafting schemes timed against the base model (best estimates first; 0: skip)
    compiled_trials: bool = False  # also time the kept mode compiled against the base model's compiled decode
    # cap on the timing trials' seconds, later trials cut: "auto" (a third of the other phases' seconds, at least
    # AUTO_TRIAL_FLOOR_S: a quarter of the calibration), a number, or None (no cap)
    timing_budget_s: float | str | None = "auto"
    prompt_new_tokens: int = 128  # with `prompts`: tokens the base model writes after each prompt
    prompt_samples: int = 2  # with `prompts`: sampled continuations of each prompt, besides the greedy one
    prompt_chat: bool | None = None  # with `prompts`: strings go through the chat template (None: where there is one)
    progress: bool = True

    def __post_init__(self):
        for name in ("num_samples", "max_length", "batch_size", "minibatch", "head_steps", "passes",
                     "validation_tokens", "draft_trials", "seed"):
            value = getattr(self, name)
            if name == "head_steps" and value is None:
                continue
            minimum = 1 if name in ("num_samples", "max_length", "batch_size", "minibatch") else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"calibrate: {name} must be an integer >= {minimum}, got {value!r}.")
        if self.buffer_size is not None and (not isinstance(self.buffer_size, int) or self.buffer_size < 1):
            raise ValueError(f"calibrate: buffer_size must be a positive integer or None, got {self.buffer_size!r}.")
        if not isinstance(self.heldout_fraction, (int, float)) or not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"calibrate: heldout_fraction must be between 0 and 1 (exclusive), "
                             f"got {self.heldout_fraction!r}.")
        budget = self.timing_budget_s
        if budget is not None and budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                                         or not math.isfinite(budget) or budget < 0):
            raise ValueError(f"calibrate: timing_budget_s must be \"auto\", a finite number >= 0 or None, "
                             f"got {budget!r}.")
        for name in ("head_lr", "lr"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0.0:
                raise ValueError(f"calibrate: {name} must be a positive number, got {value!r}.")


def calibrate(
    model,
    tokenizer,
    dataset=None,
    config: TideConfig | None = None,
    *,
    prompts: list | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    text_column: str | None = None,
    **options,
) -> TideForCausalLM:
    """Train exit heads and routers on `dataset` and/or on the model's own answers to `prompts`, and calibrate
    per-checkpoint thresholds; returns a `TideForCausalLM`.

    `model` is a base causal LM (fresh routers are created from `config`) or a `TideForCausalLM` (its
    routers are retrained). `prompts` (strings, through the chat template where the tokenizer has one, or chat
    message lists) are continued by the base model, greedily and `prompt_samples` times sampled, and calibration
    reads those texts (with the dataset's, where both are given); held-out prompts are then what the timing trials
    decode from. Extra keyword arguments set `CalibrationOptions` fields.
    """
    opts = _options(options)
    if dataset is None and not prompts:
        raise ValueError("calibrate needs text: pass dataset=... (a Hub name, local files, a datasets.Dataset or a "
                         "list of strings) and/or prompts=[...] for the model to answer.")
    tide = _model_to_calibrate(model, config, opts)
    run = _Run(tide, tokenizer, opts, PhaseTimes())
    run.read_texts(dataset, prompts, dataset_config=dataset_config, split=split, text_column=text_column)
    run.train_and_score()
    run.measure_costs()
    run.choose_thresholds()
    run.choose_drafts()
    run.time_compiled()
    tide.config.calibration = run.record(_data_name(dataset, prompts)).to_dict()
    return tide


def _held_count(n: int, fraction: float) -> int:
    """How many of n (>= 2) texts or prompts are held out: `fraction` of them, at least one, and one left to train."""
    return min(n - 1, max(1, round(n * fraction)))


def _data_name(dataset, prompts) -> str:
    """The calibration data in words, for the record and the model card."""
    name = None if dataset is None else dataset if isinstance(dataset, str) else f"<{type(dataset).__name__}>"
    own = f"the model's answers to {len(prompts)} prompts" if prompts else None
    return " + ".join(n for n in (name, own) if n)


def _options(options: dict) -> CalibrationOptions:
    known = {f.name for f in fields(CalibrationOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"calibrate: unknown option(s) {unknown}; the options are {sorted(known)}.")
    return CalibrationOptions(**options)


def _model_to_calibrate(model, config: TideConfig | None, opts: CalibrationOptions) -> TideForCausalLM:
    """`model` itself (a `TideForCausalLM`, with `config`'s recipe), or new routers from `config` on a base model."""
    if isinstance(model, TideForCausalLM):
        if config is not None:
            _apply_recipe(model, config)
        return model
    return TideForCausalLM.from_base(model, config or TideConfig(), seed=opts.seed)  # copies the config


class _Run:
    """One calibration's phases, in order, and what each leaves for the next (`calibrate` runs them)."""

    def __init__(self, tide: TideForCausalLM, tokenizer, opts: CalibrationOptions, phases: "PhaseTimes"):
        self.tide, self.cfg, self.tokenizer, self.opts, self.phases = tide, tide.config, tokenizer, opts, phases
        # one, or those `accelerate launch` started: each takes a shard
        self.procs = Processes.current(tide.base.device)
        self.budget = _TrialBudget(opts.timing_budget_s, phases)
        self.num_layers = tide.parts.num_layers
        self.draft_selection = self.compiled_timing = None

    def read_texts(self, dataset, prompts=None, **load) -> None:
        """Read, shuffle and split the texts (the dataset's, then the model's answers to the prompts, split by
        prompt); each process keeps its shard of the training and held-out ones."""
        opts, procs = self.opts, self.procs
        texts = []
        if dataset is not None:
            with self.phases("data"):
                texts = load_texts(dataset, **load)
            random.Random(opts.seed).shuffle(texts)
            texts = take_samples(texts, opts.num_samples)
            if len(texts) < 2:
                raise ValueError(f"Calibration needs at least 2 texts (one held out); the dataset gave {len(texts)}.")
        n_held = _held_count(len(texts), opts.heldout_fraction) if texts else 0
        train_texts, held_texts = texts[n_held:], texts[:n_held]
        self.timing_texts = None  # what the timing trials decode from: the held-out texts' openings, or prompts
        if prompts:
            train_own, held_own, self.timing_texts = self._answers(prompts)
            train_texts, held_texts = train_texts + train_own, held_texts + held_own
            texts = train_texts + held_texts
        if procs.world > min(len(train_texts), len(held_texts)):
            raise ValueError(f"Calibration on {procs.world} processes needs at least {procs.world} training and "
                             f"{procs.world} held-out texts; got {len(train_texts)} and {len(held_texts)}.")
        self.num_texts = len(texts)
        # the check through the decode step and the timing trials read the same as in one process
        self.all_held = held_texts
        self.train_texts, self.held_texts = procs.shard(train_texts), procs.shard(held_texts)

    def _answers(self, prompts) -> tuple[list[str], list[str], list[str]]:
        """(training texts, held-out texts, held-out prompts): the prompts split as texts are, and continued by the
        base model (`selftext`); every process writes the answers of all prompts (the same, from the same seed)."""
        opts = self.opts
        prompts = prompt_texts(self.tokenizer, list(prompts), opts.prompt_chat)
        random.Random(opts.seed).shuffle(prompts)
        if len(prompts) < 2:
            raise ValueError(f"Calibration from prompts needs at least 2 prompts (one held out); got {len(prompts)}.")
        n_held = _held_count(len(prompts), opts.heldout_fraction)
        how = SelfText(opts.prompt_new_tokens, opts.prompt_samples)
        with self.phases("generation"):
            train = generated_texts(self.tide.base, self.tokenizer, prompts[n_held:], how, seed=opts.seed)
            held = generated_texts(self.tide.base, self.tokenizer, prompts[:n_held], how, seed=opts.seed + 1)
        return train, held, prompts[:n_held]

    def train_and_score(self) -> None:
        """Stream the training texts (exit heads, draft heads, then routers), then score the held-out texts."""
        tide, opts, procs, phases, cfg = self.tide, self.opts, self.procs, self.phases, self.cfg
        device = tide.base.device
        was_training = tide.base.training
        tide.base.eval()
        bar = tqdm(total=len(self.train_texts) + len(self.held_texts), desc="Tide calibration", unit="text",
                   disable=not (opts.progress and procs.is_main))
        try:
            local_batches = math.ceil(len(self.train_texts) / opts.batch_size)
            num_batches = procs.max_int(local_batches)  # every process takes the same steps, in step
            trainer = self.trainer = _Trainer(tide, opts, num_batches=num_batches, procs=procs)
            for batch in phases.counted("data", _batches(self.train_texts, self.tokenizer, opts, device)):
                with phases("training"):
                    trainer.add(_capture(tide, batch, top=trainer.candidates))
                bar.update(batch["input_ids"].shape[0])
                bar.set_postfix(kl=f"{trainer.last_kl:.3f}")
            with phases("training"):
                for _ in range(num_batches - local_batches):
                    trainer.add(None)
                trainer.finish()
                self.ranked = _ranked_vocabulary(tide, trainer, procs) if opts.draft_trials else None
            held = _Heldout()
            for batch in phases.counted("data", _batches(self.held_texts, self.tokenizer, opts, device)):
                with phases("held-out scoring"):
                    held.add(_score(tide, _capture(tide, batch), cfg, self.ranked))
                bar.update(batch["input_ids"].shape[0])
            self.held_local = (len(self.held_texts), held.num_tokens if self.held_texts else 0)
            with phases("held-out scoring"):
                self.held = held.gathered(procs)
        finally:
            bar.close()
            tide.base.train(was_training)

    def measure_costs(self) -> None:
        """Time a decode step's pieces (main process), and prepare what the check and the timing trials read."""
        tide, opts, procs, device = self.tide, self.opts, self.procs, self.tide.base.device
        with self.phases("cost measurement"):
            self.costs = procs.on_main(lambda: measure_costs(tide) if opts.measure_costs else None)
        with self.phases("data"):
            # this process's share of the token lists one process would check, balanced by length (possibly none,
            # but every process takes part in the check when there are any)
            tokens = _validation_tokens(self.all_held, self.tokenizer, opts) if opts.validation_tokens else None
            self.validation_tokens = procs.shard_by_size(tokens, [len(ids) for ids in tokens]) if tokens else None
            timed = self.costs is not None
            self.prompts = (timing_prompts(self.tokenizer, self.timing_texts or self.all_held, device,
                                           whole=self.timing_texts is not None) if timed else None)
            self.batch = timing_batch(self.tokenizer, self.all_held, device) if timed else None

    def choose_thresholds(self) -> None:
        """Exit mode's thresholds for the target: selection, the check through the decode step, timing."""
        held, cfg = self.held, self.cfg
        layers = cfg.generation_config.consulted_checkpoints(self.tide.checkpoints)
        self.tide.heldout_selection = _HeldoutSelection(layers, held.scores(), held.agree(), held.labels(),
                                                        held.num_tokens, self.num_layers, cfg.confidence, self.costs,
                                                        self.validation_tokens, self.prompts, self.batch)
        self.point = operating_point(self.tide, cfg.target_agreement, self.procs, self.phases, self.budget)
        cfg.thresholds = self.point.thresholds
        if self.point.selection.exit_error_budget == 0.0:  # no threshold held the bound on these held-out tokens
            warnings.warn(kept_nothing_message(layers, held.scores(), held.agree(), held.labels(), cfg.target_agreement,
                                               cfg.confidence, len(self.all_held), self.opts.heldout_fraction))
        cfg.set_generation_defaults(batch_exits=self.point.batch_exits)

    def choose_drafts(self) -> None:
        """Time the best-estimated drafting schemes; keep the fastest that holds, and make lossless mode the
        default (`"auto"`) where it timed faster than exit mode."""
        tide, held, opts, costs = self.tide, self.held, self.opts, self.costs
        if costs is None or not opts.draft_trials:
            return
        max_draft = self.cfg.generation_config.max_draft or 8
        depth = min(max_draft, NGRAM_DEPTH)  # trees' n-gram branches, at most this deep
        candidates = timed_schemes(draft_candidates(held.ranks(), self.num_layers, costs, max_draft,
                                                    chain_ranks=held.chain_ranks(), restricted=held.restricted(),
                                                    head_rows=tide.num_head_rows, ngram=NGRAM, ngram_depth=depth),
                                   opts.draft_trials)
        tide.draft_vocabulary = self.ranked  # for the trials; cut to the chosen scheme's below
        # the trials cut when it is spent
        options = {"spent": self.budget.spent} if self.budget.seconds is not None else {}
        if depth != NGRAM_DEPTH:  # a configured max_draft below it
            options["ngram_depth"] = depth
        with self.phases("timing trials"):
            procs = self.procs
            if procs.world > 1 and procs.own_devices(tide.base.device):  # each times a share on its own device
                selection = choose_draft(tide, self.tokenizer, self.all_held, candidates, procs=procs, **options)
            else:  # processes that share a device would time each other's load: the main process times alone
                selection = procs.on_main(lambda: choose_draft(tide, self.tokenizer, self.all_held, candidates,
                                                               **options))
        self.draft_selection = DraftSelection.from_dict(selection)
        chosen = self.draft_selection.chosen
        exit_timing = as_record(self.point.exit_timing, ExitTiming)
        exit_speed = exit_timing.measured if exit_timing and exit_timing.active else 1.0
        lossless_wins = chosen is not None and chosen.measured > exit_speed
        vocab = (chosen.draft_vocab_size or 0) if chosen else 0
        # kept whole (the largest candidate size, a few KB): the chosen drafts read its first `vocab` ids, and a
        # call may ask for another `draft_vocab_size`
        tide.draft_vocabulary = self.ranked
        self.cfg.set_generation_defaults(draft_layer=chosen.draft_layer if chosen else None,
                                         max_draft=chosen.max_draft if chosen else 0,
                                         draft_topk=chosen.draft_topk if chosen else 1,
                                         draft_vocab_size=vocab, draft_ngram=(chosen.draft_ngram or 0) if chosen else 0,
                                         head_drafts=(chosen.head_drafts is not False) if chosen else True,
                                         mode="auto" if lossless_wins else "exit")

    def time_compiled(self) -> None:
        """Time the default mode compiled against the base model's compiled decode (`compiled_modes`)."""
        opts, procs = self.opts, self.procs
        default = _default_run(self.cfg) if self.prompts is not None and opts.compiled_trials else None
        if default is None:
            return
        with self.phases("timing trials"):
            timing = procs.on_main(lambda: time_compiled(self.tide, self.prompts, default)
                                   if self.budget.allows("the default mode compiled") else None)
        if timing is not None:
            self.compiled_timing = Timing.from_dict(timing)
            self.cfg.set_generation_defaults(compiled_modes=self.compiled_timing.active)

    def record(self, dataset) -> CalibrationRecord:
        """What the calibration found, as saved in the config (`TideConfig.calibration`)."""
        procs, phases, held, costs, point = self.procs, self.phases, self.held, self.costs, self.point
        selection, trainer = point.selection, self.trainer
        train_tokens = int(procs.sum([trainer.train_tokens])[0])
        record = _summary(selection, held, self.cfg, self.num_layers, dataset, self.num_texts, train_tokens)
        record.costs = costs.record() if costs else None
        record.dropped_checkpoints = {str(k): why for k, why in point.dropped.items()}
        record.expected_layer_cost = layer_cost_of_cascade(selection.checkpoints, held.num_tokens, self.num_layers,
                                                           costs) if costs else None
        record.draft_selection = self.draft_selection
        record.exit_timing = as_record(point.exit_timing, ExitTiming)
        record.compiled_timing = self.compiled_timing
        record.decode_validation = as_record(point.validation, Validation)
        record.phase_seconds = phases.rounded()
        record.work_per_rank = _work_per_rank(procs, (len(self.train_texts), trainer.train_tokens), self.held_local,
                                              getattr(self.tide.heldout_selection, "decoded_per_rank", None),
                                              trainer.head_rows)
        if procs.world > 1:
            per_rank = procs.per_rank(list(phases.seconds.values()))
            record.phase_seconds_per_rank = {name: [round(r[i], 2) for r in per_rank]
                                             for i, name in enumerate(phases.NAMES)}
        if self.budget.seconds is not None:
            record.timing_budget = TimingBudget(round(self.budget.seconds, 2),
                                                round(phases.seconds["timing trials"], 2),
                                                procs.broadcast(_cut_trials(self.budget, self.draft_selection)))
        return record


def _cut_trials(budget: "_TrialBudget", draft: DraftSelection | None) -> list[str]:
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


AUTO_TRIAL_SHARE = 1 / 3  # "auto" budget: of the other phases' seconds (so the trials take a quarter of the whole)
AUTO_TRIAL_FLOOR_S = 30.0  # "auto" budget: at least this, so that a fast calibration still times its best scheme


class _TrialBudget:
    """`timing_budget_s`: a timing trial starts only while the timing trials have taken less than `seconds` (the
    one under way finishes); `cut` names the trials that did not start. Decided on the main process (it times).
    "auto": `AUTO_TRIAL_SHARE` of the seconds the other phases have taken so far, at least `AUTO_TRIAL_FLOOR_S`."""

    def __init__(self, budget: float | str | None, phases: "PhaseTimes"):
        self.budget, self.phases, self.cut = budget, phases, []

    @property
    def seconds(self) -> float | None:
        if self.budget != "auto":
            return self.budget
        others = sum(self.phases.elapsed(name) for name in self.phases.NAMES if name != "timing trials")
        return max(AUTO_TRIAL_FLOOR_S, AUTO_TRIAL_SHARE * others)

    def spent(self) -> bool:
        seconds = self.seconds
        return seconds is not None and self.phases.elapsed("timing trials") >= seconds

    def allows(self, trial: str) -> bool:
        """False (and `trial` recorded as cut) once the budget is spent."""
        if self.spent():
            self.cut.append(trial)
            return False
        return True


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


def _default_run(cfg: TideConfig) -> dict | None:
    """The `tide_config` a single-sequence call runs at the repo's defaults, or None where that is the base model."""
    generation = cfg.generation_config
    if generation.mode == "auto" and generation.max_draft:
        return lossless_config(generation.to_dict())
    if any(t < 1.0 for t in (cfg.thresholds or {}).values()):
        return {"mode": "exit", "thresholds": dict(cfg.thresholds)}
    return None


_RECIPE_FIELDS = ("label", "cosine_threshold", "target_agreement", "confidence")


def _apply_recipe(tide: TideForCausalLM, config: TideConfig) -> None:
    """Recalibrating a `TideForCausalLM` with `config`: its calibration recipe (label rule, target, confidence,
    generation defaults) applies; its router layout must be the model's own."""
    layout = {
        "checkpoints": (config.resolve_checkpoints(tide.parts.num_layers), tide.checkpoints),
        "router_hidden_size": (config.router_hidden_size, tide.config.router_hidden_size),
        "exit_head": (config.exit_head, tide.config.exit_head),
        "exit_head_rank": (config.exit_head_rank, tide.config.exit_head_rank),
        "draft_head": (config.draft_head, tide.config.draft_head),
        "draft_head_mlp": (config.draft_head_mlp, tide.config.draft_head_mlp),
    }
    different = {k: v for k, v in layout.items() if v[0] != v[1]}
    if different:
        detail = "; ".join(f"{k}: config {a!r}, model {b!r}" for k, (a, b) in different.items())
        raise ValueError(f"calibrate: the config describes other routers than the model's ({detail}). Recalibrating a "
                         "TideForCausalLM keeps its routers; to calibrate new ones, pass its base model (model.base).")
    for name in _RECIPE_FIELDS:
        setattr(tide.config, name, getattr(config, name))
    if config.generation:
        tide.config.set_generation_defaults(**config.generation)
    tide.config.validate(num_layers=tide.parts.num_layers)


# ---------------------------------------------------------------------- batches
def _batches(texts, tokenizer, opts: CalibrationOptions, device):
    """Right-padded token batches; works for tokenizers without a pad token."""
    for start in range(0, len(texts), opts.batch_size):
        encoded = tokenizer(texts[start : start + opts.batch_size], truncation=True, max_length=opts.max_length)
        rows = [ids for ids in encoded["input_ids"] if len(ids) > 1] or encoded["input_ids"]
        width = max(len(ids) for ids in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        yield {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}


# ---------------------------------------------------------------------- one base forward
@dataclass
class _Capture:
    states: dict[int, torch.Tensor]  # [N, H] raw output of each checkpoint layer (real tokens only)
    final: torch.Tensor  # [N, H] raw output of the last layer
    full_top1: torch.Tensor  # [N] the full model's top-1
    context: torch.Tensor | None  # [N, H] the final normed state at the position before (zeros at a text's first
    # token); None when the model has no draft heads
    first: torch.Tensor | None = None  # [N] bool: a text's first token (with `context`)
    top: torch.Tensor | None = None  # [N, TEACHER_TOP] the full model's best tokens (with `top=True`)


@torch.no_grad()
def _capture(tide: TideForCausalLM, batch, top: bool = False) -> _Capture:
    parts, last = tide.parts, tide.parts.num_layers - 1
    with capture_outputs(parts, tide.checkpoints + [last]) as states:
        logits = tide.base(**batch, use_cache=False).logits
    keep = batch["attention_mask"].bool()
    context = first = None
    if any(tide.routers[k].draft is not None for k in tide.checkpoints):
        normed = parts.final_norm(states[last])
        context = torch.cat([torch.zeros_like(normed[:, :1]), normed[:, :-1]], 1)[keep]
        first = (keep.cumsum(1) == 1)[keep]
    logits = logits[keep]
    return _Capture({k: states[k][keep] for k in tide.checkpoints}, states[last][keep], logits.argmax(-1),
                    context, first, logits.topk(TEACHER_TOP, -1).indices if top else None)


def _labels(exit_logits: torch.Tensor, states: torch.Tensor, final: torch.Tensor, full_top1: torch.Tensor,
            cfg: TideConfig):
    """(agree, label) [N]: the exit's top-1 (from its logits [N, V]) equals the full model's, and the training label."""
    agree = exit_logits.argmax(-1) == full_top1
    if cfg.label == "top1":
        return agree, agree
    return agree, F.cosine_similarity(states.float(), final.float(), dim=-1) > cfg.cosine_threshold


def _draft_ranks(logits: torch.Tensor, full_top1: torch.Tensor) -> torch.Tensor:
    """[N] uint8: where the full model's top-1 ranks among a lossless draft's logits [N, V] (0: the draft's top-1;
    capped at MAX_DRAFT_TOPK, for tree drafts)."""
    return (logits > logits.gather(-1, full_top1[:, None])).sum(-1).clamp(max=MAX_DRAFT_TOPK).to(torch.uint8)


@torch.no_grad()
def _score(tide: TideForCausalLM, cap: _Capture, cfg: TideConfig, vocab: torch.Tensor | None = None) -> dict:
    """Held-out scalars per checkpoint: router scores (as generation computes them), agreement, label, and where
    the full model's token ranks among drafts (also restricted to the first ids of `vocab`, the ranked
    vocabulary, at each candidate size)."""
    out = {"scores": {}, "agree": {}, "labels": {}, "ranks": {}, "chain_ranks": {}, "vocab_ranks": {},
           "vocab_chain_ranks": {}}
    tests = tide.exit_tests({k: 1.0 for k in cap.states})  # the decode step's own checkpoint test
    sizes = [n for n in candidate_sizes(tide.num_head_rows) if vocab is not None and n <= vocab.numel()]
    for k, states in cap.states.items():
        exit_logits = tide.exit_logits(k, states)
        agree, label = _labels(exit_logits, states, cap.final, cap.full_top1, cfg)
        out["scores"][k] = tests[k](states)[0].cpu()
        out["agree"][k], out["labels"][k] = agree.cpu(), label.cpu()
        if cap.context is None or tide.routers[k].draft is None:  # drafts from the exit head: the logits above
            first = chained = exit_logits
        else:
            first, normed = tide.draft_logits(k, states, cap.context.to(states.dtype))
            # A chain's second and later drafts read the previous draft's own normed state, not a verified one.
            context = torch.cat([torch.zeros_like(normed[:1]), normed[:-1]]).masked_fill(cap.first[:, None], 0.0)
            chained = tide.draft_logits(k, states, context)[0]
        out["ranks"][k] = _draft_ranks(first, cap.full_top1).cpu()
        out["chain_ranks"][k] = out["ranks"][k] if chained is first else _draft_ranks(chained, cap.full_top1).cpu()
        for n in sizes:  # the same drafts ranking only the n most-predicted tokens
            ranks = out["vocab_ranks"][(k, n)] = restricted_ranks(first, cap.full_top1, vocab[:n], MAX_DRAFT_TOPK).cpu()
            out["vocab_chain_ranks"][(k, n)] = ranks if chained is first else \
                restricted_ranks(chained, cap.full_top1, vocab[:n], MAX_DRAFT_TOPK).cpu()
    return out


def _ranked_vocabulary(tide: TideForCausalLM, trainer: "_Trainer", procs: Processes) -> torch.Tensor | None:
    """The tokens the full model predicted most on the training texts (all processes), as many as the largest
    draft vocabulary calibration scores; None where the head is too small for one, or where generation could
    not read its rows alone (`ModelParts.head_rows_readable`), as for an offloaded head."""
    sizes = candidate_sizes(tide.num_head_rows)
    if not sizes or not tide.parts.head_rows_readable:  # the drafts would read the whole head: no cheaper
        return None
    counts = torch.tensor(procs.sum(trainer.predicted.tolist())) if procs.world > 1 else trainer.predicted
    return ranked_vocabulary(counts, max(sizes))


# ---------------------------------------------------------------------- training
# The heads' default Adam steps, by loss: {candidates: steps}. A candidate step costs a fraction of a step over the
# whole vocabulary, and on SmolLM2-135M-Instruct 1,000 of them raised draft acceptance at layer 3 from 36% to 47%
# over 200 (docs/benchmarks.md).
HEAD_STEPS = {False: 200, True: 1000}

class _Trainer:
    """Exit heads then routers, from a bounded ring buffer of training tokens.

    While the training texts stream, each batch's states enter the buffer and the exit heads (translators) and
    draft heads take Adam steps minimising KL(full model || head) on buffered tokens, `head_steps` in all. Then
    every buffered token is labelled through the trained exits and the routers (on fp32 copies) sweep the buffer
    `passes` times. Memory: the buffer, (checkpoints + 2) x buffer_size x H floats.
    """

    def __init__(self, tide: TideForCausalLM, opts: CalibrationOptions, num_batches: int,
                 procs: Processes | None = None):
        self.tide, self.opts, self.parts = tide, opts, tide.parts
        self.procs = procs or Processes()
        self.layers = list(tide.checkpoints)
        hidden = tide.config.base_hidden_size or self.parts.norm.weight.shape[-1]
        size = opts.buffer_size or max(opts.minibatch, min(32768, (1 << 30) // (4 * hidden * (len(self.layers) + 2))))
        size = math.ceil(size / self.procs.world)  # together, the processes' buffers hold what one process's would
        device = tide.base.device
        self.states = {k: torch.empty(size, hidden, device=device) for k in self.layers}
        self.final = torch.empty(size, hidden, device=device)
        self.top1 = torch.empty(size, dtype=torch.long, device=device)
        self.size, self.filled, self.cursor, self.train_tokens, self.head_rows = size, 0, 0, 0, 0
        self.translators = {k: copy.deepcopy(tide.routers[k].translator).float() for k in self.layers
                            if tide.routers[k].translator is not None}
        self.drafts = {k: copy.deepcopy(tide.routers[k].draft).float() for k in self.layers
                       if tide.routers[k].draft is not None}
        self.context = torch.empty(size, hidden, device=device) if self.drafts else None
        self.predicted = torch.zeros(tide.num_head_rows, dtype=torch.long, device=device)  # full-model top-1 counts
        # the candidate loss, else the whole vocabulary
        self.candidates = uses_candidates(tide.num_head_rows, self.parts.head_rows_readable)
        self.top = torch.empty(size, TEACHER_TOP, dtype=torch.long, device=device) if self.candidates else None
        params = self._head_params()
        self.head_optim = torch.optim.Adam(params, lr=opts.head_lr) if params else None
        steps = HEAD_STEPS[self.candidates] if opts.head_steps is None else opts.head_steps
        self.steps_per_batch = math.ceil(steps / max(num_batches, 1))
        self.head_steps_left = steps if params else 0
        self.generator = torch.Generator(device="cpu").manual_seed(opts.seed)
        self.last_kl = float("nan")

    def add(self, cap: _Capture | None) -> None:
        """Buffer a batch's states (None: no batch left on this process, but take the steps the others take)."""
        if cap is not None:
            self._buffer(cap)
        for _ in range(min(self.steps_per_batch, self.head_steps_left)):
            self._head_step()

    def _buffer(self, cap: _Capture) -> None:
        n = min(cap.final.shape[0], self.size)
        idx = ((torch.arange(n) + self.cursor) % self.size).to(self.final.device)
        for k in self.layers:
            self.states[k][idx] = cap.states[k][-n:].float()
        self.final[idx], self.top1[idx] = cap.final[-n:].float(), cap.full_top1[-n:]
        if self.top is not None:
            self.top[idx] = cap.top[-n:]
        self.predicted += torch.bincount(cap.full_top1, minlength=self.predicted.numel())
        if self.context is not None:
            self.context[idx] = cap.context[-n:].float()
        self.cursor = (self.cursor + n) % self.size
        self.filled = min(self.filled + n, self.size)
        self.train_tokens += cap.final.shape[0]

    def _pick(self) -> torch.Tensor:
        """This process's share of a minibatch (the gradients are averaged over the processes, so a step still
        learns from `minibatch` tokens in all)."""
        rows = math.ceil(self.opts.minibatch / self.procs.world)
        pick = torch.randint(self.filled, (min(rows, self.filled),), generator=self.generator)
        return pick.to(self.final.device)

    def _logits(self, state: torch.Tensor, candidates: Candidates | None) -> torch.Tensor:
        """Final norm + head of the model on fp32 states (cast to the model's dtype), over the whole vocabulary or
        the rows' candidates. [M, H] -> fp32 [M, V] or [M, C]."""
        dtype = self.parts.norm.weight.dtype if hasattr(self.parts.norm, "weight") else state.dtype
        normed = self.parts.final_norm(state.to(dtype))
        if candidates is None:
            return self.parts.logits_from_normed(normed).float()
        return candidates.logits(self.parts, normed)

    def _head_step(self) -> None:
        self.head_steps_left -= 1
        pick = self._pick()
        self.head_rows += pick.numel()
        candidates = (Candidates(self.top[pick], draw_negatives(self.predicted, self.generator))
                      if self.candidates else None)
        with torch.no_grad():
            teacher = self._logits(self.final[pick], candidates)  # [M, V] or [M, C]
        with torch.enable_grad():
            states = [t(self.states[k][pick]) for k, t in self.translators.items()]
            states += [d(self.states[k][pick], self.context[pick]) for k, d in self.drafts.items()]
            loss = sum(head_kl(self._logits(state, candidates), teacher) for state in states) / len(states)
            params = self._head_params()
            grads = torch.autograd.grad(loss, params)  # the base model's own parameters get no .grad
        for p, g in zip(params, grads):
            p.grad = g
        self.procs.mean_grads(params)
        self.head_optim.step()
        self.last_kl = float(loss.detach())

    def _head_params(self) -> list:
        return [p for head in [*self.translators.values(), *self.drafts.values()] for p in head.parameters()]

    def finish(self) -> None:
        """Copy the trained exit and draft heads into the model, then train the routers on labels through the exits.

        Each router is trained by one process (checkpoints dealt out in turn) on every process's buffered tokens,
        with no collective per step, and then sent to the others: a router's minibatch steps cost their fixed work,
        not their rows, so splitting rows across processes would not shorten them (with an all-reduce a step, two
        processes took three times as long as one), while splitting the routers divides the phase."""
        with torch.no_grad():
            for heads, name in ((self.translators, "translator"), (self.drafts, "draft")):
                for k, trained in heads.items():
                    target = getattr(self.tide.routers[k], name)
                    for dst, src in zip(target.parameters(), trained.parameters()):
                        dst.copy_(src.to(dst.dtype))
        for i, k in enumerate(self.layers):
            owner = i % self.procs.world
            normed, labels = (self.procs.gather_to(x, owner) for x in self._router_data(k))
            if self.procs.rank == owner:
                self._train_router(k, normed, labels)
        for i, k in enumerate(self.layers):
            router = self.tide.routers[k]
            self.procs.broadcast_tensors([*router.down.parameters(), *router.up.parameters()], src=i % self.procs.world)

    def _router_data(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The final-norm view of this process's buffered exit states at `k` and their labels through the exit
        (fp32)."""
        tide, n, router = self.tide, self.filled, self.tide.routers[k]
        with torch.no_grad():
            states, final, top1 = self.states[k][:n].to(router.down.weight.dtype), self.final[:n], self.top1[:n]
            normed, labels = [], []
            for part in range(0, n, 4096):
                chunk = slice(part, part + 4096)
                normed.append(self.parts.final_norm(router.exit_state(states[chunk])).float())
                exit_logits = tide.exit_logits(k, states[chunk])
                labels.append(_labels(exit_logits, states[chunk], final[chunk], top1[chunk], tide.config)[1].float())
        return torch.cat(normed), torch.cat(labels)

    def _train_router(self, k: int, normed: torch.Tensor, labels: torch.Tensor) -> None:
        """Router `k`'s Adam steps on (normed, labels): `passes` sweeps in minibatches."""
        router = self.tide.routers[k]
        trained = copy.deepcopy(router).float()
        trained.translator = trained.draft = None
        optim = torch.optim.Adam(trained.parameters(), lr=self.opts.lr)
        n = normed.shape[0]
        with torch.enable_grad():
            for _ in range(self.opts.passes * math.ceil(n / self.opts.minibatch)):
                pick = torch.randint(n, (min(self.opts.minibatch, n),), generator=self.generator).to(normed.device)
                loss = F.binary_cross_entropy_with_logits(trained(normed[pick]), labels[pick])
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
        with torch.no_grad():
            for name in ("down", "up"):
                for dst, src in zip(getattr(router, name).parameters(), getattr(trained, name).parameters()):
                    dst.copy_(src.to(dst.dtype))


# ---------------------------------------------------------------------- threshold selection
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

    @staticmethod
    def thresholds(selection, checkpoints) -> dict[str, float]:
        out = {str(k): 1.0 for k in checkpoints}  # never: not consulted
        out.update({str(r.layer): r.threshold for r in selection.checkpoints})
        return out


def _validation_tokens(texts, tokenizer, opts: CalibrationOptions) -> list[list[int]]:
    """Held-out texts as token lists, up to `opts.validation_tokens` tokens in all."""
    out, total, budget = [], 0, opts.validation_tokens
    for text in texts:
        ids = tokenizer(text, truncation=True, max_length=opts.max_length)["input_ids"]
        if len(ids) > 2:
            out.append(ids[: budget - total + 2])
            total += len(out[-1]) - 2
        if total >= budget:
            break
    return out


def _validate(tide, token_lists, selection, dropped, target: float, procs: Processes):
    """Check the target through the decode step itself (teacher-forced, with the configured KV strategy,
    whose approximate K/V for skipped layers also changes later tokens); lower the per-exit budget until
    the one-sided lower confidence bound on the decoded agreement reaches the target.
    Each process decodes its share of the tokens (`token_lists`: its held-out texts'); the counts are summed
    over the processes, so the bound is the one a process decoding them all would compute.
    Returns (selection, dropped, {agreement, tokens, lower_bound, exit_error_budget, mean_layers, tokens_per_rank:
    the tokens each process decoded in all rounds})."""
    held = tide.heldout_selection
    decoded = 0  # tokens this process decoded, all rounds
    for round_ in range(MAX_VALIDATION_ROUNDS):
        run = tide.config.resolve_generation({"thresholds": held.thresholds(selection, tide.checkpoints),
                                              "exit_threshold": None, "mode": "exit"})
        active = any(t < 1.0 for t in run.thresholds.values())
        report = teacher_forced(tide, token_lists, run) if active else None
        if report is None:  # nothing exits (any earlier rounds' decoded tokens are kept for the phase record)
            return selection, dropped, None
        decoded += report.tokens
        held.decoded_per_rank = [int(r[0]) for r in procs.per_rank([decoded])]
        agreeing, tokens, layers = procs.sum(  # a process with no share adds zeros
            [report.agreement * report.tokens, report.tokens,
             report.mean_layers * report.tokens if report.tokens else 0.0])
        tokens = int(tokens)
        errors = tokens - round(agreeing)
        bound = 1.0 - binomial_upper_bound(errors, tokens, held.confidence)
        result = {"agreement": agreeing / max(tokens, 1), "tokens": tokens, "lower_bound": bound,
                  "exit_error_budget": selection.exit_error_budget, "mean_layers": layers / max(tokens, 1),
                  "tokens_per_rank": held.decoded_per_rank}
        if bound >= target:
            return selection, dropped, result
        smaller = [b for b in EXIT_ERROR_BUDGETS if b < selection.exit_error_budget]
        if not smaller or round_ == MAX_VALIDATION_ROUNDS - 1:  # no budget left to try, or no round: no exits
            selection, dropped = held.select(target, max_budget=0.0)
            return selection, dropped, result
        selection, dropped = held.select(target, max_budget=next_budget(
            smaller, selection.exit_error_budget, errors, allowed_errors(tokens, target, held.confidence)))


def allowed_errors(tokens: int, target: float, confidence: float) -> int:
    """The most disagreements in `tokens` decoded tokens whose lower confidence bound still reaches `target`
    (-1 where even none would not)."""
    allowed = -1
    while allowed + 1 < tokens and 1.0 - binomial_upper_bound(allowed + 1, tokens, confidence) >= target:
        allowed += 1
    return allowed


# Rounds of the check through the decode step: each decodes every validation token again (on a 30-layer model,
# 1,024 tokens took about 70 s a round on one core, and a model whose exits rarely agree took 14 rounds); where the
# target still fails after these, nothing exits.
MAX_VALIDATION_ROUNDS = 4


def next_budget(smaller: list[float], budget: float, errors: int, allowed: int) -> float:
    """The per-exit error budget to check next after `errors` disagreements at `budget` where `allowed` would pass:
    the largest of the `smaller` budgets at most budget x sqrt(allowed / errors), and at least one step down.
    Decoded disagreements grow more slowly than the budget (part of them come from the approximate K/V of
    skipped layers, not from the exits the budget allows), so the step is half the one that proportion would
    give, in log scale: a few rounds to the budget the measurement points at, where stepping down one budget a
    round took up to 7 rounds of the check on the shipped model, and no overshoot to a budget far below it."""
    estimate = budget * math.sqrt(max(allowed, 0) / max(errors, 1))
    fitting = [b for b in smaller if b <= estimate * 1.0001]  # the budgets are rounded to 6 decimals
    return fitting[-1] if fitting else smaller[0]


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
                    phases: PhaseTimes | None = None, budget: "_TrialBudget | None" = None) -> OperatingPoint:
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
    budget = budget or _TrialBudget(None, phases)
    with phases("thresholds"):
        selection, dropped = held.select(target_agreement)
    validation = None
    if held.validation_tokens is not None:
        with phases("decode validation"):
            selection, dropped, validation = _validate(model, held.validation_tokens, selection, dropped,
                                                       target_agreement, procs)
    thresholds = held.thresholds(selection, model.checkpoints)
    exit_timing = None
    if held.timing_prompts is not None and any(t < 1.0 for t in thresholds.values()):
        with phases("timing trials"):
            exit_timing = procs.on_main(lambda: time_exit(model, held.timing_prompts, held.timing_batch, thresholds)
                                        if budget.allows("exit mode") else None)
        if exit_timing is not None and not exit_timing["active"]:
            thresholds = dict.fromkeys(thresholds, 1.0)  # exit mode then runs the base model
    expected = None
    if held.costs is not None:
        expected = held.num_layers / layer_cost_of_cascade(selection.checkpoints, held.num_tokens, held.num_layers,
                                                           held.costs)
    return OperatingPoint(target_agreement, thresholds, selection, dropped, validation, exit_timing, expected)


# ---------------------------------------------------------------------- held-out statistics
class _Heldout:
    def __init__(self):
        self._scores, self._agree, self._labels, self._ranks, self._chain_ranks = {}, {}, {}, {}, {}
        self._vocab_ranks, self._vocab_chain_ranks = {}, {}  # keyed (layer, draft vocabulary size)

    def _stores(self):
        return {"scores": self._scores, "agree": self._agree, "labels": self._labels, "ranks": self._ranks,
                "chain_ranks": self._chain_ranks, "vocab_ranks": self._vocab_ranks,
                "vocab_chain_ranks": self._vocab_chain_ranks}

    def add(self, scored: dict) -> None:
        for name, store in self._stores().items():
            for k, v in scored[name].items():
                store.setdefault(k, []).append(v.cpu())

    def _cat(self, store):
        return {k: torch.cat(v) for k, v in store.items()}

    def gathered(self, procs: Processes) -> "_Heldout":
        """Every process's held-out scalars, in rank order, on every process."""
        if procs.world == 1:
            return self
        out = _Heldout()
        for name, mine in self._stores().items():
            theirs = out._stores()[name]
            for k, parts in mine.items():
                theirs[k] = [procs.gather_cat(torch.cat(parts))]
        return out

    def scores(self):
        return self._cat(self._scores)

    def agree(self):
        return self._cat(self._agree)

    def labels(self):
        return self._cat(self._labels)

    def ranks(self):
        return self._cat(self._ranks)

    def chain_ranks(self):
        return self._cat(self._chain_ranks)

    def restricted(self) -> dict[int, tuple[dict, dict]]:
        """{draft vocabulary size n: ({layer: ranks}, {layer: chain ranks})} of drafts restricted to n tokens."""
        out: dict[int, tuple[dict, dict]] = {}
        chain = self._cat(self._vocab_chain_ranks)
        for (k, n), ranks in self._cat(self._vocab_ranks).items():
            first, later = out.setdefault(n, ({}, {}))
            first[k], later[k] = ranks, chain[(k, n)]
        return out

    @property
    def num_tokens(self) -> int:
        return sum(v.numel() for v in next(iter(self._scores.values())))


def _summary(selection, held: _Heldout, cfg, num_layers, dataset, num_samples, train_tokens) -> CalibrationRecord:
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
    )


def _oracle_mean_layers(agree: dict[int, torch.Tensor], layers: list[int], num_layers: int) -> float:
    """Mean depth if every token left at the first checkpoint whose top-1 already matches the full model."""
    return float(oracle_depth(agree, layers, num_layers).mean())
