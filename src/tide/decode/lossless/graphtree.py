"""Trees as one compiled graph and one host read a cycle (`graph.GraphCycles`, calls with `draft_topk` > 1), greedy
or sampled.

A tree here has a fixed shape per graph (`TreeShape`): after the last emitted token x, the draft head's `siblings`
best candidates for the next position and, where the host found one this cycle, the n-gram continuation as a branch
of its own, padded to `ngram` tokens (`valid` of them count). The cycle (`tree_cycle`) runs

1. x through layers 0..E (the draft layer); the head gives the siblings;
2. the siblings and the n-gram branch through layers 0..E in one pass, with a tree mask (each node sees the
   sequence, its ancestors and itself);
3. layers E+1..L-1 and the head over every node in one pass, with the same mask;
4. acceptance on the device (`accept.py`): greedy, a node is accepted where its token is the full model's argmax
   after its parent and its parent is accepted (`greedy_tree_verdict_on_device`); sampling, the multi-draft rule for
   point masses, exact (`sampling_tree_verdict_on_device`); the deepest accepted node ends the path, and the token
   after it is its argmax, or drawn;
5. the path's K/V moved to the slots after x in every cache layer, and each layer's length cut to the path.

Nodes are written to the static cache in that order (x, the siblings, the n-gram branch), so slots and positions
differ: a node's position is the sequence's length plus its depth. A chain from the best sibling, one pass of layers
0..E a draft, timed slower than the siblings alone on every model and text measured, so trees have none
(docs/benchmarks.md); each node verified costs a row through the deep layers, which on one CPU core is not free.
"""

from __future__ import annotations

import torch

from ..cachepool import slots
from .accept import greedy_tree_verdict_on_device, sampling_tree_verdict_on_device

__all__ = ["TreeShape", "tree_cycle"]


class TreeShape:
    """The nodes of one fused tree, in slot order (x, `siblings` candidates, an n-gram branch of `ngram` tokens), with
    their parents and depths (Python lists: constants of the graph) -> `ancestry` [n, n] (row v: v and its
    ancestors), `path` [n, D + 1] (row v: the slot of v's ancestor at each depth, v itself past its depth)."""

    def __init__(self, siblings: int, ngram: int):
        self.siblings, self.ngram = siblings, ngram
        parents = [-1] + [0] * siblings + [0 if i == 0 else siblings + i for i in range(ngram)]
        depths = [0] + [1] * siblings + [i + 1 for i in range(ngram)]
        self.parents, self.depths, self.size = parents, depths, len(parents)
        self.max_depth = max(depths)
        self.ancestry = [[False] * self.size for _ in range(self.size)]
        self.path = [[v] * (self.max_depth + 1) for v in range(self.size)]
        self.children = [[parents[c] == v for c in range(self.size)] for v in range(self.size)]  # row v: its children
        self.earlier_siblings = [[parents[c] == parents[v] and c < v for c in range(self.size)]
                                 for v in range(self.size)]
        for v in range(self.size):
            u = v
            while u >= 0:
                self.ancestry[v][u] = True
                self.path[v][depths[u]] = u
                u = parents[u]

    def key(self) -> tuple:
        return self.siblings, self.ngram


def _tree_mask(shape: TreeShape, nodes: list[int], start: torch.Tensor, keys: int, dtype) -> torch.Tensor:
    """The additive mask [1, 1, len(nodes), keys] of `nodes` over a static cache of `keys` slots, the cycle's nodes
    from slot `start`: the sequence before it, and each node's ancestors and itself."""
    device = start.device
    relative = torch.arange(keys, device=device) - start  # [keys]
    inside = (relative >= 0) & (relative < shape.size)
    ancestry = torch.tensor([shape.ancestry[v] for v in nodes], device=device)  # [q, n]
    sees = (relative < 0)[None, :] | (inside[None, :] & ancestry[:, relative.clamp(0, shape.size - 1)])
    return torch.zeros((), dtype=dtype, device=device).masked_fill(~sees, torch.finfo(dtype).min)[None, None]


