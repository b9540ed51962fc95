"""Exit mode's graph backend: a step is one graph from the token to the next token, and one host read.

`walkgraph.ExitGraph` makes a step's walk one graph, but each step of the walk backend (`loop.Walk`) still goes
through the session's forward, the capture of the layers' arguments, the head, the processors and the sampling, on
the host. Here, for one row on a static full-attention cache with processors that run in the graph
(`graphparts.GraphProcessors`), a step (`_exit_step`) is:

1. the last emitted token x through layers 0..c1 (the first consulted checkpoint) by the backbone's own forward on a
   view of those layers (`graphparts.backbone_view`), its position the static cache's length and its mask made
   inside the graph (`graphparts.causal_mask`), as the lossless cycles do;
2. `walkgraph.cond_walk`: at each checkpoint `torch.cond` between the batched fill of every later layer's K/V and
   the next view's layers, nested; the rotary the fill needs is a row of a table of every position of the cache,
   captured once per call (`_RotaryTable`);
3. the final norm and head on the state the walk returns, a minimum length's end-of-sequence scores set to -inf, a
   repetition penalty on the tokens seen so far (a mask of the vocabulary each new token is marked in, on the
   device), and the next token: the argmax, or a draw after the call's warpers;
4. one host read: the token and x's exit layer, which the exit-mode loop (`loop.exit_decode`) hands to the stopping
   criteria, the streamer and the stats (each `torch.cond` reads its predicate inside the graph: `walkgraph.py`).

The first new token comes from the prompt's full pass, as in every exit-mode call; the loop then runs these steps
where `graph_steps` finds that the call fits them. One graph per call shape, none made again for another prompt
length or cache: the static cache's length, read from its tensors, and the rotary table's are dynamic dimensions of
the graph (`cachepool.dynamic_length`; the longest table made so far serves every shorter cache).
"""

from __future__ import annotations

import torch

from ...layers.calls import capture_layer_calls
from ...layers.kvfill import fused_available, stack_for
from ...layers.spans import dense
from ..cachepool import dynamic_length, slots
from ..graphparts import GraphProcessors, causal_mask, one_graph_fits, penalised, views_of
from ..lossless.accept import draw
from .walkgraph import Fill, cond_walk

__all__ = ["GraphSteps", "graph_steps"]


def _exit_step(token, suppress, views: tuple, offset, final_norm, logits_from_normed, cache, dtype, checkpoints: tuple,
               tests: tuple, stack, table, warp, num_layers: int, penalty):
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


def graph_steps(session, input_ids, logits_processor, generation_config, cache, mask, emitted) -> GraphSteps | str:
    """The graph backend for this call after its first new token, or why its steps walk on (`loop.Walk`)."""
    graph = getattr(session, "graph", None)  # (the compiled base's session walks no exits)
    if graph is None:
        return "its steps do not run as one graph (`walkgraph.ExitGraph`)"
    if input_ids.shape[0] != 1:
        return "more than one row"
    if emitted.keeps_outputs:
        return "per-token scores or logits asked for"
    parts, device, checkpoints = session.parts, input_ids.device, graph.checkpoints
    processors = GraphProcessors.of(logits_processor, session.model.num_head_rows, device,
                                    bool(generation_config.do_sample))
    if processors is None:
        return "logits processors that do not run in the graph"
    if not one_graph_fits(parts, cache, mask) or not all(layer.is_initialized for layer in cache.layers):
        return "a model, cache or padding the graph does not fit (`graphparts.one_graph_fits`)"
    bounds = (0,) + tuple(c + 1 for c in checkpoints) + (parts.num_layers,)
    views = views_of(session.model, parts, bounds, (False,) * (len(bounds) - 1))
    if views is None:
        return "a backbone that does not fit views (`graphparts.views_of`)"
    weight = next(parts.layers[0].parameters())
    like = weight.new_zeros(1, 1, weight.shape[-1])  # (the fill's stack is per device and dtype)
    stack, layers = stack_for(parts, like), list(range(checkpoints[0] + 1, parts.num_layers))
    calls = capture_layer_calls(parts, input_ids=input_ids[:, -1:], position_ids=torch.tensor(
        [[input_ids.shape[1] - 1]], device=device), use_cache=False)
    if stack is None or not fused_available(parts, calls, layers, like):
        return "skipped layers' K/V that the batched fill does not compute (`kvfill.fused_available`)"
    table = None
    if stack.rotary(calls, layers) is not None:
        keys = cache.layers[0].max_cache_len
        tables = session.model.__dict__.setdefault("_rotary_tables", {})  # (positions only: the longest per device
        held, table = tables.get((device, like.dtype), (0, None))  # and dtype serves every cache as long or shorter)
        if held < keys:
            table = _RotaryTable.build(parts, stack, layers, keys, device, input_ids.shape[1] - 1)
            tables[device, like.dtype] = keys, table
        if table is None:
            return "a rotary the table of positions does not reproduce"
    dynamic_length(cache)  # (one graph for every cache length)
    penalty = processors.penalty
    penalty = None if penalty is None else (penalty, processors.seen(input_ids[0].tolist(), device))
    key = ("fused exit", checkpoints, processors.warp is not None, penalty is not None)
    return GraphSteps(session.spans, key, processors, dense(input_ids[:, -1:]), penalty, (
        *views, parts.final_norm, parts.logits_from_normed, cache, like.dtype, checkpoints, graph.tests, stack, table,
        processors.warp, parts.num_layers, penalty))


class GraphSteps:
    """The graph backend: an exit-mode step of one call as one compiled graph and one host read. A step gives (the
    next token [1], no scores or logits, the read: (the token, its exit layer))."""

    def __init__(self, spans, key: tuple, processors: GraphProcessors, token, penalty, arguments: tuple):
        self.spans, self.key, self.processors, self.arguments = spans, key, processors, arguments  # (the graph's own)
        self.token, self.penalty = token, penalty  # the last token [1, 1], on the device; `_exit_step`'s penalty

    def step(self, input_ids, tokens) -> tuple:
        """The step after `input_ids` [1, n], whose last token the previous step's graph gave."""
        read, self.token = self.spans.graph(self.key, _exit_step, "tide_exit_step_fused", self.token,
                                            self.processors.suppress(input_ids.shape[1], 0), *self.arguments, lean=True)
        if self.penalty is not None:
            self.penalty[1][self.token.view(-1)] = True  # (on the device: no read)
        new, exit_layer = read.tolist()  # the step's one host read
        return torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device), None, None, (new, exit_layer)
