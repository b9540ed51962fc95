"""Logits processors applied as transformers' `LogitsProcessorList` applies them, without its per-call cost.

`LogitsProcessorList.__call__` reads every processor's signature with `inspect` on every call (about 45 us a
processor here), to hand extra keyword arguments to the few processors that take them. Tide's loops pass none,
so they call each processor in turn; a processor that needs keyword arguments gets transformers' own error.
"""

from __future__ import annotations

import torch

__all__ = ["process"]


def process(processors, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """`processors(input_ids, scores)`, computed processor by processor."""
    if not isinstance(processors, (list, tuple)):  # a single callable
        return processors(input_ids, scores)
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores
