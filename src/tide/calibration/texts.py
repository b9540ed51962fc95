"""Calibration's texts: read, shuffled and split into training and held-out ones (`read_texts`: the dataset's,
then the model's answers to the prompts, split by prompt), each process keeping its shard; and the token batches
the training and held-out streams read (`batches`)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from .chat import ChatText, answer_mask
from .data import load_texts, take_samples
from .options import CalibrationOptions
from .phases import Context
from .selftext import SelfText, check_lengths, generated_texts, prompt_texts

__all__ = ["Texts", "read_texts", "batches", "data_name", "within_budget", "stream_size"]


@dataclass
class Texts:
    """What `read_texts` leaves for the later phases."""

    train_texts: list[str]  # this process's shard of the training texts
    held_texts: list[str]  # this process's shard of the held-out texts
    # every held-out text: the check through the decode step and the timing trials read the same as in one process
    all_held: list[str]
    timing_texts: list[str] | None  # what the timing trials decode from: held-out prompts (None: the held-out
    # texts' openings)
    num_texts: int  # the texts read, training and held-out


def read_texts(ctx: Context, dataset, prompts=None, **load) -> Texts:
    """Read, shuffle and split the texts (the dataset's, then the model's answers to the prompts, split by
    prompt); each process keeps its shard of the training and held-out ones."""
    opts, procs = ctx.opts, ctx.procs
    texts = []
    if dataset is not None:
        with ctx.phases("data"):
            texts = load_texts(dataset, tokenizer=ctx.tokenizer, **load)
        random.Random(opts.seed).shuffle(texts)
        texts = take_samples(texts, opts.num_samples)
        if len(texts) < 2:
            raise ValueError(f"Calibration needs at least 2 texts (one held out); the dataset gave {len(texts)}.")
    n_held = _held_count(len(texts), opts.heldout_fraction) if texts else 0
    train_texts, held_texts = _budgeted(ctx, texts[n_held:], texts[:n_held])
    # conversations: the timing trials answer the held-out ones' first questions
    timing_texts = [t.prompt for t in held_texts] if held_texts and all(isinstance(t, ChatText) for t in
                                                                        held_texts) else None
    if prompts:
        train_own, held_own, own_timing = _answers(ctx, prompts)
        timing_texts = (timing_texts or []) + own_timing
        train_texts, held_texts = train_texts + train_own, held_texts + held_own
        texts = train_texts + held_texts
    if procs.world > min(len(train_texts), len(held_texts)):
        raise ValueError(f"Calibration on {procs.world} processes needs at least {procs.world} training and "
                         f"{procs.world} held-out texts; got {len(train_texts)} and {len(held_texts)}.")
    return Texts(procs.shard(train_texts), procs.shard(held_texts), held_texts, timing_texts, len(texts))


def _budgeted(ctx: Context, train: list[str], held: list[str]) -> tuple[list[str], list[str]]:
    """The dataset's training and held-out texts within `train_tokens` (the held-out ones in proportion, and within
    `heldout_tokens`)."""
    opts, budget = ctx.opts, ctx.opts.train_budget
    if budget is None:
        return train, held
    share = opts.heldout_fraction / (1.0 - opts.heldout_fraction)
    held_budget = min(max(1, round(budget * share)), opts.heldout_tokens or math.inf)
    return (within_budget(train, ctx.tokenizer, opts.max_length, budget),
            within_budget(held, ctx.tokenizer, opts.max_length, held_budget))


def _answers(ctx: Context, prompts) -> tuple[list[str], list[str], list[str]]:
    """(training texts, held-out texts, held-out prompts): the prompts split as texts are, and continued by the
    base model (`selftext`); every process writes the answers of all prompts (the same, from the same seed)."""
    opts, tokenizer, base = ctx.opts, ctx.tokenizer, ctx.tide.base
    prompts = prompt_texts(tokenizer, prompts, opts.prompt_chat)
    check_lengths(tokenizer, base, prompts, opts.prompt_new_tokens, opts.max_length)
    random.Random(opts.seed).shuffle(prompts)
    if len(prompts) < 2:
        raise ValueError(f"Calibration from prompts needs at least 2 prompts (one held out); got {len(prompts)}.")
    n_held = _held_count(len(prompts), opts.heldout_fraction)
    how = SelfText(opts.prompt_new_tokens, opts.prompt_samples)
    with ctx.phases("generation"):
        train = generated_texts(base, tokenizer, prompts[n_held:], how, seed=opts.seed)
        held = generated_texts(base, tokenizer, prompts[:n_held], how, seed=opts.seed + 1)
    return train, held, prompts[:n_held]


def _held_count(n: int, fraction: float) -> int:
    """How many of n (>= 2) texts or prompts are held out: `fraction` of them, at least one, and one left to train."""
    return min(n - 1, max(1, round(n * fraction)))


def data_name(dataset, prompts) -> str:
    """The calibration data in words, for the record and the model card."""
    name = None if dataset is None else dataset if isinstance(dataset, str) else f"<{type(dataset).__name__}>"
    own = f"the model's answers to {len(prompts)} prompts" if prompts else None
    return " + ".join(n for n in (name, own) if n)


def within_budget(texts: list[str], tokenizer, max_length: int, budget: int | None) -> list[str]:
    """The first texts that hold `budget` training tokens (all of them where it is None)."""
    if budget is None:
        return texts
    total = 0
    for i, text in enumerate(texts):
        total += stream_size([text], tokenizer, max_length)[1]
        if total >= budget:
            return texts[:i + 1]
    return texts


def stream_size(texts: list[str], tokenizer, max_length: int) -> tuple[int, int]:
    """(rows, training tokens) that `batches` makes of `texts`: the tokens trained on are a conversation's answer
    positions (in every window), a plain text's tokens up to `max_length`."""
    rows = tokens = 0
    for text in texts:
        for _, mask in _rows(text, tokenizer, max_length):
            rows, tokens = rows + 1, tokens + int(mask.sum())
    return rows, tokens


