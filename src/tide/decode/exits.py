"""The exit-mode decode loop: one token per step for every row, each step a walk with per-token exits.

The prompt runs as transformers prepares it (`prepare_inputs_for_generation`) through the session's forward
(the base model's own forward, or a prefill walk with `prefill_exit`); every later step feeds the last tokens
to the session's decode step (`exitsession.ExitSession`) with the attention mask and positions grown by one. Logits
processors, sampling, padding of finished rows, stopping criteria and streamers are served as transformers'
sampling loop serves them. Greedy and sampling; beams go through transformers' beam search (`generation.py`).
"""

from __future__ import annotations

import torch

from .emit import Emitted
from .fusedexit import fused_exit_for
from .processors import process

__all__ = ["exit_decode"]


@torch.no_grad()
def exit_decode(session, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                model_kwargs: dict):
    """Generate from `input_ids` [B, n] until every row has stopped; returns what `generate` returns."""
    emitted = Emitted(generation_config, streamer)
    pad = generation_config._pad_token_tensor
    pads = pad is not None and any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    cache = model_kwargs.get("past_key_values")
    logits = _prefill(session, input_ids, generation_config, model_kwargs)
    mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
    first = True
    while True:
        raw = logits.to(torch.float32, copy=True).to(input_ids.device)  # [B, V]
        scores = process(logits_processor, input_ids, raw)
        if generation_config.do_sample:
            tokens = torch.multinomial(scores.softmax(-1), 1).squeeze(1)
        else:
            tokens = scores.argmax(-1)
        if pads:
            tokens = torch.where(unfinished, tokens, pad.to(tokens.device))
        input_ids = torch.cat([input_ids, tokens[:, None]], 1)
        emitted.add(tokens[:, None], scores[:, None], raw[:, None])
        unfinished = unfinished & ~stopping_criteria(input_ids, emitted.scores)
        if not bool(unfinished.any()):
            return emitted.finish(input_ids, cache)
        if first:  # after the prompt's token, one graph a step where the call allows (`fusedexit.py`)
            first, fused = False, fused_exit_for(session, input_ids, generation_config, logits_processor, cache, mask,
                                                 emitted)
            if fused is not None:
                return fused.decode(input_ids, stopping_criteria, generation_config, emitted)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        if positions is not None:
            positions = positions[..., -1:] + 1
        # (this step's tokens as a tensor of their own: a slice of the sequence would carry its length in its
        # stride, and a compiled forward (`baseline.BaseSession`) records a graph for every stride it sees)
        out = session.forward(input_ids=tokens[:, None], past_key_values=cache, attention_mask=mask,
                              position_ids=positions, use_cache=True)
        logits = out.logits[:, -1]


def _prefill(session, input_ids, generation_config, model_kwargs: dict) -> torch.Tensor:
    """The prompt's last logits [B, V], its inputs prepared by transformers (uncached tokens only)."""
    cache, mask = model_kwargs.get("past_key_values"), model_kwargs.get("attention_mask")
    length = None
    if cache is not None:
        mask_length = mask.shape[1] if mask is not None else getattr(generation_config, "_mask_length", -1)
        if mask_length == input_ids.shape[1]:
            length = input_ids.shape[1] - cache.get_seq_length()
    inputs = session.base.prepare_inputs_for_generation(input_ids, next_sequence_length=length,
                                                        is_first_iteration=True, **model_kwargs)
    return session.forward(**inputs).logits[:, -1]
