"""Lossless mode: self-speculative decoding from a checkpoint's exit head (the loop is `decode.lossless`).

Drafting runs each token through the shallow layers 0..E only (E = the draft layer), on the model's own
cache: those layers' K/V are exactly what the full model writes. The exit head at E drafts the next token.
Verification runs the last draft through the shallow layers, then the deep layers E+1..L-1 over all the
drafted positions at once (their layer-E states were kept), which makes the cache even again and gives
the full model's logits for every position. Acceptance (longest greedy prefix, or the speculative-sampling
rule), cache cropping, logits processors, stopping criteria and streaming of accepted tokens are the decode
loop's (`decode/lossless.py`). Batch size 1. No router or threshold is involved: a wrong draft
costs time, never output. Drafts read the full model's final normed state at the position before the drafted
token (the "context") when the draft layer has a draft head (`TideForCausalLM.draft_logits`); verification
computes that state for every position it checks, and the accepted count picks the next draft's. With
`draft_topk` > 1, `treedraft.TreeDrafter` drafts one tree instead of a chain (the head's candidates and the
n-gram continuation as a deeper branch) and hands the loop the accepted path with logits it has already
verified (under sampling, with the verdict its walk drew).
"""

from __future__ import annotations

import inspect
import time

import torch

from ..layers.args import LayerArgs, grown_mask, new_positions
from ..layers.calls import capture_outputs, positions_of
from ..layers.fewrows import few_row_linears
from ..layers.spans import SpanRunner
from ..models.compat import crop_layer, grouped_query_attention_in_place, layer_length, unrecoverable_sliding_layers
from .accept import certain_scores
from .dispatch import base_forward
from .drafts import Draft
from .ngram import NgramLookup
from .processors import process
from .stats import GenerationStats
from .treedraft import TreeDrafter

__all__ = ["LosslessSession", "ChainDrafter", "LosslessUnavailable", "check_rollback", "next_cap"]


def next_cap(cap: int, drafted: int, accepted: int, max_draft: int) -> int:
    """The chain's draft cap after a verification: one more after a fully accepted draft (up to `max_draft`),
    the accepted count + 1 after a rejection, unchanged when nothing was drafted."""
    if not drafted:
        return cap
    return min(cap + 1, max_draft) if accepted >= drafted else max(1, accepted + 1)


class LosslessUnavailable(ValueError):
    """Lossless mode cannot run this call or model (the message says what to do instead)."""


def check_rollback(cache) -> None:
    """Sliding-window layers must keep evicted positions until a draft is accepted or cropped: the decode loop
    turns that on (`activate_past_recording`); a cache where it is off cannot be used."""
    layers = unrecoverable_sliding_layers(cache)
    if layers:
        raise LosslessUnavailable(
            f"mode='lossless' needs sliding-window cache layers that can roll back rejected drafts, and layers "
            f"{layers} of this cache drop evicted positions at once. Pass a DynamicCache (or none) and let "
            "generate create it, or use mode='exit'."
        )


