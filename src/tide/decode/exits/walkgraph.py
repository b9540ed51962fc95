"""Exit mode's decode step as one compiled graph and one host read (`tide_config={"compile": True}`, one row).

Compiled spans (`layers/spans.py`) run a step as one graph per run of layers between consulted checkpoints, and the
host reads each checkpoint's test to pick what runs next. Here the whole walk is one graph (`_walk`):

1. the layers up to the first consulted checkpoint, on the cache;
2. at each consulted checkpoint, its test (`CheckpointTest`: the `tide::checkpoint_test` op under compilation) and
   `torch.cond` on its result between leaving (the K/V of every later layer from the token's state there, by the
   batched fill's stacked projections, `kvfill`) and going on (the layers up to the next checkpoint, then the next
   test, nested);
3. the K/V the branch handed out written into the cache, and the state the head reads and the exit layer returned:
   the loop's one host read of the step is the exit layer, for the stats.

Inside the graph each `torch.cond` picks its branch by reading its predicate on the host (eagerly, and in inductor's
code alike): on a CPU that is no synchronisation; on a GPU only CUDA graphs' conditional nodes keep the choice on
the device, and those are not used yet (below).

A branch of `torch.cond` may not write its inputs, so the layers inside one run on a staged view of the cache
(`_Staged`): attention sees the layer's cache with this step's K/V put in out of place (a copy of that layer's
K/V a step), and the K/V are handed out and written after the branch. The tokens are those of the compiled spans
(the same layers, tests and fill). The cache's length, and the key axis of the masks the layers take, are dynamic
dimensions of the graph (`cachepool.dynamic_length`): one graph serves every cache the pool lends.

Where it runs: a single-row decode step of a compiled exit-mode call with `kv_strategy="propagate"` on a static
full-attention cache, compiled without CUDA graphs (torch captures `torch.cond` as CUDA graphs' conditional nodes,
which no GPU has measured here yet: with `mode="reduce-overhead"`, a GPU's default, steps run as compiled spans), a
model whose layers take one set of arguments and whose skipped layers' K/V the batched fill computes
(`kvfill.fused_available`); anything else walks as before (`session.walk_layers`).
"""

from __future__ import annotations

import torch

from ...layers.kvfill import fused_available, stack_for
from ...layers.spans import at_offset_zero, run_span
from ...models.compat import is_static_layer
from ..cachepool import dynamic_length, slots

__all__ = ["ExitGraph", "Fill", "cond_walk"]


class _Staged:
    """A static cache's view whose `update` writes nothing: it returns the layer's keys and values with the new ones
    put in at the layer's length (out of place) and keeps the new ones (`new[layer]`) for the caller to write."""

    def __init__(self, cache):
        self.cache, self.new = cache, {}

    def __getattr__(self, name):  # (everything else is the cache's: a backbone's forward asks it for mask sizes)
        return getattr(self.cache, name)

    def update(self, keys, values, layer_idx, *args, **kwargs):
        layer = self.cache.layers[layer_idx]
        at = torch.arange(keys.shape[-2], device=keys.device) + layer.cumulative_length
        self.new[layer_idx] = (keys, values)
        return layer.keys.index_copy(2, at, keys), layer.values.index_copy(2, at, values)


def _with_cache(args: tuple, kwargs: dict, where, cache) -> tuple[tuple, dict]:
    """A layer call's arguments after the hidden state (`args`, `kwargs`) with the cache replaced (`where`: the
    family's `cache_arg`, a keyword or a position counting the hidden state)."""
    if isinstance(where, int) and where - 1 < len(args):
        return args[: where - 1] + (cache,) + args[where:], kwargs
    return args, {**kwargs, (where if isinstance(where, str) else "past_key_values"): cache}


def _walk(layers, returns_tuple: bool, hidden, args, kwargs, where, cache, checkpoints: tuple, tests: tuple, fill):
    """One exit-mode step on a layer call's arguments (module docstring) -> (the state the head reads [1, 1, H], the
    exit layer [] long)."""
    def run(start: int, stop: int, hidden, on):
        on_args, on_kwargs = _with_cache(args, kwargs, where, on)
        return run_span(layers[start:stop], returns_tuple, hidden, on_args, on_kwargs)

    return cond_walk(run, run(0, checkpoints[0] + 1, hidden, cache), cache, checkpoints, tests, fill, len(layers))


def cond_walk(run, hidden, cache, checkpoints: tuple, tests: tuple, fill, num_layers: int):
    """The rest of a step from the first consulted checkpoint's output `hidden` [1, 1, H]: `torch.cond` at each
    checkpoint (`tests[n]` at `checkpoints[n]`), then every later layer's K/V written into `cache` -> (the state the
    head reads, the exit layer [] long). `run(start, stop, hidden, cache)` runs layers start..stop-1 on a cache
    object; `fill(first, hidden)` gives layers first..L-1's keys and values [m, 1, heads, 1, D]."""
    state, exit_layer, keys, values = _at_checkpoint(0, hidden, run, cache, checkpoints, tests, fill, num_layers)
    for offset, layer in enumerate(range(checkpoints[0] + 1, num_layers)):
        cache.update(keys[offset], values[offset], layer)
    return state, exit_layer


