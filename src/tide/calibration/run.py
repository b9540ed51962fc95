"""Streaming router calibration: `tide.calibrate(model, tokenizer, dataset=..., config=...)`, its phases in order.

Texts are read and split (`texts`); pass 1 streams training batches: one base forward per batch (hooks capture
the checkpoint layers' outputs, `forward`), labels computed on the fly, a bounded buffer per checkpoint, a few
minibatch steps per batch (`trainer`). Pass 2 streams held-out batches and keeps only (score, agree, label)
scalars per token (`heldout`). Costs are measured, then `thresholds.calibrate_cascade` picks the thresholds,
checked through the decode step and timed (`operating`, `validation`); drafting schemes and the default mode are
timed (`timing`), and what was found is recorded (`record`); what the compiled trials compiled is persisted
(`persist`). Memory is bounded by the batch and the buffer, whatever the number of samples. This module does not
generate text.
"""

from __future__ import annotations

import contextlib

import torch
from tqdm.auto import tqdm

from ..config import TideConfig
from ..decode.machinecheck import machine_name, record_cycle_steps
from ..hub.card import calibration_table
from ..modeling import TideForCausalLM
from ..models.compat import CompileWatch
from .heldout import score_heldout
from .operating import OperatingPoint, choose_thresholds, cost_measurement, operating_point, thresholds_for_target
from .options import CalibrationOptions, options_from
from .persist import persist_compiled
from .phases import Context
from .record import build_record
from .selftext import check_prompts
from .texts import Texts, data_name, read_texts
from .thresholds import allowed_errors, next_budget  # noqa: F401 - imported from here (docs/scaling.md, tests)
from .timing import choose_drafts, time_default_compiled
from .trainer import train

__all__ = ["calibrate", "calibration_table", "thresholds_for_target", "operating_point", "OperatingPoint",
           "CalibrationOptions"]


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
    opts = options_from(options)
    if prompts is not None:
        prompts = check_prompts(prompts, opts.prompt_chat)  # before any work: a string, blank prompts, bad messages
    if dataset is None and not prompts:
        raise ValueError("calibrate needs text: pass dataset=... (a Hub name, local files, a datasets.Dataset or a "
                         "list of strings) and/or prompts=[...] for the model to answer.")
    tide = _model_to_calibrate(model, config, opts)
    ctx = Context.start(tide, tokenizer, opts)
    texts = read_texts(ctx, dataset, prompts, dataset_config=dataset_config, split=split, text_column=text_column)
    trainer, ranked, held, held_local = _train_and_score(ctx, texts)
    with decoding_threads(opts.decode_threads):  # (costs, the decode check and the trials: as decoding will run)
        timing_machine = machine_name(tide)
        measured = cost_measurement(ctx, texts)
        point = choose_thresholds(ctx, held, measured, len(texts.all_held))
        draft_selection = choose_drafts(ctx, held, measured.costs, ranked, texts.all_held, point)
        with CompileWatch() as compiling:  # (the compiled trials' graphs: persisted below, the repo's config final)
            compiled_timing, compiled_chains = time_default_compiled(ctx, measured.prompts, draft_selection)
    record = build_record(ctx, data_name(dataset, prompts), texts=texts, trainer=trainer, held=held,
                          held_local=held_local, costs=measured.costs, point=point, draft_selection=draft_selection,
                          compiled_timing=compiled_timing, compiled_chains=compiled_chains,
                          timing_machine=timing_machine)
    tide.config.calibration = record.to_dict()
    with decoding_threads(opts.decode_threads), ctx.phases("cost measurement"):  # (for other machines' checks)
        with_steps = ctx.procs.on_main(lambda: record_cycle_steps(tide))
    tide.config.calibration = {**with_steps, "phase_seconds": ctx.phases.rounded()}
    persist_compiled(tide, compiling.graphs)
    return tide


@contextlib.contextmanager
def decoding_threads(threads: int | None):
    """torch's intra-op threads set to `threads` inside the block (None: left as they are), restored after."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train_and_score(ctx: Context, texts: Texts) -> tuple:
    """Stream the training texts (exit heads, draft heads, then routers: `trainer.train`), then score the held-out
    texts (`heldout.score_heldout`), under one progress bar. (Trainer, ranked draft vocabulary or None, every
    process's held-out scores, this process's held-out (texts, tokens).)"""
    tide, opts, procs = ctx.tide, ctx.opts, ctx.procs
    was_training = tide.base.training
    tide.base.eval()
    bar = tqdm(total=len(texts.train_texts) + len(texts.held_texts), desc="Tide calibration", unit="text",
               disable=not (opts.progress and procs.is_main))
    try:
        trainer, ranked = train(ctx, texts.train_texts, bar)
        held, held_local = score_heldout(ctx, texts.held_texts, ranked, bar,
                                         draft_vocab_only=trainer.draft_rows is not None)
    finally:
        bar.close()
        tide.base.train(was_training)
    return trainer, ranked, held, held_local


def _model_to_calibrate(model, config: TideConfig | None, opts: CalibrationOptions) -> TideForCausalLM:
    """`model` itself (a `TideForCausalLM`, with `config`'s recipe), or new routers from `config` on a base model."""
    if isinstance(model, TideForCausalLM):
        if config is not None:
            _apply_recipe(model, config)
        return model
    return TideForCausalLM.from_base(model, config or TideConfig(), seed=opts.seed)  # copies the config


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
