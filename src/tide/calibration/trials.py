"""What calibration keeps is what timed faster here: exit mode and drafting schemes, timed against the base model.

A mode is kept only when it is `KEEP_SPEEDUP` times faster than the base model's `generate` in two timings on
this machine (`kept`); exits kept for one sequence are also timed on a batch (`time_exit`). Drafting schemes are
chosen for timing by their estimates (`timed_schemes`) and the fastest that holds is kept (`choose_draft`).
The repo's default mode is then timed compiled against the base model's compiled decode (`time_compiled`), the
baseline of a call with `compile=True`. Every timing is `measured_speedup`: a mode's decode speed over the base
model's, runs alternating. Where calibration runs on processes that each have a device of their own (GPUs, or
CPU processes pinned to disjoint cores), the drafting schemes are dealt out among them (`choose_draft(procs=)`).
This module times `generate`; it trains nothing and selects no threshold.
"""

from __future__ import annotations

import itertools
import statistics
from contextvars import ContextVar

import torch

from ..decode.lossless.verifier import LosslessUnavailable
from .distributed import Processes
from .measure import seconds_of, timing_kwargs

__all__ = ["measured_speedup", "COMPILED_BASE", "KEEP_SPEEDUP", "BATCH_TIMING_ROWS", "timing_prompts", "timing_batch",
           "timed", "kept", "time_exit", "time_compiled", "time_ngram", "timed_schemes", "choose_draft",
           "lossless_config", "NGRAM", "NGRAM_DEPTH", "NGRAM_ONLY"]


# `tide_config` that runs the base model's compiled static-cache decode (`decode.baseline.BaseSession`).
COMPILED_BASE = {"compile": True, "compiled_modes": False}


def measured_speedup(model, prompts: list[torch.Tensor], tide_config: dict, new_tokens: int = 24, repeats: int = 3,
                     baseline: str = "generate", bar: float | None = None) -> float:
    """Decode tokens/s of `model.generate(..., tide_config=...)` over the base model's, greedy, measured here.

    `baseline`: "generate" (the base model's `generate`) or "compiled" (its compiled static-cache decode; the
    config then runs compiled too). Runs alternate between the two and the median of the per-repeat ratios is
    returned. `bar`: the repeats stop once more than half of them timed below it (the median of all `repeats`
    would be below it too, so the mode is not kept either way); the median of those timed is returned.
    Eager runs warm up on the first prompt (one call makes what later calls reuse); compiled runs on each prompt
    (a prompt length may make another graph). Inside `kept(accepted=True)`, each Tide run's accepted drafts and
    verification passes are counted (`_COUNTS`).
    """
    if baseline not in ("generate", "compiled"):
        raise ValueError(f"baseline must be 'generate' or 'compiled', got {baseline!r}.")
    kwargs = timing_kwargs(model, new_tokens)
    if baseline == "compiled":
        tide_config = {**tide_config, "compile": True}

    def seconds(fn):
        return sum(seconds_of(lambda ids=ids: fn(ids)) for ids in prompts)

    counts = _COUNTS.get()

    def tide_run(ids):
        out = model.generate(ids, tide_config=tide_config, **kwargs)
        stats = model.last_stats if counts is not None else None
        if stats is not None:
            counts["accepted"] = counts.get("accepted", 0) + stats.accepted
            counts["cycles"] = counts.get("cycles", 0) + stats.verify_passes
            # positions verified: the last token's, each chain draft and n-gram token, a tree's candidates
            counts["verified"] = counts.get("verified", 0) + (stats.verify_passes + stats.drafted
                                                              + stats.tree_cycles * (stats.draft_topk - 1))
        return out

    def base_run(ids):
        if baseline == "compiled":
            return model.generate(ids, tide_config=COMPILED_BASE, **kwargs)
        return model.base.generate(ids, **kwargs)

    warm = prompts if baseline == "compiled" else prompts[:1]
    for ids in warm:
        tide_run(ids), base_run(ids)
    ratios, below, majority = [], 0, repeats // 2 + 1
    for _ in range(repeats):
        ratios.append(seconds(base_run) / seconds(tide_run))
        below += bar is not None and ratios[-1] < bar
        if below >= majority:
            break
    return statistics.median(ratios)


