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
(SDPA, eager) and a backbone whose output is its final norm's (`TreeDrafter._through_backbone`). Where no 4-D mask
tensor reaches the layers, or a cache layer is neither a plain `DynamicLayer` nor a full-attention static layer
(sliding windows keep their own bookkeeping), or a static cache has no room for x and every node, the cycle drafts
as before: the n-gram continuation as a chain where there is one, else a chain from the head. Families whose
positions live in the mask rather than in `position_ids` (alibi) never get here (`ArchSpec.tree_drafts`). Those
chains are judged as chains: sampling a head chain from the head's distribution and an n-gram chain as certain of
its tokens, by the speculative-sampling rule.
"""

from __future__ import annotations

import functools
import time

import torch

from ..layers.args import new_positions
from ..layers.calls import (
    additive_mask,
    additive_masks,
    capture_layer_calls,
    tree_mask_calls,
    without_first_position,
)
from ..layers.fewrows import few_row_linears
from ..models.compat import (
    LengthView,
    crop_cache,
    crop_layer,
    grouped_query_attention_in_place,
    is_static_layer,
    keep_path,
    layer_length,
    plain_dynamic_layers,
)
from .accept import among_certain_drafts, certain_scores
from .drafts import Draft, Verdict
from .processors import process

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
    """Lossless drafting of a trie per cycle, greedy or sampled: the head's `session.draft_topk` candidates and
    the n-gram continuation (used by `LosslessSession`)."""

    def __init__(self, session, chain):
        self.session, self.chain = session, chain  # chain: the session's chain drafter (prefill, masks, stopping)
        self.k = session.draft_topk
        self.usable = None  # known at the first call: the cache can be compacted and the layers take a tree mask
        self.backbone = None  # known at the first tree: trees are verified by the backbone's compiled forward
        self.tree: DraftTree | None = None  # the last cycle's tree (None: it drafted a chain)
        self.path: list[int] = []  # the last tree's accepted path, x first

    def verified(self, accepted: int) -> None:
        """After the loop accepted `accepted` drafted tokens: the next context and the counters."""
        tree, self.tree = self.tree, None
        if tree is None:
            self.chain.verified(accepted)
            return
        session, stats = self.session, self.session.stats
        session.accept(accepted)
        stats.accepted += accepted
        stats.ngram_accepted += sum(tree.ngram[node] for node in self.path[1:accepted + 1])
        stats.decode_tokens += accepted + 1

    def draft(self, input_ids: torch.LongTensor) -> Draft:
        start = time.perf_counter()
        try:
            return self._draft(input_ids)
        finally:
            self.session.stats.decode_time_s += time.perf_counter() - start

    def _draft(self, input_ids: torch.LongTensor) -> Draft:
        session, chain, stats = self.session, self.chain, self.session.stats
        chain._prefill(input_ids)
        continuation = chain.ngram_continuation(input_ids)
        cache = chain.cache
        if self.usable is None:
            self.usable = plain_dynamic_layers(cache) or all(is_static_layer(layer) for layer in cache.layers)
        if not self.usable:
            stats.draft_topk = 1
        room = chain.max_length - input_ids.shape[1] >= 2 and _room_for(cache, self.k + 1 + len(continuation))
        if not (self.usable and room):  # a cache the tree cannot compact, or no room for the tree: as before
            self.tree = None
            if continuation:  # an earlier occurrence's next tokens: a chain that costs no head
                return chain.ngram_draft(input_ids, continuation)
            return chain.draft(input_ids)
        x = input_ids[:, -1:]
        with torch.no_grad():
            logits, _ = session.draft_step(x, cache, session.grown_mask(input_ids.shape[1]), session.context)
            draft_scores = process(chain.logits_processor, input_ids, logits.float())
            candidates = draft_scores.topk(self.k, dim=-1).indices  # [1, k]
            tree = DraftTree()
            for token in candidates[0].tolist():
                tree.add(0, token)
            tree.add_chain(continuation, ngram=True)
            logits = self._verify(tree, cache, session.grown_mask(input_ids.shape[1]))
        if logits is None:  # no tree mask reached the layers: a chain draft of one (the session verifies it)
            if layer_length(cache, 0) > 1:  # (a one-token context may get no mask: causal attention needs none)
                self.usable, stats.draft_topk = False, 1  # this model's attention takes none: chains from here on
            self.tree, chain.drafted, chain.from_ngram = None, 1, False
            stats.drafted += 1
            top = candidates[:, :1]  # the head's top candidate: a draft certain of it (sampling)
            scores = certain_scores(top, session.model.num_head_rows) if chain.do_sample else None
            return Draft(torch.cat([input_ids, top], 1), 1, scores)
        self.tree, nodes = tree, len(tree) - 1
        stats.drafted += 1 + len(continuation)  # one head step (k candidates) and the n-gram tokens
        stats.ngram_drafted += len(continuation)
        stats.merged_cycles += bool(continuation)
        stats.tree_cycles += 1
        walk = self._sampled_walk if chain.do_sample else self._walk
        self.path, out, last = walk(tree, logits, input_ids)
        stats.later_children_accepted += sum(next(iter(tree.children[tree.parents[node]].values())) != node
                                             for node in self.path[1:])
        keep_path(cache, session.parts.num_layers, nodes, [node - 1 for node in self.path[1:]])
        session.verified_contexts = session.verified_contexts[:, self.path]
        count = len(self.path) - 1
        # the walk decided: the path's tokens, then the token after them (the loop does not judge them again)
        decided = Verdict(torch.cat([out[:, out.shape[1] - count:], last.to(out.device)], 1), count)
        return Draft(out, count, verified=logits[:, self.path], decided=decided)

    def _walk(self, tree: DraftTree, logits: torch.Tensor, input_ids: torch.LongTensor):
        """The accepted path (node indices, x first), the sequence with its tokens, and the full model's token
        [1, 1] after them: from x, the child equal to the full model's processed argmax, while one exists and that
        token would not stop generation (a stopping token is the one after the path, as the loop's bonus token)."""
        path, ids = [0], input_ids
        while True:
            node = path[-1]
            # (a copy: processors may work in place, and the loop may apply them to these logits itself)
            scores = process(self.chain.logits_processor, ids, logits[:, node].to(torch.float32, copy=True))
            target = scores.argmax(-1, keepdim=True)
            child = tree.children[node].get(int(target))
            if child is None or self.chain.stops(torch.cat([ids, target], 1), logits[:, node]):
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
            scores = process(self.chain.logits_processor, ids, logits[:, node].to(torch.float32, copy=True))
            children = tree.children[node]
            tried, token = among_certain_drafts(scores.softmax(-1)[0], list(children))
            target = torch.tensor([[token]], dtype=ids.dtype, device=ids.device)
            if tried < 0 or self.chain.stops(torch.cat([ids, target], 1), logits[:, node]):
                return path, ids, target
            path.append(children[token])
            ids = torch.cat([ids, target], 1)

    def _verify(self, tree: DraftTree, cache, mask) -> torch.Tensor | None:
        """Full-model logits [1, N, V] at the pending token x and at each node of `tree`; None if no tree mask."""
        session, parts, n = self.session, self.session.parts, len(tree)
        pad = self._padding(tree, cache)
        if self.backbone is None:  # (known at the first tree: the call's cache and compile options stay)
            self.backbone = self._through_backbone(cache)
        if pad is not None and self.backbone:
            return self._verify_through_backbone(tree, cache, mask, pad)
        # compiled graphs serve the head's k-wide trees and, padded to one width, trees with n-gram branches; where
        # a static cache has no room left for that width, an n-gram tree runs eagerly
        eager, pad = pad is None, pad or 0
        q = n + pad  # the chunk's width: the tree, and padding after it to the compiled width of n-gram trees
        x_state = session.pending_states  # [1, 1, H]
        have = layer_length(cache, 0)  # shallow layers hold x; deep layers do not yet
        ids, inputs, blocked = self._chunk(tree, pad, mask, have - 1)
        deep = capture_layer_calls(parts, input_ids=ids, past_key_values=LengthView(cache, have - 1), use_cache=True,
                                   **inputs)
        deep = tree_mask_calls(deep, blocked, start=have - 1)
        if deep is None:
            return None
        deep = additive_masks(parts, deep)
        # The nodes' chunk for the shallow layers is the same chunk without x: same keys (x is cached there),
        # same positions. Sliced from the deep calls where every per-position argument is recognised, else captured.
        shallow = without_first_position(deep[: session.draft_layer + 1], q)
        if shallow is None:
            inputs["position_ids"] = inputs["position_ids"][:, 1:]
            shallow = tree_mask_calls(capture_layer_calls(parts, input_ids=ids[:, 1:], use_cache=True, **inputs,
                                                          past_key_values=LengthView(cache, have)), blocked[1:, 1:],
                                      start=have)
            shallow = additive_masks(parts, shallow)
        with few_row_linears(parts, session.few_row_layout), grouped_query_attention_in_place():  # N - 1 and N rows
            states = session.spans.run(0, session.draft_layer + 1, shallow[0].hidden, shallow, eager=eager)
            states = session.spans.run(session.draft_layer + 1, parts.num_layers, torch.cat([x_state, states], 1),
                                       deep, eager=eager)
            states = self._without_padding(states, cache, n, pad)
            normed = parts.final_norm(states)
            return self._verified(normed, parts.logits_from_normed(normed))

    def _chunk(self, tree: DraftTree, pad: int, mask, past: int):
        """The verification chunk [x, nodes, padding] after `past` cached positions: its ids [1, Q]; the backbone's
        inputs for it (the mask grown over it, positions x's + each node's depth, the padding's depth 1); and the
        tree's blocked entries [Q, Q] (the padding sees what causal attention lets it see, and no node sees it)."""
        x_ids = self.session.pending_ids  # [1, 1]
        nodes = torch.tensor([tree.tokens[1:] + [0] * pad], dtype=x_ids.dtype, device=x_ids.device)
        inputs = new_positions(mask, past, len(tree) + pad, x_ids.device)
        depths = torch.tensor([tree.depths + [1] * pad], device=inputs["position_ids"].device)
        inputs["position_ids"] = inputs["position_ids"][:, :1] + depths
        blocked = tree.blocked()
        if pad:
            blocked = torch.nn.functional.pad(blocked, (0, pad, 0, pad), value=False)
        return torch.cat([x_ids, nodes], 1), inputs, blocked

    @staticmethod
    def _without_padding(states: torch.Tensor, cache, n: int, pad: int) -> torch.Tensor:
        """The chunk's states without its padding; the padding's K/V lie past every layer's length afterwards, where
        the next chunk overwrites them."""
        if pad:
            states = states[:, :n]
            crop_cache(cache, pad)
        return states

    def _verified(self, normed: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """After a verification pass: the full model's final normed states [1, N, H] kept for the next drafts'
        context, the pending token handed over, the counters; returns `logits`."""
        session = self.session
        session.verified_contexts = normed
        session.pending_ids = session.pending_states = None
        session.stats.layer_passes += session.parts.num_layers  # the nodes' shallow layers and everyone's deep ones
        session.stats.verify_passes += 1
        session.stats.decode_steps += 1
        return logits

    def _through_backbone(self, cache) -> bool:
        """Whether a compiled call verifies its trees in one pass of the backbone's own compiled forward, with the
        tree as a custom 4-D mask (which transformers passes to every layer as given): every layer takes the same
        arguments (one mask serves all), attention adds the mask (SDPA, eager), the backbone's output is its final
        norm's (no projection after it, e.g. OPT's project_out), and the cache is a full-attention static one (one
        shape, one graph)."""
        session, parts = self.session, self.session.parts
        return (session.spans.compiled and parts.uniform_layers and parts.post_norm is None
                and parts.spec.norm.startswith(parts.spec.backbone + ".")
                and getattr(parts.backbone.config, "_attn_implementation", None) in ("sdpa", "eager")
                and all(is_static_layer(layer) for layer in cache.layers))

    def _verify_through_backbone(self, tree: DraftTree, cache, mask, pad: int) -> torch.Tensor:
        """`_verify` as one compiled pass of the backbone over the chunk [x, nodes, padding] (positions x's + the
        nodes' depths, the tree mask), from x's position in every layer: the draft layers drop x first, and the
        pass writes it again with the rest. The backbone's output is the full model's final normed state."""
        session, n = self.session, len(tree)
        q = n + pad
        for layer in range(session.draft_layer + 1):
            crop_layer(cache, layer, -1)
        past = layer_length(cache, 0)  # every layer holds the context before x
        ids, inputs, blocked = self._chunk(tree, pad, mask, past)
        keys = cache.layers[0].get_mask_sizes(q)[0]  # a static layer's masks span the whole cache
        sees = torch.zeros(1, 1, q, keys, dtype=torch.bool, device=ids.device)
        context = inputs.get("attention_mask")
        sees[..., :past] = True if context is None else context[:, None, None, :past].bool()
        tree_part = torch.ones(q, q, dtype=torch.bool).tril().logical_and_(blocked.logical_not())  # ancestors, itself
        sees[0, 0, :, past:past + q] = tree_part.to(sees.device)
        states = session.spans.backbone(input_ids=ids, position_ids=inputs["position_ids"],
                                        attention_mask=additive_mask(sees, session.pending_states.dtype),
                                        past_key_values=cache, use_cache=True)
        states = self._without_padding(states, cache, n, pad)
        return self._verified(states, session.parts.logits_from_normed(states))

    def _padding(self, tree: DraftTree, cache) -> int | None:
        """Positions to add after a tree with n-gram branches so that compiled passes see one width for them (the
        widest such a tree gets: x, k candidates and the longest continuation), on a static cache with room for it;
        0 where nothing is compiled and for the head's trees (one width already); None where there is no room."""
        if not (self.session.spans.compiled and tree.has_ngram):
            return 0
        widest = 1 + self.k + self.session.max_draft
        return widest - len(tree) if _room_for(cache, widest) else None


def _room_for(cache, positions: int) -> bool:
    """Whether every layer of a static cache has `positions` free slots past its length (a tree writes x and all
    its nodes before it keeps a path); always on a dynamic cache."""
    return all(not is_static_layer(layer) or layer.max_cache_len - int(layer.get_seq_length()) >= positions
               for layer in cache.layers)
