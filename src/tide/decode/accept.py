"""Acceptance rules for drafted tokens: pure tensor functions, no model, no cache.

Greedy: the longest prefix of the draft that equals the full model's argmax, then the full model's next token.
Sampling: the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023): drafted token i is kept with
probability min(1, p_i / q_i), and at the first rejection the next token is drawn from the normalised residual
max(p - q, 0); after a fully accepted draft it is drawn from p (`sampling_verdict_on_device`: the same rule with
its draws on the device, no host read). The output is distributed exactly as the full model's own samples.
Several drafts for one position (a tree's children), each certain of its token: the multi-draft rule
(SpecInfer; EAGLE's recursive rejection sampling) for point masses, `among_certain_drafts`.
"""

from __future__ import annotations

import torch

from .drafts import Verdict

__all__ = ["among_certain_drafts", "certain_scores", "draw", "greedy_verdict", "greedy_verdict_on_device",
           "sampling_verdict", "sampling_verdict_on_device"]


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


def greedy_verdict_on_device(logits: torch.Tensor, drafts: torch.Tensor, counts: torch.Tensor | None = None):
    """The rule of `greedy_verdict` with no host read (what a compiled cycle runs, `fused.py`). logits: [1, k + 1, V]
    the full model's processed scores; drafts [1, k]; `counts` [k] bool: the drafts that count (padding does not:
    never accepted) -> (tokens [1, k + 1]: the full model's argmax at each position, of which the first
    accepted + 1 are emitted; accepted [])."""
    tokens = logits.argmax(-1)
    agree = drafts == tokens[:, : drafts.shape[1]]
    return tokens, (agree if counts is None else agree & counts).long().cumprod(-1).sum()


def sampling_verdict_on_device(p: torch.Tensor, drafts: torch.Tensor, drawn_from: torch.Tensor | None,
                               counts: torch.Tensor | None = None):
    """The rule of `sampling_verdict` with no host read (what a compiled cycle runs, `fused.py`). p: [k + 1, V]
    the full model's distributions; drafts [k]; drawn_from: [1, k, V] (None when k = 0). Draft i is kept with
    probability min(1, p_i / q_i); after the first rejection, at a, the next token is drawn from max(p_a - q_a, 0)
    (from p_a where that is all zero, as `sampling_verdict`), after k accepted drafts from p_k -> (tokens
    [1, k + 1]: the drafts with the drawn token at a; a []). `counts` [k] bool: the drafts that count (padding
    does not: its q is zero, never kept)."""
    width = drafts.shape[0]
    q = drawn_from[0] if counts is None else drawn_from[0] * counts[:, None]
    q = torch.cat([q, p.new_zeros(1, p.shape[1])]) if width else p.new_zeros(1, p.shape[1])
    index = torch.arange(width, device=p.device)
    kept = torch.rand(width, device=p.device) * q[index, drafts] <= p[index, drafts]  # u <= p / q (q > 0 there)
    kept = kept if counts is None else kept & counts
    accepted = kept.long().cumprod(0).sum()
    at = accepted.view(1)
    target, drafted = p.index_select(0, at), q.index_select(0, at)
    residual = (target - drafted).clamp(min=0)
    residual = torch.where(residual.sum() > 0, residual, target)
    last = draw(residual)[0]  # [1]
    tokens = torch.where(torch.arange(width + 1, device=p.device) == accepted, last, torch.cat([drafts, last]))
    return tokens[None], accepted


def draw(probs: torch.Tensor) -> torch.Tensor:
    """A token drawn from each row of `probs` [n, V] (not necessarily normalised) -> [n, 1]: the exponential race,
    argmax of p_i / E_i with E_i ~ Exp(1), picks i with probability p_i / sum(p) (one kernel, no host read)."""
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1, keepdim=True)


def certain_scores(drafted: torch.Tensor, width: int) -> torch.Tensor:
    """[1, k, width] draft scores certain of each drafted token [1, k] (0 there, -inf elsewhere): what a draft
    that was not sampled (an n-gram continuation, a head's top candidate) was drawn from. The rule above then
    keeps drafted token i with probability p_i(token)."""
    scores = torch.full((*drafted.shape, width), float("-inf"), device=drafted.device)
    return scores.scatter_(-1, drafted[..., None], 0.0)


def among_certain_drafts(probs: torch.Tensor, drafted: list[int]) -> tuple[int, int]:
    """The next token where the full model's distribution is `probs` [V] and the drafts for this position are
    the distinct tokens `drafted`, each a point mass, tried in order: (the index of the accepted draft, or -1;
    the token). Draft j is accepted with probability r(t_j), r being `probs` with the mass of the drafts rejected
    before it set to 0 and renormalised; after every draft is rejected the token is drawn from that residual.

    Exact: P(t_1) = p(t_1), P(t_2) = (1 - p(t_1)) * p(t_2) / (1 - p(t_1)) = p(t_2), and so on; any other token
    x: (1 - sum_j p(t_j)) * p(x) / (1 - sum_j p(t_j)) = p(x). (The speculative-sampling rule above, for one
    point-mass draft: min(1, r(t) / 1) to accept, residual max(r - delta_t, 0) = r without t.)"""
    if not drafted:
        return -1, int(torch.multinomial(probs, 1))
    index = torch.tensor(drafted, device=probs.device)
    *mass, left = torch.cat([probs[index], probs.sum()[None]]).double().tolist()  # one device read
    for j, (token, u) in enumerate(zip(drafted, torch.rand(len(drafted), dtype=torch.float64).tolist())):
        if u * left < mass[j] or left - mass[j] <= 0:  # (the second: the rest of the mass rounded away)
            return j, token
        left -= mass[j]
    residual = probs.index_fill(0, index, 0.0)
    if not bool(residual.sum() > 0):  # (rounding: the drafts held all of the mass; the last one is the draw)
        return len(drafted) - 1, drafted[-1]
    return -1, int(torch.multinomial(residual, 1))
