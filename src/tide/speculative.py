"""Lossless mode: self-speculative decoding from a checkpoint's exit head, inside transformers' assisted generation.

Drafting runs each token through the shallow layers 0..E only (E = the draft layer), on the model's own
cache: those layers' K/V are exactly what the full model writes. The exit head at E drafts the next token.
Verification runs the last draft through the shallow layers, then the deep layers E+1..L-1 over all the
drafted positions at once (their layer-E states were kept), which makes the cache even again and gives
the full model's logits for every position. Acceptance (longest greedy prefix, or the speculative-sampling
rule), cache cropping, logits processors, stopping on EOS/length and streaming of accepted tokens are
transformers' own `_assisted_decoding`. Batch size 1. No router or threshold is involved: a wrong draft
costs time, never output. Drafts read the full model's final normed state at the position before the drafted
token (the "context") when the draft layer has a draft head (`TideForCausalLM.draft_logits`); verification
computes that state for every position it checks, and the accepted count picks the next draft's. With
`draft_topk` > 1 (greedy), `treedraft.TreeDrafter` drafts a one-level tree of candidates instead of a chain
and hands this session's `forward` logits it has already verified.
"""

from __future__ import annotations

import time

import torch
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.modeling_outputs import CausalLMOutputWithPast

from ._hf_compat import (LengthView, crop_layer, grouped_query_attention_in_place, layer_length,
                         unrecoverable_sliding_layers)
from .dispatch import base_forward
from .fewrows import few_row_linears
from .layercalls import additive_masks, capture_layer_calls, capture_outputs
from .stats import GenerationStats
from .treedraft import TreeDrafter, grown_mask, new_positions

__all__ = ["LosslessSession", "LosslessUnavailable", "check_rollback", "next_cap"]


def next_cap(cap: int, drafted: int, accepted: int, max_draft: int) -> int:
    """The chain's draft cap after a verification: one more after a fully accepted draft (up to `max_draft`),
    the accepted count + 1 after a rejection, unchanged when nothing was drafted."""
    if not drafted:
        return cap
    return min(cap + 1, max_draft) if accepted >= drafted else max(1, accepted + 1)


class LosslessUnavailable(ValueError):
    """Lossless mode cannot run this call or model (the message says what to do instead)."""


def check_rollback(cache) -> None:
    """Sliding-window layers must keep evicted positions until a draft is accepted or cropped: transformers'
    assisted generation turns that on (`activate_past_recording`); a cache where it is off cannot be used."""
    layers = unrecoverable_sliding_layers(cache)
    if layers:
        raise LosslessUnavailable(
            f"mode='lossless' needs sliding-window cache layers that can roll back rejected drafts, and layers "
            f"{layers} of this cache drop evicted positions at once. Pass a DynamicCache (or none) and let "
            "generate create it, or use mode='exit'."
        )


class LosslessSession:
    """One lossless `generate` call: drafted states between drafting and verification, and the counters."""

    def __init__(self, model, config, stopping_criteria=None):
        self.model, self.base, self.parts = model, model.base, model.parts
        self.draft_layer = config.resolve_draft_layer(model.checkpoints, self.parts.num_layers)
        self.max_draft = config.max_draft
        self.cap = config.max_draft
        self.draft_topk = config.draft_topk if self.parts.spec.tree_drafts else 1
        self.draft_vocab_size = config.draft_vocab_size
        self.verified = None  # (ids, logits) a tree draft already verified, for the next forward
        self.user_stopping_criteria = stopping_criteria
        self.stats = GenerationStats(self.parts.num_layers, [self.draft_layer], mode="lossless", kv_strategy="exact",
                                     draft_vocab_size=config.draft_vocab_size)
        self.pending_ids = None  # [1, P] tokens through the shallow layers only
        self.pending_states = None  # [1, P, H] their layer-E outputs
        self.context = None  # [1, H] the full model's final normed state before the next drafted token
        self.verified_contexts = None  # [1, P + 1, H] the same for each position the last verification checked
        self.original_forward = base_forward(model.base)

    @property
    def pending(self) -> int:
        return 0 if self.pending_ids is None else self.pending_ids.shape[1]

    def candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, **_):
        chain = _TideDrafter(self, generation_config, logits_processor, model_kwargs)
        if self.draft_topk > 1 and not generation_config.do_sample:
            self.stats.draft_topk = self.draft_topk
            return TreeDrafter(self, chain)
        return chain

    # ------------------------------------------------------------------ the shallow step (drafting)
    def shallow_step(self, token: torch.Tensor, cache, mask) -> torch.Tensor:
        """Run token [1, 1] through layers 0..E on the real cache; keep and return its layer-E state [1, 1, H]."""
        inputs = new_positions(mask, cache.get_seq_length(), 1)
        calls = capture_layer_calls(self.parts, input_ids=token, past_key_values=cache, use_cache=True, **inputs)
        hidden = calls[0].hidden
        for i in range(self.draft_layer + 1):
            hidden = calls[i].run(self.parts, i, hidden)
        self.stats.layer_passes += self.draft_layer + 1
        if self.pending_ids is None:
            self.pending_ids, self.pending_states = token, hidden
        else:
            self.pending_ids = torch.cat([self.pending_ids, token], 1)
            self.pending_states = torch.cat([self.pending_states, hidden], 1)
        return hidden

    def accept(self, num_matches: int) -> None:
        """After verification accepted `num_matches` drafts: the next draft's context is the state at that position."""
        if self.verified_contexts is not None:
            self.context = self.verified_contexts[:, int(num_matches)]
            self.verified_contexts = None

    def drop_last(self, cache) -> None:
        """Forget the newest drafted position (its shallow K/V and state)."""
        for i in range(self.draft_layer + 1):
            crop_layer(cache, i, -1)
        self.pending_ids, self.pending_states = self.pending_ids[:, :-1], self.pending_states[:, :-1]
        if self.pending == 0:
            self.pending_ids = self.pending_states = None

    # ------------------------------------------------------------------ the verification forward
    @torch.no_grad()
    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, **kwargs):
        """Full-model logits [1, P + 1, V] for the drafted positions and the last token of `input_ids`."""
        if self.verified is not None:  # a tree draft: its logits came from the pass that verified it
            ids, logits = self.verified
            self.verified = None
            if input_ids is None or not torch.equal(input_ids[:, -ids.shape[1]:].to(ids.device), ids):
                raise RuntimeError("Tide lossless mode: the verified tokens are not the drafted ones.")
            return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)
        pending, cache = self.pending, past_key_values
        if cache is None or input_ids is None or input_ids.shape[1] < pending + 1:
            raise RuntimeError("Tide lossless mode: unexpected verification call (was generate's flow changed?).")
        if pending and not torch.equal(input_ids[:, -pending - 1 : -1].to(self.pending_ids.device), self.pending_ids):
            raise RuntimeError("Tide lossless mode: the verified tokens are not the drafted ones.")
        start = time.perf_counter()
        self.shallow_step(input_ids[:, -1:], cache, attention_mask)
        ids, states = self.pending_ids, self.pending_states  # [1, P + 1], [1, P + 1, H]
        deep_length = layer_length(cache, self.parts.num_layers - 1)  # deep layers hold every position before the chunk
        inputs = new_positions(attention_mask, deep_length, ids.shape[1])
        calls = additive_masks(self.parts, capture_layer_calls(self.parts, input_ids=ids, use_cache=True,
                                                               past_key_values=LengthView(cache, deep_length), **inputs))
        with few_row_linears(self.parts), grouped_query_attention_in_place():  # P + 1 positions: the CPU layouts
            for i in range(self.draft_layer + 1, self.parts.num_layers):
                states = calls[i].run(self.parts, i, states)
            normed = self.parts.final_norm(states)
            logits = self.parts.logits_from_normed(normed)
        self.verified_contexts = normed
        self.stats.layer_passes += self.parts.num_layers - self.draft_layer - 1
        self.pending_ids = self.pending_states = None
        self.stats.verify_passes += 1
        self.stats.decode_steps += 1
        self.stats.decode_time_s += time.perf_counter() - start
        return CausalLMOutputWithPast(logits=logits, past_key_values=cache)