def _pass(view, shape: TreeShape, cache, nodes: list[int], start, keys: int, dtype, **inputs):
    """`nodes` (their `input_ids` [1, q], or `inputs_embeds`) through `view` on the cache -> its last hidden state
    [1, q, H]."""
    positions = start + torch.tensor([shape.depths[v] for v in nodes], device=start.device)
    return view(position_ids=positions[None], attention_mask=_tree_mask(shape, nodes, start, keys, dtype),
                past_key_values=cache, use_cache=True, **inputs).last_hidden_state


def tree_cycle(shallow, head, deep, offset, logits_from_normed, cache, token, context, shape: TreeShape, dtype,
               suppress, warp, given, valid):
    """One tree cycle as one graph (module docstring). `token` [1, 1] x; `context` [1, H]; `given` [1, ngram] the
    n-gram branch (padding past `valid` []; None without one); `suppress` (where [D + 1] bool by depth, tokens [V]
    bool): scores set to -inf; `warp`: None (greedy) or the call's warpers (sampling) -> (accepted count then D + 1
    tokens, of which the first accepted + 1 are emitted [D + 2]; the next x [1, 1]; the next context [1, H])."""
    k, m, device, keys = shape.siblings, shape.ngram, token.device, slots(cache)  # (the length: a dynamic dimension)
    start = cache.layers[0].cumulative_length.clone()  # (every layer's, at the cycle's start)
    states = [_pass(shallow, shape, cache, [0], start, keys, dtype, input_ids=token)]
    logits, _ = head(states[0][:, -1], context)
    tokens = [token, logits.topk(k, dim=-1).indices] + ([given] if m else [])  # the siblings, the best first
    states.append(_pass(shallow, shape, cache, list(range(1, 1 + k + m)), start, keys, dtype,
                        input_ids=torch.cat(tokens[1:], 1)))
    ids, states = torch.cat(tokens, 1)[0], torch.cat(states, 1)  # [n], [1, n, H]: in slot order
    depths = torch.tensor(shape.depths, device=device)
    if offset is not None:
        states = states - offset(inputs_embeds=torch.zeros_like(states), position_ids=(start + depths)[None],
                                 use_cache=False).last_hidden_state
    normed = _pass(deep, shape, cache, list(range(shape.size)), start, keys, dtype, inputs_embeds=states)
    logits = logits_from_normed(normed)[0]  # [n, V]
    where, suppressed = suppress
    logits = logits.masked_fill(where[depths][:, None] & suppressed, float("-inf"))
    counts = torch.cat([torch.ones(1 + k, dtype=torch.bool, device=device), torch.arange(m, device=device) < valid])
    if warp is None:
        end, after = greedy_tree_verdict_on_device(logits, ids, shape, counts)
    else:
        end, after = sampling_tree_verdict_on_device(warp(logits.float()).softmax(-1), ids, shape, counts)
    accepted = depths.index_select(0, end)  # [1]
    path = torch.tensor(shape.path, device=device).index_select(0, end)[0]  # [D + 1] slots
    steps = torch.arange(shape.max_depth + 1, device=device)
    emitted = torch.where(steps < accepted, ids.index_select(0, path.roll(-1)), after)  # (ids[path[i + 1]] at i)
    _compact(cache, start, path[1:])
    for layer in cache.layers:
        layer.cumulative_length.sub_(shape.size - 1 - accepted[0])
    return torch.cat([accepted, emitted]), after.view(1, 1), normed[0].index_select(0, end)


def _compact(cache, start: torch.Tensor, path: torch.Tensor) -> None:
    """Every cache layer's K/V of the path's nodes (slots `start` + `path` [D]) moved to the slots after x."""
    source = start + path
    target = start + 1 + torch.arange(path.shape[0], device=path.device)
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            tensor.index_copy_(2, target, tensor.index_select(2, source))
