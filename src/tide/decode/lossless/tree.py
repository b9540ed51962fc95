"""Lossless tree drafts: every free draft of a cycle in one trie, verified together in one pass.

A chain draft is accepted only when the draft head's top-1 is the full model's token; the full model's token is
often among its top few (docs/benchmarks.md), and where the text repeats itself an n-gram continuation
(`ngram.py`) guesses several tokens at no cost. One cycle here, for the last emitted token x (the root):

1. x runs through the shallow layers 0..E (as a chain draft would) and the draft head at E gives k candidates
   for the next position. Where the latest n-gram occurred before, its continuation c1, c2, ... is a branch
   several tokens deep. Both go into one trie (`drafts.DraftTree`): branches that share a prefix share nodes (a
   candidate equal to c1 is c1's node).
2. Every node runs through layers 0..E at once, at position x's + its depth, seeing the context, x, its
   ancestors and itself, not its siblings or cousins (a tree attention mask).
3. The deep layers E+1..L-1 run over x and every node at once, with the same mask; the final head gives the
   full model's logits at x and at each node.
4. The tree is walked (`accept.tree_verdict`). Greedy: from x, move to the child equal to the full model's token
   there (after the logits processors), as long as one exists and that token would not stop generation; the
   path's tokens are kept and the full model's token after the last accepted node follows them (the bonus
   token). Sampling: every draft here is certain of its token (the head's top candidates, an n-gram
   continuation), and the multi-draft rule for such drafts (SpecInfer; EAGLE's recursive rejection sampling;
   `accept.among_certain_drafts`) decides: at a node with the full model's distribution p (processed scores,
   softmax; the processors see that node's own prefix), its children are tried in order, child c accepted with
   probability r(c), r being p with the rejected siblings' mass set to 0 and renormalised; on acceptance the walk
   moves to c and goes on with c's p; when every child is rejected the next token is drawn from r, and after an
   accepted leaf from the leaf's p. Each token comes out with probability p: P(c1) = p(c1), P(c2) = (1 - p(c1)) *
   p(c2) / (1 - p(c1)) = p(c2), and so on, and any other token's (1 - sum of p(children)) * p(x) / (1 - sum of
   p(children)) = p(x). An accepted child that would stop generation ends the walk as its last token, as the
   greedy walk's stopping token does. Either way the cache keeps the accepted path's K/V, moved right after x in
   order, and drops the other nodes'.

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

`TreeDrafter` only proposes: it runs step 1 and hands the loop the trie (`Draft.tree`). The loop's draft-and-verify
backend (`loop.DraftVerify`) runs the passes of steps 2 and 3 (the call's verifier's: `Verifier.verify_tree`),
has `accept.tree_verdict` walk the tree (step 4) and compacts the cache (`Verifier.keep_path`); where no tree mask
reached the layers it verifies the head's top candidate alone, as a chain of one, and tells the drafter
(`TreeDrafter.verified`). The fallback chains are the chain drafter's (`chain.ChainDrafter`) and the n-gram
drafter's (`ngram.NgramDrafter`). Compiled tree cycles run all four steps as one graph (`graphtree.py`).
"""

from __future__ import annotations

import torch

from ...models.compat import is_static_layer, layer_length, plain_dynamic_layers
from ..processors import process
from .drafts import Draft, DraftTree
from .verifier import room_for

__all__ = ["TreeDrafter"]


class TreeDrafter:
    """Lossless drafting of a trie per cycle: the head's `session.draft_topk` candidates and the n-gram
    continuation (`session`: a `session.LosslessSession`; the rest, the call's `ShallowPasses`, `Verifier`,
    `Stops`, `NgramDrafter` or None, and `ChainDrafter`, which drafts where a tree cannot). It proposes the trie;
    the backend verifies it and `accept.tree_verdict` walks it."""

    def __init__(self, session, shallow, verifier, stops, ngrams, chain, logits_processor):
        self.session, self.shallow, self.verifier, self.stops = session, shallow, verifier, stops
        self.ngrams, self.chain, self.logits_processor = ngrams, chain, logits_processor
        self.k = session.draft_topk
        self.usable = None  # known at the first call: the cache can be compacted and the layers take a tree mask
        self.chained = False  # the last cycle drafted a chain of the chain drafter's (it keeps the cap)
        self.lone = False  # the last tree's context was x alone (attention may take no mask there: causal needs none)

    @property
    def topk(self) -> int:
        """The candidates it drafts for the next position: `session.draft_topk`, or 1 (chains) once the cache or
        the model's attention turned out to take no tree."""
        return self.k if self.usable is None or self.usable else 1

    def verified(self, accepted: int, tree_mask: bool = True) -> None:
        """After the loop accepted `accepted` drafted tokens: a chain of the chain drafter's tells it. `tree_mask`
        False: no tree mask reached the layers, and the backend verified the tree's top candidate alone, a chain
        of one (the chain drafter's, for its cap); past a one-token context, this model's attention takes no tree
        mask: chains from here on."""
        if not tree_mask:
            if not self.lone:
                self.usable = False
            self.chained = True
            self.chain.drafted_one()
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
            candidates = draft_scores.topk(self.k, dim=-1).indices  # [1, k], the best first
        tree = DraftTree()
        for token in candidates[0].tolist():
            tree.add(0, token)
        tree.add_chain(continuation, ngram=True)
        self.chained, self.lone = False, layer_length(cache, 0) <= 1
        # one head step (k candidates) and the n-gram tokens
        return Draft(input_ids, 0, steps=1 + len(continuation), ngram=len(continuation), tree=tree)
