"""Calibration's timing-trial phases, after the thresholds (`trials` holds the trials themselves): the drafting
schemes estimated best, timed against the base model (not those the measured costs price below
`MIN_TIMED_ESTIMATE`), and lossless mode made the default where it timed faster than exit mode (`choose_drafts`);
then the default mode timed compiled against the base model's compiled decode
(`time_default_compiled`), and greedy draft chains compiled, each cycle one graph (`compiled_chains`). Each sets the
generation defaults of the repo it decides."""

from __future__ import annotations

import torch

from ..config import TideConfig
from ..records import DraftRecord, DraftSelection, ExitTiming, Timing, as_record
from .costs import draft_candidates
from .heldout import Heldout
from .operating import OperatingPoint
from .phases import Context
from .trials import NGRAM, NGRAM_DEPTH, choose_draft, lossless_config, time_compiled, timed_schemes

__all__ = ["choose_drafts", "time_default_compiled", "compiled_chains", "COMPILED_CHAIN_DRAFTS", "MIN_TIMED_ESTIMATE"]

# A drafting scheme is timed only where the measured costs and the held-out drafts estimate it at least this much of
# the base model's speed. The estimates have erred both ways: x1.23 estimated against x1.01 timed on the shipped
# model, and on a random 262,144-token model on a loaded machine x0.46-0.50 against x0.68-0.77 timed (the timing
# 1.45-1.6 times the estimate); they also leave out a tree's n-gram branches, which added x0.14 on SmolLM2's chat
# (docs/benchmarks.md). A scheme estimated below x0.6 would have to time 1.7 times its estimate to be kept
# (`trials.KEEP_SPEEDUP`), while each of its timings costs a few hundred decode steps.
MIN_TIMED_ESTIMATE = 0.6

# The greedy drafts timed compiled (`compiled_chains`), as (chain length, n-gram drafts, the head's candidates for
# the first position): a chain of one, a chain of two with n-gram drafts, and two candidates for one position (a
# tree, `decode/lossless/graphtree.py`). A compiled cycle is one graph, so its cost beyond a base step is the drafts'
# passes and the verification's width: on SmolLM2-135M (draft layer 3 of 30, chat) the chains timed x1.10-1.12 of the
# compiled base and the two candidates x1.06; on the shipped model's quotes the two candidates x1.07 and the chain
# of two with n-gram drafts x0.97 (docs/benchmarks.md).
COMPILED_CHAIN_DRAFTS = ((1, 0, 1), (2, NGRAM, 1), (1, 0, 2))


def choose_drafts(ctx: Context, held: Heldout, costs, ranked: torch.Tensor | None, held_texts: list[str],
                  point: OperatingPoint) -> DraftSelection | None:
    """Time the best-estimated drafting schemes (on `held_texts`, all the held-out texts); keep the fastest that
    holds, and make lossless mode the default (`"auto"`) where it timed faster than exit mode (`point`). None where
    no scheme was timed (`costs` None, or no `draft_trials`): the repo then keeps the ranked vocabulary `ranked`, for
    calls that name a `draft_vocab_size`, and no drafting scheme."""
    tide, opts = ctx.tide, ctx.opts
    # kept whole (the largest candidate size, a few KB), timed schemes or not: the trials and the chosen drafts read
    # its first `draft_vocab_size` ids, and a call may ask for another `draft_vocab_size`
    tide.draft_vocabulary = ranked
    if costs is None or not opts.draft_trials:
        return None
    max_draft = ctx.cfg.generation_config.max_draft or 8
    depth = min(max_draft, NGRAM_DEPTH)  # trees' n-gram branches, at most this deep
    estimated = draft_candidates(held.ranks(), ctx.num_layers, costs, max_draft, chain_ranks=held.chain_ranks(),
                                 restricted=held.restricted(), head_rows=tide.num_head_rows, ngram=NGRAM,
                                 ngram_depth=depth)
    candidates, untimed = schemes_to_time(estimated, opts.draft_trials)
    # the trials cut by the seconds it has left
    options = {"left": ctx.budget.left} if ctx.budget.seconds is not None else {}
    if depth != NGRAM_DEPTH:  # a configured max_draft below it
        options["ngram_depth"] = depth
    selection = {"trials": [], "chosen": None}  # nothing to time
    with ctx.phases("timing trials"):
        procs = ctx.procs
        if not candidates:
            pass
        elif procs.world > 1 and procs.own_devices(tide.base.device):  # each times a share on its own device
            selection = choose_draft(tide, ctx.tokenizer, held_texts, candidates, procs=procs, **options)
        else:  # processes that share a device would time each other's load: the main process times alone
            selection = procs.on_main(lambda: choose_draft(tide, ctx.tokenizer, held_texts, candidates, **options))
    draft_selection = DraftSelection.from_dict(selection)
    draft_selection.untimed = [DraftRecord.from_dict({k: v for k, v in scheme._asdict().items()
                                                      if k != "draft_ngram" or v}) for scheme in untimed]
    chosen = draft_selection.chosen
    exit_timing = as_record(point.exit_timing, ExitTiming)
    exit_speed = exit_timing.measured if exit_timing and exit_timing.active else 1.0
    lossless_wins = chosen is not None and chosen.measured > exit_speed
    vocab = (chosen.draft_vocab_size or 0) if chosen else 0
    ctx.cfg.set_generation_defaults(draft_layer=chosen.draft_layer if chosen else None,
                                    max_draft=chosen.max_draft if chosen else 0,
                                    draft_topk=chosen.draft_topk if chosen else 1,
                                    draft_vocab_size=vocab, draft_ngram=(chosen.draft_ngram or 0) if chosen else 0,
                                    head_drafts=(chosen.head_drafts is not False) if chosen else True,
                                    mode="auto" if lossless_wins else "exit")
    return draft_selection


