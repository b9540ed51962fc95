"""What the pieces of a decode step cost on this machine, measured.

`measure_costs` times, on the loaded model and its device, one decode token's pieces as the engine runs them:
every decoder layer in turn (so each layer's weights come from memory as in a real step), the checkpoint
test (exit head + norm + router + threshold + host sync) at every checkpoint in turn, the batched K/V fill
of the skipped layers, the head, capturing the layers' arguments, verification passes over several positions,
and what `generate` itself spends per token and per lossless cycle. `StepCosts` holds the seconds and the same
relative to a decoder layer; the cost model (`costs.py`) reads them. Nothing here trains or saves anything.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache

from ..decode.lossless.verifier import LosslessUnavailable
from ..layers.args import LayerArgs
from ..layers.calls import capture_layer_calls
from ..layers.calltransforms import additive_masks
from ..layers.fewrows import few_row_linears
from ..layers.kvfill import fill_kv
from ..models.compat import grouped_query_attention_in_place
from ..records import CostsRecord
from .costs import chain_cost

__all__ = ["StepCosts", "VERIFY_POSITIONS", "WIDE_VERIFY_POSITIONS", "VERIFY_POINTS", "LOOP_TOKENS", "measure_costs",
           "seconds_of", "timing_kwargs"]

VERIFY_POSITIONS = 4  # a verification of three drafts and the token before them (the figure reported first)
WIDE_VERIFY_POSITIONS = 8  # and a wider one (a tree of seven candidates), where few-row passes start to cost
# The position counts measure_costs times a verification pass at. Each is measured, not interpolated: on CPU the
# cost can jump between neighbours (MKL leaves its 2-3-row kernel at 4 rows: on a hidden-384 Llama, 12 layers +
# head over 3 positions cost x1.06 of one, over 4 x1.3; docs/benchmarks.md).
VERIFY_POINTS = (2, 3, VERIFY_POSITIONS, 6, WIDE_VERIFY_POSITIONS)


@dataclass
class StepCosts:
    """Seconds per decode token of each piece, and the same relative to one decoder layer."""

    layer_s: float  # one decoder layer (attention + MLP)
    checkpoint_s: float  # one consulted checkpoint (exit head, norm, router, threshold, host sync)
    skipped_layer_s: float  # one skipped layer's K/V (batched fill, per layer)
    head_s: float  # final norm + head
    capture_s: float  # embedding, masks and rotary for one step (the backbone up to its first layer)
    device: str
    # {p: a pass over p positions (whole stack + head, as lossless verification runs it) minus a one-position
    # pass}: what verifying p - 1 drafts at once adds to a decode step, at the VERIFY_POINTS that were measured
    # (the wide ones not inside a short sliding window)
    verify_extra_s: dict[int, float] = field(default_factory=dict)
    # What `generate` spends beyond these pieces, measured in `generate` itself (0: not measured): per token of
    # the base model (its decoding loop, logits processors, stopping criteria), and per lossless cycle
    # (drafting's bookkeeping and logits processors, the decode loop, the verification's second
    # capture). Speed-up estimates that leave them out overshoot the timings on small models (x1.23 estimated,
    # x1.01 timed on the shipped model; docs/benchmarks.md).
    step_extra_s: float = 0.0
    cycle_extra_s: float = 0.0
    # Tide's own passes take their layer arguments from one capture per window of positions (`layers/args.py`),
    # not one per pass; False where that does not hold for this model (each draft and verification pays one)
    windowed: bool = False

    @property
    def step_extra(self) -> float:
        return self.step_extra_s / self.layer_s

    @property
    def cycle_extra(self) -> float:
        return self.cycle_extra_s / self.layer_s

    @property
    def verify_extra(self) -> float:
        return self.verify_extra_at(VERIFY_POSITIONS)

    def verify_extra_at(self, positions: int) -> float:
        """What a verification pass over `positions` positions adds to a one-position step, in layers: linear
        between the measured points (1: nothing; a point never below the one before it), and beyond the last."""
        points = [(1, 0.0)]
        for p in sorted(self.verify_extra_s):
            points.append((p, max(self.verify_extra_s[p] / self.layer_s, points[-1][1])))
        if len(points) == 1:
            return 0.0
        (x0, y0), (x1, y1) = next(((a, b) for a, b in zip(points, points[1:]) if positions <= b[0]), points[-2:])
        return max(0.0, y0 + (y1 - y0) * (positions - x0) / (x1 - x0))

    @property
    def checkpoint(self) -> float:
        return self.checkpoint_s / self.layer_s

    @property
    def skipped_layer(self) -> float:
        return self.skipped_layer_s / self.layer_s

    @property
    def head(self) -> float:
        return self.head_s / self.layer_s

    @property
    def capture(self) -> float:
        return self.capture_s / self.layer_s

    @property
    def step_fixed(self) -> float:
        """What a base model's decode step pays beside its layers, in layers: the head, the capture and `generate`'s
        own work (which exits do not save)."""
        return self.head + self.capture + self.step_extra

    @property
    def pass_capture(self) -> float:
        """What one of Tide's own passes (a draft, a verification) pays for its layer arguments, in layers."""
        return 0.0 if self.windowed else self.capture

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(checkpoint=self.checkpoint, skipped_layer=self.skipped_layer, head=self.head, capture=self.capture,
                   step_extra=self.step_extra, cycle_extra=self.cycle_extra,
                   verify_extra=self.verify_extra, wide_verify_extra=self.verify_extra_at(WIDE_VERIFY_POSITIONS),
                   verify_extras={p: self.verify_extra_at(p) for p in sorted(self.verify_extra_s)})
        return out

    def record(self) -> CostsRecord:
        """The costs as calibration saves them."""
        return CostsRecord.from_dict(self.as_dict())


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds_of(fn) -> float:
    """Seconds `fn()` takes, the device's queued work included."""
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(seconds_of(fn) for _ in range(repeats))


