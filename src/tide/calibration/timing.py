"""Calibration's timing-trial phases, after the thresholds (`trials` holds the trials themselves): the drafting
schemes estimated best, timed against the base model, and lossless mode made the default where it timed faster
than exit mode (`choose_drafts`); then the default mode timed compiled against the base model's compiled decode
(`time_default_compiled`). Each sets the generation defaults of the repo it decides."""

from __future__ import annotations

import torch

from ..config import TideConfig
from ..records import DraftSelection, ExitTiming, Timing, as_record
from .costs import draft_candidates
from .heldout import Heldout
from .operating import OperatingPoint
from .phases import Context
from .trials import NGRAM, NGRAM_DEPTH, choose_draft, lossless_config, time_compiled, timed_schemes

__all__ = ["choose_drafts", "time_default_compiled"]


def choose_drafts(ctx: Context, held: Heldout, costs, ranked: torch.Tensor | None, held_texts: list[str],
                  point: OperatingPoint) -> DraftSelection | None:
    """Time the best-estimated drafting schemes (on `held_texts`, all the held-out texts); keep the fastest that
    holds, and make lossless mode the default (`"auto"`) where it timed faster than exit mode (`point`). None where
    no scheme was timed (`costs` None, or no `draft_trials`)."""
    tide, opts = ctx.tide, ctx.opts
    if costs is None or not opts.draft_trials:
        return None
    max_draft = ctx.cfg.generation_config.max_draft or 8
    depth = min(max_draft, NGRAM_DEPTH)  # trees' n-gram branches, at most this deep
    candidates = timed_schemes(draft_candidates(held.ranks(), ctx.num_layers, costs, max_draft,
                                                chain_ranks=held.chain_ranks(), restricted=held.restricted(),
                                                head_rows=tide.num_head_rows, ngram=NGRAM, ngram_depth=depth),
                               opts.draft_trials)
    tide.draft_vocabulary = ranked  # for the trials; cut to the chosen scheme's below
    # the trials cut when it is spent
    options = {"spent": ctx.budget.spent} if ctx.budget.seconds is not None else {}
    if depth != NGRAM_DEPTH:  # a configured max_draft below it
        options["ngram_depth"] = depth
    with ctx.phases("timing trials"):
        procs = ctx.procs
        if procs.world > 1 and procs.own_devices(tide.base.device):  # each times a share on its own device
            selection = choose_draft(tide, ctx.tokenizer, held_texts, candidates, procs=procs, **options)
        else:  # processes that share a device would time each other's load: the main process times alone
            selection = procs.on_main(lambda: choose_draft(tide, ctx.tokenizer, held_texts, candidates, **options))
    draft_selection = DraftSelection.from_dict(selection)
    chosen = draft_selection.chosen
    exit_timing = as_record(point.exit_timing, ExitTiming)
    exit_speed = exit_timing.measured if exit_timing and exit_timing.active else 1.0
    lossless_wins = chosen is not None and chosen.measured > exit_speed
    vocab = (chosen.draft_vocab_size or 0) if chosen else 0
    # kept whole (the largest candidate size, a few KB): the chosen drafts read its first `vocab` ids, and a
    # call may ask for another `draft_vocab_size`
    tide.draft_vocabulary = ranked
    ctx.cfg.set_generation_defaults(draft_layer=chosen.draft_layer if chosen else None,
                                    max_draft=chosen.max_draft if chosen else 0,
                                    draft_topk=chosen.draft_topk if chosen else 1,
                                    draft_vocab_size=vocab, draft_ngram=(chosen.draft_ngram or 0) if chosen else 0,
                                    head_drafts=(chosen.head_drafts is not False) if chosen else True,
                                    mode="auto" if lossless_wins else "exit")
    return draft_selection


def time_default_compiled(ctx: Context, prompts: list | None) -> Timing | None:
    """Time the default mode compiled against the base model's compiled decode (`compiled_modes`), with
    `compiled_trials`; None where not timed."""
    default = _default_run(ctx.cfg) if prompts is not None and ctx.opts.compiled_trials else None
    if default is None:
        return None
    with ctx.phases("timing trials"):
        timing = ctx.procs.on_main(lambda: time_compiled(ctx.tide, prompts, default)
                                   if ctx.budget.allows("the default mode compiled") else None)
    if timing is None:
        return None
    compiled_timing = Timing.from_dict(timing)
    ctx.cfg.set_generation_defaults(compiled_modes=compiled_timing.active)
    return compiled_timing


def _default_run(cfg: TideConfig) -> dict | None:
    """The `tide_config` a single-sequence call runs at the repo's defaults, or None where that is the base model."""
    generation = cfg.generation_config
    if generation.mode == "auto" and generation.max_draft:
        return lossless_config(generation.to_dict())
    if any(t < 1.0 for t in (cfg.thresholds or {}).values()):
        return {"mode": "exit", "thresholds": dict(cfg.thresholds)}
    return None