class LosslessSession:
    """One lossless `generate` call: drafted states between drafting and verification, and the counters."""

    def __init__(self, model, config, spans: SpanRunner | None = None):
        self.model, self.base, self.parts = model, model.base, model.parts
        self.spans = spans or SpanRunner(self.parts)  # the shallow and the deep layers' runs (compiled or eager)
        self.draft_layer = config.resolve_draft_layer(model.checkpoints, self.parts.num_layers)
        # drafts run the draft layer's heads on its states: they must share its device and dtype
        model.routers.check_placement(self.draft_layer, next(self.parts.layers[self.draft_layer].parameters()))
        self.max_draft = config.max_draft
        self.cap = config.max_draft
        self.draft_topk = config.draft_topk if self.parts.spec.tree_drafts else 1
        self.draft_vocab_size = config.draft_vocab_size
        self.draft_ngram, self.head_drafts = config.draft_ngram, config.head_drafts
        self.few_row_layout = config.few_row_layout  # the CPU linears' layout in multi-position passes
        self.mask = None  # [1, n] the prompt's attention mask (None: no padding)
        self.stats = GenerationStats(self.parts.num_layers, [self.draft_layer], mode="lossless", kv_strategy="exact",
                                     draft_vocab_size=config.draft_vocab_size, switches=config.switches)
        self.pending_ids = None  # [1, P] tokens through the shallow layers only
        self.pending_states = None  # [1, P, H] their layer-E outputs
        self.pending_complete = False  # the pending tokens include the last drafted one (n-gram drafts)
        self.context = None  # [1, H] the full model's final normed state before the next drafted token
        self.verified_contexts = None  # [1, P + 1, H] the same for each position the last verification checked
        self.original_forward = base_forward(model.base)
        self.layer_args = LayerArgs(self.parts, stats=self.stats)  # drafted tokens' and verification's layer arguments
        self.chains_in_one_call = True  # until `draft_chain` finds this model's arguments cannot run that way
        self.fused_chain_first = False  # a compiled call drafts greedy chains as one graph a cycle where it can,
        #   whatever tree or n-gram scheme its config names (`decode/fused.py`)

    @property
    def pending(self) -> int:
        return 0 if self.pending_ids is None else self.pending_ids.shape[1]

    def drafter(self, generation_config, logits_processor, stopping_criteria, cache, mask):
        """The drafter for this call: a chain, or a tree of `draft_topk` candidates (greedy or sampling)."""
        self.mask = mask
        chain = ChainDrafter(self, generation_config, logits_processor, stopping_criteria, cache)
        if self.draft_topk > 1 and self.head_drafts:
            self.stats.draft_topk = self.draft_topk
            return TreeDrafter(self, chain)
        return chain

    def grown_mask(self, length: int):
        return grown_mask(self.mask, length)

    # ------------------------------------------------------------------ the shallow step (drafting)
    def shallow_step(self, token: torch.Tensor, cache, mask) -> torch.Tensor:
        """Run token [1, 1] through layers 0..E on the real cache; keep and return its layer-E state [1, 1, H].
        Tokens [1, T] that need no head between them (n-gram drafts) run as one chunk, eagerly."""
        hidden, calls = self._shallow_calls(token, cache, mask)
        if token.shape[1] == 1:
            hidden = self.spans.run(0, self.draft_layer + 1, hidden, calls)
        else:
            with few_row_linears(self.parts, self.few_row_layout), grouped_query_attention_in_place():
                hidden = self.spans.run(0, self.draft_layer + 1, hidden, calls, eager=True)
        self._keep_pending(token, hidden)
        return hidden

    def draft_step(self, token: torch.Tensor, cache, mask, context: torch.Tensor | None):
        """`shallow_step` for one token [1, 1], then the draft head on its state and `context` (`draft_logits`),
        in one compiled call where spans are compiled: -> (logits [1, V], the draft's normed state [1, H])."""
        head = self.model.draft_function(self.draft_layer, self.draft_vocab_size)
        if head is None:  # a replaced draft_logits: called as it is
            hidden = self.shallow_step(token, cache, mask)
            return self.model.draft_logits(self.draft_layer, hidden[:, -1], context, self.draft_vocab_size)
        hidden, calls = self._shallow_calls(token, cache, mask)
        hidden, drafted = self.spans.run_then(0, self.draft_layer + 1, hidden, calls, head, context)
        self._keep_pending(token, hidden)
        return drafted

    def draft_chain(self, token: torch.Tensor, cache, mask, context: torch.Tensor | None, count: int):
        """`count` greedy drafts after token [1, 1] in one compiled call: each token runs layers 0..E and the draft
        head, and the next is the head's argmax (no logits processors: the caller checks). The tokens run (the
        given one and every draft but the last) become pending with their states. -> (drafts [1, count], their
        logits [1, count, V]); None where a chain cannot run as one call (eager spans, per-layer arguments,
        embeddings the backbone transforms beyond adding positions, arguments with no recognisable position axis,
        a replaced `draft_logits`), and nothing has run."""
        head = self.model.draft_function(self.draft_layer, self.draft_vocab_size)
        if head is None or not self.chains_in_one_call or not self.spans.compiled or not self.parts.uniform_layers:
            return None
        past = layer_length(cache, 0)
        inputs = new_positions(mask, past, count, token.device)
        hidden, calls = self.layer_args.calls(token.expand(-1, count), cache, inputs.get("attention_mask"),
                                              inputs["position_ids"])
        call, form = calls[0], self.layer_args.embedding_form
        # learned positions: what the backbone adds to the embeddings, from the window these arguments were cut from
        positional = self.layer_args.positional(past, count) if self.layer_args.off_reason is None else None
        steps = []
        if ((form == "exact" or (form == "positional" and positional is not None)) and call.args
                and all(c is call for c in calls[: self.draft_layer + 1])):
            steps = [positions_of([call], count, i, 1) for i in range(count)]  # position i's arguments
        if not steps or any(step is None for step in steps):
            self.chains_in_one_call = False  # (this model and cache: not again in this call)
            return None
        steps = [(step[0].args[1:], step[0].kwargs) for step in steps]
        embed = self.parts.backbone.get_input_embeddings()
        states, drafts, logits = self.spans.run_chain(0, self.draft_layer + 1, hidden[:, :1], steps, embed,
                                                      positional if form == "positional" else None, head, context)
        self.stats.layer_passes += (self.draft_layer + 1) * (count - 1)  # (`_keep_pending` counts one token)
        self._keep_pending(torch.cat([token, drafts[:, :-1]], 1), states)
        return drafts, logits

    def drop_pending(self, count: int, cache) -> None:
        """Forget the last `count` pending tokens: their states, and their K/V in layers 0..E."""
        for layer in range(self.draft_layer + 1):
            crop_layer(cache, layer, -count)
        self.pending_ids = self.pending_ids[:, :-count]
        self.pending_states = self.pending_states[:, :-count]

    def _shallow_calls(self, token, cache, mask):
        inputs = new_positions(mask, layer_length(cache, 0), token.shape[1], token.device)
        return self.layer_args.calls(token, cache, inputs.get("attention_mask"), inputs["position_ids"])

    def _keep_pending(self, token, hidden) -> None:
        self.stats.layer_passes += self.draft_layer + 1
        if self.pending_ids is None:
            self.pending_ids, self.pending_states = token, hidden
        else:
            self.pending_ids = torch.cat([self.pending_ids, token], 1)
            self.pending_states = torch.cat([self.pending_states, hidden], 1)

    def accept(self, num_matches: int) -> None:
        """After verification accepted `num_matches` drafts: the next draft's context is the state at that position."""
        if self.verified_contexts is not None:
            self.context = self.verified_contexts[:, int(num_matches)]
            self.verified_contexts = None

    # ------------------------------------------------------------------ verification
    @torch.no_grad()
    def verify(self, input_ids: torch.Tensor, cache) -> torch.Tensor:
        """Full-model logits [1, P + 1, V] for the drafted positions and the last token of `input_ids` (the
        sequence with the drafts appended)."""
        pending, complete = self.pending, self.pending_complete
        if input_ids.shape[1] < pending + 1:
            raise RuntimeError("Tide lossless mode: unexpected verification call.")
        drafted = input_ids[:, input_ids.shape[1] - pending:] if complete else input_ids[:, -pending - 1: -1]
        if pending and not torch.equal(drafted.to(self.pending_ids.device), self.pending_ids):
            raise RuntimeError("Tide lossless mode: the verified tokens are not the drafted ones.")
        mask = self.grown_mask(input_ids.shape[1])
        if not complete:  # the last drafted token has not run through the shallow layers yet
            self.shallow_step(input_ids[:, -1:], cache, mask)
        self.pending_complete = False
        ids, states = self.pending_ids, self.pending_states  # [1, P + 1], [1, P + 1, H]
        positions = ids.shape[1]
        deep_length = layer_length(cache, self.parts.num_layers - 1)  # deep layers hold every position before the chunk
        pad = self._padding(cache, positions, deep_length)
        if pad is None:  # no room left to pad to the compiled width: the last few verifications run eagerly
            pad, eager = 0, True
        else:
            eager = False
        if pad:  # compiled on a static cache: one width for every verification (one graph)
            ids = torch.cat([ids, ids.new_zeros(1, pad)], 1)
            states = torch.cat([states, states.new_zeros(1, pad, states.shape[-1])], 1)
        inputs = new_positions(mask, deep_length, ids.shape[1], ids.device)
        _, calls = self.layer_args.calls(ids, cache, inputs.get("attention_mask"), inputs["position_ids"],
                                         past=deep_length)
        deep = range(self.draft_layer + 1, self.parts.num_layers)
        with few_row_linears(self.parts, self.few_row_layout), grouped_query_attention_in_place():  # P + 1 positions
            states = self.spans.run(deep.start, deep.stop, states, calls, eager=eager)
            if pad:  # the padding's K/V lie past the deep layers' length, where the next chunk overwrites them
                states = states[:, :positions]
                for i in deep:
                    crop_layer(cache, i, -pad)
            normed = self.parts.final_norm(states)
            logits = self.parts.logits_from_normed(normed)
        self.verified_contexts = normed
        self.stats.layer_passes += self.parts.num_layers - self.draft_layer - 1
        self.pending_ids = self.pending_states = None
        self.stats.verify_passes += 1
        self.stats.decode_steps += 1
        return logits

    def _padding(self, cache, positions: int, deep_length: int) -> int | None:
        """Positions to add to a verification so that compiled passes see one width (the widest a draft makes),
        on a static cache (where positions past a layer's length are free to overwrite); 0 where nothing is
        compiled; None where the cache has no room left for the widest."""
        if not self.spans.compiled:
            return 0
        widest = self.max_draft + 1
        room = min(getattr(layer, "max_cache_len", 0) for layer in cache.layers) - deep_length
        return widest - positions if room >= widest else None


