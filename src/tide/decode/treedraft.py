"""Lossless tree drafts: every free draft of a cycle in one trie, verified together in one pass.

A chain draft is accepted only when the draft head's top-1 is the full model's token; the full model's token is
often among its top few (docs/benchmarks.md), and where the text repeats itself an n-gram continuation
(`ngram.py`) guesses several tokens at no cost. One cycle here, for the last emitted token x (the root):

1. x runs through the shallow layers 0..E (as a chain draft would) and the draft head at E gives k candidates
   for the next position. Where the latest n-gram occurred before, its continuation c1, c2, ... is a branch
   several tokens deep. Both go into one trie (`DraftTree`): branches that share a prefix share nodes (a
   candidate equal to c1 is c1's node).
2. Every node runs through layers 0..E at once, at position x's + its depth, seeing the context, x, its
   ancestors and itself, not its siblings or cousins (a tree attention mask).
3. The deep layers E+1..L-1 run over x and every node at once, with the same mask; the final head gives the
   full model's logits at x and at each node.
4. The tree is walked. Greedy: from x, move to the child equal to the full model's token there (after the
   logits processors), as long as one exists and that token would not stop generation; the path goes to the
   decode loop as an already verified draft (its logits are those of step 3, so the loop's acceptance test and
   bonus token, from the last accepted node's logits, run unchanged). Sampling: every draft here is certain of
   its token (the head's top candidates, an n-gram continuation), and the multi-draft rule for such drafts
   (SpecInfer; EAGLE's recursive rejection sampling; `accept.among_certain_drafts`) decides: at a node with the
   full model's distribution p (processed scores, softmax; the processors see that node's own prefix), its
   children are tried in order, child c accepted with probability r(c), r being p with the rejected siblings'
   mass set to 0 and renormalised; on acceptance the walk moves to c and goes on with c's p; when every child
   is rejected the next token is drawn from r, and after an accepted leaf from the leaf's p. Each token comes
   out with probability p: P(c1) = p(c1), P(c2) = (1 - p(c1)) * p(c2) / (1 - p(c1)) = p(c2), and so on, and
   any other token's (1 - sum of p(children)) * p(x) / (1 - sum of p(children)) = p(x). An accepted child that
   would stop generation ends the walk as its last token, as the greedy walk's stopping token does. The walk
   hands the loop its verdict (`Draft.decided`): the path's tokens and the one drawn after them.
   Either way the cache keeps the accepted path's K/V, moved right after x in order, and drops the other nodes'.

The tree mask is the mask the backbone builds for the chunk [x, nodes] with the entries between non-ancestors
blocked, and positions set to depths; the nodes' shallow calls are the same calls without x's row (one capture
per cycle). Compiled calls (a static cache) verify instead in one pass of the backbone's own compiled forward over
[x, nodes], from x's position in every layer (the draft layers drop x, and the pass writes it again), with the tree
given as a custom 4-D mask, which transformers passes to the layers as it is: one graph per tree width, no capture,
no masks patched per cycle. That needs one mask for every layer (one attention type), attention that adds a mask
(SDPA, eager) and a backbone whose output is its final norm's (`Verifier._through_backbone`). Where no 4-D mask
tensor reaches the layers, or a cache layer is neither a plain `DynamicLayer` nor a full-attention static layer
(sliding windows keep their own bookkeeping), or a static cache has no room for x and every node, the cycle drafts
as before: the n-gram continuation as a chain where there is one, else a chain from the head. Families whose
positions live in the mask rather than in `position_ids` (alibi) never get here (`ArchSpec.tree_drafts`). Those
chains are judged as chains: sampling a head chain from the head's distribution and an n-gram chain as certain of
its tokens, by the speculative-sampling rule.

`TreeDrafter` builds the trie (step 1) and walks it (step 4); the passes of steps 2 and 3 and the cache's
compaction are the call's verifier's (`verifier.Verifier.verify_tree`, `keep_path`), the chains the chain
drafter's (`speculative.ChainDrafter`) and the n-gram drafter's (`ngram.NgramDrafter`).
"""

from __future__ import annotations

import functools

