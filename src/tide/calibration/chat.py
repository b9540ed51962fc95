"""Conversations as calibration text: chat records through the model's chat template, with the answers marked.

A draft head is judged on the positions whose next token is the model's answer. `chat_texts` renders each
conversation (a ShareGPT record `{"conversations": [{"from": "human", "value": ...}, ...]}`, a record with
`"messages"`, or a list of `{"role", "content"}` messages) through the tokenizer's chat template into a
`ChatText`: the rendered string, which the rest of calibration reads as any text, and the character spans of its
assistant turns, from which `answer_mask` marks the tokens to train and score on (teacher-forced: one forward pass
gives every position's target, nothing is generated). `sharegpt_records` streams a ShareGPT JSON file record by
record, a file cut short included. This module knows nothing about heads, routers or the model.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Iterator

import torch

__all__ = ["ChatText", "chat_texts", "is_chat_record", "answer_mask", "sharegpt_records"]

# ShareGPT's speaker names -> chat-template roles
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
          "bing": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}


class ChatText(str):
    """A conversation rendered through the chat template (the string itself), with `answers`: the (start, end)
    character spans of its assistant turns, and `prompt`: the text up to the first answer (what a model is asked)."""

    answers: tuple[tuple[int, int], ...]
    prompt: str

    def __new__(cls, text: str, answers, prompt: str):
        self = super().__new__(cls, text)
        self.answers, self.prompt = tuple(answers), prompt
        return self

    def __reduce__(self):  # pickled (sent to another process) with its spans
        return ChatText, (str(self), self.answers, self.prompt)


def is_chat_record(item) -> bool:
    """True for a ShareGPT record, a record with "messages", or a list of message dicts."""
    if isinstance(item, dict):
        return isinstance(item.get("conversations", item.get("messages")), list)
    return isinstance(item, list) and all(isinstance(m, dict) for m in item)


def messages_of(record) -> list[dict]:
    """A record's messages as [{"role", "content"}], ShareGPT's speakers mapped to roles; a message without a known
    role or a string content is an error that names it."""
    raw = record if isinstance(record, list) else record.get("conversations", record.get("messages"))
    out = []
    for i, message in enumerate(raw):
        speaker = message.get("role", message.get("from")) if isinstance(message, dict) else None
        content = message.get("content", message.get("value")) if isinstance(message, dict) else None
        role = _ROLES.get(str(speaker).lower()) if speaker is not None else None
        if role is None or not isinstance(content, str):
            raise ValueError(f"calibrate: chat message {i} ({str(message)[:80]!r}) needs a role ('user', 'assistant', "
                             "'system'; ShareGPT's 'from': 'human'/'gpt') and a string content ('content' or 'value').")
        out.append({"role": role, "content": content})
    return out


def chat_texts(tokenizer, records: Iterable) -> list[ChatText]:
    """Each conversation with at least one non-empty answer, rendered through `tokenizer`'s chat template, with its
    answers' spans; conversations without an answer are left out, and one warning counts them and the answers the
    rendered text did not contain verbatim (templates that rewrite content; those answers are not trained on)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("calibrate: chat data needs a tokenizer with a chat template (tokenizer.chat_template); "
                         "for a model without one, pass the conversations as plain strings.")
    out, empty, unmatched = [], 0, 0
    for record in records:
        text, missed = _render(tokenizer, messages_of(record))
        unmatched += missed
        if text is None:
            empty += 1
        else:
            out.append(text)
    if empty or unmatched:
        warnings.warn(f"calibrate: {empty} conversation(s) without an answer were left out, and {unmatched} answer(s) "
                      "not found verbatim in the chat template's output are not trained on.")
    return out


def _render(tokenizer, messages: list[dict]) -> tuple[ChatText | None, int]:
    """(The conversation as a ChatText, or None where no answer is left; answers not found in the rendered text.)"""
    while messages and messages[-1]["role"] != "assistant":  # a trailing question has no answer to train on
        messages = messages[:-1]
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return None, 0
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor, missed = [], 0, 0
    for message in messages:
        content = message["content"].strip()
        if not content:
            continue
        at = text.find(content, cursor)
        if at < 0:
            missed += message["role"] == "assistant"
            continue
        cursor = at + len(content)
        if message["role"] == "assistant":
            spans.append((at, cursor))
    if not spans:
        return None, missed
    return ChatText(text, spans, text[:spans[0][0]]), missed


def answer_mask(text: ChatText, offsets: list[tuple[int, int]]) -> torch.Tensor:
    """[T] bool over a tokenization of `text` (its character `offsets`): position t is marked where token t + 1
    begins inside an answer, i.e. where the model predicts an answer token."""
    bounds = torch.tensor(offsets, dtype=torch.long).reshape(-1, 2)
    starts, ends = bounds[:, 0], bounds[:, 1]
    inside = torch.zeros(len(offsets), dtype=torch.bool)
    for a, b in text.answers:
        inside |= (starts >= a) & (starts < b)
    inside &= ends > starts
    mask = torch.zeros_like(inside)
    mask[:-1] = inside[1:]
    return mask


def sharegpt_records(path, start: int = 0, stop: int | None = None) -> Iterator[dict]:
    """The records of a ShareGPT JSON file (one array of conversations), read one at a time, from index `start` up
    to `stop`; a file cut short ends at its last whole record."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buffer, pos, index, eof = f.read(1 << 22), 0, 0, False
        pos = _skip(buffer, pos, " \t\r\n")
        if buffer[pos:pos + 1] != "[":
            raise ValueError(f"{path} is not a JSON array of conversations (ShareGPT's layout).")
        pos += 1
        while stop is None or index < stop:
            pos = _skip(buffer, pos, " \t\r\n,")
            if buffer[pos:pos + 1] == "]":
                return
            try:
                record, pos_after = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the cut: what is left is no whole record
                more = f.read(1 << 22)
                eof = not more
                buffer, pos = buffer[pos:] + more, 0
                continue
            if index >= start:
                yield record
            index, pos = index + 1, pos_after


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos
