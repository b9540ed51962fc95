"""Runs of consecutive decoder layers, eager or compiled (`tide_config={"compile": True}`).

Between two decisions (a checkpoint's exit test, a draft, a verification) Tide runs a span of layers on
the same arguments. Eagerly that is a Python loop over the layers. Compiled, each span is one graph
(`torch.compile(fullgraph=True, dynamic=False)`, the options of the call's `generation_config.compile_config`,
transformers' `CompileConfig`, where it gives them): a span runs on a static cache with static shapes, so a
graph is made once per span and width and then replayed; on a GPU `mode="reduce-overhead"` captures it in a
CUDA graph. Each span gets a code object of its own, so that its graphs never count against another span's
recompile limit. A draft step runs the shallow layers and the draft head in one graph (`run_then`): one compiled
call a drafted token; a greedy chain with no logits processors runs all its steps in one graph (`run_chain`).
Layers whose calls differ (per-layer-type masks), and layers called with another cache object (row splitting),
run eagerly.
"""

from __future__ import annotations

import types

import torch

from ..models.architectures import ModelParts

__all__ = ["SpanRunner", "at_offset_zero", "compile_options", "dense", "options_key", "own_code", "run_span"]


def run_span(layers, returns_tuple: bool, hidden, args, kwargs):
    """`hidden` through `layers` in order, each called with the same arguments after the hidden state (`args`,
    `kwargs`) -> the last layer's hidden state (the first output where a layer returns a tuple)."""
    for layer in layers:
        out = layer(hidden, *args, **kwargs)
        hidden = out[0] if returns_tuple or isinstance(out, tuple) else out
    return hidden


def _run_span_then(layers, returns_tuple: bool, hidden, args, kwargs, then, context):
    hidden = run_span(layers, returns_tuple, hidden, args, kwargs)
    return hidden, then(hidden[:, -1], context)


def _run_chain(layers, returns_tuple: bool, embed, positional, hidden, steps, then, context):
    states, tokens, logits = [], [], []
    for i, (args, kwargs) in enumerate(steps):
        if i:
            hidden = embed(tokens[-1]) if positional is None else embed(tokens[-1]) + positional[:, i:i + 1]
        hidden = run_span(layers, returns_tuple, hidden, args, kwargs)
        step_logits, context = then(hidden[:, -1], context)
        states.append(hidden)
        logits.append(step_logits)
        tokens.append(step_logits.argmax(-1, keepdim=True))
    return torch.cat(states, 1), torch.cat(tokens, 1), torch.stack(logits, 1)


def own_code(function, name: str) -> types.FunctionType:
    """`function` with a code object of its own named `name`: dynamo keeps compiled graphs and counts recompiles per
    code object, so a function compiled under several keys gets one copy a key."""
    return types.FunctionType(function.__code__.replace(co_name=name, co_qualname=name), function.__globals__, name)


def compile_options(compile_config=None, device: str | None = None) -> dict:
    """torch.compile keyword arguments from a call's `compile_config` (transformers' `CompileConfig`; None: its
    defaults) for a model on `device` (a device type: on "cpu", inductor's default mode takes
    `rowproducts.CPU_INDUCTOR_OPTIONS`, products of a few rows lowered to inductor's own reductions, where the config
    does not name them)."""
    from transformers import CompileConfig

    config = compile_config or CompileConfig()
    options = {"fullgraph": config.fullgraph, "dynamic": config.dynamic, "backend": config.backend,
               "mode": config.mode, "options": config.options}
    if not torch.cuda.is_available():  # CUDA graphs need a GPU; inductor's default mode elsewhere
        options["mode"] = None if options["mode"] == "reduce-overhead" else options["mode"]
    if device == "cpu" and options["backend"] == "inductor" and options["mode"] is None:
        from .rowproducts import CPU_INDUCTOR_OPTIONS  # (here: it imports inductor, which `import tide` need not)

        options["options"] = {**CPU_INDUCTOR_OPTIONS, **(options["options"] or {})}
    return options


def options_key(options: dict) -> tuple:
    """A hashable key for a set of torch.compile options (what compiled runs are kept on the model under)."""
    return tuple(sorted((k, repr(v)) for k, v in options.items()))


def at_offset_zero(value):
    """`value` with every tensor in it starting at offset 0 of its storage: the layer arguments are slices of a
    window of positions (`layers/args.py`), and dynamo specialises a storage offset of 0 or 1, so a slice that comes
    to start there would recompile a graph made for another."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.storage_offset() else value
    if type(value) in (tuple, list):
        return type(value)(at_offset_zero(v) for v in value)
    if isinstance(value, dict):
        return {k: at_offset_zero(v) for k, v in value.items()}
    return value


class SpanRunner:
    """Runs layers start..stop-1 of `parts` with one layer call's arguments; compiled when `options` are given."""

    def __init__(self, parts: ModelParts, options: dict | None = None, precompiled=None):
        self.parts, self.options = parts, options
        self._compiled: dict = {}  # (start, stop) -> a span's compiled function; "backbone" -> the backbone's
        # `graph`'s graphs: AOT-compiled, or loaded without tracing (`decode.precompiled.Precompiled`)
        self.precompiled = precompiled

    @property
    def compiled(self) -> bool:
        return self.options is not None

    def run(self, start: int, stop: int, hidden: torch.Tensor, calls, eager: bool = False) -> torch.Tensor:
        """Layers start..stop-1 on `hidden`, each with its call in `calls` (a list over all layers); `eager`: not
        compiled, e.g. for a width that would need a graph of its own."""
        call = None if eager else self.shared_call(calls, start, stop)
        if call is None:
            for i in range(start, stop):
                hidden = calls[i].run(self.parts, i, hidden)
            return hidden
        fn = self._function(run_span, (start, stop), f"tide_layers_{start}_to_{stop - 1}")
        return self._own(fn(tuple(self.parts.layers[start:stop]), self.parts.spec.returns_tuple, hidden,
                            at_offset_zero(call.args[1:]), at_offset_zero(call.kwargs)))

    def run_then(self, start: int, stop: int, hidden: torch.Tensor, calls, then, context):
        """`run`, then `then(output at the last position [B, H], context)`, in the same graph where the span is
        compiled (the draft head after the shallow layers: one compiled call, not a compiled span and eager head
        ops). -> (the span's output, what `then` returns)."""
        call = self.shared_call(calls, start, stop)
        if call is None:
            hidden = self.run(start, stop, hidden, calls)
            return hidden, then(hidden[:, -1], context)
        fn = self._function(_run_span_then, (start, stop, "then"), f"tide_layers_{start}_to_{stop - 1}_and_draft")
        return self._own(fn(tuple(self.parts.layers[start:stop]), self.parts.spec.returns_tuple, hidden,
                            at_offset_zero(call.args[1:]), at_offset_zero(call.kwargs), then, dense(context)))

    def run_chain(self, start: int, stop: int, hidden: torch.Tensor, steps: list, embed, positional, then, context):
        """A greedy chain of `len(steps)` drafts in one compiled call: each step runs layers start..stop-1 on its
        token (the first on `hidden`, the next ones on `embed` of the token before, plus its row of `positional`
        [B, k, H] where the backbone adds one to the embeddings) with its layer call's arguments
        `steps[i]` = (args after the hidden state, kwargs), then `then(output at its position, context)` (the draft
        head: logits and the next context), and takes the logits' argmax as the next token. -> (the states [B, k, H],
        the drafted tokens [B, k], their logits [B, k, V]). Compiled spans only (one graph per chain length)."""
        fn = self._function(_run_chain, (start, stop, "chain", len(steps)),
                            f"tide_layers_{start}_to_{stop - 1}_chain_of_{len(steps)}")
        return self._own(fn(tuple(self.parts.layers[start:stop]), self.parts.spec.returns_tuple, embed,
                            at_offset_zero(positional), hidden,
                            [(at_offset_zero(args), at_offset_zero(kwargs)) for args, kwargs in steps], then,
                            dense(context)))

    def graph(self, key, function, name: str, *args, lean: bool = False):
        """`function(*args)` compiled (one graph per `key`; `function`'s own Python decides what it runs): through
        `precompiled` where there is one (AOT-compiled or loaded, its guards checked once per argument signature).
        `lean`: inductor (where it compiles in its default mode) leaves out its checks of every input's size and
        strides, which dynamo's guards have made already: a graph of nested `torch.cond` branches passes each branch
        every parameter it reads, and the checks cost more than its smaller kernels."""
        return self._own(self._function(function, ("graph", key), name, lean)(*args))

    def backbone(self, **inputs):
        """The backbone's own forward on `inputs`, compiled (one graph per input shape): its last hidden state
        [B, T, H], which the backbone gives after its final norm."""
        fn = self._compiled.get("backbone")
        if fn is None:
            fn = self._compiled["backbone"] = torch.compile(self.parts.backbone.forward, **self.options)
        return self._own(fn(**inputs)[0])

    @property
    def cuda_graphs(self) -> bool:
        return self.options is not None and self.options.get("mode") == "reduce-overhead"

    def shared_call(self, calls, start: int, stop: int):
        """The one call every layer of start..stop-1 takes, where that span runs compiled; None where it runs
        eagerly (not compiled, calls that differ between layers, hidden states passed by keyword)."""
        span = calls[start:stop]
        call = span[0] if span else None
        if self.options is None or call is None or any(c is not call for c in span) or not call.args:
            return None
        return call

    def _function(self, function, key, name: str, lean: bool = False):
        """`function` compiled under `key`, as a code object of its own named `name` (its own recompile limit); a
        `graph`'s, where there is a `precompiled`, its function from there."""
        fn = self._compiled.get(key)
        if fn is None:
            options = self.options
            if lean and options.get("backend", "inductor") == "inductor" and options.get("mode") is None:
                options = {**options, "options": {**(options.get("options") or {}), "size_asserts": False}}

            def compiled():
                return torch.compile(own_code(function, name), **options)

            precompiled = self.precompiled if key[0] == "graph" else None
            fn = precompiled and precompiled.wrap(function, key, name, options, compiled)
            fn = self._compiled[key] = fn or compiled()
        return fn

    def _own(self, out):
        """A compiled call's output (tensors, in tuples), copied out of the CUDA graph's memory pool where it lives
        there: the next replay of any graph overwrites it, and the loops keep states across spans and steps (pending
        drafts, exit states)."""
        return _copied(out) if self.cuda_graphs else out


def _copied(value):
    return value.clone() if isinstance(value, torch.Tensor) else tuple(_copied(v) for v in value)


def dense(value):
    """`value` (a tensor, or None) laid out afresh, at offset 0 with contiguous strides: a row or slice of another
    tensor (a draft's context, a row of the verified states) would be guarded on its offset and strides and
    recompile a graph made for another."""
    return None if value is None else value.clone(memory_format=torch.contiguous_format)
