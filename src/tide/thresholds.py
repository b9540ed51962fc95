"""Threshold selection with a statistical guarantee: pure math, no models, no I/O.

For each checkpoint, in exit order, the threshold is the lowest candidate (scanned from high to low,
stopping at the first failure: Learn-then-Test's fixed-sequence procedure) for which the one-sided
Clopper-Pearson upper bound on the disagreement rate of the tokens that would exit there is at most
`1 - target_agreement`, at the stated confidence. Tokens that exit at an earlier checkpoint are removed
before the next checkpoint is calibrated, so the bound holds for the cascade that generation runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["binomial_upper_bound", "select_threshold", "calibrate_cascade", "CheckpointCalibration", "oracle_depth"]

NEVER = 1.0  # scores are sigmoids in [0, 1] and a token exits when score > threshold


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


def binomial_upper_bound(errors: int, n: int, confidence: float) -> float:
    """One-sided Clopper-Pearson upper bound on a rate after `errors` in `n` trials."""
    if n == 0:
        return 1.0
    if errors >= n:
        return 1.0
    alpha = 1.0 - confidence
    lo, hi = errors / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _binom_cdf(errors, n, mid) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def select_threshold(
    scores: torch.Tensor, agree: torch.Tensor, max_error: float, confidence: float, num_candidates: int = 64
) -> float:
    """Lowest threshold whose exiting tokens' disagreement bound stays <= max_error.

    scores: [N] float router scores, agree: [N] bool (checkpoint top-1 == full top-1).
    """
    if scores.numel() == 0:
        return NEVER
    quantiles = torch.linspace(1.0, 0.0, num_candidates + 1, dtype=torch.float64)[1:]
    candidates = torch.quantile(scores.double(), quantiles).unique().flip(0)  # high -> low
    # Fewer exits than this cannot pass even with zero errors; the scan starts where a pass is possible
    # (a rule on scores alone, so the fixed sequence stays fixed before any label is looked at).
    min_exits = math.ceil(math.log(1.0 - confidence) / math.log1p(-max_error)) if max_error < 1.0 else 1
    chosen = NEVER
    for t in candidates.tolist():
        exits = scores > t
        n = int(exits.sum())
        if n < min_exits:
            continue
        errors = int((exits & ~agree).sum())
        if binomial_upper_bound(errors, n, confidence) > max_error:
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


def calibrate_cascade(
    layers: list[int],
    scores: dict[int, torch.Tensor],
    agree: dict[int, torch.Tensor],
    labels: dict[int, torch.Tensor],
    target_agreement: float,
    confidence: float,
) -> list[CheckpointCalibration]:
    """Thresholds for each checkpoint in order, each calibrated on the tokens still running there."""
    total = next(iter(scores.values())).numel()
    running = torch.ones(total, dtype=torch.bool)
    out = []
    for layer in layers:
        s, a = scores[layer][running], agree[layer][running]
        threshold = select_threshold(s, a, 1.0 - target_agreement, confidence)
        exits = torch.zeros_like(running)
        exits[running] = scores[layer][running] > threshold
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


def oracle_depth(agree: dict[int, torch.Tensor], layers: list[int], num_layers: int) -> torch.Tensor:
    """Per token, the layers a perfect router would run: the first checkpoint whose top-1 agrees, else all.

    agree: {layer: bool [N]} -> float64 [N].
    """
    depth = torch.full_like(agree[layers[0]], num_layers, dtype=torch.float64)
    for k in reversed(layers):
        depth = torch.where(agree[k], torch.full_like(depth, k + 1), depth)
    return depth