class ChainDrafter:
    """Drafts a chain of tokens from the draft layer's exit head on the main model's own cache."""

    def __init__(self, session: LosslessSession, generation_config, logits_processor, stopping_criteria, cache):
        self.session, self.logits_processor, self.stopping_criteria = session, logits_processor, stopping_criteria
        self.cache = cache
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.drafted = 0
        self.ngrams = NgramLookup(session.draft_ngram) if session.draft_ngram else None
        self.from_ngram = False  # the last draft was an n-gram continuation

    def draft(self, input_ids: torch.LongTensor) -> Draft:
        session, stats = self.session, self.session.stats
        start = time.perf_counter()
        self._prefill(input_ids)
        continuation = self.ngram_continuation(input_ids)
        if continuation:
            draft = self.ngram_draft(input_ids, continuation)
            stats.decode_time_s += time.perf_counter() - start
            return draft
        budget = min(session.cap, self.max_length - input_ids.shape[1] - 1) if session.head_drafts else 0
        tokens, draft_scores, stops = input_ids, [], False
        token, context = input_ids[:, -1:], session.context
        with torch.no_grad():
            draft = self._chain_in_one_call(input_ids, budget)
            if draft is not None:
                stats.decode_time_s += time.perf_counter() - start
                return draft
            while len(draft_scores) < budget:
                logits, context = session.draft_step(token, self.cache, self._mask(tokens), context)
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
        stats.drafted += self.drafted
        stats.decode_time_s += time.perf_counter() - start
        scores = torch.stack(draft_scores, 1) if (draft_scores and self.do_sample) else None
        return Draft(tokens, self.drafted, scores, stops=stops)

    def _chain_in_one_call(self, input_ids: torch.LongTensor, budget: int) -> Draft | None:
        """A greedy chain of `budget` drafts in one compiled call (`LosslessSession.draft_chain`), cut after the
        first that would stop generation; None where the call samples, has logits processors, drafts fewer than
        two, or the session cannot run a chain that way."""
        processors = self.logits_processor
        if budget < 2 or self.do_sample or not isinstance(processors, (list, tuple)) or len(processors):
            return None
        session = self.session
        out = session.draft_chain(input_ids[:, -1:], self.cache, self._mask(input_ids), session.context, budget)
        if out is None:
            return None
        drafts, logits = out
        count, stops = self._first_stop(input_ids, drafts, logits.float())
        if count < budget:  # the drafts after a stopping one: their shallow K/V and states go
            session.drop_pending(budget - count, self.cache)
        self.drafted = count
        session.stats.drafted += count
        return Draft(torch.cat([input_ids, drafts[:, :count]], 1), count, None, stops=stops)

    def verified(self, accepted: int) -> None:
        """After the loop accepted `accepted` of the drafts: the next context, the counters and the cap (of head
        drafts: n-gram drafts leave it)."""
        stats, session = self.session.stats, self.session
        session.accept(accepted)
        stats.accepted += min(accepted, self.drafted)
        stats.decode_tokens += accepted + 1
        if self.from_ngram:
            stats.ngram_accepted += min(accepted, self.drafted)
        else:
            session.cap = next_cap(session.cap, self.drafted, accepted, session.max_draft)

    def ngram_continuation(self, input_ids: torch.LongTensor) -> list[int]:
        """The tokens that followed the latest n-gram where it last occurred (none: draft from the head)."""
        self.from_ngram = False
        if self.ngrams is None:
            return []
        self.ngrams.update(input_ids)
        return self.ngrams.continuation(min(self.session.max_draft, self.max_length - input_ids.shape[1] - 1))

    def ngram_draft(self, input_ids: torch.LongTensor, continuation: list[int]) -> Draft:
        """The draft `continuation` (an earlier occurrence's next tokens), up to the first that would stop
        generation; every drafted token and the last emitted one run through the shallow layers as one chunk.
        Sampling reads the drafts as drawn from a distribution that is certain of them."""
        session, stats = self.session, self.session.stats
        drafted = torch.tensor([continuation], dtype=input_ids.dtype, device=input_ids.device)
        scores = certain_scores(drafted, session.model.num_head_rows)
        count, stops = self._first_stop(input_ids, drafted, scores)
        tokens = torch.cat([input_ids, drafted[:, :count]], 1)
        with torch.no_grad():
            session.shallow_step(tokens[:, -count - 1:], self.cache, self._mask(tokens))
        session.pending_complete = True
        self.drafted, self.from_ngram = count, True
        stats.drafted += count
        stats.ngram_drafted += count
        return Draft(tokens, count, scores[:, :count] if self.do_sample else None, stops=stops)

    # ------------------------------------------------------------------ helpers
    def _prefill(self, input_ids) -> None:
        """Make the cache hold the exact K/V of everything but the last token (the first call only)."""
        have = layer_length(self.cache, 0)
        if have == 0:
            check_rollback(self.cache)
        if have < input_ids.shape[1] - 1:
            parts = self.session.parts
            mask = self._mask(input_ids[:, :-1])
            # positions as generate gives them (from the mask: a left-padded prompt's start at 0), not the cache's
            positions = {}
            if mask is not None and "position_ids" in inspect.signature(type(self.session.base).forward).parameters:
                positions["position_ids"] = new_positions(mask, have, input_ids.shape[1] - 1 - have)["position_ids"]
            with torch.no_grad(), capture_outputs(parts, [parts.num_layers - 1]) as last:
                self.session.original_forward(input_ids=input_ids[:, have:-1], past_key_values=self.cache,
                                              attention_mask=mask, use_cache=True, **positions)
                self.session.context = parts.final_norm(last[parts.num_layers - 1][:, -1])
            check_rollback(self.cache)
            self.session.stats.prefill_tokens += input_ids.shape[1] - 1 - have

    def _mask(self, tokens):
        return self.session.grown_mask(tokens.shape[1])

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        if self.do_sample:
            return torch.multinomial(scores.softmax(-1), 1)
        return scores.argmax(-1, keepdim=True)

    def _first_stop(self, input_ids, drafted, scores) -> tuple[int, bool]:
        """(how many of the drafts [1, k] to keep, whether the last kept one stops generation): up to and including
        the first after which a stopping criterion fires (`scores` [1, k, V]: the drafts' scores, for the criteria)."""
        for i in range(drafted.shape[1]):
            if self.stops(torch.cat([input_ids, drafted[:, : i + 1]], 1), scores[:, i]):
                return i + 1, True
        return drafted.shape[1], False

    def stops(self, tokens, scores) -> bool:
        """Whether a stopping criterion of the call (EOS, length, stop strings, the caller's) fires on `tokens`
        (generate builds the EOS criterion from the generation config)."""
        return bool(self.stopping_criteria(tokens, scores).any())