def timing_prompts(tokenizer, texts, device, whole: bool = False) -> list[torch.Tensor]:
    """Four prompts: the first 16 tokens of `texts`, or with `whole` the texts themselves (prompts written for the
    model, e.g. through its chat template)."""
    # Four prompts, 32 new tokens, five alternating repeats (see `timed`): with two prompts of 24 tokens and three
    # repeats, one tree scheme on the shipped model timed x0.95-1.13 across runs (docs/benchmarks.md).
    if whole:
        return [tokenizer(t, return_tensors="pt", add_special_tokens=False).input_ids.to(device) for t in texts[:4]]
    return [torch.tensor([tokenizer(t)["input_ids"][:16]], device=device) for t in texts[:4]]


BATCH_TIMING_ROWS = 8


def timing_batch(tokenizer, texts, device, length: int = 16) -> torch.Tensor | None:
    """[rows, length]: the first `length` tokens of up to `BATCH_TIMING_ROWS` texts that have that many (one
    batch, no padding), to time exit mode on several sequences; None when fewer than 2 texts are long enough."""
    long_enough = (ids[:length] for ids in (tokenizer(t)["input_ids"] for t in texts) if len(ids) >= length)
    rows = list(itertools.islice(long_enough, BATCH_TIMING_ROWS))
    return torch.tensor(rows, device=device) if len(rows) >= 2 else None


# A timed mode is kept only when at least this much faster than the base model: the median of 5 interleaved
# repeats still moves by about 1% between runs (rows of `tide bench` that run the base model: x0.992-1.007;
# a tree that calibration timed at x1.002 ran x0.992 in the bench), and a kept scheme that is really no
# faster costs the user time on every call.
KEEP_SPEEDUP = 1.02


def timed(tide, prompts, tide_config: dict, baseline: str = "generate", bar: float | None = KEEP_SPEEDUP) -> float:
    return measured_speedup(tide, prompts, tide_config, new_tokens=32, repeats=5, baseline=baseline, bar=bar)


# Inside `kept(accepted=True)`: the Tide runs' accepted drafts, verification passes and the positions they verified
# ({"accepted", "cycles", "verified"}).
_COUNTS: ContextVar = ContextVar("tide_trial_counts", default=None)


def kept(tide, prompts, tide_config: dict, first: float | None = None, baseline: str = "generate",
         bar: float = KEEP_SPEEDUP, accepted: bool = False) -> dict:
    """Time `tide_config` against the base model here (`first`: a timing already made); it is kept only when
    two timings both find it `bar` (`KEEP_SPEEDUP`) times faster. {"measured": the lower timing, "timings",
    "active"}.

    One timing is not enough on a shared machine: on the shipped model, the layer-wise engine with no exit (the
    base model's work) timed x0.88-1.04 in six runs of `timed`, and exits that run about 5% slower timed
    x1.054 once and were kept (docs/benchmarks.md).

    `accepted`: also "accepted_per_cycle", the drafts the lossless runs timed here accepted a cycle (where they
    drafted), and "verified_per_cycle", the positions a cycle verified (a tree's n-gram branch only where the text
    repeated), which `decode/machinecheck.py` weighs against another machine's costs."""
    counts = {} if accepted else None
    token = _COUNTS.set(counts)
    try:
        timings = [timed(tide, prompts, tide_config, baseline, bar) if first is None else first]
        if timings[0] >= bar:
            timings.append(timed(tide, prompts, tide_config, baseline, bar))
    finally:
        _COUNTS.reset(token)
    cycles = (counts or {}).get("cycles")
    return {"measured": min(timings), "timings": timings, "active": min(timings) >= bar,
            **({"accepted_per_cycle": counts["accepted"] / cycles, "verified_per_cycle": counts["verified"] / cycles}
               if cycles else {})}


def time_compiled(tide, prompts, tide_config: dict) -> dict:
    """Time the repo's default mode (`tide_config`) compiled against the base model's compiled static-cache
    decode, the baseline of a call with `compile=True` (`kept`); `tide_config` then runs compiled only where it
    is kept (`compiled_modes`). The first call of each compiles; the timings are of later calls."""
    return kept(tide, prompts, tide_config, baseline="compiled", accepted=True)


