"""Acceptance rules for drafted tokens: pure tensor functions, no model, no cache.

Greedy: the longest prefix of the draft that equals the full model's argmax, then the full model's next token.
Sampling: the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023): drafted token i is kept with
probability min(1, p_i / q_i), and at the first rejection the next token is drawn from the normalised residual
max(p - q, 0); after a fully accepted draft it is drawn from p (`sampling_verdict_on_device`: the same rule with
its draws on the device, no host read). The output is distributed exactly as the full model's own samples.
Several drafts for one position (a tree's children), each certain of its token: the multi-draft rule
(SpecInfer; EAGLE's recursive rejection sampling) for point masses, `among_certain_drafts`; a whole tree of
drafts, walked from its root by either rule, `tree_verdict`; a compiled tree's (`graphtree.TreeShape`), by either
rule with no host read, `greedy_tree_verdict_on_device` and `sampling_tree_verdict_on_device`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .drafts import DraftTree, Verdict

__all__ = ["among_certain_drafts", "certain_scores", "draw", "greedy_tree_verdict_on_device", "greedy_verdict",
           "greedy_verdict_on_device", "sampling_tree_verdict_on_device", "sampling_verdict",
           "sampling_verdict_on_device", "tree_verdict"]


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
    """The rule of `greedy_verdict` with no host read (what a compiled cycle runs, `graph.py`). logits: [1, k + 1, V]
    the full model's processed scores; drafts [1, k]; `counts` [k] bool: the drafts that count (padding does not:
    never accepted) -> (tokens [1, k + 1]: the full model's argmax at each position, of which the first
    accepted + 1 are emitted; accepted [])."""
    tokens = logits.argmax(-1)
    agree = drafts == tokens[:, : drafts.shape[1]]
    return tokens, (agree if counts is None else agree & counts).long().cumprod(-1).sum()


def sampling_verdict_on_device(p: torch.Tensor, drafts: torch.Tensor, drawn_from: torch.Tensor | None,
                               counts: torch.Tensor | None = None):
    """The rule of `sampling_verdict` with no host read (what a compiled cycle runs, `graph.py`). p: [k + 1, V]
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


def tree_verdict(tree: DraftTree, logits: torch.Tensor, ids: torch.Tensor,
                 process: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 stops: Callable[[torch.Tensor, torch.Tensor], bool], sample: bool) -> tuple[list[int], Verdict]:
    """The walk of a verified tree (a `DraftTree` under the last token of `ids` [1, n]; `logits`
    [1, N, V]: the full model's at the root and at each node) -> (the accepted path, node indices, the root first;
    the verdict: the path's tokens and the one after them). At each node, `process` (ids, raw [1, V] -> scores)
    gives the full model's scores there, on that node's own prefix. Greedy: the walk moves to the child equal to
    the scores' argmax, while one exists. Sampling: the multi-draft rule for drafts certain of their tokens
    (`among_certain_drafts`): the node's children in order, each accepted with its probability under what the
    rejected ones leave of the distribution there; the walk ends where every child is rejected (the token drawn
    from the rest) or at a leaf (drawn from its distribution). Either way a child that would stop generation
    (`stops`: ids, the node's raw logits -> bool) ends the walk as the token after the path (that token is the
    cycle's last)."""
    path = [0]
    while True:
        node = path[-1]
        # (a copy: processors may work in place, and the loop may apply them to these logits itself)
        scores = process(ids, logits[:, node].to(torch.float32, copy=True))
        children = tree.children[node]
        if sample:
            tried, token = among_certain_drafts(scores.softmax(-1)[0], list(children))
            target = torch.tensor([[token]], dtype=ids.dtype, device=ids.device)
            child = children[token] if tried >= 0 else None
        else:
            target = scores.argmax(-1, keepdim=True)
            child = children.get(int(target))
        if child is None or stops(torch.cat([ids, target], 1), logits[:, node]):
            count = len(path) - 1
            return path, Verdict(torch.cat([ids[:, ids.shape[1] - count:], target.to(ids.device)], 1), count)
        path.append(child)
        ids = torch.cat([ids, target], 1)


