"""Calibration text written by the model itself: prompts, continued by the base model.

What a draft head or a router sees at decode time is the model's own output, not a corpus. `generated_texts`
turns prompts into such text: each prompt (through the tokenizer's chat template where it has one) continued
greedily and `samples` times by sampling, in left-padded batches through the base model's own `generate`. The
texts come back as strings (prompt and continuation, special tokens kept) for the same pipeline as a dataset's.
This module knows nothing about routers or thresholds.
"""

from __future__ import annotations

import torch

__all__ = ["SelfText", "prompt_texts", "generated_texts"]


class SelfText:
    """How calibration continues its prompts: `new_tokens` tokens each, greedily and `samples` times sampled
    (at `temperature`, top-p `top_p`), `batch_size` sequences a `generate` call. (Whether strings go through the
    chat template is `prompt_texts`' choice, made before.)"""

    def __init__(self, new_tokens: int = 128, samples: int = 6, temperature: float = 0.8, top_p: float = 0.95,
                 batch_size: int = 16):
        if not isinstance(new_tokens, int) or new_tokens < 1:
            raise ValueError(f"calibrate: prompt_new_tokens must be a positive integer, got {new_tokens!r}.")
        if not isinstance(samples, int) or samples < 0:
            raise ValueError(f"calibrate: prompt_samples must be an integer >= 0, got {samples!r}.")
        self.new_tokens, self.samples, self.temperature, self.top_p = new_tokens, samples, temperature, top_p
        self.batch_size = batch_size


def prompt_texts(tokenizer, prompts, chat: bool | None = None) -> list[str]:
    """Each prompt as the text the model is asked to continue: a string, or a list of chat messages
    ([{"role": ..., "content": ...}]); strings go through the chat template where `chat` (None: the tokenizer has
    one), messages always."""
    if isinstance(prompts, str) or not all(isinstance(p, (str, list)) for p in prompts):
        raise ValueError("calibrate: prompts must be a list of strings or of chat message lists.")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    chat = has_template if chat is None else chat
    out = []
    for prompt in prompts:
        if isinstance(prompt, list) or chat:
            if not has_template:
                raise ValueError("calibrate: chat prompts need a tokenizer with a chat template; pass plain strings "
                                 "with prompt_chat=False.")
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(prompt)
    return out


@torch.no_grad()
def generated_texts(model, tokenizer, prompts: list[str], how: SelfText, seed: int = 0) -> list[str]:
    """Every prompt text continued by `model` (the base model): greedily, then `how.samples` times sampled; the
    texts in that order, prompt by prompt. Each continuation ends at the model's end-of-sequence token (kept)."""
    runs = [dict(do_sample=False)] + [dict(do_sample=True, temperature=how.temperature, top_p=how.top_p, top_k=0)
                                      ] * how.samples
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    texts = [[] for _ in prompts]
    try:
        for start in range(0, len(prompts), how.batch_size):
            batch = tokenizer(prompts[start:start + how.batch_size], return_tensors="pt", padding=True,
                              add_special_tokens=False).to(model.device)
            for run in runs:
                out = model.generate(**batch, max_new_tokens=how.new_tokens, pad_token_id=tokenizer.pad_token_id,
                                     **run)
                for i, row in enumerate(out):
                    texts[start + i].append(_text(tokenizer, model, row, batch["attention_mask"][i]))
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad
        torch.random.set_rng_state(generator_state)
    return [text for per_prompt in texts for text in per_prompt]


def _text(tokenizer, model, row: torch.Tensor, mask: torch.Tensor) -> str:
    """One generated row as text: the prompt without its left padding, the continuation up to and with its first
    end-of-sequence token."""
    width = mask.shape[0]
    prompt, continuation = row[:width][mask.bool()], row[width:]
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    ends = [i for i, t in enumerate(continuation.tolist()) if t in eos]
    if ends:
        continuation = continuation[:ends[0] + 1]
    return tokenizer.decode(torch.cat([prompt, continuation]), skip_special_tokens=False)