def _median_extra(base_fn, fn, repeats: int) -> float:
    """Median over alternating runs of (time of fn - time of base_fn): drift and noise hit both alike."""
    base_fn(), fn()  # warm-up
    return max(statistics.median(seconds_of(fn) - seconds_of(base_fn) for _ in range(repeats)), 0.0)


@torch.no_grad()
def measure_costs(model, prompt_length: int = 32, repeats: int = 30) -> StepCosts:
    """Time one decode token's pieces on `model` (a `TideForCausalLM`) with a `prompt_length` cache."""
    parts, base = model.parts, model.base
    device = base.device
    window = getattr(base.config.get_text_config(), "sliding_window", None)
    # the wide passes only where the window has room for them (and a prompt)
    points = [p for p in VERIFY_POINTS if p <= VERIFY_POSITIONS or not window or window > 2 * p + 1]
    if window:  # stay inside the window: a sliding layer that has evicted keys cannot be cropped back
        prompt_length = max(1, min(prompt_length, window - max(points) - 1))
    ids = torch.arange(prompt_length + 1, device=device).remainder(base.config.get_text_config().vocab_size)[None] + 0
    cache = DynamicCache(config=base.config)
    base(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
    step = dict(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    calls = capture_layer_calls(parts, **step)
    hidden = calls[0].hidden
    windows = LayerArgs(parts)
    windows.calls(ids[:, -1:], cache)
    num_layers = parts.num_layers

    checkpoints = set(model.checkpoints)
    tests = model.exit_tests({k: 0.5 for k in checkpoints})

    chunks = {p: additive_masks(parts, capture_layer_calls(parts, input_ids=ids[:, -p:], past_key_values=cache,
                                                           use_cache=True)) for p in points}

    def layers(consult: bool = False, head: bool = False, step_calls=calls):
        """The step of `step_calls` (one position, or a chunk of `points` positions, as lossless verification
        runs it)."""
        def run():
            h = step_calls[0].hidden
            # the layouts Tide's multi-position passes use; one position is unchanged
            with few_row_linears(parts), grouped_query_attention_in_place():
                for i in range(num_layers):
                    h = step_calls[i].run(parts, i, h)
                    if consult and i in checkpoints:
                        bool(tests[i](h.reshape(-1, h.shape[-1]))[1].any())  # the decision and its host sync
                if head:
                    parts.logits_from_normed(parts.final_norm(h))
            cache.crop(-h.shape[1])
        return run

    def skipped():
        fill_kv(parts, calls, list(range(num_layers)), hidden, cache)
        cache.crop(-1)

    # Interleaved with the layers, so each piece's weights come from memory as in a real decode step.
    one_layer_fill = lambda: (fill_kv(parts, calls, [num_layers - 1], hidden, cache), cache.layers[-1].crop(-1))  # noqa: E731
    costs = StepCosts(
        layer_s=_median_time(layers(), repeats) / num_layers,
        checkpoint_s=_median_extra(layers(), layers(consult=True), repeats) / max(len(checkpoints), 1),
        skipped_layer_s=_median_extra(one_layer_fill, skipped, repeats) / max(num_layers - 1, 1),
        head_s=_median_extra(layers(), layers(head=True), repeats),
        capture_s=_median_time(lambda: capture_layer_calls(parts, **step), repeats),
        device=str(device),
        windowed=windows.off_reason is None,
        verify_extra_s={p: _median_extra(layers(head=True), layers(head=True, step_calls=chunks[p]),
                                         max(repeats // 3, 5))
                        for p in points},
    )
    costs.step_extra_s, costs.cycle_extra_s = _loop_extras(model, ids, costs)
    return costs


LOOP_TOKENS = (8, 40)  # generate runs of these lengths: their difference leaves out prefill and per-call set-up


def _loop_extras(model, ids: torch.Tensor, costs: StepCosts, repeats: int = 3) -> tuple[float, float]:
    """(per base token, per lossless cycle) seconds that `generate` spends beyond the pieces `costs` holds.

    Times the base model's `generate` and lossless mode with a chain of one draft from the first checkpoint,
    each for LOOP_TOKENS new tokens (greedy, as calibration's timings run it: `min_new_tokens` set), and
    subtracts what the pieces account for over the extra tokens: the layers, head and capture of each base
    step; each cycle's drafts and verification as `draft_candidates` prices them. (0, 0) where lossless mode
    cannot run here."""
    short, long = LOOP_TOKENS
    config = {"mode": "lossless", "draft_layer": model.checkpoints[0], "max_draft": 1, "draft_topk": 1,
              "draft_vocab_size": 0}
    step = model.parts.num_layers + costs.head + costs.capture  # a base step's pieces, in layers
    verify = model.parts.num_layers + costs.head + costs.pass_capture
    draft = config["draft_layer"] + 1 + costs.head + costs.pass_capture

    def run(n: int, lossless: bool):
        start = time.perf_counter()
        if lossless:
            model.generate(ids, tide_config=config, **timing_kwargs(model, n))
        else:
            model.base.generate(ids, **timing_kwargs(model, n))
        _sync()
        stats = model.last_stats if lossless else None
        return time.perf_counter() - start, stats

    try:
        run(short, True)  # warm-up (and the check that lossless mode runs here)
    except LosslessUnavailable:
        return 0.0, 0.0
    per_token, per_cycle = [], []
    for _ in range(repeats):
        (base_short, _), (base_long, _) = run(short, False), run(long, False)
        (tide_short, few), (tide_long, many) = run(short, True), run(long, True)
        per_token.append((base_long - base_short) / (long - short) - step * costs.layer_s)
        cycles, drafted = many.verify_passes - few.verify_passes, many.drafted - few.drafted
        if cycles <= 0:
            continue
        pieces = chain_cost(Counter({1: drafted, 0: cycles - drafted}), draft,
                             lambda positions: verify + costs.verify_extra_at(positions)) * costs.layer_s
        per_cycle.append((tide_long - tide_short - pieces) / cycles)
    return max(statistics.median(per_token), 0.0), max(statistics.median(per_cycle), 0.0) if per_cycle else 0.0


def timing_kwargs(model, new_tokens: int) -> dict:
    """Greedy `generate` arguments for a timing: exactly `new_tokens` new tokens."""
    return dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                pad_token_id=model.base.generation_config.pad_token_id or 0)