def _at_checkpoint(n: int, hidden, run, cache, checkpoints, tests, fill, num_layers: int):
    """The test at the n-th consulted checkpoint and what follows it, as `torch.cond` -> (state, exit layer, the keys
    and the values of every layer after the checkpoint, stacked [m, 1, heads, 1, D])."""
    at = checkpoints[n]
    _, exits, state = tests[n](hidden.reshape(-1, hidden.shape[-1]))
    state = state.view(hidden.shape).clone()  # (a test may give the layer's output itself: operands may not alias)

    def leave(hidden, state):
        keys, values = fill(at + 1, hidden)  # from the layer's output, as the walk fills
        return _laid_out(state, torch.full((), at, dtype=torch.long, device=hidden.device), keys, values)

    def stay(hidden, state):
        staged = _Staged(cache)
        stop = checkpoints[n + 1] + 1 if n + 1 < len(checkpoints) else num_layers
        hidden = run(at + 1, stop, hidden, staged)
        keys, values = (torch.stack([staged.new[i][j] for i in range(at + 1, stop)]) for j in (0, 1))
        if n + 1 < len(checkpoints):
            out, exit_layer, later_keys, later_values = _at_checkpoint(n + 1, hidden, run, cache, checkpoints, tests,
                                                                       fill, num_layers)
            return _laid_out(out, exit_layer, torch.cat([keys, later_keys]), torch.cat([values, later_values]))
        return _laid_out(hidden, torch.full((), num_layers - 1, dtype=torch.long, device=hidden.device), keys,
                         values)

    return torch.cond(exits.view(()), leave, stay, (hidden, state))


def _laid_out(*tensors) -> tuple:
    """A branch's outputs laid out afresh (contiguous, at offset 0): both branches of a `torch.cond` must give
    tensors of one layout, and the fill's keys are a view of other tensors."""
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t) for t in tensors)


class Fill:
    """The K/V of layers first..L-1 from a state, by the batched fill's stacked projections and the step's rotary."""

    def __init__(self, stack, rotary, num_layers: int):
        self.stack, self.rotary, self.num_layers = stack, rotary, num_layers

    def __call__(self, first: int, hidden):
        return self.stack.kv(list(range(first, self.num_layers)), hidden, self.rotary)


class ExitGraph:
    """Runs an exit-mode call's single-row decode steps as one graph each, where they qualify (module docstring)."""

    def __init__(self, session):
        self.session, self.parts = session, session.parts
        self.checkpoints = tuple(sorted(session.consulted))
        self.tests = tuple(session.exit_tests[k] for k in self.checkpoints)

    @classmethod
    def for_session(cls, session) -> ExitGraph | None:
        """The call's exit graph, or None where its steps walk as before."""
        config, parts = session.options, session.parts
        if (not session.spans.compiled or session.spans.cuda_graphs  # (CUDA graphs: not measured with torch.cond)
                or session.recompute is not None or not session.consulted
                or not parts.uniform_layers or config.kv_fill == "layerwise"
                or max(session.consulted) >= parts.num_layers - 1):
            return None
        return cls(session)

    def step(self, steps, cache):
        """One decode step from `steps` (`PropagateSteps`, its layer calls captured) -> (the state the head reads
        [1, 1, H], the exit layer), or None where this step does not qualify."""
        parts, spans, hidden = self.parts, self.session.spans, steps.hidden
        call = spans.shared_call(steps.calls, 0, parts.num_layers)
        layers = list(range(self.checkpoints[0] + 1, parts.num_layers))
        if (call is None or hidden.shape[:2] != (1, 1) or not cache.layers
                or not all(is_static_layer(layer) and layer.is_initialized for layer in cache.layers)
                or not fused_available(parts, steps.calls, layers, hidden)):
            return None
        stack = stack_for(parts, hidden)
        rotary = stack.rotary(steps.calls, layers)  # (copied: the layers' own would alias them on some steps only)
        fill = Fill(stack, tuple(t.clone() for t in rotary) if isinstance(rotary, tuple) else rotary,
                    parts.num_layers)
        args, kwargs = at_offset_zero(call.args[1:]), at_offset_zero(call.kwargs)
        dynamic_length(cache)  # (one graph for every cache length: the cache's and the masks' key axis)
        for mask in (v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() == 4):
            if mask.shape[-1] == slots(cache):
                torch._dynamo.maybe_mark_dynamic(mask, 3)
        return spans.graph(("exit", self.checkpoints), _walk, "tide_exit_step", tuple(parts.layers),
                           parts.spec.returns_tuple, hidden, args, kwargs, parts.spec.cache_arg, cache,
                           self.checkpoints, self.tests, fill, lean=True)
