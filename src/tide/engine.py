"""The early-exit decode step and its place inside transformers' own `generate` loop.

`generate_with_tide` runs the base model's `generate` unchanged, with the base model's `forward`
replaced (for the duration of the call only) by `ExitSession.forward`: prompt steps go to the original
forward; decode steps run the layers one at a time, score the routers at each checkpoint, leave the
stack for rows whose score is above the threshold, and fill the skipped layers' KV by the configured
strategy. Logits processors, stopping criteria, streamers and sampling stay transformers' own. This
module does no file I/O and knows no architecture by name (see `architectures.py`).
"""

from __future__ import annotations

import functools
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from .config import TideConfig
from .kvfill import fill_kv
from .layercalls import LayerCall, capture_layer_calls
from .stats import GenerationStats

__all__ = ["generate_with_tide", "ExitSession", "forward_swapped", "walk_layers", "WalkResult"]

_BACKBONE_KEYS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "cache_position", "inputs_embeds")


def resolve_run_config(model, tide_config) -> TideConfig | None:
    """The config a generate call runs with, or None for the plain base model."""
    if tide_config is False:
        return None
    if isinstance(tide_config, dict) and tide_config.get("mode") == "lossless" and "exit_threshold" in tide_config:
        raise ValueError(
            "tide_config: exit_threshold applies to mode='exit'. Lossless mode drafts from the exit head at "
            "draft_layer, up to max_draft tokens per verification; set those instead."
        )
    run = model.config.with_overrides(tide_config)
    run.validate(num_layers=model.parts.num_layers)
    if run.has_operating_point or run.mode == "lossless":  # lossless drafts need no thresholds
        return run
    if tide_config is not None:
        warnings.warn(
            "tide_config was given, but these routers have no thresholds (not calibrated) and no exit_threshold "
            "was set, so the base model runs unchanged. Calibrate with tide.calibrate or pass exit_threshold.",
            stacklevel=3,
        )
    return None


@contextmanager
def forward_swapped(base, forward):
    """Route `base.forward` to `forward` for the duration; yields the original forward."""
    had_instance_forward = "forward" in base.__dict__
    original = base.forward

    def swapped(*args, **kwargs):
        return forward(*args, **kwargs)

    # generate inspects forward's signature (e.g. to build position_ids from the mask): keep the base's.
    functools.update_wrapper(swapped, original)
    base.forward = swapped
    try:
        yield original
    finally:
        if had_instance_forward:
            base.forward = original
        else:
            del base.forward


def generate_with_tide(model, tide_config, *args, **kwargs):
    run = resolve_run_config(model, tide_config)
    if run is None:
        model.last_stats = None
        return model.base.generate(*args, **kwargs)
    if run.mode == "lossless":
        from .speculative import generate_lossless

        return generate_lossless(model, run, *args, **kwargs)
    session = ExitSession(model, run)
    with session.installed():
        start = time.perf_counter()
        output = model.base.generate(*args, **kwargs)
        session.stats.wall_time_s = time.perf_counter() - start
    model.last_stats = session.stats
    return attach_stats(output, session.stats)


def attach_stats(output, stats: GenerationStats):
    if not isinstance(output, torch.Tensor):
        output["tide_stats"] = stats
    return output


