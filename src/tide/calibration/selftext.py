"""Calibration text written by the model itself: prompts, continued by the base model.

What a draft head or a router sees at decode time is the model's own output, not a corpus. `generated_texts`
turns prompts into such text: each prompt (through the tokenizer's chat template where it has one) continued
greedily and `samples` times by sampling, in left-padded batches through the base model's own `generate`. The
texts come back as strings (prompt and continuation, special tokens kept) for the same pipeline as a dataset's.
This module knows nothing about routers or thresholds.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["SelfText", "check_prompts", "prompt_texts", "check_lengths", "max_positions", "generated_texts"]


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


def check_prompts(prompts, chat=None) -> list:
    """`prompts` as a list, each checked to be a non-blank string or a conversation (a list of chat messages, each
    {"role": <a non-empty string>, "content": <text>}, some of it non-blank), and `chat` (`prompt_chat`) to be True,
    False or None; an error says what to pass instead."""
    if chat is not None and not isinstance(chat, bool):
        raise ValueError(f"calibrate: prompt_chat must be True, False or None (through the chat template where the "
                         f"tokenizer has one), got {chat!r}.")
    if isinstance(prompts, (str, bytes, dict)) or not isinstance(prompts, (list, tuple)):
        raise ValueError(f"calibrate: prompts must be a list of prompts (strings, or conversations: lists of chat "
                         f"messages), got {type(prompts).__name__}; for one prompt pass [prompt]. At least 2 are "
                         "needed (one is held out).")
    if prompts and all(isinstance(p, dict) for p in prompts):
        raise ValueError("calibrate: prompts holds chat messages, not conversations; pass a list of conversations, "
                         "each a list of messages: prompts=[[{'role': 'user', 'content': ...}], ...].")
    for i, prompt in enumerate(prompts):
        problem = _prompt_problem(prompt)
        if problem:
            raise ValueError(f"calibrate: prompts[{i}] ({str(prompt)[:60]!r}) {problem}")
    return list(prompts)


def _prompt_problem(prompt) -> str | None:
    """What is wrong with one prompt (a sentence that says what to pass), or None."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "is blank; leave it out, or write the question it stands for."
    if not isinstance(prompt, list):
        return (f"is a {type(prompt).__name__}; a prompt is a string or a list of chat messages "
                "[{'role': 'user', 'content': ...}].")
    for j, message in enumerate(prompt):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and message["role"].strip()
                and isinstance(message.get("content"), (str, list))):
            return (f"message {j} ({str(message)[:60]!r}) is not a chat message: each needs a 'role' ('system', "
                    "'user', ...) and a 'content' (its text).")
    if not any(m["content"].strip() if isinstance(m["content"], str) else m["content"] for m in prompt):
        return "holds no text: give at least one message some content."
    return None


def prompt_texts(tokenizer, prompts, chat: bool | None = None) -> list[str]:
    """Each prompt as the text the model is asked to continue: a string, or a list of chat messages
    ([{"role": ..., "content": ...}]); strings go through the chat template where `chat` (None: the tokenizer has
    one), messages always. `check_prompts` checks them first."""
    prompts = check_prompts(prompts, chat)
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


def check_lengths(tokenizer, model, texts: list[str], new_tokens: int, max_length: int) -> None:
    """Raise where a prompt text and its `new_tokens` would run past the model's positions; warn where prompt texts
    fill calibration's `max_length` tokens, so that none of the model's answer is read after them (raise where
    every one does)."""
    lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    limit = max_positions(model)
    longest = max(range(len(texts)), key=lengths.__getitem__)
    if limit is not None and lengths[longest] + new_tokens > limit:
        raise ValueError(f"calibrate: a prompt of {lengths[longest]} tokens ({texts[longest][:60]!r}) and its "
                         f"prompt_new_tokens={new_tokens} answer tokens would run past the model's {limit} positions; "
                         f"shorten the prompt, or lower prompt_new_tokens, to {limit} tokens together at most.")
    full = sum(len(tokenizer(text)["input_ids"]) >= max_length for text in texts)
    if not full:
        return
    message = (f"calibrate: {full} of {len(texts)} prompts are {max_length} tokens or longer (max_length), so their "
               "calibration texts are cut before the model's answer")
    if full == len(texts):
        raise ValueError(f"{message}: calibration would read none of the model's answers. Raise max_length above "
                         "the prompts' length, or shorten the prompts.")
    warnings.warn(f"{message}, which calibration then does not read; raise max_length, or shorten those prompts.")


def max_positions(model) -> int | None:
    """The most positions `model` takes (its config's `max_position_embeddings` or `n_positions`), or None."""
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


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