def greedy_tree_verdict_on_device(logits: torch.Tensor, ids: torch.Tensor, shape, counts: torch.Tensor):
    """Greedy acceptance of a compiled tree with no host read (what `graphtree.tree_cycle` runs). `shape`: the tree,
    a `graphtree.TreeShape` (x first, then its nodes in slot order); logits [n, V] the full model's processed scores
    after each node; ids [n] the nodes' tokens; counts [n] bool (padding does not). A node is accepted where its
    token is the full model's argmax after its parent and its parent is accepted; the deepest accepted node ends
    the path (the first of equals: a sibling before the n-gram branch's node at the same depth), and its argmax is
    the token after it -> (the end's slot [1], the token [1])."""
    best = logits.argmax(-1)  # [n]
    matches = (ids == best[_tree_parents(shape, ids.device)]) & counts
    end = _deepest_accepted(shape, [matches[v] for v in range(shape.size)])
    return end, best.index_select(0, end)


def sampling_tree_verdict_on_device(p: torch.Tensor, ids: torch.Tensor, shape, counts: torch.Tensor):
    """Sampled acceptance of a compiled tree, exact, with no host read (what `graphtree.tree_cycle` runs: the
    multi-draft rule of `among_certain_drafts`, per node, on the device). `shape`: the tree, a `graphtree.TreeShape`
    (x first, then its nodes in slot order); p [n, V] the full model's distributions after each node; ids [n] the
    nodes' tokens, each a point mass; counts [n] bool (padding does not). From x down, a node's children are tried
    in slot order: child c is accepted with probability r(t_c), r being its parent's distribution with the mass of
    the children tried before set to 0 and renormalised (a child repeating an earlier one's token has none left);
    the deepest accepted node ends the path, and the token after it is drawn from its distribution without its
    children's tokens (all tried, all rejected) -> (the end's slot [1], the token [1])."""
    device, dtype = p.device, p.dtype
    parents = _tree_parents(shape, device)
    earlier = torch.tensor(shape.earlier_siblings, device=device)  # [n, n] bool
    repeats = (earlier & (ids[:, None] == ids[None, :]) & counts[None, :]).any(-1)
    mass = torch.where(counts & ~repeats, p[parents, ids], 0.0)  # [n]
    left = p.sum(-1)[parents] - earlier.to(dtype) @ mass  # the parent's mass not yet tried
    u = torch.rand(shape.size, device=device, dtype=dtype)
    passes = ((u * left < mass) | ((left - mass <= 0) & (mass > 0)))  # (the second: the rest rounded away)
    chosen = passes & ~((earlier.to(dtype) @ passes.to(dtype)) > 0)  # the first child of its parent that passes
    end = _deepest_accepted(shape, [chosen[v] for v in range(shape.size)])
    tried = torch.tensor(shape.children, device=device).index_select(0, end)[0] & counts  # [n]
    target = p.index_select(0, end)[0]  # [V]
    removed = torch.zeros_like(target).scatter_reduce(0, ids, tried.to(dtype), "amax") > 0
    residual = target.masked_fill(removed, 0.0)
    residual = torch.where(residual.sum() > 0, residual, target)
    return end, draw(residual[None])[0]


def _tree_parents(shape, device) -> torch.Tensor:
    return torch.tensor([max(q, 0) for q in shape.parents], device=device)


def _deepest_accepted(shape, passed: list) -> torch.Tensor:
    """The deepest node whose every ancestor's test (and its own) passed, x (depth 0) where none did, as a [1] index
    (a 0-d one would be read on the host); the first of equals."""
    accepted = [torch.ones((), dtype=torch.bool, device=passed[0].device)]
    for v in range(1, shape.size):
        accepted.append(passed[v] & accepted[shape.parents[v]])
    depths = torch.tensor(shape.depths, device=passed[0].device)
    return (torch.stack(accepted).long() * (depths + 1)).argmax().view(1)