class ExitSession:
    """One `generate` call in exit mode: the decode step plus its counters."""

    def __init__(self, model, config: TideConfig):
        self.model, self.config, self.parts = model, config, model.parts
        self.checkpoints = [k for k in model.checkpoints if k + 1 >= config.min_layers]
        # Checkpoints whose threshold is >= 1.0 can never fire (scores are sigmoids): they are not consulted.
        self.thresholds = {k: t for k in self.checkpoints if (t := config.threshold_for(k)) < 1.0}
        self.exit_tests = model.exit_tests(self.thresholds)
        norm_param = next(self.parts.norm.parameters(), None)
        self.norm_device = norm_param.device if norm_param is not None else None
        # Only the checkpoints that can fire are consulted, and the stats name those.
        self.stats = GenerationStats(self.parts.num_layers, sorted(self.thresholds), kv_strategy=config.kv_strategy)
        if config.kv_strategy == "recompute":
            from .recompute import RecomputeState

            self.recompute = RecomputeState(self)
        else:
            self.recompute = None
        self._original_forward = None

    @contextmanager
    def installed(self):
        with forward_swapped(self.model.base, self.forward) as original:
            self._original_forward = original
            yield self

    # ------------------------------------------------------------------ the forward generate sees
    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        if not self._is_decode_step(input_ids, past_key_values, kwargs):
            self.stats.prefill_tokens += 0 if input_ids is None else input_ids.numel()
            if self.config.prefill_exit and input_ids is not None and past_key_values is not None:
                logits = self.prefill_step(input_ids, past_key_values, kwargs)
                return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)
            output = self._original_forward(input_ids=input_ids, past_key_values=past_key_values, **kwargs)
            if self.recompute is not None:
                self.recompute.after_prefill(input_ids, past_key_values)
            return output
        start = time.perf_counter()
        logits = self.decode_step(input_ids, past_key_values, kwargs)
        self.stats.decode_time_s += time.perf_counter() - start
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)

    def _is_decode_step(self, input_ids, cache, kwargs) -> bool:
        if input_ids is None or input_ids.shape[1] != 1 or cache is None or cache.get_seq_length() == 0:
            return False
        if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
            raise ValueError("Tide decode steps do not return hidden states or attentions; drop those flags.")
        return True

    # ------------------------------------------------------------------ one decode step
    @torch.no_grad()
    def decode_step(self, input_ids, cache, kwargs) -> torch.Tensor:
        """input_ids: [B, 1] -> logits [B, 1, V]; the cache grows by one position at every layer."""
        if self.recompute is not None:
            logits, exit_layer = self.recompute.decode_step(input_ids, cache, kwargs)
            self.stats.decode_steps += 1
            self.stats.record_exits(exit_layer.tolist())
            return logits
        inputs = {k: v for k, v in kwargs.items() if k in _BACKBONE_KEYS}
        calls = capture_layer_calls(self.parts, input_ids=input_ids, past_key_values=cache, use_cache=True, **inputs)
        walk = self.run_layers(calls, calls[0].hidden, cache)
        self.stats.decode_steps += 1
        self.stats.layer_passes += walk.full_passes
        self.stats.kv_only_passes += walk.kv_only_passes
        self.stats.record_exits(walk.exit_layer[:, -1].tolist())
        return self.logits(walk.states)

    @torch.no_grad()
    def prefill_step(self, input_ids, cache, kwargs) -> torch.Tensor:
        """Prompt tokens exit by router too (`prefill_exit=True`); skipped layers get propagated KV."""
        inputs = {k: v for k, v in kwargs.items() if k in _BACKBONE_KEYS}
        calls = capture_layer_calls(self.parts, input_ids=input_ids, past_key_values=cache, use_cache=True, **inputs)
        walk = self.run_layers(calls, calls[0].hidden, cache)
        self.stats.prefill_token_layers += int((walk.exit_layer + 1).sum())
        return self.logits(walk.states)

    def run_layers(self, calls: list[LayerCall], hidden: torch.Tensor, cache):
        """One walk through the stack with per-token exits (`walk_layers` with this session's thresholds)."""
        return walk_layers(self.model, calls, hidden, cache, self.exit_tests)

    def exits_at(self, layer: int, hidden: torch.Tensor):
        """(bool [B, T] exits, exit states [B, T, H]) at checkpoint `layer`. hidden: [B, T, H]."""
        _, exits, state = self.exit_tests[layer](hidden.reshape(-1, hidden.shape[-1]))
        return exits.view(hidden.shape[:-1]), state.view(hidden.shape)

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


def walk_layers(model, calls: list[LayerCall], hidden: torch.Tensor, cache, exit_tests: dict) -> WalkResult:
    """Run the stack with per-token exits at the checkpoints in `exit_tests` ({layer: test}, see
    `TideForCausalLM.exit_tests`).

    hidden: [B, T, H]. A token that exits keeps its raw state, and the layers after its exit see that state
    (so its K/V there is propagated from it); once every token has left, the remaining layers only get K/V,
    all of them in one batched fill (`kvfill.fill_kv`). The one host sync is at a checkpoint where a token
    leaves.
    """
    num_layers = model.parts.num_layers
    ran_all = num_layers - 1
    exit_layer = torch.full(hidden.shape[:2], ran_all, dtype=torch.long, device=hidden.device)
    exited = torch.zeros(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    exit_states = hidden
    num_exited, full_passes = 0, 0  # num_exited: tokens that have left, as of the last checkpoint
    for i in range(num_layers):
        if num_exited == exited.numel():
            fill_kv(model.parts, calls, list(range(i, num_layers)), hidden, cache)
            return WalkResult(exit_states, exit_layer, full_passes, num_layers - i)
        out = calls[i].run(model.parts, i, hidden)
        full_passes += 1
        if num_exited:
            exited = exited.to(out.device)
            hidden = torch.where(exited[..., None], hidden.to(out.device), out)
        else:
            hidden = out
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
    if num_exited:
        hidden = torch.where(exited[..., None], exit_states.to(hidden.device), hidden)
    return WalkResult(hidden, exit_layer, full_passes, 0)


def _to(tensor: torch.Tensor, device) -> torch.Tensor:
    return tensor if device is None else tensor.to(device)
