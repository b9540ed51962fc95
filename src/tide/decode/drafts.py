"""The small records that pass between drafting, verification and the decode loop (a cycle's, `Cycle`, from either
backend), and what a drafter is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Cycle", "Draft", "Drafter", "Verdict", "Verified"]


@dataclass
class Draft:
    """What a drafter proposes after the sequence it was given.

    `ids` is the sequence with the drafted tokens appended. `scores` holds the processed draft scores the tokens
    were sampled from (sampling only; the speculative-sampling rule needs them). A tree draft verifies its
    candidates in the same pass that drafts them and hands over the full model's logits as `verified`; its walk
    also decides what is kept (it judged each node on the way; under sampling the acceptance is random and depends
    on the path), and hands over that verdict as `decided`: the loop emits it as is, without judging the draft
    again. A draft whose last token would stop generation says so (`stops`): if verification accepts it, nothing
    follows it. The rest says what the loop counts for the draft (`GenerationStats`).
    """

    ids: torch.Tensor  # [1, n + k]
    count: int  # k, the drafted tokens at the end of `ids`
    scores: torch.Tensor | None = None  # [1, k, V] (sampling)
    verified: torch.Tensor | None = None  # [1, k + 1, V] full-model logits at the last k + 1 positions of `ids`
    stops: bool = False  # the last drafted token ends generation (EOS, a stop string, the caller's criteria)
    decided: Verdict | None = None  # the verdict, already decided (a tree walk): every drafted token kept
    steps: int | None = None  # draft steps and n-gram tokens offered (`drafted`: a tree's head step offers its
    #   candidates for one position as one step); None: `count`
    ngram: int = 0  # of `steps`, n-gram tokens
    from_ngram: tuple[bool, ...] = ()  # per drafted token of `ids` (or none): offered by an n-gram continuation
    tree: bool = False  # `ids` ends with the path a tree's walk kept; its verification went over the whole tree
    later_children: int = 0  # of that path, the nodes that were not their parent's first child


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
    """What one lossless cycle gives the loop (`lossless.py`), from either backend: the tokens it would emit and
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
    """What the lossless loop drafts with (`speculative.ChainDrafter`, `treedraft.TreeDrafter`): a draft after the
    sequence `ids` [1, n] each cycle, and, once it is verified, how many of its tokens the loop accepted; `topk`:
    the candidates it drafts for the next position (1: a chain), for the stats."""

    topk: int

    def draft(self, ids: torch.Tensor) -> Draft: ...

    def verified(self, accepted: int) -> None: ...
