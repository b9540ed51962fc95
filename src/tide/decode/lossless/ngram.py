"""Free drafts: continuations of the latest n-gram where it occurred before, in the prompt or the output.

Text that users generate repeats itself (code, lists, edits of a given document, answers that quote the
question); where the last n tokens occurred before, the tokens that followed them then are a draft that costs
no layer and no head. `NgramLookup` keeps, for every n-gram of the sequence and every n up to `max_n`, the
position where it last occurred; each cycle it reads only the tokens added since the last (no scan of the
sequence), and the longest n-gram that matches gives the continuation. `NgramDrafter` makes a lossless draft of
it: the continuation up to the first token that would stop generation, run with the last emitted token through
the shallow layers as one chunk (no head between them).
"""

from __future__ import annotations

import torch

from .accept import certain_scores
from .drafts import Draft

__all__ = ["NgramDrafter", "NgramLookup"]


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


class NgramDrafter:
    """Lossless drafts of the sequence's n-gram continuation (`session`: a `session.LosslessSession`; `shallow`,
    `verifier`, `stops`: the call's `ShallowPasses`, `Verifier` and `drafts.Stops`). Used by the chain and
    tree drafters, which draft from the head where there is no continuation."""

    def __init__(self, session, lookup: NgramLookup, shallow, verifier, stops, sample: bool):
        self.session, self.lookup, self.shallow, self.verifier, self.stops = session, lookup, shallow, verifier, stops
        self.do_sample = sample

    def continuation(self, input_ids: torch.LongTensor) -> list[int]:
        """The tokens that followed the latest n-gram of `input_ids` [1, n] where it last occurred (none: draft
        from the head), as many as a draft may hold."""
        self.lookup.update(input_ids)
        return self.lookup.continuation(min(self.session.options.max_draft, self.stops.room(input_ids)))

    def draft(self, input_ids: torch.LongTensor, continuation: list[int]) -> Draft:
        """The draft `continuation` (an earlier occurrence's next tokens), up to the first that would stop
        generation; every drafted token and the last emitted one run through the shallow layers as one chunk.
        Sampling reads the drafts as drawn from a distribution that is certain of them."""
        drafted = torch.tensor([continuation], dtype=input_ids.dtype, device=input_ids.device)
        scores = certain_scores(drafted, self.session.model.num_head_rows)
        count, stops = self.stops.first(input_ids, drafted, scores)
        tokens = torch.cat([input_ids, drafted[:, :count]], 1)
        chunk = tokens[:, -count - 1:]
        with torch.no_grad():
            self.verifier.keep(chunk, self.shallow.run(chunk, self.session.grown_mask(tokens.shape[1])), complete=True)
        return Draft(tokens, count, scores[:, :count] if self.do_sample else None, stops=stops, ngram=count,
                     from_ngram=(True,) * count)