def _rows(text: str, tokenizer, max_length: int):
    """(ids [T], trained positions [T] bool) of a text: a plain text once, truncated to `max_length` tokens; a
    conversation (`ChatText`) in windows of `max_length` tokens, each with an answer position, its answer positions
    marked (`chat.answer_mask`)."""
    if not isinstance(text, ChatText):
        ids = torch.tensor(tokenizer(text, truncation=True, max_length=max_length)["input_ids"], dtype=torch.long)
        yield ids, torch.ones_like(ids, dtype=torch.bool)
        return
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids, mask = torch.tensor(encoded["input_ids"], dtype=torch.long), answer_mask(text, encoded["offset_mapping"])
    for start in range(0, max(len(ids) - 1, 1), max_length):
        if mask[start:start + max_length].any():
            yield ids[start:start + max_length], mask[start:start + max_length]


def batches(texts, tokenizer, opts: CalibrationOptions, device):
    """Right-padded token batches of `opts.batch_size` rows (a conversation gives a row a window); `trained`
    marks the positions calibration trains and scores on (real tokens; a conversation's answer positions);
    `texts` counts the texts a batch finished. Works for tokenizers without a pad token."""
    rows, finished = [], 0
    for text in texts:
        for row in _rows(text, tokenizer, opts.max_length):
            if len(rows) == opts.batch_size:
                yield _batch(rows, device, finished)
                rows, finished = [], 0
            rows.append(row)
        finished += 1
    if rows:
        yield _batch(rows, device, finished)


def _batch(rows: list, device, texts: int) -> dict:
    rows = [row for row in rows if len(row[0]) > 1] or rows  # a one-token text has nothing to predict
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    trained = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (ids, keep) in enumerate(rows):
        input_ids[i, : len(ids)] = ids
        mask[i, : len(ids)] = 1
        trained[i, : len(ids)] = keep
    return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device), "trained": trained.to(device),
            "texts": texts}
