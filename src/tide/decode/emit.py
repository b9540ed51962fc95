"""What a decode loop hands back: the emitted tokens, streamed as they are accepted, and generate's output."""

from __future__ import annotations

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

__all__ = ["Emitted"]


class Emitted:
    """Collects per-token scores and logits where the call asked for them, streams tokens, builds the output."""

    def __init__(self, generation_config, streamer=None):
        as_dict = bool(generation_config.return_dict_in_generate)
        self.as_dict, self.streamer = as_dict, streamer
        self.scores = () if as_dict and generation_config.output_scores else None
        self.logits = () if as_dict and generation_config.output_logits else None

    @property
    def keeps_outputs(self) -> bool:
        """Whether the call returns per-token scores or logits (else `add` needs neither)."""
        return self.scores is not None or self.logits is not None

    def add(self, tokens: torch.Tensor, scores: torch.Tensor | None, logits: torch.Tensor | None) -> None:
        """tokens: [B, n] emitted now; scores / logits: [B, >= n, V] processed and raw, one row per token (None
        where the call keeps neither). The streamer gets what transformers' loops give it: [B] for one token a step,
        [1, n] for several."""
        n = tokens.shape[1]
        if self.scores is not None:
            self.scores += tuple(scores[:, i] for i in range(n))
        if self.logits is not None:
            self.logits += tuple(logits[:, i] for i in range(n))
        if self.streamer is not None:
            self.streamer.put((tokens[:, 0] if n == 1 and tokens.shape[0] > 1 else tokens).cpu())

    def finish(self, sequences: torch.Tensor, cache):
        if self.streamer is not None:
            self.streamer.end()
        if not self.as_dict:
            return sequences
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=self.scores, logits=self.logits,
                                         past_key_values=cache)
