"""What the pieces of a decode step cost on this machine, and which checkpoints pay for themselves.

`measure_costs` times, on the loaded model and its device, one decode token's pieces as the engine runs them:
every decoder layer in turn (so each layer's weights come from memory as in a real step), the checkpoint
test (exit head + norm + router + threshold + host sync) at every checkpoint in turn, the batched K/V fill
of the skipped layers, the head, and capturing the layers' arguments. Costs are reported relative to a
decoder layer. `prune_checkpoints` turns those costs and calibration's held-out cascade into the set of
checkpoints worth consulting; `draft_candidates` ranks lossless mode's drafting schemes (draft layer, chain
length or tree width) the same way, and
`measured_speedup` times a configuration against the base model.
Nothing here trains or saves anything.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
from transformers import DynamicCache

from ..config import MAX_DRAFT_TOPK
from ..decode.speculative import LosslessUnavailable, next_cap
from ..layers.args import LayerArgs
from ..layers.calls import additive_masks, capture_layer_calls
from ..layers.fewrows import few_row_linears
from ..layers.kvfill import fill_kv
from ..models.compat import grouped_query_attention_in_place

__all__ = ["StepCosts", "DraftScheme", "VERIFY_POSITIONS", "WIDE_VERIFY_POSITIONS", "VERIFY_POINTS", "draft_candidates",
           "measure_costs", "measured_speedup", "prune_checkpoints", "verify_extras_text", "loop_extras_text",
           "chain_cycles"]

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
    # Tide's own passes take their layer arguments from one capture per window of positions (`layerargs.py`),
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


def loop_extras_text(costs: dict) -> str:
    """'generate's own work +2.64 layer a base token, +8.54 layer a lossless cycle' from `StepCosts.as_dict()`
    ('' where not measured, as in repos calibrated before it was)."""
    if not costs.get("step_extra_s") and not costs.get("cycle_extra_s"):
        return ""
    return (f"generate's own work +{costs['step_extra']:.2f} layer a base token, +{costs['cycle_extra']:.2f} layer a "
            "lossless cycle")


def verify_extras_text(costs: dict) -> str:
    """'verifying 2 / 3 / 4 positions instead of 1: +0.1 / +0.3 / +2.0 layer' from `StepCosts.as_dict()` (also
    as saved in a router repo, where the keys are strings; older repos hold only the 4 and 8 positions)."""
    extras = {int(p): v for p, v in (costs.get("verify_extras") or {}).items()}
    if not extras and "verify_extra" in costs:
        extras = {VERIFY_POSITIONS: costs["verify_extra"], WIDE_VERIFY_POSITIONS: costs.get("wide_verify_extra", float("nan"))}
    if not extras:
        return ""
    points = sorted(extras)
    return (f"verifying {' / '.join(map(str, points))} positions instead of 1: "
            + " / ".join(f"+{extras[p]:.2f}" for p in points) + " layer")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(_seconds(fn) for _ in range(repeats))


def _median_extra(base_fn, fn, repeats: int) -> float:
    """Median over alternating runs of (time of fn - time of base_fn): drift and noise hit both alike."""
    base_fn(), fn()  # warm-up
    return max(statistics.median(_seconds(fn) - _seconds(base_fn) for _ in range(repeats)), 0.0)


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
        verify_extra_s={p: _median_extra(layers(head=True), layers(head=True, step_calls=chunks[p]), max(repeats // 3, 5))
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
            model.generate(ids, tide_config=config, **_timing_kwargs(model, n))
        else:
            model.base.generate(ids, **_timing_kwargs(model, n))
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
        pieces = _chain_cost(Counter({1: drafted, 0: cycles - drafted}), draft,
                             lambda positions: verify + costs.verify_extra_at(positions)) * costs.layer_s
        per_cycle.append((tide_long - tide_short - pieces) / cycles)
    return max(statistics.median(per_token), 0.0), max(statistics.median(per_cycle), 0.0) if per_cycle else 0.0


def _timing_kwargs(model, new_tokens: int) -> dict:
    """Greedy `generate` arguments for a timing: exactly `new_tokens` new tokens."""
    return dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                pad_token_id=model.base.generation_config.pad_token_id or 0)


def layer_cost_of_cascade(rows, total: int, num_layers: int, costs: StepCosts) -> float:
    """Mean cost per token, in decoder layers, of the cascade `rows` (CheckpointCalibration list, exit order).

    A token that reaches a checkpoint with a threshold < 1 pays for consulting it; one that exits after layer
    k runs k + 1 layers and fills the other layers' K/V.
    """
    running, cost = total, 0.0
    for row in rows:
        if row.threshold < 1.0:
            cost += running * costs.checkpoint
        cost += row.exits * ((row.layer + 1) + (num_layers - row.layer - 1) * costs.skipped_layer)
        running -= row.exits
    return (cost + running * num_layers) / max(total, 1)


def prune_checkpoints(select, layers: list[int], total: int, num_layers: int, costs: StepCosts):
    """Drop consulted checkpoints that cost more than they save; returns (selection, dropped {layer: reason}).

    `select(layers)` runs threshold selection on a subset of checkpoints (a `CascadeSelection`). A checkpoint
    is dropped when removing it lowers the cascade's expected cost per token; the worst is dropped first and
    the thresholds are selected again each time.
    """
    active, dropped = list(layers), {}
    selection = select(active)
    while True:
        cost = layer_cost_of_cascade(selection.checkpoints, total, num_layers, costs)
        trials = []
        for row in selection.checkpoints:
            if row.threshold >= 1.0:
                continue
            rest = [k for k in active if k != row.layer]
            trial = select(rest)  # may be empty: no checkpoint at all, every token runs the whole stack
            trials.append((layer_cost_of_cascade(trial.checkpoints, total, num_layers, costs), row.layer, rest, trial))
        if not trials:
            return selection, dropped
        best_cost, layer, rest, trial = min(trials, key=lambda t: t[0])
        if best_cost >= cost:
            return selection, dropped
        exits = next(r.exits for r in selection.checkpoints if r.layer == layer)
        dropped[layer] = (f"{exits / max(total, 1):.1%} of tokens exit there; consulting it costs "
                          f"{costs.checkpoint:.2f} layer per token that reaches it")
        active, selection = rest, trial


class DraftScheme(NamedTuple):
    draft_layer: int
    max_draft: int  # chain drafts: most per verification
    draft_topk: int  # > 1: one-level tree drafts of this many candidates (max_draft is then 1)
    estimate: float  # estimated speed-up over the base model
    draft_vocab_size: int = 0  # > 0: drafts rank only that many most-predicted tokens (draftvocab.py)


def draft_candidates(ranks: dict[int, torch.Tensor], num_layers: int, costs: StepCosts, max_draft: int = 8,
                     max_topk: int = MAX_DRAFT_TOPK, chain_ranks: dict[int, torch.Tensor] | None = None,
                     restricted: dict[int, tuple[dict, dict]] | None = None, head_rows: int = 0) -> list[DraftScheme]:
    """Lossless mode's drafting schemes with their estimated speed-up, best first, from held-out exit heads.

    ranks: {layer: [N]} in text order, where the full model's next token ranks among the draft's logits
    (0: its top-1), for a draft that reads a verified context (a chain's first draft, a tree's).
    chain_ranks: the same for a chain's later drafts, whose draft head reads the previous draft's own state
    (default: `ranks`; equal where there is no draft head). A draft step from layer E costs E + 1 layers and the head; a verification costs the
    whole stack and the head (each plus a capture where layer arguments are not windowed, `costs.pass_capture`), plus what a pass over p positions costs more than a pass
    over one (`costs.verify_extra_at(p)`, measured at `VERIFY_POINTS`; speculative decoding assumes it
    small, and on a CPU it can be a third of a step). A chain cycle emits the run of drafts that agree with
    the full model, plus one, and drafts as many as generation's adaptive cap allows (`chain_cycles` walks the
    held-out text with it); a tree cycle (k candidates for one position, run through the shallow layers
    together and verified with the token before them in one pass: about a chain cycle of one draft) emits
    two tokens when the full model's token is among the k, else one. A cycle also pays `generate`'s own work
    per cycle, and the base model's per token (`costs.cycle_extra`, `costs.step_extra`, measured in `generate`).
    An estimate: calibration then measures the best.

    restricted: {n: (ranks, chain_ranks)} for drafts that rank only the n most-predicted tokens (a token outside
    them ranks last), whose head costs n / `head_rows` of the whole head.
    """
    step = num_layers + costs.head + costs.capture  # a base step
    passes = num_layers + costs.head + costs.pass_capture

    def verify(positions: int) -> float:  # a verification, and the cycle's work beyond its pieces
        return passes + costs.verify_extra_at(positions) + costs.cycle_extra

    variants = [(0, ranks, chain_ranks or ranks)]
    variants += [(n, r, c) for n, (r, c) in sorted((restricted or {}).items()) if head_rows and n < head_rows]
    out = []
    for vocab, layer_ranks, layer_chain_ranks in variants:
        head = costs.head * (vocab / head_rows if vocab else 1.0)
        out += _schemes(layer_ranks, layer_chain_ranks, head + costs.pass_capture, verify, step + costs.step_extra,
                        max_draft, max_topk, vocab, tree_extra=2 * (costs.capture - costs.pass_capture))
    return sorted(out, key=lambda c: -c.estimate)


def _schemes(ranks, chain_ranks, draft_overhead: float, verify, base: float, max_draft: int, max_topk: int,
             vocab: int, tree_extra: float = 0.0) -> list:
    """`draft_candidates`' schemes for one draft vocabulary (a draft step costs E + 1 layers + `draft_overhead`;
    a cycle's verification `verify(positions)`; a base token `base`; a tree cycle also `tree_extra`: its tree
    masks' two captures, where the chain's passes take windowed arguments)."""
    out = []
    for layer, rank in ranks.items():
        later = chain_ranks[layer]
        first_flags, later_flags, runs, current = (rank == 0).tolist(), (later == 0).tolist(), [], 0
        for first, flag in zip(reversed(first_flags), reversed(later_flags)):
            runs.append(current + 1 if first else 0)  # runs[t]: a chain drafted from t, agreeing drafts in a row
            current = current + 1 if flag else 0  # the same for drafts that follow a draft
        runs.reverse()
        draft = layer + 1 + draft_overhead
        for length in range(1, max_draft + 1):
            tokens, drafted = chain_cycles(runs, length)
            out.append(DraftScheme(layer, length, 1, tokens / _chain_cost(drafted, draft, verify) * base, vocab))
        if max_draft:
            for k in range(2, max_topk + 1):
                hit = float((rank.long() < k).double().mean())
                out.append(DraftScheme(layer, 1, k, (1 + hit) / (draft + verify(k + 1) + tree_extra) * base, vocab))
    return out


def _chain_cost(drafted: Counter, draft: float, verify) -> float:
    """What chain cycles cost, in layers: {drafts in a cycle: cycles}, a draft step `draft`, and a verification
    over p positions `verify(p)` (the drafts and the token before them)."""
    return sum(count * (d * draft + verify(d + 1)) for d, count in drafted.items())


def chain_cycles(runs: list[int], max_draft: int) -> tuple[int, Counter]:
    """Lossless mode's chain drafting walked over held-out text: (tokens emitted, {drafts in a cycle: cycles}).

    runs[t]: how many drafts in a row from position t agree with the full model. A cycle at t drafts `cap`
    tokens, emits the agreeing ones and one more, and the cap follows generation's rule (`next_cap`). So a
    chain of up to 4 whose drafts often fail early mostly verifies 2-3 positions, not 5."""
    tokens, drafted, cap, t = 0, Counter(), max_draft, 0
    while t < len(runs):
        accepted = min(runs[t], cap)
        drafted[cap] += 1
        tokens += accepted + 1
        t += accepted + 1
        cap = next_cap(cap, cap, accepted, max_draft)
    return tokens, drafted


# `tide_config` that runs the base model's compiled static-cache decode (`decode.baseline.BaseSession`).
COMPILED_BASE = {"compile": True, "compiled_modes": False}


def measured_speedup(model, prompts: list[torch.Tensor], tide_config: dict, new_tokens: int = 24, repeats: int = 3,
                     baseline: str = "generate") -> float:
    """Decode tokens/s of `model.generate(..., tide_config=...)` over the base model's, greedy, measured here.

    `baseline`: "generate" (the base model's `generate`) or "compiled" (its compiled static-cache decode; the
    config then runs compiled too). Runs alternate between the two and the median of the per-repeat ratios is
    returned.
    """
    if baseline not in ("generate", "compiled"):
        raise ValueError(f"baseline must be 'generate' or 'compiled', got {baseline!r}.")
    kwargs = _timing_kwargs(model, new_tokens)
    if baseline == "compiled":
        tide_config = {**tide_config, "compile": True}

    def seconds(fn):
        return sum(_seconds(lambda ids=ids: fn(ids)) for ids in prompts)

    def tide_run(ids):
        return model.generate(ids, tide_config=tide_config, **kwargs)

    def base_run(ids):
        if baseline == "compiled":
            return model.generate(ids, tide_config=COMPILED_BASE, **kwargs)
        return model.base.generate(ids, **kwargs)

    seconds(tide_run), seconds(base_run)  # warm-up
    return statistics.median(seconds(base_run) / seconds(tide_run) for _ in range(repeats))
