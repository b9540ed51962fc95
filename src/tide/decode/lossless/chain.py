"""The chain drafter: a chain of drafts from the draft layer's head on the main model's own cache, or the n-gram
continuation where there is one, and the chain's draft cap (`next_cap`) that the graph's cycles keep too."""

from __future__ import annotations

import torch

from ..processors import process
from .drafts import Draft, Stops
from .ngram import NgramDrafter
from .shallow import ShallowPasses
from .verifier import Verifier

__all__ = ["ChainDrafter", "next_cap"]


def next_cap(cap: int, drafted: int, accepted: int, max_draft: int) -> int:
    """The chain's draft cap after a verification: one more after a fully accepted draft (up to `max_draft`),
    the accepted count + 1 after a rejection, unchanged when nothing was drafted."""
    if not drafted:
        return cap
    return min(cap + 1, max_draft) if accepted >= drafted else max(1, accepted + 1)


class ChainDrafter:
    """Drafts a chain of tokens from the draft layer's head on the main model's own cache, or the n-gram
    continuation where there is one (`ngrams`); keeps the chain's draft cap."""

    topk = 1  # the candidates it drafts for the next position (`drafts.Drafter`): a chain

    def __init__(self, session, shallow: ShallowPasses, verifier: Verifier, stops: Stops,
                 ngrams: NgramDrafter | None, logits_processor, sample: bool):
        self.session, self.shallow, self.verifier, self.stops, self.ngrams = session, shallow, verifier, stops, ngrams
        self.logits_processor, self.do_sample = logits_processor, sample
        self.cap = session.options.max_draft  # the longest chain the head drafts next
        self.drafted = 0  # the head's drafts in the last chain (n-gram drafts: none, they leave the cap)

    def draft(self, input_ids: torch.LongTensor) -> Draft:
        self.drafted = 0
        continuation = self.ngrams.continuation(input_ids) if self.ngrams is not None else []
        if continuation:
            return self.ngrams.draft(input_ids, continuation)
        session, verifier = self.session, self.verifier
        budget = min(self.cap, self.stops.room(input_ids)) if session.options.head_drafts else 0
        tokens, draft_scores, stops = input_ids, [], False
        token, context = input_ids[:, -1:], verifier.context
        with torch.no_grad():
            draft = self._chain_in_one_call(input_ids, budget)
            if draft is not None:
                return draft
            while len(draft_scores) < budget:
                hidden, (logits, context) = self.shallow.head(token, session.grown_mask(tokens.shape[1]), context)
                verifier.keep(token, hidden)
                scores = process(self.logits_processor, tokens, logits.float())
                token = self._choose(scores)
                tokens = torch.cat([tokens, token], 1)
                draft_scores.append(scores)
                # A draft that would stop generation ends the chain. It is verified like any other (dropping a
                # draft because of its value would bias sampling); the loop emits nothing after it if accepted.
                stops = self.stops(tokens, scores)
                if stops:
                    break
        self.drafted = len(draft_scores)
        scores = torch.stack(draft_scores, 1) if (draft_scores and self.do_sample) else None
        return Draft(tokens, self.drafted, scores, stops=stops)

    def drafted_one(self) -> None:
        """The last draft was one token from the head that another drafter drafted (a tree's top candidate, verified
        alone where no tree mask reached the layers): counted as this drafter's, for the cap."""
        self.drafted = 1

    def verified(self, accepted: int, tree_mask: bool = True) -> None:
        """After the loop accepted `accepted` of the drafts: the cap (of head drafts: n-gram drafts leave it).
        (`tree_mask`: for tree drafts, which this drafter never drafts.)"""
        self.cap = next_cap(self.cap, self.drafted, accepted, self.session.options.max_draft)

    def _chain_in_one_call(self, input_ids: torch.LongTensor, budget: int) -> Draft | None:
        """A greedy chain of `budget` drafts in one compiled call (`ShallowPasses.chain`), cut after the first that
        would stop generation; None where the call samples, has logits processors, drafts fewer than two, or the
        model cannot run a chain that way."""
        processors = self.logits_processor
        if budget < 2 or self.do_sample or not isinstance(processors, (list, tuple)) or len(processors):
            return None
        token = input_ids[:, -1:]
        out = self.shallow.chain(token, self.session.grown_mask(input_ids.shape[1]), self.verifier.context, budget)
        if out is None:
            return None
        states, drafts, logits = out
        self.verifier.keep(torch.cat([token, drafts[:, :-1]], 1), states)
        count, stops = self.stops.first(input_ids, drafts, logits.float())
        if count < budget:  # the drafts after a stopping one: their shallow K/V and states go
            self.verifier.drop(budget - count)
        self.drafted = count
        return Draft(torch.cat([input_ids, drafts[:, :count]], 1), count, None, stops=stops)

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        if self.do_sample:
            return torch.multinomial(scores.softmax(-1), 1)
        return scores.argmax(-1, keepdim=True)
