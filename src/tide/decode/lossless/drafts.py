"""The small records that pass between drafting, verification and the decode loop (a tree draft's trie, `DraftTree`;
a cycle's, `Cycle`, from either backend), and what a drafter is."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Cycle", "Draft", "DraftTree", "Drafter", "Stops", "Verdict", "Verified"]


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

    def later_children(self, path: list[int]) -> int:
        """Of a path from the root (node indices, the root first), the nodes that are not their parent's first
        child."""
        return sum(next(iter(self.children[self.parents[node]].values())) != node for node in path[1:])

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


@dataclass
class Draft:
    """What a drafter proposes after the sequence it was given; it decides nothing (acceptance is `accept.py`'s).

    A chain: `ids` is the sequence with the drafted tokens appended. `scores` holds the processed draft scores the
    tokens were sampled from (sampling only; the speculative-sampling rule needs them). A draft whose last token
    would stop generation says so (`stops`): if verification accepts it, nothing follows it. A tree (`tree`, a
    `DraftTree` under the sequence's last token): its tokens are the trie's, `ids` is the sequence and
    `count` 0; the backend verifies the whole trie and keeps the path that acceptance walks. The rest says what the
    loop counts for the draft (`GenerationStats`).
    """

    ids: torch.Tensor  # [1, n + k]
    count: int  # k, the drafted tokens at the end of `ids`
    scores: torch.Tensor | None = None  # [1, k, V] (sampling)
    stops: bool = False  # the last drafted token ends generation (EOS, a stop string, the caller's criteria)
    steps: int | None = None  # draft steps and n-gram tokens offered (`drafted`: a tree's head step offers its
    #   candidates for one position as one step); None: `count`
    ngram: int = 0  # of `steps`, n-gram tokens
    from_ngram: tuple[bool, ...] = ()  # per drafted token of `ids` (or none): offered by an n-gram continuation
    tree: DraftTree | None = None  # a tree draft's trie (its n-gram branch: `ngram` tokens); None: a chain


@dataclass
class Verdict:
    """What verification decided: the tokens to append, of which the first `accepted` were drafted."""

    tokens: torch.Tensor  # [1, accepted + 1]
    accepted: int


@dataclass
class Verified:
    """What one verification pass gave, for each position it checked in order (the last emitted token's, then the
    drafted tokens' or a tree's nodes'): the full model's logits, and its final normed states (the context the
    next draft reads is the state at the position after the accepted drafts)."""

    logits: torch.Tensor  # [1, N, V]
    states: torch.Tensor  # [1, N, H]


@dataclass
class Cycle:
    """What one lossless cycle gives the loop (`loop.py`), from either backend: the tokens it would emit and
    what the call's counters take of it (`GenerationStats.record_cycle`); the loop counts the tokens it keeps (a
    stop may drop the graph's later ones) and the accepted ones among them."""

    tokens: torch.Tensor  # [1, accepted + 1] on the sequence's device (fewer: none after an accepted stopping draft)
    accepted: int  # drafted tokens among `tokens`
    drafted: int  # draft steps and n-gram tokens offered
    topk: int  # the candidates drafted for the next position (1: a chain)
    ngram_drafted: int = 0  # of `drafted`, n-gram tokens
    ngram_accepted: int = 0  # of `accepted`, n-gram tokens
    tree: bool = False  # verified over a tree
    merged: bool = False  # a tree that held an n-gram branch
    later_children: int = 0  # accepted tree nodes that were not their parent's first child (draft and verify)
    layer_passes: int = 0  # layer calls, where the backend knows them a cycle (the graph)
    graph_s: float | None = None  # the graph: seconds inside it (its launch, guards and host read too)
    read: list[int] | None = None  # the graph: `tokens` as the host read them, for the stopping criteria
    scores: torch.Tensor | None = None  # draft and verify, where the call keeps them: [1, k + 1, V] processed
    raw: torch.Tensor | None = None  # and raw


class Drafter(Protocol):
    """What the lossless loop drafts with (`chain.ChainDrafter`, `tree.TreeDrafter`): a draft after the
    sequence `ids` [1, n] each cycle (it only proposes: the backend verifies it, `accept.py` decides), and, once it
    is decided, how many of its tokens the loop accepted; `tree_mask` False: the draft was a tree, but no tree mask
    reached the layers, and the backend verified the head's top candidate alone, as a chain of one. `topk`: the
    candidates it drafts for the next position (1: a chain), for the stats."""

    topk: int

    def draft(self, ids: torch.Tensor) -> Draft: ...

    def verified(self, accepted: int, tree_mask: bool = True) -> None: ...


class Stops:
    """The call's stopping criteria (EOS, length, stop strings, the caller's; generate builds the EOS criterion from
    the generation config) as drafting checks them, and the tokens its length limit leaves to draft."""

    def __init__(self, stopping_criteria, max_length: int):
        self.criteria, self.max_length = stopping_criteria, max_length

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor) -> bool:
        """Whether a criterion fires on `tokens` [1, T] (`scores`: the last token's, for the criteria)."""
        return bool(self.criteria(tokens, scores).any())

    def first(self, input_ids: torch.Tensor, drafted: torch.Tensor, scores: torch.Tensor) -> tuple[int, bool]:
        """(how many of the drafts [1, k] to keep, whether the last kept one stops generation): up to and including
        the first after which a criterion fires (`scores` [1, k, V]: the drafts' scores, for the criteria)."""
        for i in range(drafted.shape[1]):
            if self(torch.cat([input_ids, drafted[:, : i + 1]], 1), scores[:, i]):
                return i + 1, True
        return drafted.shape[1], False

    def room(self, input_ids: torch.Tensor) -> int:
        """Tokens that may be drafted after `input_ids`: the length limit keeps one for the token after them."""
        return self.max_length - input_ids.shape[1] - 1
