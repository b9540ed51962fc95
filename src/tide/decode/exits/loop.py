"""The exit-mode decode loop: one token per step for every row, over one of two step backends.

The loop owns the sequence, the padding of finished rows, the stopping criteria, the streamer and what `generate`
returns (`emit.Emitted`). A backend gives each step's next tokens:

- the walk (`Walk`): the session's forward (`session.ExitSession`: eager, in compiled spans or as one graph,
  `walkgraph.ExitGraph`; `baseline.BaseSession`: the compiled base) on the prompt as transformers prepares it
  (`prepare_inputs_for_generation`), then on the last tokens with the mask and positions grown by one; processors
  and sampling as in transformers' sampling loop, the stopping criteria on the sequence. The session counts its
  steps, as it does in a beam search.
- the graph (`graph.GraphSteps`): a compiled single-row step from the last token to the next as one graph, the
  processors inside it, and one host read (the token and its exit layer); the stopping criteria on the host's list
  of tokens (`graphparts.Stops`), and the loop counts the step.

The prompt's pass gives the first token in every call; the backend for the rest of the call is chosen then, once:
the graph where the call fits it (`graph.graph_steps`, which otherwise says why not), else the walk. Greedy and
sampling; beams go through transformers' beam search (`generation.py`).
"""

from __future__ import annotations

import time

import torch

from ..emit import Emitted
from ..graphparts import Stops
from ..processors import process
from .graph import graph_steps

__all__ = ["Walk", "exit_decode"]


@torch.no_grad()
def exit_decode(session, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                model_kwargs: dict):
    """Generate from `input_ids` [B, n] until every row has stopped; returns what `generate` returns."""
    emitted, stats, device = Emitted(generation_config, streamer), session.stats, input_ids.device
    pad = generation_config._pad_token_tensor
    pads = pad is not None and any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=device)
    steps = walk = Walk(session, logits_processor, generation_config, model_kwargs)
    tokens = graph = stops = listed = None  # (the graph backend, or why not; with it, the criteria on its tokens)
    while True:
        start = time.perf_counter()
        tokens, scores, raw, read = steps.step(input_ids, tokens)
        if pads and read is None:
            tokens = torch.where(unfinished, tokens, pad.to(tokens.device))
        input_ids = torch.cat([input_ids, tokens[:, None]], 1)
        emitted.add(tokens[:, None], scores, raw)
        if read is None:  # the walk's tokens: the criteria on the sequence (its session counted the step)
            unfinished = unfinished & ~stopping_criteria(input_ids, emitted.scores)
            done = not bool(unfinished.any())
        else:  # the graph's: the criteria on the host's tokens, and the step counted here
            new, exit_layer = read
            done = stops.emitted(listed, [new])[1]
            listed.append(new)
            stats.record_step([exit_layer], exit_layer + 1, session.parts.num_layers - 1 - exit_layer)
            stats.record_time(time.perf_counter() - start)
        if done:
            return emitted.finish(input_ids, walk.cache)
        if graph is None:  # after the prompt's token: the backend for the rest of the call
            graph = graph_steps(session, input_ids, logits_processor, generation_config, walk.cache, walk.mask,
                                emitted)
            if not isinstance(graph, str):  # (else the reason the call walks on)
                steps, listed = graph, input_ids[0].tolist()
                stops = Stops(stopping_criteria, generation_config, device)


class Walk:
    """The walk backend: the session's forward a step, the call's processors and sampling on its logits."""

    def __init__(self, session, logits_processor, generation_config, inputs: dict):
        self.session, self.processor, self.config, self.inputs = session, logits_processor, generation_config, inputs
        self.cache, self.mask, self.positions = map(inputs.get, ("past_key_values", "attention_mask", "position_ids"))

    def step(self, input_ids, tokens) -> tuple:
        """The session's forward on this step's `tokens` [B] (None: the prompt, its inputs prepared by transformers,
        uncached tokens only), `input_ids` [B, n] ending with them -> (the next tokens [B], their scores and logits
        [B, 1, V], None: no host read for the loop to count)."""
        if tokens is None:
            length = None
            if self.cache is not None:
                mask_length = self.mask.shape[1] if self.mask is not None else getattr(self.config, "_mask_length", -1)
                if mask_length == input_ids.shape[1]:
                    length = input_ids.shape[1] - self.cache.get_seq_length()
            inputs = self.session.base.prepare_inputs_for_generation(input_ids, next_sequence_length=length,
                                                                     is_first_iteration=True, **self.inputs)
        else:
            if self.mask is not None:
                self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], 1)
            self.positions = None if self.positions is None else self.positions[..., -1:] + 1
            # (the tokens as a tensor of their own: a slice of the sequence would carry its length in its stride, and
            # a compiled forward (`baseline.BaseSession`) records a graph for every stride it sees)
            inputs = dict(input_ids=tokens[:, None], past_key_values=self.cache, attention_mask=self.mask,
                          position_ids=self.positions, use_cache=True)
        raw = self.session.forward(**inputs).logits[:, -1].to(torch.float32, copy=True).to(input_ids.device)  # [B, V]
        scores = process(self.processor, input_ids, raw)
        tokens = torch.multinomial(scores.softmax(-1), 1).squeeze(1) if self.config.do_sample else scores.argmax(-1)
        return tokens, scores[:, None], raw[:, None], None
