"""The early-exit decode step: one walk through the layers, and the session that runs it inside `generate`.

`ExitSession.forward` is each pass of the exit-mode loop's walk backend (`loop.Walk`), and what the base model's
`forward` runs in a beam search while the call is active (see `generation.py` and `dispatch.py`): prompt steps go
to the base model's own forward; decode steps capture the layers' arguments, walk the stack with per-token exits
(`walk_layers`), and return logits from each token's exit state. How a walk runs a layer and fills skipped layers'
K/V is the KV strategy's (`PropagateSteps` here, `recompute.RecomputeSteps`); the session records its passes' stats.
Logits processors, stopping criteria, streamers and sampling are the loop's (`loop.py`), or transformers' beam
search's. This module does no file I/O and knows no architecture by name (see `models/architectures.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ...config import TideGenerationConfig
from ...layers.args import LayerArgs
from ...layers.calls import capture_layer_calls
from ...layers.calltransforms import additive_masks, map_calls
from ...layers.kvfill import fill_kv
from ...layers.recompute import RecomputeState
from ...layers.rowsplit import RowSplitCache, can_slice, sliced_call
from ...layers.spans import SpanRunner
from ..dispatch import base_forward
from ..stats import GenerationStats
from .walkgraph import ExitGraph

__all__ = ["ExitSession", "walk_layers", "WalkResult", "PropagateSteps", "BACKBONE_KEYS"]

BACKBONE_KEYS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "cache_position", "inputs_embeds")


class ExitSession:
    """One `generate` call in exit mode: the decode step plus its counters."""

    def __init__(self, model, config: TideGenerationConfig, spans: SpanRunner | None = None):
        self.model, self.base, self.options, self.parts = model, model.base, config, model.parts
        self.spans = spans or SpanRunner(self.parts)  # runs of layers between checkpoints (compiled or eager)
        # The checkpoints consulted, with the threshold in force at each: those past `min_layers` whose
        # threshold can fire (>= 1.0 never does, scores being sigmoids). The stats name these.
        self.consulted = {k: t for k in config.consulted_checkpoints(model.checkpoints)
                          if (t := config.threshold_for(k)) < 1.0}
        self.exit_tests = model.exit_tests(self.consulted)
        norm_param = next(self.parts.norm.parameters(), None)
        self.norm_device = norm_param.device if norm_param is not None else None
        self.stats = GenerationStats(self.parts.num_layers, sorted(self.consulted), kv_strategy=config.kv_strategy,
                                     switches=config.switches)
        self.recompute = (RecomputeState(self.parts, config.few_row_layout) if config.kv_strategy == "recompute"
                          else None)
        # propagate's switches, read once per call: exited rows leave a batch; skipped layers' K/V layer by layer
        self.steps_options = dict(row_skipping=config.row_skipping, layerwise=config.kv_fill == "layerwise")
        # the decode steps' layer arguments, one capture per window
        self.layer_args = LayerArgs(self.parts)
        self.original_forward = base_forward(model.base)
        self.graph = ExitGraph.for_session(self)  # single-row compiled steps as one graph each

    # ------------------------------------------------------------------ the forward generate sees
    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        if not self._is_decode_step(input_ids, past_key_values, kwargs):
            self.stats.record_passes(0, 0 if input_ids is None else input_ids.numel())
            if self.recompute is not None:
                self.recompute.after_prefill(past_key_values)
            if self.options.prefill_exit and input_ids is not None and past_key_values is not None:
                logits = self.prefill_step(input_ids, past_key_values, kwargs)
                return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)
            return self.original_forward(input_ids=input_ids, past_key_values=past_key_values, **kwargs)
        start = time.perf_counter()
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 4:  # generate's own mask for a static cache (a beam search's)
            kwargs = {**kwargs, "attention_mask": _padding_mask(mask, past_key_values.get_seq_length() + 1)}
        logits = self.decode_step(input_ids, past_key_values, kwargs)
        self.stats.record_time(time.perf_counter() - start)
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)

    def _is_decode_step(self, input_ids, cache, kwargs) -> bool:
        if input_ids is None or input_ids.shape[1] != 1 or cache is None or cache.get_seq_length() == 0:
            return False
        if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
            raise ValueError("Tide decode steps do not return hidden states or attentions; drop those flags.")
        return True

    # ------------------------------------------------------------------ the steps
    @torch.no_grad()
    def decode_step(self, input_ids, cache, kwargs) -> torch.Tensor:
        """input_ids: [B, 1] -> logits [B, 1, V]; the cache grows by one position at every layer."""
        inputs = {k: v for k, v in kwargs.items() if k in BACKBONE_KEYS}
        if self.recompute is not None:
            steps = self.recompute.steps(input_ids, cache, inputs)
        else:
            steps = PropagateSteps(self.parts, input_ids, cache, inputs, self.layer_args, self.spans,
                                   **self.steps_options)
            graph = None if self.graph is None else self.graph.step(steps, cache)
            if graph is not None:
                state, exit_layer = graph
                exit_layer = int(exit_layer)  # the graph's one read
                self.stats.record_step([exit_layer], exit_layer + 1, self.parts.num_layers - 1 - exit_layer, 0)
                return self.logits(state)
        walk = walk_layers(self.parts, steps, self.exit_tests)
        if self.recompute is not None:
            self.recompute.after_step(steps, walk)
        self.stats.record_step(walk.exit_layer[:, -1].tolist(), walk.full_passes, walk.kv_only_passes, walk.recomputed)
        return self.logits(walk.states)

    @torch.no_grad()
    def prefill_step(self, input_ids, cache, kwargs) -> torch.Tensor:
        """Prompt tokens exit by router too (`prefill_exit=True`); skipped layers get propagated KV."""
        inputs = {k: v for k, v in kwargs.items() if k in BACKBONE_KEYS}
        steps = PropagateSteps(self.parts, input_ids, cache, inputs, **self.steps_options)
        walk = walk_layers(self.parts, steps, self.exit_tests)
        self.stats.record_passes(0, prefill_token_layers=int((walk.exit_layer + 1).sum()))
        return self.logits(walk.states)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.parts.final_norm(_to(hidden, self.norm_device))
        return self.parts.logits_from_normed(normed)


@dataclass
class WalkResult:
    """What one walk through the layer stack did."""

    states: torch.Tensor  # [B, T, H] pre-norm states for the head: exit states, or the last layer's output
    exit_layer: torch.Tensor  # [B, T] layer each token left after (num_layers - 1: it ran every layer)
    full_passes: int  # batched decoder-layer calls that ran attention + MLP
    kv_only_passes: int  # layers that only had K/V written (after every token had left)
    recomputed: int = 0  # stale K/V entries rewritten on the way (kv_strategy="recompute")


class PropagateSteps:
    """How a walk runs layers with `kv_strategy="propagate"`: an exited token's state stays frozen, so the
    layers after its exit see it (its K/V there is propagated from it), filled by one batched K/V computation
    (`kvfill.fill_kv`; `layerwise=True`: layer by layer, a call's `kv_fill="layerwise"`).

    In a batched decode step, rows that have exited leave the running batch (`rowsplit`): their K/V for every
    later layer is filled when they exit, and the layers run on the remaining rows only. Where a layer's
    arguments cannot be sliced by row, or with `row_skipping=False` (a call's option), every row keeps running
    (exited rows' outputs are discarded).
    """

    recomputed = 0

    def __init__(self, parts, input_ids, cache, inputs: dict, layer_args: LayerArgs | None = None,
                 spans: SpanRunner | None = None, row_skipping: bool = True, layerwise: bool = False):
        self.parts, self.cache, self.layerwise = parts, cache, layerwise
        self.spans = spans or SpanRunner(parts)
        if layer_args is not None and set(inputs) <= {"attention_mask", "position_ids"}:
            self.hidden, self.calls = layer_args.calls(input_ids, cache, inputs.get("attention_mask"),
                                                       inputs.get("position_ids"))
        else:
            self.calls = additive_masks(parts, capture_layer_calls(
                parts, input_ids=input_ids, past_key_values=cache, use_cache=True, **inputs))  # (padded batches' masks)
            self.hidden = self.calls[0].hidden  # [B, T, H]: the input of the first layer
        batch, length = self.hidden.shape[:2]
        self.split = None  # RowSplitCache once a row has left, when rows can leave the batch
        self.row_skipping = (row_skipping and batch > 1 and length == 1
                             and all(can_slice(c, batch) for c in {id(c): c for c in self.calls}.values()))

    def run(self, i: int, hidden: torch.Tensor, exited: torch.Tensor | None) -> torch.Tensor:
        if exited is None:
            return self.calls[i].run(self.parts, i, hidden)
        if self.split is not None:
            running = (~exited[:, 0]).nonzero().squeeze(1)
            self.split.rows = running
            call = sliced_call(self.calls[i], running, hidden.shape[0])
            out = call.run(self.parts, i, hidden.index_select(0, running.to(hidden.device)), cache=self.split)
            return hidden.to(out.device).index_copy(0, running.to(out.device), out)
        out = self.calls[i].run(self.parts, i, hidden)
        return torch.where(exited.to(out.device)[..., None], hidden.to(out.device), out)

    def run_span(self, start: int, stop: int, hidden: torch.Tensor) -> torch.Tensor:
        """Layers start..stop-1 while no token has left (one compiled graph where compiling)."""
        return self.spans.run(start, stop, hidden, self.calls)

    def rows_left(self, layer: int, leaving: torch.Tensor, hidden: torch.Tensor) -> None:
        """Rows `leaving` (bool [B, T]) exited after `layer`: with row skipping, fill their K/V for every later
        layer now, from their state."""
        if not self.row_skipping:
            return
        batch = hidden.shape[0]
        if self.split is None:
            self.split = RowSplitCache(self.cache, batch)
        rows = leaving[:, 0].nonzero().squeeze(1)
        self.split.rows = rows
        calls = map_calls(self.calls, lambda call: sliced_call(call, rows, batch))
        fill_kv(self.parts, calls, list(range(layer + 1, self.parts.num_layers)),
                hidden.index_select(0, rows.to(hidden.device)), self.split, self.layerwise)

    def fill_kv(self, layers: list[int], hidden: torch.Tensor) -> None:
        if self.split is not None:  # every row's later layers were filled when it left
            self.split.check_complete()
            return
        fill_kv(self.parts, self.calls, layers, hidden, self.cache, self.layerwise)


def walk_layers(parts, steps, exit_tests: dict) -> WalkResult:
    """Run the stack from `steps.hidden` with per-token exits at the checkpoints in `exit_tests` ({layer: test},
    see `TideForCausalLM.exit_tests`).

    `steps` runs layer i (`steps.run(i, hidden, exited)`, exited: bool [B, T] or None while no token has
    left) and fills the K/V of the layers left once every token has exited (`steps.fill_kv`). The one host
    sync is at a checkpoint where a token leaves.
    """
    hidden = steps.hidden
    num_layers = parts.num_layers
    exit_layer = torch.full(hidden.shape[:2], num_layers - 1, dtype=torch.long, device=hidden.device)
    exited = torch.zeros(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    exit_states = hidden
    num_exited, full_passes = 0, 0  # num_exited: tokens that have left, as of the last checkpoint
    run_span = getattr(steps, "run_span", None)
    i = 0
    while i < num_layers:
        if num_exited == exited.numel():
            steps.fill_kv(list(range(i, num_layers)), hidden)
            return WalkResult(exit_states, exit_layer, full_passes, num_layers - i, int(steps.recomputed))
        if num_exited == 0 and run_span is not None:  # up to the next checkpoint in one run
            stop = min([k for k in exit_tests if k >= i] + [num_layers - 1]) + 1
            hidden = run_span(i, stop, hidden)
            full_passes += stop - i
            i = stop - 1
        else:
            hidden = steps.run(i, hidden, exited if num_exited else None)
            full_passes += 1
        if i in exit_tests:
            _, exits, state = exit_tests[i](hidden.reshape(-1, hidden.shape[-1]))
            exits, state = exits.view(hidden.shape[:-1]), state.view(hidden.shape)
            exited = exited.to(hidden.device)
            leaving = exits & ~exited
            if leaving.any():  # the one host sync per checkpoint
                exit_layer = exit_layer.to(hidden.device).masked_fill(leaving, i)
                exit_states = torch.where(leaving[..., None], state, exit_states.to(state.device))
                exited = exited | leaving
                num_exited = int(exited.sum())
                steps.rows_left(i, leaving, hidden)
        i += 1
    if num_exited:
        hidden = torch.where(exited[..., None], exit_states.to(hidden.device), hidden)
    steps.fill_kv([], hidden)
    return WalkResult(hidden, exit_layer, full_passes, 0, int(steps.recomputed))


def _to(tensor: torch.Tensor, device) -> torch.Tensor:
    return tensor if device is None else tensor.to(device)


def _padding_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """The 2-D padding mask [B, length] (1: a token, 0: padding) of a decode step's 4-D mask [B, 1, 1, keys] (boolean,
    or additive: 0 where seen), which generate makes for a static cache: the keys the new token sees."""
    seen = mask if mask.dtype == torch.bool else mask == 0
    return seen[:, 0, -1, :length].long()
