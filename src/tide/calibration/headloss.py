"""The exit and draft heads' training loss: KL divergence to the full model, over the whole vocabulary or over a
few candidate tokens per row.

A head's logits over the whole vocabulary cost a [rows x vocabulary x hidden] product forward and backward for
every head on every training step, plus the teacher's: on a real model (49,152 tokens and up) most of
calibration's time. What a head must learn is the order of the tokens the full model ranks high against the
tokens it could confuse them with. The candidate loss therefore compares the two distributions renormalised over
each row's candidates: the full model's `TEACHER_TOP` best tokens for that row, plus `NEGATIVES` tokens shared by
the minibatch, drawn by how often the full model predicts them (and uniformly). Draft heads, which rank only a
restricted vocabulary at generation, take the KL over that vocabulary instead (the trainer's `draft_rows`). Several
heads' logits for the same rows come from one product (their states stacked), and `head_kl` averages their KLs. Pure
tensor math; the trainer owns the buffers and the optimiser.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["TEACHER_TOP", "NEGATIVES", "uses_candidates", "draw_negatives", "Candidates", "head_kl"]

TEACHER_TOP = 32  # the full model's best tokens per row, kept from the capture
NEGATIVES = 256  # tokens shared by a minibatch's rows, drawn afresh each step
_MASKED = -1e4  # a duplicate candidate's logit: no probability, and no NaN in the KL


def uses_candidates(vocab_size: int, readable: bool) -> bool:
    """The candidate loss where the head's rows can be read alone and the vocabulary is at least 16 times the
    candidates; the whole vocabulary otherwise (small vocabularies cost little)."""
    return readable and vocab_size >= 16 * (TEACHER_TOP + NEGATIVES)


def draw_negatives(predicted: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[NEGATIVES] token ids, without repeats: half the weight by how often the full model predicted each token
    (`predicted` [V] counts), half uniform."""
    counts = predicted.float().cpu()
    weights = counts / counts.sum().clamp(min=1.0) + 1.0 / counts.numel()
    return torch.multinomial(weights, NEGATIVES, replacement=False, generator=generator).to(predicted.device)


class Candidates:
    """Each row's candidate ids: its teacher's top tokens [M, K] then the shared negatives [S]; a negative that is
    also one of the row's top tokens is masked. The head's rows for them are read once, at the first `logits`, and
    serve every later call (the teacher's and each head's)."""

    def __init__(self, top: torch.Tensor, negatives: torch.Tensor):
        self.top, self.negatives = top, negatives
        self.duplicate = (negatives[None, :, None] == top[:, None, :]).any(-1)  # [M, S]
        self._rows = None  # (own rows, shared rows), as `ModelParts.head_rows` reads them

    def logits(self, parts, normed: torch.Tensor) -> torch.Tensor:
        """The candidates' logits through the model's own head. normed: [..., M, H] (leading dimensions: several
        heads' states for the same rows) -> [..., M, K + S]."""
        if self._rows is None:
            own = parts.head_rows(self.top.reshape(-1))
            if own is not None:
                weight, bias = own
                own = weight.view(*self.top.shape, -1), None if bias is None else bias.view(self.top.shape)
            self._rows = own, parts.head_rows(self.negatives)
        own_rows, shared_rows = self._rows
        own = parts.logits_for_ids(normed, self.top, own_rows)
        if shared_rows is None:  # the head's rows cannot be read alone: the whole head, then the negatives
            shared = parts.logits_from_normed(normed).index_select(-1, self.negatives)
        else:
            shared = parts.logits_from_normed(normed, shared_rows)
        return torch.cat([own, shared.masked_fill(self.duplicate, _MASKED)], -1).float()


def head_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student), averaged over rows, from logits over the same tokens. student [..., M, C] (leading
    dimensions: several heads, each against the same teacher), teacher [M, C] -> scalar: the mean of each head's
    KL averaged over its rows."""
    log_teacher = F.log_softmax(teacher, -1)
    return (log_teacher.exp() * (log_teacher - F.log_softmax(student, -1))).sum(-1).mean()
