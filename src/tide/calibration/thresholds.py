"""Threshold selection with a statistical guarantee: pure math, no models, no I/O.

The guarantee is on what a user is told: the top-1 agreement of *all* tokens with the full model. The
cascade is indexed by a per-exit error budget `eps`: at each checkpoint, in exit order, the threshold is
the lowest candidate (scanned from high to low, stopping at the first failure) whose exiting tokens
disagree with the full model at a rate of at most `eps`; tokens that exit at an earlier checkpoint are
removed before the next checkpoint is calibrated, as generation runs the cascade. Budgets are tried from
small to large (Learn-then-Test's fixed sequence) and the largest one kept is the last for which the
one-sided Clopper-Pearson upper bound on the overall disagreement rate, over all held-out tokens, is at
most `1 - target_agreement` at the stated confidence.

The check through the decode step (`validation.validate`) then lowers the budget while the decoded agreement's
bound misses the target: `allowed_errors` (the disagreements a count of decoded tokens allows) and `next_budget`
(the budget it checks next).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..heads.router import exit_decision

__all__ = ["auc", "binomial_upper_bound", "select_threshold", "calibrate_cascade", "CascadeSelection",
           "CheckpointCalibration", "oracle_depth", "tokens_for_bound", "kept_nothing_message", "allowed_errors",
           "next_budget"]

NEVER = 1.0  # scores are sigmoids in [0, 1] and a token exits when score > threshold
# Per-exit error budgets tried, in this fixed order, by `calibrate_cascade`.
EXIT_ERROR_BUDGETS = tuple(round(0.001 * 1.25**i, 6) for i in range(30))  # 0.001 ... ~0.65


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k)."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    i = torch.arange(k + 1, dtype=torch.float64)
    log_terms = (
        math.lgamma(n + 1)
        - torch.lgamma(i + 1)
        - torch.lgamma(n - i + 1)
        + i * math.log(p)
        + (n - i) * math.log1p(-p)
    )
    return float(torch.logsumexp(log_terms, 0).exp().clamp(max=1.0))


@functools.lru_cache(maxsize=65536)
def binomial_upper_bound(errors: int, n: int, confidence: float) -> float:
    """One-sided Clopper-Pearson upper bound on a rate after `errors` in `n` trials (kept per arguments: threshold
    selection asks for the same bounds many times)."""
    if n == 0:
        return 1.0
    if errors >= n:
        return 1.0
    alpha = 1.0 - confidence
    lo, hi = errors / n, 1.0
    # a bracket a few standard deviations wide (checked), so that the bisection's steps are spent near the bound
    wide = min(1.0, lo + 8.0 * math.sqrt(max(lo * (1.0 - lo), 1.0 / n) / n) + 8.0 / n)
    if _binom_cdf(errors, n, wide) <= alpha:
        hi = wide
    for _ in range(60):
        mid = (lo + hi) / 2
        if _binom_cdf(errors, n, mid) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def select_threshold(
    scores: torch.Tensor, agree: torch.Tensor, max_error: float, confidence: float | None, num_candidates: int = 64
) -> float:
    """Lowest threshold whose exiting tokens' disagreement rate (its upper bound at `confidence`, or the
    observed rate when `confidence` is None) stays <= max_error.

    scores: [N] float router scores, agree: [N] bool (checkpoint top-1 == full top-1).
    """
    if scores.numel() == 0 or max_error <= 0.0:
        return NEVER
    quantiles = torch.linspace(1.0, 0.0, num_candidates + 1, dtype=torch.float64)[1:]
    candidates = torch.quantile(scores.double(), quantiles).unique().flip(0)  # high -> low
    # Fewer exits than this cannot pass even with zero errors; the scan starts where a pass is possible
    # (a rule on scores alone, so the fixed sequence stays fixed before any label is looked at).
    if confidence is None:
        min_exits = 1
    else:
        min_exits = math.ceil(math.log(1.0 - confidence) / math.log1p(-max_error)) if max_error < 1.0 else 1
    chosen = NEVER
    for t in candidates.tolist():
        exits = exit_decision(scores, t)
        n = int(exits.sum())
        if n < min_exits:
            continue
        errors = int((exits & ~agree).sum())
        rate = errors / n if confidence is None else binomial_upper_bound(errors, n, confidence)
        if rate > max_error:
            break
        chosen = t
    return chosen


@dataclass
class CheckpointCalibration:
    layer: int
    threshold: float
    label_rate: float  # fraction of held-out tokens whose label was positive here
    exit_rate: float  # fraction of all held-out tokens that exit here in the cascade
    heldout_agreement: float | None  # top-1 agreement of the tokens that exit here
    exits: int
    errors: int  # exiting tokens whose checkpoint top-1 differs from the full model's

    def as_dict(self) -> dict:
        return {
            "threshold": self.threshold,
            "label_rate": self.label_rate,
            "exit_rate": self.exit_rate,
            "heldout_agreement": self.heldout_agreement,
            "exits": self.exits,
            "errors": self.errors,
        }


@dataclass
class CascadeSelection:
    checkpoints: list[CheckpointCalibration]
    exit_error_budget: float  # the per-exit budget chosen (0.0: no budget passed, nothing exits)
    agreement_bound: float  # lower confidence bound on held-out overall agreement with these thresholds


def cascade(layers, scores, agree, labels, exit_error: float) -> list[CheckpointCalibration]:
    """Thresholds for each checkpoint in order, each chosen on the tokens still running there."""
    total = next(iter(scores.values())).numel()
    running = torch.ones(total, dtype=torch.bool)
    out = []
    for layer in layers:
        threshold = select_threshold(scores[layer][running], agree[layer][running], exit_error, None)
        exits = torch.zeros_like(running)
        exits[running] = exit_decision(scores[layer][running], threshold)
        n = int(exits.sum())
        out.append(
            CheckpointCalibration(
                layer=layer,
                threshold=threshold,
                label_rate=float(labels[layer].float().mean()),
                exit_rate=n / max(total, 1),
                heldout_agreement=float(agree[layer][exits].float().mean()) if n else None,
                exits=n,
                errors=int((exits & ~agree[layer]).sum()),
            )
        )
        running &= ~exits
    return out


def calibrate_cascade(
    layers: list[int],
    scores: dict[int, torch.Tensor],
    agree: dict[int, torch.Tensor],
    labels: dict[int, torch.Tensor],
    target_agreement: float,
    confidence: float,
    max_budget: float = 1.0,
) -> CascadeSelection:
    """Per-checkpoint thresholds whose held-out overall agreement is >= target at `confidence` (module doc).

    Budgets above `max_budget` are not tried.
    """
    total = next(iter(scores.values())).numel()
    never = [CheckpointCalibration(k, NEVER, float(labels[k].float().mean()), 0.0, None, 0, 0) for k in layers]
    best = CascadeSelection(never, 0.0, 1.0 - binomial_upper_bound(0, total, confidence))
    for budget in (b for b in EXIT_ERROR_BUDGETS if b <= max_budget):
        rows = cascade(layers, scores, agree, labels, budget)
        bound = binomial_upper_bound(sum(r.errors for r in rows), total, confidence)
        if bound > 1.0 - target_agreement:
            break
        best = CascadeSelection(rows, budget, 1.0 - bound)
    return best


def tokens_for_bound(rate: float, target_agreement: float, confidence: float, limit: int = 1 << 24) -> int | None:
    """The fewest held-out tokens n at which `rate` * n disagreements (rounded up) keep the upper confidence bound on
    the disagreement rate at most 1 - target; None where the rate itself is not below it (or n would pass `limit`)."""
    allowed = 1.0 - target_agreement
    if rate >= allowed:
        return None

    def holds(n: int) -> bool:
        return binomial_upper_bound(math.ceil(rate * n - 1e-9), n, confidence) <= allowed

    high = 1
    while not holds(high):
        if high >= limit:
            return None
        high *= 2
    low = high // 2  # fails (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if holds(mid) else (mid, high)
    return high


def allowed_errors(tokens: int, target: float, confidence: float) -> int:
    """The most disagreements in `tokens` decoded tokens whose lower confidence bound still reaches `target`
    (-1 where even none would not)."""
    allowed = -1
    while allowed + 1 < tokens and 1.0 - binomial_upper_bound(allowed + 1, tokens, confidence) >= target:
        allowed += 1
    return allowed



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


def kept_nothing_message(layers: list[int], scores: dict, agree: dict, labels: dict, target_agreement: float,
                         confidence: float, heldout_texts: int, heldout_fraction: float) -> str:
    """Why a calibration kept no exit threshold on its held-out tokens, and how many texts would be needed: per
    budget of `calibrate_cascade`, the disagreement rate its cascade measured here, and the held-out tokens at which
    that rate would pass the confidence bound (`tokens_for_bound`); the fewest of them, scaled to texts."""
    total = next(iter(scores.values())).numel()
    errors = set()  # the measured disagreements of each budget's cascade that lets some token exit
    for budget in EXIT_ERROR_BUDGETS:
        rows = cascade(layers, scores, agree, labels, budget)
        if sum(r.exits for r in rows):
            errors.add(sum(r.errors for r in rows))
    needed = [n for e in sorted(errors) if (n := tokens_for_bound(e / max(total, 1), target_agreement, confidence))]
    head = (f"Calibration kept no exits: on {total} held-out tokens ({heldout_texts} held-out texts) no threshold "
            f"keeps the lower {confidence:.0%} confidence bound on top-1 agreement at the target {target_agreement}")
    if needed and min(needed) <= total:  # the held-out tokens allowed some: the check through the decode step did not
        return head + " through the decode step (the thresholds the held-out scores allowed did not hold there)."
    if target_agreement >= 1.0:
        return (head + "; a target of 1.0 allows no disagreement, which no sample size can bound: "
                "lower target_agreement.")
    if not needed:
        return (head + "; the exits measured here disagree with the full model too often for that target at any "
                "sample size: lower target_agreement.")
    tokens = min(needed)
    texts = math.ceil(tokens / max(total / max(heldout_texts, 1), 1e-9) / max(heldout_fraction, 1e-9))
    return (head + f"; at the disagreement rate measured here that takes about {tokens} held-out tokens, i.e. about "
            f"{texts} texts (num_samples >= {texts}), or a lower target_agreement.")


def auc(scores: torch.Tensor, positive: torch.Tensor) -> float | None:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties counted half.

    scores: [N] float, positive: [N] bool. None when either class is empty.
    """
    pos, neg = int(positive.sum()), int((~positive).sum())
    if pos == 0 or neg == 0:
        return None
    ranks = _average_ranks(scores.double())
    return float((ranks[positive].sum() - pos * (pos + 1) / 2) / (pos * neg))


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks of x [N], tied values sharing their mean rank."""
    values, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    return (ends - (counts.double() - 1) / 2)[inverse]


def oracle_depth(agree: dict[int, torch.Tensor], layers: list[int], num_layers: int) -> torch.Tensor:
    """Per token, the layers a perfect router would run: the first checkpoint whose top-1 agrees, else all.

    agree: {layer: bool [N]} -> float64 [N].
    """
    depth = torch.full_like(agree[layers[0]], num_layers, dtype=torch.float64)
    for k in reversed(layers):
        depth = torch.where(agree[k], torch.full_like(depth, k + 1), depth)
    return depth