import torch

from ..models.compat import is_static_layer, layer_length, plain_dynamic_layers
from .accept import among_certain_drafts, certain_scores
from .drafts import Draft, Verdict
from .processors import process
from .verifier import room_for

__all__ = ["DraftTree", "TreeDrafter"]


class DraftTree:
    """A trie of drafted tokens under the root x (node 0): each node's token, parent and depth, and whether it
    lies on the n-gram branch. Parents come before their children."""

    def __init__(self):
        self.tokens, self.parents, self.depths, self.ngram = [-1], [-1], [0], [False]
        self.children: list[dict[int, int]] = [{}]

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, ngram: bool = False) -> int:
        """The node for `token` under `parent`: the existing one (shared prefix) or a new one."""
        node = self.children[parent].get(token)
        if node is None:
            node = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.ngram.append(False)
            self.children.append({})
            self.children[parent][token] = node
        self.ngram[node] = self.ngram[node] or ngram
        return node

    def add_chain(self, tokens: list[int], ngram: bool = False) -> None:
        """A branch from the root through `tokens`, in order."""
        node = 0
        for token in tokens:
            node = self.add(node, token, ngram)

    @property
    def has_ngram(self) -> bool:
        return any(self.ngram)

    def blocked(self) -> torch.Tensor:
        """[N, N] (query node, key node), x included: True where a node would see an earlier node that is not its
        ancestor. Later nodes are left to the causal mask. (Shared between trees of one shape: do not modify.)"""
        return _blocked(tuple(self.parents))


@functools.lru_cache(maxsize=256)
def _blocked(parents: tuple[int, ...]) -> torch.Tensor:
    sees = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node in range(len(parents)):
        if node:
            sees[node] = sees[parents[node]]
        sees[node, node] = True
    return ~sees & torch.ones_like(sees).tril()


