"""The check through the decode step: the selected thresholds decoded teacher-forced on held-out tokens
(`validation_tokens`), with the configured KV strategy, and the per-exit budget lowered until the decoded
agreement's lower confidence bound reaches the target (`validate`), for `MAX_VALIDATION_ROUNDS` rounds at most."""

from __future__ import annotations

from .distributed import Processes
from .evaluate import teacher_forced
from .options import CalibrationOptions
from .thresholds import EXIT_ERROR_BUDGETS, allowed_errors, binomial_upper_bound, next_budget
from .trials import KEEP_SPEEDUP

__all__ = ["validate", "validation_tokens", "MAX_VALIDATION_ROUNDS", "SavesTooLittle"]


# Rounds of the check through the decode step: each decodes every validation token again (on a 30-layer model,
# 1,024 tokens took about 70 s a round on one core, and a model whose exits rarely agree took 14 rounds); where the
# target still fails after these, nothing exits.
MAX_VALIDATION_ROUNDS = 4


class SavesTooLittle(str):
    """A dropped checkpoint's reason (`dropped`'s value) where its exits would save too little to be kept: what
    calibration's warning tells apart from exits that missed the agreement target."""


def validation_tokens(texts, tokenizer, opts: CalibrationOptions) -> list[list[int]]:
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


def validate(tide, token_lists, selection, dropped, target: float, procs: Processes):
    """Check the target through the decode step itself (teacher-forced, with the configured KV strategy,
    whose approximate K/V for skipped layers also changes later tokens); lower the per-exit budget until
    the one-sided lower confidence bound on the decoded agreement reaches the target.
    Each process decodes its share of the tokens (`token_lists`: its held-out texts'); the counts are summed
    over the processes, so the bound is the one a process decoding them all would compute.
    In one process, a round stops decoding once it has seen more disagreements than the whole round may have (it
    fails then, whatever the rest would give): on SmolLM2-135M-Instruct at a 0.9 target, whose decoded exits
    agreed on 0.906, its four rounds decoded 2,485 tokens instead of 4,096 (at the default 0.99, 1,024 tokens may
    hold 4 disagreements); the next budget is then estimated from the disagreements projected to the round's
    tokens. (Processes decode their whole shares, so that the counts, and the budgets chosen from them, are the
    ones one process decoding everything finds.)
    Exits that would speed a whole decode step less than a timing's keep margin (`step_speedup`: before a round
    by the held-out scores, after one by the layers it decoded, whether or not it held the target) are dropped with
    a `SavesTooLittle` reason, and not timed.
    Returns (selection, dropped, {agreement, tokens, lower_bound, exit_error_budget, mean_layers, tokens_per_rank:
    the tokens each process decoded in all rounds, stopped_early where the last round stopped early})."""
    held = tide.heldout_selection
    decoded = 0  # tokens this process decoded, all rounds
    planned = int(procs.sum([sum(max(len(ids) - 2, 0) for ids in token_lists)])[0])  # a whole round's tokens
    allowed = allowed_errors(planned, target, held.confidence)
    stop = allowed if procs.world == 1 else None
    result = None
    for round_ in range(MAX_VALIDATION_ROUNDS):
        expected = held.step_speedup(selection)
        if expected is not None and expected < KEEP_SPEEDUP and selection.exit_error_budget > 0.0:
            # exits that would speed a step less than the timing's keep margin even at their expected layers: the
            # timing after the check would turn them off, so they are neither checked nor timed
            return (*_saving_too_little(held, selection, dropped, target, expected, "by the held-out scores"),
                    result)
        run = tide.config.resolve_generation({"thresholds": held.thresholds(selection, tide.checkpoints),
                                              "exit_threshold": None, "mode": "exit"})
        active = any(t < 1.0 for t in run.thresholds.values())
        report = teacher_forced(tide, token_lists, run, stop_after_errors=stop) if active else None
        if report is None:  # nothing exits (any earlier rounds' decoded tokens are kept for the phase record)
            return selection, dropped, None
        decoded += report.tokens
        held.decoded_per_rank = [int(r[0]) for r in procs.per_rank([decoded])]
        agreeing, tokens, layers, stopped = procs.sum(  # a process with no share adds zeros
            [report.agreement * report.tokens, report.tokens,
             report.mean_layers * report.tokens if report.tokens else 0.0, float(report.stopped)])
        tokens = int(tokens)
        errors = tokens - round(agreeing)
        bound = 1.0 - binomial_upper_bound(errors, tokens, held.confidence)
        result = {"agreement": agreeing / max(tokens, 1), "tokens": tokens, "lower_bound": bound,
                  "exit_error_budget": selection.exit_error_budget, "mean_layers": layers / max(tokens, 1),
                  "tokens_per_rank": held.decoded_per_rank, **({"stopped_early": True} if stopped else {})}
        decoded_speedup = held.step_speedup(selection, result["mean_layers"])
        if decoded_speedup is not None and decoded_speedup < KEEP_SPEEDUP:
            # held or not, the timing would turn them off (and a smaller budget exits less): not timed
            return (*_saving_too_little(held, selection, dropped, target, decoded_speedup, "by the tokens decoded"),
                    result)
        if bound >= target:
            return selection, dropped, result
        smaller = [b for b in EXIT_ERROR_BUDGETS if b < selection.exit_error_budget]
        if not smaller or round_ == MAX_VALIDATION_ROUNDS - 1:  # no budget left to try, or no round: no exits
            selection, dropped = held.select(target, max_budget=0.0)
            return selection, dropped, result
        selection, dropped = held.select(target, max_budget=next_budget(
            smaller, selection.exit_error_budget, round(errors * planned / max(tokens, 1)), allowed))


def _saving_too_little(held, selection, dropped: dict, target: float, speedup: float, where: str):
    """No exits, each checkpoint the selection consulted dropped with why: its exits save too little."""
    why = SavesTooLittle(f"the exits would make a decode step x{speedup:.3f} faster {where}, below the "
                         f"x{KEEP_SPEEDUP} a timing keeps")
    consulted = {row.layer: why for row in selection.checkpoints if row.threshold < 1.0}
    selection, _ = held.select(target, max_budget=0.0)
    return selection, {**dropped, **consulted}
