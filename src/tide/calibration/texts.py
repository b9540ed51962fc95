"""Calibration's texts: read, shuffled and split into training and held-out ones (`read_texts`: the dataset's,
then the model's answers to the prompts, split by prompt), each process keeping its shard; and the token batches
the training and held-out streams read (`batches`)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .data import load_texts, take_samples
from .options import CalibrationOptions
from .phases import Context
from .selftext import SelfText, check_lengths, generated_texts, prompt_texts

__all__ = ["Texts", "read_texts", "batches", "data_name"]


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
            texts = load_texts(dataset, **load)
        random.Random(opts.seed).shuffle(texts)
        texts = take_samples(texts, opts.num_samples)
        if len(texts) < 2:
            raise ValueError(f"Calibration needs at least 2 texts (one held out); the dataset gave {len(texts)}.")
    n_held = _held_count(len(texts), opts.heldout_fraction) if texts else 0
    train_texts, held_texts = texts[n_held:], texts[:n_held]
    timing_texts = None
    if prompts:
        train_own, held_own, timing_texts = _answers(ctx, prompts)
        train_texts, held_texts = train_texts + train_own, held_texts + held_own
        texts = train_texts + held_texts
    if procs.world > min(len(train_texts), len(held_texts)):
        raise ValueError(f"Calibration on {procs.world} processes needs at least {procs.world} training and "
                         f"{procs.world} held-out texts; got {len(train_texts)} and {len(held_texts)}.")
    return Texts(procs.shard(train_texts), procs.shard(held_texts), held_texts, timing_texts, len(texts))


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


def batches(texts, tokenizer, opts: CalibrationOptions, device):
    """Right-padded token batches; works for tokenizers without a pad token."""
    for start in range(0, len(texts), opts.batch_size):
        encoded = tokenizer(texts[start : start + opts.batch_size], truncation=True, max_length=opts.max_length)
        rows = [ids for ids in encoded["input_ids"] if len(ids) > 1] or encoded["input_ids"]
        width = max(len(ids) for ids in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        yield {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}
