"""Acceptance rules for drafted tokens: pure tensor functions, no model, no cache.

Greedy: the longest prefix of the draft that equals the full model's argmax, then the full model's next token.
Sampling: the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023): drafted token i is kept with
probability min(1, p_i / q_i), and at the first rejection the next token is drawn from the normalised residual
max(p - q, 0); after a fully accepted draft it is drawn from p. The output is distributed exactly as the full
model's own samples.
"""

from __future__ import annotations

import torch

from .records import Verdict

__all__ = ["greedy_verdict", "sampling_verdict"]


def greedy_verdict(drafted: torch.Tensor, scores: torch.Tensor) -> Verdict:
    """drafted: [1, k] tokens; scores: [1, k + 1, V] the full model's processed scores at each drafted position
    and the one after."""
    chosen = scores.argmax(-1)  # [1, k + 1]
    k = drafted.shape[1]
    accepted = int((drafted == chosen[:, :k]).long().cumprod(-1).sum()) if k else 0
    return Verdict(chosen[:, : accepted + 1], accepted)


def sampling_verdict(drafted: torch.Tensor, draft_scores: torch.Tensor | None, scores: torch.Tensor) -> Verdict:
    """drafted: [1, k]; draft_scores: [1, k, V] the processed scores the drafts were sampled from (None when
    k = 0); scores: [1, k + 1, V] the full model's processed scores."""
    p = scores.softmax(-1)[0]  # [k + 1, V]
    k = drafted.shape[1]
    if k == 0:
        return Verdict(torch.multinomial(p[0], 1)[None], 0)
    q = draft_scores.softmax(-1)[0]  # [k, V]
    index = torch.arange(k, device=p.device)
    tokens = drafted[0].to(p.device)
    ratio = p[index, tokens] / q[index, tokens]  # [k]
    kept = torch.rand_like(ratio) <= ratio
    accepted = int(kept.long().cumprod(0).sum())
    if accepted < k:
        residual = (p[accepted] - q[accepted]).clamp(min=0)
        total = residual.sum()
        nxt = p[accepted] if total <= 0 else residual / total
    else:
        nxt = p[accepted]
    last = torch.multinomial(nxt, 1)  # [1]
    return Verdict(torch.cat([tokens[:accepted], last])[None], accepted)
