"""Free drafts: continuations of the latest n-gram where it occurred before, in the prompt or the output.

Text that users generate repeats itself (code, lists, edits of a given document, answers that quote the
question); where the last n tokens occurred before, the tokens that followed them then are a draft that costs
no layer and no head. `NgramLookup` keeps, for every n-gram of the sequence and every n up to `max_n`, the
position where it last occurred; each cycle it reads only the tokens added since the last (no scan of the
sequence), and the longest n-gram that matches gives the continuation.
"""

from __future__ import annotations

import torch

__all__ = ["NgramLookup"]


class NgramLookup:
    """Continuations of the sequence's latest n-gram (n = `max_n` down to `min_n`) where it last occurred."""

    def __init__(self, max_n: int, min_n: int = 2):
        if max_n < 1:
            raise ValueError(f"NgramLookup needs max_n >= 1, got {max_n}.")
        self.max_n, self.min_n = max_n, min(min_n, max_n)
        self.tokens: list[int] = []
        self.follows: list[dict] = [{} for _ in range(max_n + 1)]  # [n]: n-gram -> index of the token after it

    def update(self, ids: torch.Tensor) -> None:
        """Read the tokens of `ids` [1, T] (the whole sequence so far) added since the last call."""
        self.extend(ids[0, len(self.tokens):].tolist())

    def extend(self, tokens: list[int]) -> None:
        """Read `tokens`, the sequence's next tokens."""
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the new token follows the n-grams that end just before it
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self.follows[n][tuple(self.tokens[end - n:end])] = end

    def continuation(self, length: int) -> list[int]:
        """Up to `length` tokens that followed the longest earlier occurrence of the sequence's last n-gram."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(self.tokens) < n:
                continue
            start = self.follows[n].get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start:start + length]
        return []
