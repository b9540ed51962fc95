"""Exit mode's compiled decode loop: a step is one graph from the token to the next token, and one host read.

`exitgraph.ExitGraph` makes a step's walk one graph, but each step still goes through generate's loop, the session's
forward, the capture of the layers' arguments and the head, on the host. Here, for one row on a static
full-attention cache with processors that run in the graph (`graphparts.GraphProcessors`), a step (`_exit_step`) is:

1. the last emitted token x through layers 0..c1 (the first consulted checkpoint) by the backbone's own forward on a
   view of those layers (`graphparts.backbone_view`), its position the static cache's length and its mask made
   inside the graph (`graphparts.causal_mask`), as the lossless cycles do;
2. `exitgraph.cond_walk`: at each checkpoint `torch.cond` between the batched fill of every later layer's K/V and
   the next view's layers, nested; the rotary the fill needs is a row of a table of every position of the cache,
   captured once per call (`_RotaryTable`);
3. the final norm and head on the state the walk returns, a minimum length's end-of-sequence scores set to -inf, a
   repetition penalty on the tokens seen so far (a mask of the vocabulary the loop marks each new token in, on the
   device), and the next token: the argmax, or a draw after the call's warpers;
4. one host read by the loop: the token and x's exit layer, for the stopping criteria, the streamer and the stats
   (each `torch.cond` reads its predicate inside the graph: `exitgraph.py`).

The first new token comes from the prompt's full pass in `exits.exit_decode`, as in every exit-mode call; then this
loop takes over. One graph per call shape, none made again for another prompt length or cache: the static
cache's length, read from its tensors, and the rotary table's are dynamic dimensions of the graph
(`cachepool.dynamic_length`; the longest table made so far serves every shorter cache).
"""

from __future__ import annotations

import time

import torch

from ..layers.calls import capture_layer_calls
from ..layers.kvfill import fused_available, stack_for
from ..layers.spans import dense
from .accept import draw
from .cachepool import dynamic_length, slots
from .exitgraph import Fill, cond_walk
from .graphparts import GraphProcessors, Stops, causal_mask, one_graph_fits, penalised, views_of

__all__ = ["FusedExit", "fused_exit_for"]


def _exit_step(views: tuple, offset, final_norm, logits_from_normed, cache, token, dtype, checkpoints: tuple,
               tests: tuple, stack, table, suppress, warp, num_layers: int, penalty=None):
    """One step as one graph (module docstring) -> (the next token and x's exit layer [2]: what the host reads; the
    next token [1, 1]). `penalty`: (p [], the tokens seen so far [V] bool) for a repetition penalty. The cache's
    length is read from its tensors, a dynamic dimension of the graph (`cachepool.dynamic_length`), as is the
    rotary table's: one graph for every cache length."""
    position = cache.layers[0].cumulative_length.reshape(1).clone()  # (a copy: layer 0 moves its length on)
    mask = causal_mask(position, slots(cache), dtype)
    starts = (0,) + tuple(c + 1 for c in checkpoints)

    def run(start: int, stop: int, hidden, on):
        if start == 0:
            inputs = {"input_ids": hidden}
        else:
            if offset is not None:  # what the view adds to its input embeddings (learned positions), taken off
                hidden = hidden - offset(inputs_embeds=torch.zeros_like(hidden), position_ids=position[None],
                                         use_cache=False).last_hidden_state
            inputs = {"inputs_embeds": hidden}
        return views[starts.index(start)](position_ids=position[None], attention_mask=mask, past_key_values=on,
                                          use_cache=True, **inputs).last_hidden_state

    rotary = None if table is None else table.at(position)
    hidden = run(0, checkpoints[0] + 1, token, cache)
    state, exit_layer = cond_walk(run, hidden, cache, checkpoints, tests, Fill(stack, rotary, num_layers), num_layers)
    logits = logits_from_normed(final_norm(state))[0]  # [1, V]
    where, suppressed = suppress
    logits = logits.masked_fill(where[:, None] & suppressed, float("-inf"))
    if penalty is not None:
        logits = penalised(logits.float(), penalty[0], penalty[1][None])
    nxt = logits.argmax(-1, keepdim=True) if warp is None else draw(warp(logits.float()).softmax(-1))  # [1, 1]
    return torch.cat([nxt.view(1), exit_layer.view(1)]), nxt


class _RotaryTable:
    """The rotary the batched fill applies (`kvfill`'s `rotary(calls, layers)`) for every position of a static cache
    of `keys` slots, captured once from the backbone's own prelude, and `at(position)`: a position's row, in the
    graph. None (`build`) where the rows cannot be told apart from what one position's capture gives. The positions'
    axis is a dynamic dimension of the graph, so a table made for a longer cache serves the same graph."""

    def __init__(self, tensors: tuple, axes: tuple):
        self.tensors, self.axes = tensors, axes
        for tensor, axis in zip(tensors, axes):
            torch._dynamo.maybe_mark_dynamic(tensor, axis)

    def at(self, position: torch.Tensor) -> tuple:
        return tuple(t.index_select(axis, position) for t, axis in zip(self.tensors, self.axes))

    @classmethod
    def build(cls, parts, stack, layers: list[int], keys: int, device, one_position) -> _RotaryTable | None:
        def rotary(positions):
            ids = torch.zeros(1, len(positions), dtype=torch.long, device=device)
            calls = capture_layer_calls(parts, input_ids=ids, position_ids=torch.tensor([positions], device=device),
                                        use_cache=False)
            return stack.rotary(calls, layers)

        table, row = rotary(list(range(keys))), rotary([one_position])
        if not isinstance(table, tuple) or not isinstance(row, tuple) or len(table) != len(row):
            return None
        axes = []
        for full, one in zip(table, row):
            differ = [i for i, (a, b) in enumerate(zip(full.shape, one.shape)) if a != b]
            if full.dim() != one.dim() or len(differ) != 1:
                return None
            axes.append(differ[0])
        built = cls(table, tuple(axes))
        position = torch.tensor([one_position], device=device)
        return built if all(torch.equal(a, b) for a, b in zip(built.at(position), row)) else None