def time_exit(tide, prompts, batch, thresholds) -> dict:
    """Time exit mode at `thresholds` against the base model here (`kept`), and where it is kept, on `batch`
    [rows, T] too (None: not timed): exits that leave rows of a batch save less (the running rows still run every
    layer) and may not pay there."""
    config = {"mode": "exit", "thresholds": thresholds}
    timing = kept(tide, prompts, config)
    if timing["active"] and batch is not None:
        timing["batch"] = {"rows": batch.shape[0], **kept(tide, [batch], config)}
    return timing


def timed_schemes(candidates: list, count: int) -> list:
    """The `count` drafting schemes calibration times, of different shapes (draft layer, chain length or tree
    width, and whether the tree has n-gram branches), each with its best-estimated draft vocabulary.

    Two sources take turns: the head's own schemes (chains and trees) and trees with n-gram branches
    (`draft_ngram > 0`, where `candidates` hold them); the head's first, then the other source's, and so on. A
    source with nothing left gives its turn to the other. Within a source: its best-estimated scheme, then each
    time its best-estimated one that verifies at most half as many positions per cycle as its last one taken
    (else its next best-estimated shape).

    The estimate is least sure of what a wide verification costs: on CPU a pass over 4 or more rows can cost a
    jump, and a cycle's own work is one measured average. On a hidden-256 Qwen3 it ranked trees of 8, 7 and 6
    first (timed x0.995-1.018) where a tree of 3 timed x1.056, and on the shipped model trees of 8, 7 and 6
    too. Trials spread over verification widths let the timing choose between them. It knows nothing of n-gram
    branches (they pay where the text repeats itself, and cost a lookup elsewhere): a tree with them is estimated as
    the tree without them, and the turns make sure one is timed."""
    pools = [[s for s in candidates if not _ngram(s)], [s for s in candidates if _ngram(s)]]
    seen, out, widths, turn = set(), [], [None, None], 0
    while len(out) < count:
        pools = [[s for s in pool if _shape(s) not in seen] for pool in pools]
        if not any(pools):
            break
        if not pools[turn]:
            turn = 1 - turn
        pool, width = pools[turn], widths[turn]
        narrower = [s for s in pool if width is not None and _verified_positions(s) <= width // 2]
        pick = (narrower or pool)[0]
        seen.add(_shape(pick))
        out.append(pick)
        widths[turn], turn = _verified_positions(pick), 1 - turn
    return out


def _ngram(scheme) -> int:
    return getattr(scheme, "draft_ngram", 0) or 0


def _shape(scheme) -> tuple:
    return scheme.draft_layer, scheme.max_draft, scheme.draft_topk, _ngram(scheme)


def _verified_positions(scheme) -> int:
    """Positions one verification covers at most: the drafted-from token and a tree's candidates (and its
    n-gram branch, `max_draft` deep at most) or a chain's drafts."""
    if scheme.draft_topk > 1:
        return 1 + scheme.draft_topk + (scheme.max_draft if _ngram(scheme) else 0)
    return 1 + scheme.max_draft


def _scheme_dict(scheme) -> dict:
    """A `DraftScheme` as a trial's record: `draft_ngram` only where the scheme has n-gram branches."""
    out = scheme._asdict()
    if not out.get("draft_ngram"):
        out.pop("draft_ngram", None)
    return out


def choose_draft(tide, tokenizer, texts, candidates, left=None, procs=None, ngram_depth: int | None = None) -> dict:
    """Time the best-estimated drafting schemes against the base model here, once each; then the fastest again
    (`kept`), and the next fastest while one is not kept. The chosen scheme is the first kept, or none (lossless
    mode then decodes plainly). A kept scheme without n-gram drafts is then timed with them (`time_ngram`; a tree's
    n-gram branches go `ngram_depth` deep, default `NGRAM_DEPTH`); a kept tree with n-gram branches was timed with
    them already. Where no scheme is kept, n-gram drafts alone are timed (`NGRAM_ONLY`); where they do not pay
    either, nothing is chosen and lossless mode runs the base model.

    `left` (calibration's `timing_budget_s`): the seconds the budget has left. A scheme's first timing starts only
    while twice the last one's seconds are left (room for it and for the fastest scheme's second timing); those
    not started are listed in "cut". The fastest scheme timed once always gets its second timing, which keeping it
    needs (a scheme faster in one timing is worth the confirmation), so the trials end near the budget, not a
    trial past it.

    `procs` (processes that each have a device of their own): the schemes are dealt out, each process timing its
    share against the base model on its own device, in rounds of one scheme per process; every process returns the
    same selection. Without it, this process times them all."""
    procs = procs or Processes()
    room = _Room(_agreed(procs, left))
    prompts = timing_prompts(tokenizer, texts, tide.base.device)
    trials, cut, timed_by = [], [], [0] * procs.world  # schemes each process timed
    for start in range(0, len(candidates), procs.world):
        round_ = candidates[start: start + procs.world]
        if not room.fits(2):
            cut += [_scheme_dict(scheme) for scheme in candidates[start:]]
            break
        ratios = room.timed(lambda: procs.deal(round_, lambda scheme: _timed_or_unavailable(tide, prompts, scheme)))
        for rank in range(len(round_)):
            timed_by[rank] += 1
        for scheme, ratio in zip(round_, ratios):
            if isinstance(ratio, str):  # e.g. sliding-window caches that cannot roll back
                return {"trials": trials, "chosen": None, "unavailable": ratio}
            trials.append({**_scheme_dict(scheme), "measured": ratio})
    ranked = [t for t in sorted(trials, key=lambda t: -t["measured"]) if t["measured"] >= KEEP_SPEEDUP]
    for start in range(0, len(ranked), procs.world):  # the fastest first; the next ones if it is not kept
        if start and not room.fits(1):  # the fastest always gets its second timing
            break
        round_ = ranked[start: start + procs.world]
        timings = procs.deal(round_, lambda trial: kept(tide, prompts, lossless_config(trial), first=trial["measured"],
                                                        accepted=True))
        for rank in range(len(round_)):
            timed_by[rank] += 1
        for trial, timing in zip(round_, timings):
            trial["timings"] = timing["timings"]
        chosen = next(({**trial, "measured": timing["measured"],
                        **{k: v for k, v in timing.items() if k in ("accepted_per_cycle", "verified_per_cycle")}}
                       for trial, timing in zip(round_, timings) if timing["active"]), None)
        if chosen is not None:
            selection = {"trials": trials, "chosen": chosen, **({"cut": cut} if cut else {}), **_shares(timed_by)}
            if chosen.get("draft_ngram"):  # a tree with n-gram branches: timed with them
                return selection
            twin = _ngram_twin(trials, chosen, ngram_depth)  # the same tree with n-gram branches, timed above
            ngram = procs.on_main(lambda: time_ngram(tide, prompts, chosen, ngram_depth, first=twin)) \
                if room.fits(2) else None
            chosen["draft_ngram"] = NGRAM if ngram and ngram["active"] else 0
            if ngram and ngram["active"]:
                chosen["max_draft"] = ngram.get("max_draft", chosen["max_draft"])  # a tree's branches' depth
                # what a cycle accepted and verified with the n-gram drafts kept (the pay check weighs these)
                chosen.update({k: v for k, v in ngram.items() if k in ("accepted_per_cycle", "verified_per_cycle")})
            return {**selection, "ngram": ngram, **({"ngram_cut": True} if ngram is None else {})}
    selection = {"trials": trials, "chosen": None, **({"cut": cut} if cut else {}), **_shares(timed_by)}
    if trials and room.fits(2):  # no head scheme pays: n-gram drafts alone, plain steps elsewhere
        _time_ngram_only(selection, procs.on_main(lambda: kept(tide, prompts, NGRAM_ONLY)))
    return selection


class _Room:
    """The timing budget as the trials see it: `fits(timings)` while that many timings as long as the last round
    are left (always, without a budget: `left` None), and `timed(run)` runs a round and keeps its length (by the
    budget's clock)."""

    def __init__(self, left):
        self.left, self.last = left, 0.0

    def fits(self, timings: int) -> bool:
        return self.left is None or self.left() > timings * self.last

    def timed(self, run):
        began = self.left() if self.left is not None else 0.0
        result = run()
        self.last = began - self.left() if self.left is not None else 0.0
        return result


def _time_ngram_only(selection: dict, timing: dict) -> None:
    """Record n-gram drafts alone (`NGRAM_ONLY`), timed, in `selection`, and choose them where they were kept."""
    selection["ngram_only"] = timing
    if timing["active"]:
        selection["chosen"] = {"draft_layer": None, "max_draft": NGRAM_ONLY["max_draft"], "draft_topk": 1,
                               "draft_vocab_size": 0, "draft_ngram": NGRAM, "head_drafts": False,
                               "measured": timing["measured"], "timings": timing["timings"]}


def _ngram_twin(trials: list[dict], chosen: dict, depth: int | None) -> float | None:
    """The first timing of the chosen tree with n-gram branches, where it was among the trials (None: not timed,
    or the chosen scheme is a chain)."""
    if chosen.get("draft_topk", 1) <= 1:
        return None
    key = ("draft_layer", "draft_topk", "draft_vocab_size")
    return next((t["measured"] for t in trials
                 if t.get("draft_ngram") == NGRAM and t["max_draft"] == (depth or NGRAM_DEPTH)
                 and all(t.get(k) == chosen.get(k) for k in key)), None)


def _shares(timed_by: list[int]) -> dict:
    """Where processes shared the trials: the schemes each timed (first timings and second ones), in rank order."""
    return {"schemes_timed_per_rank": timed_by} if len(timed_by) > 1 else {}


def _timed_or_unavailable(tide, prompts, scheme) -> float | str:
    try:
        return timed(tide, prompts, lossless_config(scheme._asdict()))
    except LosslessUnavailable as err:
        return str(err)


def _agreed(procs, left):
    """`left`, read by the main process for all of them (each process's own clock would differ)."""
    if left is None or procs.world == 1:
        return left
    return lambda: procs.on_main(left)


# n-gram drafts: the longest n-gram matched (`draft_ngram`), where calibration keeps them.
NGRAM = 3
# The deepest n-gram branch of a tree calibration times (its `max_draft`; at most the configured `max_draft`).
NGRAM_DEPTH = 4
# Where no head scheme pays: n-gram continuations of up to 4 tokens, and plain steps through Tide's loop elsewhere.
NGRAM_ONLY = {"mode": "lossless", "max_draft": NGRAM_DEPTH, "draft_ngram": NGRAM, "head_drafts": False}


def time_ngram(tide, prompts, chosen: dict, depth: int | None = None, first: float | None = None) -> dict:
    """Time the chosen scheme with n-gram drafts (`draft_ngram=NGRAM`) against the base model. They are kept
    unless they time slower than the scheme alone by more than the timing's noise (`KEEP_SPEEDUP`): a lookup per
    cycle costs microseconds, so on text that does not repeat they time as the scheme does, and on text that
    repeats (code, lists, quoted passages) they draft for free. A chain's continuations are up to its length; a
    tree's are a branch of the tree up to `depth` tokens deep (default `NGRAM_DEPTH`; its `max_draft`, recorded
    here as "max_draft"). `first`: a timing of that configuration already made (`kept`). The timing holds the drafts
    a cycle accepted and the positions it verified in the runs made here (`kept(accepted=True)`)."""
    config = {**lossless_config(chosen), "draft_ngram": NGRAM}
    tree = chosen.get("draft_topk", 1) > 1
    if tree:
        config["max_draft"] = depth or NGRAM_DEPTH
    timing = kept(tide, prompts, config, first=first, bar=chosen["measured"] / KEEP_SPEEDUP, accepted=True)
    return {"draft_ngram": NGRAM, **({"max_draft": config["max_draft"]} if tree else {}), **timing}


def lossless_config(scheme: dict) -> dict:
    """The lossless `tide_config` of a drafting scheme (a trial's, or the generation defaults' `to_dict()`)."""
    keys = ("draft_layer", "max_draft", "draft_topk", "draft_vocab_size", "draft_ngram", "head_drafts")
    return {"mode": "lossless", **{k: scheme[k] for k in keys if k in scheme}}
