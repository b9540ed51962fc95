"""Lossless mode: router-driven self-speculative decoding inside transformers' assisted generation.

Drafting decodes with early exit (the `recompute` machinery, so every layer a draft token runs is the
full model's exact computation) while the routers fire, up to an adaptive cap. The first token whose
router does not fire runs the whole stack, which recomputes every pending position exactly. The
verification forward then runs the deep layers over the pending positions and the last draft at once
and returns the full model's logits for each of them. Acceptance (longest greedy prefix, or the
speculative-sampling rule), cache cropping, logits processors, stopping on EOS/length and streaming
of accepted tokens are transformers' own `_assisted_decoding`. Batch size 1.
"""

from __future__ import annotations

import time

import torch
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.modeling_outputs import CausalLMOutputWithPast

from .engine import ExitSession, attach_stats

__all__ = ["generate_lossless", "LosslessSession"]


def generate_lossless(model, config, *args, **kwargs):
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if inputs is not None and inputs.shape[0] != 1:
        raise ValueError(
            f"mode='lossless' decodes one sequence at a time (batch size 1), got a batch of {inputs.shape[0]}; "
            "loop over the rows or use mode='exit' for batches."
        )
    if kwargs.get("num_return_sequences", 1) != 1 or kwargs.get("num_beams", 1) != 1:
        raise ValueError("mode='lossless' supports greedy and sampling with one sequence (no beams, num_return_sequences=1).")
    config = config.with_overrides({"kv_strategy": "recompute"})
    session = LosslessSession(model, config, kwargs.get("stopping_criteria"))
    base = model.base
    with session.installed():
        base._get_candidate_generator = session.candidate_generator
        try:
            start = time.perf_counter()
            # prompt_lookup_num_tokens only switches generate into assisted mode; the candidate generator is ours.
            output = base.generate(*args, prompt_lookup_num_tokens=config.max_draft, **kwargs)
            session.stats.wall_time_s = time.perf_counter() - start
        finally:
            del base._get_candidate_generator
    model.last_stats = session.stats
    return attach_stats(output, session.stats)


class LosslessSession(ExitSession):
    def __init__(self, model, config, stopping_criteria=None):
        super().__init__(model, config)
        self.stats.mode = "lossless"
        self.user_stopping_criteria = stopping_criteria
        self.cap = config.max_draft

    def candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, **_):
        return _TideDrafter(self, generation_config, logits_processor, model_kwargs)

    # ------------------------------------------------------------------ the verification forward
    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        """Full-model logits for the pending drafts and the one new token at the end of `input_ids`."""
        state = self.recompute
        pending = state.pending
        if past_key_values is None or input_ids is None or input_ids.shape[1] < pending + 1:
            raise RuntimeError("Tide lossless mode: unexpected verification call (was generate's flow changed?).")
        if pending and not torch.equal(input_ids[:, -pending - 1 : -1].to(state.ids.device), state.ids):
            raise RuntimeError("Tide lossless mode: the verified tokens are not the drafted ones.")
        start = time.perf_counter()
        new = input_ids[:, -1:]
        step_kwargs = _step_inputs(kwargs.get("attention_mask"), past_key_values.get_seq_length())
        with torch.no_grad():
            state.decode_step(new, past_key_values, step_kwargs, allow_exit=False, keep_pending=True)
            logits = self.logits(state.states[:, -pending - 1 :])
        state.reset()
        self.stats.verify_passes += 1
        self.stats.decode_steps += 1
        self.stats.decode_time_s += time.perf_counter() - start
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)


def _step_inputs(mask, cache_length: int) -> dict:
    """attention_mask / position_ids for one new token at position `cache_length` (batch 1)."""
    if mask is None:
        return {}
    mask = mask[:, :cache_length]
    mask = torch.cat([mask, mask.new_ones(mask.shape[0], cache_length + 1 - mask.shape[1])], dim=1)
    return {"attention_mask": mask, "position_ids": mask.sum(-1, keepdim=True) - 1}


class _TideDrafter(CandidateGenerator):
    """Drafts with early exit on the main model's own cache while the routers fire."""

    def __init__(self, session: LosslessSession, generation_config, logits_processor, model_kwargs):
        self.session, self.logits_processor = session, logits_processor
        self.cache = model_kwargs["past_key_values"]
        self.mask = model_kwargs.get("attention_mask")
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        eos = generation_config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        self.router_drafts = 0

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        session, state, stats = self.session, self.session.recompute, self.session.stats
        start = time.perf_counter()
        self._prefill(input_ids)
        budget = min(session.cap, self.max_length - input_ids.shape[1])
        tokens, draft_logits, self.router_drafts = input_ids, [], 0
        token = input_ids[:, -1:]
        num_layers = session.parts.num_layers
        with torch.no_grad():
            while len(draft_logits) < budget:
                step_kwargs = _step_inputs(self._mask(tokens), self.cache.get_seq_length())
                logits, exit_layer = state.decode_step(token, self.cache, step_kwargs, keep_pending=True)
                exited = int(exit_layer[0]) < num_layers - 1
                stats.record_exits(exit_layer.tolist(), emitted=False)
                stats.decode_steps += 1
                scores = self.logits_processor(tokens, logits[:, -1].float())
                token = self._choose(scores)
                if self._stops(torch.cat([tokens, token], 1), scores):
                    # The stopping token is left to verification, which must feed the last kept token itself.
                    state.drop_last(self.cache)
                    break
                tokens = torch.cat([tokens, token], 1)
                draft_logits.append(scores)
                self.router_drafts += int(exited)
                if not exited or int(token) in self.eos:
                    break
        stats.drafted += self.router_drafts
        stats.decode_time_s += time.perf_counter() - start
        logits = torch.stack(draft_logits, 1) if (draft_logits and self.do_sample) else None
        return tokens, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches: int):
        stats, session = self.session.stats, self.session
        stats.accepted += min(int(num_matches), self.router_drafts)
        stats.decode_tokens += int(num_matches) + 1
        if self.router_drafts and num_matches >= self.router_drafts:
            session.cap = min(session.cap + 1, session.config.max_draft)
        elif self.router_drafts:
            session.cap = max(1, int(num_matches) + 1)

    # ------------------------------------------------------------------ helpers
    def _prefill(self, input_ids) -> None:
        """Make the cache hold the exact K/V of everything but the last token (the first call only)."""
        have = self.cache.get_seq_length()
        if have == 0:
            self.session.recompute.check_cache(self.cache)
        if have < input_ids.shape[1] - 1:
            mask = self._mask(input_ids[:, :-1])
            with torch.no_grad():
                self.session._original_forward(input_ids=input_ids[:, have:-1], past_key_values=self.cache,
                                                attention_mask=mask, use_cache=True)
            self.session.stats.prefill_tokens += input_ids.shape[1] - 1 - have

    def _mask(self, tokens):
        if self.mask is None:
            return None
        extra = tokens.shape[1] - self.mask.shape[1]
        return torch.cat([self.mask, self.mask.new_ones(1, extra)], 1) if extra > 0 else self.mask[:, : tokens.shape[1]]

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        if self.do_sample:
            return torch.multinomial(scores.softmax(-1), 1)
        return scores.argmax(-1, keepdim=True)

    def _stops(self, tokens, scores) -> bool:
        criteria = self.session.user_stopping_criteria
        return bool(criteria is not None and criteria(tokens, scores).any())
