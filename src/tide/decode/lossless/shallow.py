"""Lossless drafting's passes through the shallow layers 0..E (E = the draft layer), on the model's own cache.

Those layers' K/V are exactly what the full model writes, so a drafted token that runs them needs only the deep
layers at verification. `ShallowPasses` runs tokens through them (one token, or a chunk that needs no head between
its tokens: an n-gram continuation), the draft head after one token, or a whole greedy chain of head drafts in one
compiled call; it returns the layer-E states, which the caller hands to the verifier (`verifier.Verifier.keep`), and
counts the layer calls it ran (`layer_calls`, for the loop's stats). It holds no drafted state.
"""

from __future__ import annotations

import torch

from ...layers.args import new_positions
from ...layers.calltransforms import positions_of
from ...layers.fewrows import few_row_linears
from ...models.compat import grouped_query_attention_in_place, layer_length

__all__ = ["ShallowPasses"]


class ShallowPasses:
    """Runs tokens through layers 0..E on the call's cache (`session`: a `session.LosslessSession`)."""

    def __init__(self, session, cache):
        self.session, self.cache = session, cache
        self.last = session.draft_layer + 1  # the layers run: 0..E
        self.chains_in_one_call = True  # until `chain` finds this model's arguments cannot run that way
        self.layer_calls = 0  # decoder-layer calls run so far (the loop counts them into the stats)

    def run(self, tokens: torch.Tensor, mask) -> torch.Tensor:
        """Run tokens [1, T] through layers 0..E; -> their layer-E states [1, T, H]. One token runs as the spans
        run (compiled or eager); several (they need no head between them) run as one chunk, eagerly."""
        session = self.session
        hidden, calls = self._calls(tokens, mask)
        if tokens.shape[1] == 1:
            hidden = session.spans.run(0, self.last, hidden, calls)
        else:
            with few_row_linears(session.parts, session.options.few_row_layout), grouped_query_attention_in_place():
                hidden = session.spans.run(0, self.last, hidden, calls, eager=True)
        self.layer_calls += self.last
        return hidden

    def head(self, token: torch.Tensor, mask, context: torch.Tensor | None):
        """`run` for one token [1, 1], then the draft head on its state and `context` (`draft_logits`), in one
        compiled call where spans are compiled: -> (layer-E state [1, 1, H], (logits [1, V], the draft's normed
        state [1, H]))."""
        session = self.session
        function = session.model.draft_function(session.draft_layer, session.options.draft_vocab_size)
        if function is None:  # a replaced draft_logits: called as it is
            hidden = self.run(token, mask)
            return hidden, session.model.draft_logits(session.draft_layer, hidden[:, -1], context,
                                                      session.options.draft_vocab_size)
        hidden, calls = self._calls(token, mask)
        hidden, drafted = session.spans.run_then(0, self.last, hidden, calls, function, context)
        self.layer_calls += self.last
        return hidden, drafted

    def chain(self, token: torch.Tensor, mask, context: torch.Tensor | None, count: int):
        """`count` greedy drafts after token [1, 1] in one compiled call: each token runs layers 0..E and the draft
        head, and the next is the head's argmax (no logits processors: the caller checks). -> (the layer-E states
        of the tokens run [1, count, H]: the given one and every draft but the last, the drafts [1, count], their
        logits [1, count, V]); None where a chain cannot run as one call (eager spans, per-layer arguments,
        embeddings the backbone transforms beyond adding positions, arguments with no recognisable position axis,
        a replaced `draft_logits`), and nothing has run."""
        session, layer_args = self.session, self.session.layer_args
        head = session.model.draft_function(session.draft_layer, session.options.draft_vocab_size)
        if head is None or not (self.chains_in_one_call and session.spans.compiled and session.parts.uniform_layers):
            return None
        past = layer_length(self.cache, 0)
        inputs = new_positions(mask, past, count, token.device)
        hidden, calls = layer_args.calls(token.expand(-1, count), self.cache, inputs.get("attention_mask"),
                                         inputs["position_ids"])
        call, form = calls[0], layer_args.embedding_form
        # learned positions: what the backbone adds to the embeddings, from the window these arguments were cut from
        positional = layer_args.positional(past, count) if layer_args.off_reason is None else None
        steps = []
        if ((form == "exact" or (form == "positional" and positional is not None)) and call.args
                and all(c is call for c in calls[: self.last])):
            steps = [positions_of([call], count, i, 1) for i in range(count)]  # position i's arguments
        if not steps or any(step is None for step in steps):
            self.chains_in_one_call = False  # (this model and cache: not again in this call)
            return None
        steps = [(step[0].args[1:], step[0].kwargs) for step in steps]
        embed = session.parts.backbone.get_input_embeddings()
        states, drafts, logits = session.spans.run_chain(0, self.last, hidden[:, :1], steps, embed,
                                                         positional if form == "positional" else None, head, context)
        self.layer_calls += self.last * count
        return states, drafts, logits

    def _calls(self, tokens, mask):
        inputs = new_positions(mask, layer_length(self.cache, 0), tokens.shape[1], tokens.device)
        return self.session.layer_args.calls(tokens, self.cache, inputs.get("attention_mask"), inputs["position_ids"])