class TreeDrafter:
    """Lossless drafting of a trie per cycle, greedy or sampled: the head's `session.draft_topk` candidates and the
    n-gram continuation (`session`: a `speculative.LosslessSession`; the rest, the call's `ShallowPasses`,
    `Verifier`, `Stops`, `NgramDrafter` or None, and `ChainDrafter`, which drafts where a tree cannot)."""

    def __init__(self, session, shallow, verifier, stops, ngrams, chain, logits_processor, sample: bool):
        self.session, self.shallow, self.verifier, self.stops = session, shallow, verifier, stops
        self.ngrams, self.chain, self.logits_processor, self.do_sample = ngrams, chain, logits_processor, sample
        self.k = session.draft_topk
        self.usable = None  # known at the first call: the cache can be compacted and the layers take a tree mask
        self.chained = False  # the last cycle drafted a chain of the chain drafter's (it keeps the cap)

    @property
    def topk(self) -> int:
        """The candidates it drafts for the next position: `session.draft_topk`, or 1 (chains) once the cache or
        the model's attention turned out to take no tree."""
        return self.k if self.usable is None or self.usable else 1

    def verified(self, accepted: int) -> None:
        """After the loop accepted `accepted` drafted tokens: a chain of the chain drafter's tells it."""
        if self.chained:
            self.chain.verified(accepted)

    def draft(self, input_ids: torch.LongTensor) -> Draft:
        session, cache = self.session, self.verifier.cache
        continuation = self.ngrams.continuation(input_ids) if self.ngrams is not None else []
        if self.usable is None:
            self.usable = plain_dynamic_layers(cache) or all(is_static_layer(layer) for layer in cache.layers)
        room = self.stops.room(input_ids) >= 1 and room_for(cache, self.k + 1 + len(continuation))
        self.chained = not continuation
        if not (self.usable and room):  # a cache the tree cannot compact, or no room for the tree: as before
            if continuation:  # an earlier occurrence's next tokens: a chain that costs no head
                return self.ngrams.draft(input_ids, continuation)
            return self.chain.draft(input_ids)
        x = input_ids[:, -1:]
        with torch.no_grad():
            hidden, (logits, _) = self.shallow.head(x, session.grown_mask(input_ids.shape[1]), self.verifier.context)
            self.verifier.keep(x, hidden)
            draft_scores = process(self.logits_processor, input_ids, logits.float())
            candidates = draft_scores.topk(self.k, dim=-1).indices  # [1, k]
            tree = DraftTree()
            for token in candidates[0].tolist():
                tree.add(0, token)
            tree.add_chain(continuation, ngram=True)
            verified = self.verifier.verify_tree(tree, input_ids.shape[1])
        if verified is None:  # no tree mask reached the layers: a chain draft of one (the verifier verifies it)
            if layer_length(cache, 0) > 1:  # (a one-token context may get no mask: causal attention needs none)
                self.usable = False  # this model's attention takes none: chains from here on
            self.chained = True
            top = candidates[:, :1]  # the head's top candidate: a draft certain of it (sampling)
            scores = certain_scores(top, session.model.num_head_rows) if self.do_sample else None
            return self.chain.single(input_ids, top, scores)
        self.chained = False
        return self._walked(tree, verified.logits, input_ids, len(continuation))

    def _walked(self, tree: DraftTree, logits: torch.Tensor, input_ids: torch.LongTensor, ngram: int) -> Draft:
        """The draft of a verified tree (`logits` [1, N, V]: the full model's at x and each node): its walk's path,
        with the walk's verdict; the cache keeps the path's K/V."""
        walk = self._sampled_walk if self.do_sample else self._walk
        path, out, last = walk(tree, logits, input_ids)
        later = sum(next(iter(tree.children[tree.parents[node]].values())) != node for node in path[1:])
        verified = self.verifier.keep_path(path)
        count = len(path) - 1
        # the walk decided: the path's tokens, then the token after them (the loop does not judge them again)
        decided = Verdict(torch.cat([out[:, out.shape[1] - count:], last.to(out.device)], 1), count)
        # one head step (k candidates) and the n-gram tokens
        return Draft(out, count, verified=verified.logits, decided=decided, steps=1 + ngram, ngram=ngram,
                     from_ngram=tuple(tree.ngram[node] for node in path[1:]), tree=True, later_children=later)

    def _walk(self, tree: DraftTree, logits: torch.Tensor, input_ids: torch.LongTensor):
        """The accepted path (node indices, x first), the sequence with its tokens, and the full model's token
        [1, 1] after them: from x, the child equal to the full model's processed argmax, while one exists and that
        token would not stop generation (a stopping token is the one after the path, as the loop's bonus token)."""
        path, ids = [0], input_ids
        while True:
            node = path[-1]
            # (a copy: processors may work in place, and the loop may apply them to these logits itself)
            scores = process(self.logits_processor, ids, logits[:, node].to(torch.float32, copy=True))
            target = scores.argmax(-1, keepdim=True)
            child = tree.children[node].get(int(target))
            if child is None or self.stops(torch.cat([ids, target], 1), logits[:, node]):
                return path, ids, target
            path.append(child)
            ids = torch.cat([ids, target], 1)

    def _sampled_walk(self, tree: DraftTree, logits: torch.Tensor, input_ids: torch.LongTensor):
        """The accepted path (node indices, x first), the sequence with its tokens, and the token [1, 1] drawn
        after them, by the multi-draft rule for drafts certain of their tokens (`among_certain_drafts`): at each
        node its children in order, each accepted with its probability under what the rejected ones leave of the
        full model's processed distribution there; the walk ends where every child is rejected (the token drawn
        from the rest), at a leaf (drawn from its distribution), or at an accepted child that would stop
        generation (that child is the last token, as a stopping token is the greedy walk's last)."""
        path, ids = [0], input_ids
        while True:
            node = path[-1]
            scores = process(self.logits_processor, ids, logits[:, node].to(torch.float32, copy=True))
            children = tree.children[node]
            tried, token = among_certain_drafts(scores.softmax(-1)[0], list(children))
            target = torch.tensor([[token]], dtype=ids.dtype, device=ids.device)
            if tried < 0 or self.stops(torch.cat([ids, target], 1), logits[:, node]):
                return path, ids, target
            path.append(children[token])
            ids = torch.cat([ids, target], 1)
