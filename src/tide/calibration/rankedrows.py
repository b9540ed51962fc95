"""The head's rows for the ranked vocabulary (`RankedRows`), where calibration reads them instead of the whole head
on a large vocabulary: where the full model's token ranks among drafts restricted to each draft vocabulary size
(`ranks`), and whether an exit's top-1 is the full model's (`agreement`), the whole head run only for the exits
that no ranked token already beats. On a 262,144-token vocabulary the 4,096 ranked rows cost 1/64 of the head."""

from __future__ import annotations

import torch

from ..config import MAX_DRAFT_TOPK
from .forward import head_chunk

__all__ = ["RankedRows"]


class RankedRows:
    """The head's rows for the ranked vocabulary (`weights`, as `ModelParts.head_rows` reads them) and where each
    token stands in it (`position` [V]: its index, or the vocabulary's size where it is not in it)."""

    def __init__(self, weights: tuple, position: torch.Tensor):
        self.weights, self.position = weights, position

    @classmethod
    def of(cls, parts, ranked: torch.Tensor | None, vocab_size: int) -> "RankedRows | None":
        """The rows of `ranked` (token ids, most predicted first) in a head of `vocab_size` rows; None where there is
        no ranked vocabulary or the head's rows cannot be read alone (`ModelParts.head_rows_readable`)."""
        weights = parts.head_rows(ranked) if ranked is not None else None
        if weights is None:
            return None
        ids = ranked.to(weights[0].device)
        position = torch.full((vocab_size,), ids.numel(), dtype=torch.long, device=ids.device)
        position[ids] = torch.arange(ids.numel(), device=ids.device)
        return cls(weights, position)

    def ranks(self, parts, normed: torch.Tensor, full_top1: torch.Tensor, sizes: list[int]) -> dict:
        """{n: [N] uint8}: where the full model's top-1 ranks among the drafts (normed states [N, H]) restricted to
        the first n ranked tokens, as `draftvocab.restricted_ranks` ranks them, from one product with the rows."""
        logits = parts.logits_from_normed(normed, self.weights)  # [N, n_max]
        position = self.position[full_top1]
        target = logits.gather(-1, position.clamp(max=logits.shape[-1] - 1)[:, None])  # its own logit, where inside
        return {n: (logits[:, :n] > target).sum(-1).clamp(max=MAX_DRAFT_TOPK)
                .masked_fill(position >= n, MAX_DRAFT_TOPK).to(torch.uint8) for n in sizes}

    def agreement(self, parts, normed: torch.Tensor, full_top1: torch.Tensor) -> torch.Tensor:
        """[N] bool: the top-1 of the whole head on normed states [N, H] is `full_top1`, as `argmax` over the whole
        vocabulary says. A row where a ranked token's logit is above the full model's token's by more than
        rounding disagrees without the whole head; the rest run it, `head_chunk` rows at a time."""
        logits = parts.logits_from_normed(normed, self.weights)  # [N, n]
        target = parts.logits_for_ids(normed, full_top1[:, None])[:, 0]
        slack = 64 * torch.finfo(logits.dtype).eps * (target.abs() + 1.0)  # two products' rounding, generously
        beaten = (logits > (target + slack)[:, None]).any(-1)
        agree = torch.zeros_like(beaten)
        rest = (~beaten).nonzero().squeeze(-1)
        for part in rest.split(head_chunk(self.position.numel())):
            agree[part] = parts.logits_from_normed(normed[part]).argmax(-1) == full_top1[part]
        return agree