class _TideDrafter(CandidateGenerator):
    """Drafts tokens from the draft layer's exit head on the main model's own cache."""

    def __init__(self, session: LosslessSession, generation_config, logits_processor, model_kwargs):
        self.session, self.logits_processor = session, logits_processor
        self.cache = model_kwargs["past_key_values"]
        self.mask = model_kwargs.get("attention_mask")
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        eos = generation_config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        self.drafted = 0

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        session, stats = self.session, self.session.stats
        start = time.perf_counter()
        self._prefill(input_ids)
        budget = min(session.cap, self.max_length - input_ids.shape[1] - 1)
        tokens, draft_logits = input_ids, []
        token, context = input_ids[:, -1:], session.context
        with torch.no_grad():
            while len(draft_logits) < budget:
                state = session.shallow_step(token, self.cache, self._mask(tokens))
                logits, context = session.model.draft_logits(session.draft_layer, state[:, -1], context,
                                                             session.draft_vocab_size)
                scores = self.logits_processor(tokens, logits.float())
                token = self._choose(scores)
                if self._stops(torch.cat([tokens, token], 1), scores):
                    # The stopping token is left to verification, which must feed the last kept token itself.
                    session.drop_last(self.cache)
                    break
                tokens = torch.cat([tokens, token], 1)
                draft_logits.append(scores)
                if int(token) in self.eos:
                    break
        self.drafted = len(draft_logits)
        stats.drafted += self.drafted
        stats.decode_time_s += time.perf_counter() - start
        logits = torch.stack(draft_logits, 1) if (draft_logits and self.do_sample) else None
        return tokens, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches: int):
        stats, session = self.session.stats, self.session
        session.accept(num_matches)
        stats.accepted += min(int(num_matches), self.drafted)
        stats.decode_tokens += int(num_matches) + 1
        session.cap = next_cap(session.cap, self.drafted, int(num_matches), session.max_draft)

    # ------------------------------------------------------------------ helpers
    def _prefill(self, input_ids) -> None:
        """Make the cache hold the exact K/V of everything but the last token (the first call only)."""
        have = self.cache.get_seq_length()
        if have == 0:
            check_rollback(self.cache)
        if have < input_ids.shape[1] - 1:
            parts = self.session.parts
            with torch.no_grad(), capture_outputs(parts, [parts.num_layers - 1]) as last:
                self.session.original_forward(input_ids=input_ids[:, have:-1], past_key_values=self.cache,
                                              attention_mask=self._mask(input_ids[:, :-1]), use_cache=True)
                self.session.context = parts.final_norm(last[parts.num_layers - 1][:, -1])
            check_rollback(self.cache)
            self.session.stats.prefill_tokens += input_ids.shape[1] - 1 - have

    def _mask(self, tokens):
        return grown_mask(self.mask, tokens.shape[1])

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        if self.do_sample:
            return torch.multinomial(scores.softmax(-1), 1)
        return scores.argmax(-1, keepdim=True)

    def _stops(self, tokens, scores) -> bool:
        criteria = self.session.user_stopping_criteria
        return bool(criteria is not None and criteria(tokens, scores).any())