def fused_exit_for(session, input_ids, generation_config, logits_processor, cache, mask, emitted):
    """The fused exit loop for this call after its first new token, or None where the call goes on as it started
    (`exitsession.ExitSession` through generate's loop): more than one row, processors that do not run in the graph,
    per-token outputs, padding, steps that do not run as one graph (`ExitGraph`), a cache that is not static and
    full-attention, a model whose backbone does not fit views or whose skipped layers' K/V the batched fill does
    not compute with a rotary the table reproduces."""
    graph = getattr(session, "graph", None)  # (the compiled base's session walks no exits)
    if graph is None:
        return None
    parts = session.parts
    processors = GraphProcessors.of(logits_processor, session.model.num_head_rows, input_ids.device,
                                bool(generation_config.do_sample))
    if (input_ids.shape[0] != 1 or processors is None or emitted.keeps_outputs
            or not one_graph_fits(parts, cache, mask) or not all(layer.is_initialized for layer in cache.layers)):
        return None
    checkpoints = graph.checkpoints
    bounds = (0,) + tuple(c + 1 for c in checkpoints) + (parts.num_layers,)
    views = views_of(session.model, parts, bounds, (False,) * (len(bounds) - 1))
    if views is None:
        return None
    keys, device = cache.layers[0].max_cache_len, input_ids.device
    weight = next(parts.layers[0].parameters())
    like = weight.new_zeros(1, 1, weight.shape[-1])  # (the fill's stack is per device and dtype)
    stack = stack_for(parts, like)
    if stack is None:
        return None
    layers = list(range(checkpoints[0] + 1, parts.num_layers))
    calls = capture_layer_calls(parts, input_ids=input_ids[:, -1:], position_ids=torch.tensor(
        [[input_ids.shape[1] - 1]], device=device), use_cache=False)
    if not fused_available(parts, calls, layers, like):
        return None
    table = None
    if stack.rotary(calls, layers) is not None:
        tables = session.model.__dict__.setdefault("_rotary_tables", {})  # (positions only: the longest per device
        held, table = tables.get((device, like.dtype), (0, None))  # and dtype serves every cache as long or shorter)
        if held < keys:
            table = _RotaryTable.build(parts, stack, layers, keys, device, input_ids.shape[1] - 1)
            tables[device, like.dtype] = keys, table
        if table is None:
            return None
    dynamic_length(cache)  # (one graph for every cache length)
    return FusedExit(session, cache, *views, processors, stack, table)


class FusedExit:
    """Runs the exit-mode steps of one call as one compiled graph and one host read each."""

    def __init__(self, session, cache, views, offset, processors: GraphProcessors, stack, table):
        self.session, self.cache, self.views, self.offset = session, cache, views, offset
        self.processors, self.stack, self.table = processors, stack, table

    def decode(self, input_ids, stopping_criteria, generation_config, emitted):
        """Generate after `input_ids` [1, n] (its last token emitted, not yet through the model) until a stopping
        criterion fires; returns what `generate` returns."""
        session, cache, stats, parts = self.session, self.cache, self.session.stats, self.session.parts
        stops = Stops(stopping_criteria, generation_config, input_ids.device)
        tokens, token = input_ids[0].tolist(), dense(input_ids[:, -1:])
        dtype = next(parts.layers[0].parameters()).dtype
        graph, seen = session.graph, self.processors.seen(tokens, input_ids.device)
        penalty = None if seen is None else (self.processors.penalty, seen)
        while True:
            start = time.perf_counter()
            read, token = session.spans.graph(
                ("fused exit", graph.checkpoints, self.processors.warp is not None, seen is not None), _exit_step,
                "tide_exit_step_fused", self.views, self.offset, parts.final_norm, parts.logits_from_normed, cache,
                token, dtype, graph.checkpoints, graph.tests, self.stack, self.table,
                self.processors.suppress(len(tokens), 0), self.processors.warp, parts.num_layers, penalty, lean=True)
            if seen is not None:
                seen[token.view(-1)] = True  # (on the device: no read)
            new, exit_layer = read.tolist()  # the step's one host read
            kept, done = stops.emitted(tokens, [new])
            tokens.append(new)
            emitted.add(torch.tensor([[new]], dtype=input_ids.dtype, device=input_ids.device), None, None)
            stats.record_step([exit_layer], exit_layer + 1, parts.num_layers - 1 - exit_layer)
            stats.record_time(time.perf_counter() - start)
            if done:
                return emitted.finish(torch.tensor([tokens], dtype=input_ids.dtype, device=input_ids.device), cache)