def schemes_to_time(estimated: list, count: int) -> tuple[list, list]:
    """(the schemes to time: `trials.timed_schemes` of those estimated at `MIN_TIMED_ESTIMATE` or more, the schemes
    it would have timed besides, had the estimates not ruled them out) from `estimated` (`costs.draft_candidates`)."""
    timed = timed_schemes([s for s in estimated if s.estimate >= MIN_TIMED_ESTIMATE], count)
    untimed = [s for s in timed_schemes(estimated, count) if s.estimate < MIN_TIMED_ESTIMATE]
    return timed, untimed


def time_default_compiled(ctx: Context, prompts: list | None,
                          selection: DraftSelection | None = None) -> tuple[Timing | None, list[dict] | None]:
    """With `compiled_trials`: time the default mode compiled against the base model's compiled decode
    (`compiled_modes`), then the greedy chains of `compiled_chains(selection)`; the fastest chain that was kept
    and timed faster than the default mode compiled becomes the repo's `compiled_chain`. (The default mode's
    timing or None, the chains' timings or None.)"""
    if prompts is None or not ctx.opts.compiled_trials:
        return None, None
    default, compiled_timing = _default_run(ctx.cfg), None
    with ctx.phases("timing trials"):
        if default is not None:
            timing = ctx.procs.on_main(lambda: time_compiled(ctx.tide, prompts, default)
                                       if ctx.budget.allows("the default mode compiled") else None)
            compiled_timing = Timing.from_dict(timing) if timing is not None else None
        chains = []
        for chain in compiled_chains(selection):
            config = {"mode": "lossless", "draft_topk": 1, **chain}
            timing = ctx.procs.on_main(lambda config=config: time_compiled(ctx.tide, prompts, config)
                                       if ctx.budget.allows(_chain_text(chain)) else None)
            if timing is not None:
                chains.append({"chain": chain, **timing})
    if compiled_timing is not None:
        ctx.cfg.set_generation_defaults(compiled_modes=compiled_timing.active)
    bar = compiled_timing.measured if compiled_timing is not None and compiled_timing.active else 0.0
    kept = [c for c in chains if c["active"] and c["measured"] > bar]
    if kept:
        ctx.cfg.set_generation_defaults(compiled_chain=max(kept, key=lambda c: c["measured"])["chain"])
    return compiled_timing, chains or None


def _chain_text(chain: dict) -> str:
    ngram = f" with n-gram drafts (draft_ngram={chain['draft_ngram']})" if chain["draft_ngram"] else ""
    if chain.get("draft_topk", 1) > 1:
        return f"{chain['draft_topk']} candidates for one position from layer {chain['draft_layer']}{ngram}, compiled"
    return f"a chain of {chain['max_draft']} from layer {chain['draft_layer']}{ngram}, compiled"


def compiled_chains(selection: DraftSelection | None) -> list[dict]:
    """The greedy drafts calibration times compiled: from the draft layer and vocabulary of the scheme that timed
    fastest eagerly (kept or not), one per `COMPILED_CHAIN_DRAFTS` (a chain's length, its n-gram drafts, the
    candidates for the first position where more than one). None where no scheme was timed."""
    timed = [t for t in (selection.trials if selection else []) if t.draft_layer is not None and t.measured]
    if not timed:
        return []
    best = max(timed, key=lambda t: t.measured)
    return [{"draft_layer": best.draft_layer, "max_draft": drafts, "draft_vocab_size": best.draft_vocab_size or 0,
             "draft_ngram": ngram, **({"draft_topk": topk} if topk > 1 else {})}
            for drafts, ngram, topk in COMPILED_CHAIN_DRAFTS]


def _default_run(cfg: TideConfig) -> dict | None:
    """The `tide_config` a single-sequence call runs at the repo's defaults, or None where that is the base model."""
    generation = cfg.generation_config
    if generation.mode == "auto" and generation.max_draft:
        return lossless_config(generation.to_dict())
    if any(t < 1.0 for t in (cfg.thresholds or {}).values()):
        return {"mode": "exit", "thresholds": dict(cfg.thresholds)}
    return None
