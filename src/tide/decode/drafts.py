"""The small records that pass between drafting, verification and the decode loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Draft", "Verdict"]


@dataclass
class Draft:
    """What a drafter proposes after the sequence it was given.

    `ids` is the sequence with the drafted tokens appended. `scores` holds the processed draft scores the tokens
    were sampled from (sampling only; the speculative-sampling rule needs them). A tree draft verifies its
    candidates in the same pass that drafts them and hands over the full model's logits as `verified`; its walk
    also decides what is kept (it judged each node on the way; under sampling the acceptance is random and depends
    on the path), and hands over that verdict as `decided`: the loop emits it as is, without judging the draft
    again. A draft whose last token would stop generation says so (`stops`): if verification accepts it, nothing
    follows it.
    """

    ids: torch.Tensor  # [1, n + k]
    count: int  # k, the drafted tokens at the end of `ids`
    scores: torch.Tensor | None = None  # [1, k, V] (sampling)
    verified: torch.Tensor | None = None  # [1, k + 1, V] full-model logits at the last k + 1 positions of `ids`
    stops: bool = False  # the last drafted token ends generation (EOS, a stop string, the caller's criteria)
    decided: Verdict | None = None  # the verdict, already decided (a tree walk): every drafted token kept


@dataclass
class Verdict:
    """What verification decided: the tokens to append, of which the first `accepted` were drafted."""

    tokens: torch.Tensor  # [1, accepted + 1]
    accepted: int
