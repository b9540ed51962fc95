"""Draft vocabularies: lossless drafts read only the head's rows for the tokens the full model predicts most.

A lossless draft needs the head only to rank candidates, and the full model's next token is almost always one
of the few thousand it predicts most often. Reading the head's rows for the `n` most frequent of them costs
n / V of the head, which matters where the head is large next to a layer (a 128k vocabulary at hidden 2048 is
about four layers of weights). A draft restricted this way is still a valid draft distribution (tokens outside
it get probability 0), so lossless output stays the base model's; a token outside it only costs a rejected draft.

Calibration counts the full model's top-1 over its training texts (`ranked_vocabulary`), trains the draft heads
over the largest candidate size, scores each candidate size on held-out text (`restricted_ranks`) and lets the
drafting schemes' estimate and timing decide whether a restricted draft pays. `restricted_logits` computes a
restricted draft's logits at generation.
"""

from __future__ import annotations

import torch

__all__ = ["ranked_vocabulary", "candidate_sizes", "restricted_ranks", "restricted_logits", "MIN_SIZE", "MAX_SIZE"]

MIN_SIZE = 64  # smaller draft vocabularies miss too much to pay
FRACTIONS = (32, 16, 8, 4)  # candidate sizes: V / 32 ... V / 4 (a larger one saves little of the head)
# The largest candidate size: the draft heads train over it (each Adam step's logits, forward and backward, cost
# its rows), and held-out scoring and the repo keep that many ranked ids. Calibrations have kept 256-1,536 tokens
# (docs/benchmarks.md); 4,096 rows at hidden 640 are half a decoder layer of a 270M model, where a quarter of a
# 262,144-token vocabulary is 7.5 layers (in weights).
MAX_SIZE = 4096


def ranked_vocabulary(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` token ids the full model predicted most often (`counts` [V]), most frequent first (ties: lower id)."""
    order = torch.sort(counts.cpu(), descending=True, stable=True).indices
    return order[: min(size, counts.numel())].clone()


def candidate_sizes(vocab_size: int) -> list[int]:
    """The restricted sizes calibration scores for a head of `vocab_size` rows (none for small heads): V / 32 ...
    V / 4, or where V / 4 is above `MAX_SIZE`, the same ladder of halvings down from `MAX_SIZE`."""
    largest = min(vocab_size // FRACTIONS[-1], MAX_SIZE)
    return sorted({n for n in (largest * FRACTIONS[-1] // f for f in FRACTIONS) if n >= MIN_SIZE})


def restricted_ranks(logits: torch.Tensor, full_top1: torch.Tensor, ids: torch.Tensor, cap: int) -> torch.Tensor:
    """[N] uint8: where the full model's top-1 ranks among a draft's logits [N, V] restricted to `ids` (0: the
    restricted draft's top-1), `cap` where it is not among `ids` or ranks at `cap` or below."""
    ids = ids.to(logits.device)
    sub = logits.index_select(-1, ids)  # [N, n]
    target = logits.gather(-1, full_top1[:, None])  # [N, 1]
    inside = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    inside[ids] = True
    ranks = (sub > target).sum(-1).clamp(max=cap)
    return ranks.masked_fill(~inside[full_top1], cap).to(torch.uint8)


def restricted_logits(parts, normed: torch.Tensor, ids: torch.Tensor, head: tuple | None,
                      vocab_size: int) -> torch.Tensor:
    """Logits [..., vocab_size] of a draft restricted to `ids`: from `head` (the head's rows for them, see
    `ModelParts.head_rows`; None: the whole head, then those ids), -inf elsewhere."""
    if head is None:
        sub = parts.logits_from_normed(normed).index_select(-1, ids.to(normed.device))
    else:
        sub = parts.logits_from_normed(normed, head)
    out = sub.new_full((*sub.shape[:-1], vocab_size), float("-inf"))
    return out.index_copy_(out.dim() - 1, ids.to(out.device), sub)
