"""`TideForCausalLM.generate`: the call's plan, the session that runs it, the run.

`decode.plan.plan_call` decides once what a call runs (the base model's own `generate`, its compiled static-cache
decode, exit mode or lossless mode) and why, and `decode.machinecheck.review` whether the repo's drafting scheme pays
on this machine (else the base model runs); this module builds that plan's session and runs it. Every call runs
the base model's own `generate`: Tide's modes hand decoding to one of Tide's loops (`decode/`, through
`custom_generate`): exit mode's walk per step over an `ExitSession` (exits/session.py), or lossless mode's
draft-verify cycles over a `LosslessSession` (lossless/session.py). Each call's session lives in its own loop, so
concurrent calls on one model, from threads or asyncio tasks, each run their own configuration and the base
model is never changed per call. Exit-mode beam search alone runs transformers' beam loop, with the session
active for that call's context only (`dispatch.activated`).
"""

from __future__ import annotations

import copy
import time

import torch

from .config import TideGenerationConfig
from .decode import compilecache, exit_decode, generate_with_loop, lossless_decode, machinecheck
from .decode.baseline import BaseSession
from .decode.dispatch import activated, install
from .decode.exits.session import ExitSession
from .decode.lossless.session import LosslessSession
from .decode.plan import CallPlan, PlanKind, call_inputs, lossless_problem, no_cache, option, plan_call
from .decode.precompiled import Precompiled
from .decode.stats import GenerationStats
from .heads.kernels import kernel_mode
from .layers.spans import SpanRunner, compile_options, options_key
from .models.compat import CompileWatch, is_preallocated_layer

__all__ = ["generate_with_tide", "plan_call", "CallPlan", "attach_stats", "lossless_problem"]


def generate_with_tide(model, tide_config, *args, **kwargs):
    """`model.generate` with Tide: the call's plan (`decode.plan.plan_call`), its session, the run."""
    model.last_stats = None
    if "custom_generate" in kwargs:
        raise ValueError("This model already has Tide routers (a TideForCausalLM), and runs its decoding itself: call "
                         "its generate without custom_generate, or pass custom_generate to its base model (.base).")
    plan = machinecheck.review(model, plan_call(model, tide_config, args, kwargs),  # (the scheme pays here?)
                               _compile_config(model, kwargs))
    if plan.cache_length is None:
        return _execute(model, plan, args, kwargs)
    rows = call_inputs(args, kwargs).shape[0] * (option(model, kwargs, "num_return_sequences") or 1)
    with model.static_caches.lend(model.base.config, plan.cache_length, rows, next(model.base.parameters())) as cache:
        return _execute(model, plan, args, {**kwargs, "past_key_values": cache})


def _execute(model, plan: CallPlan, args, kwargs):
    """Run `plan`: the base model's own generate, its compiled decode, or a session of Tide's mode."""
    if plan.kv_cache and "use_cache" not in kwargs and not no_cache(kwargs):
        _ask(kwargs, "use_cache", True)  # Tide decodes on the KV cache, also for models whose config turns it off
    if plan.kind is PlanKind.BASE:
        return _run_base(model, plan, args, kwargs)
    if plan.kind is PlanKind.BASE_COMPILED:
        return _run(model, plan, BaseSession(model, _compiled_spans(model, _compile_options(model, kwargs))),
                    exit_decode, args, kwargs)
    run = plan.options
    if plan.kind is PlanKind.LOSSLESS:
        session, loop = LosslessSession(model, run, _spans(model, run, kwargs)), lossless_decode
        # compiled: a chain as one graph a cycle (`decode/lossless/graph.py`)
        session.fused_chain_first = plan.fused_chains
    else:
        session, loop = ExitSession(model, run, _spans(model, run, kwargs)), exit_decode
    with kernel_mode(run.kernels):  # the exit tests' path for this call (its context only)
        return _run(model, plan, session, loop, args, kwargs)


def _run(model, plan: CallPlan, session, loop, args, kwargs):
    """`generate` with `session` decoding through `loop`, timed; the session's stats (with the plan's reason) on
    the output and the model."""
    session.stats.plan = plan.reason
    start = time.perf_counter()
    with CompileWatch() as watch:  # (compiled calls: their compiling, in the stats)
        if loop is exit_decode and (option(model, kwargs, "num_beams") or 1) > 1:
            install(model.base)  # beams: transformers' beam loop, with this session's forward in this context
            with activated(session):
                output = model.base.generate(*args, **kwargs)
        else:
            output = generate_with_loop(model.base, session, loop, args, kwargs)
    session.stats.wall_time_s = time.perf_counter() - start
    layer_args = getattr(session, "layer_args", None)  # (the compiled base's session captures none)
    if layer_args is not None:
        session.stats.arg_captures, session.stats.arg_windows_off = layer_args.captures, layer_args.off_reason
    if plan.compile:
        stats = session.stats
        checked = plan.checked_compiling  # (what the machine check compiled for this call: the base step)
        stats.compiled, stats.compile_s = True, watch.seconds + checked[0]
        stats.graphs_compiled, stats.recompiles = watch.graphs + checked[1], watch.recompiles + checked[2]
    model.last_stats = session.stats
    return attach_stats(output, session.stats)


def _run_base(model, plan: CallPlan, args, kwargs):
    """The base model's own `generate`, timed; stats that say so (`GenerationStats.base_run`: every token ran every
    layer) on the output and the model, as for Tide's modes."""
    start = time.perf_counter()
    output = model.base.generate(*args, **kwargs)
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    inputs = call_inputs(args, kwargs)
    prompt = inputs.shape[1] if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else 0
    stats = GenerationStats.base_run(model.parts.num_layers, sequences.shape[0], prompt, sequences.shape[1] - prompt)
    stats.plan, stats.wall_time_s = plan.reason, time.perf_counter() - start
    model.last_stats = stats
    return attach_stats(output, stats)


def _compile_options(model, kwargs: dict) -> dict:
    """torch.compile options for a call with `compile=True`, which runs on a static cache: `kwargs` then asks
    generate for one, or must pass one."""
    cache = kwargs.get("past_key_values")
    if cache is not None and not all(is_preallocated_layer(layer) for layer in cache.layers):
        raise ValueError("tide_config compile=True runs compiled passes on a static cache; pass a StaticCache as "
                         "past_key_values, or none (Tide asks generate for cache_implementation='static').")
    if cache is None:
        implementation = kwargs.get("cache_implementation") or getattr(kwargs.get("generation_config"),
                                                                       "cache_implementation", None)
        if implementation not in (None, "static"):
            raise ValueError(f"tide_config compile=True runs on a static cache, but the call asks for "
                             f"cache_implementation={implementation!r}; drop it or pass 'static'.")
        _ask(kwargs, "cache_implementation", "static")
    return compile_options(_compile_config(model, kwargs), model.base.device.type)


def _compile_config(model, kwargs: dict):
    """The call's `CompileConfig` (its own, its generation config's, or the model's); None for the defaults."""
    config = kwargs.get("generation_config") or model.base.generation_config
    return kwargs.get("compile_config") or getattr(config, "compile_config", None)


def _ask(kwargs: dict, name: str, value) -> None:
    """Ask generate for `name=value`: in the call's own `generation_config` (a copy) where it passed one, since
    transformers deprecates keyword options beside a generation_config, else as a keyword."""
    config = kwargs.get("generation_config")
    if config is None:
        kwargs[name] = value
    else:
        kwargs["generation_config"] = config = copy.deepcopy(config)
        setattr(config, name, value)


def _spans(model, run: TideGenerationConfig, kwargs: dict) -> SpanRunner:
    """How the call's sessions run spans of layers: compiled (on a static cache, which `kwargs` then asks generate
    for) with `compile=True`, else eagerly. Compiled spans are kept on the model for later calls."""
    return _compiled_spans(model, _compile_options(model, kwargs)) if run.compile else SpanRunner(model.parts)


def _compiled_spans(model, options: dict) -> SpanRunner:
    """The model's compiled spans and graphs under torch.compile `options`, made once and kept on the model."""
    key = options_key(options)
    if key not in model.span_runners:
        compilecache.load(model, options, model.base.device)  # (what an earlier process compiled, where persisted)
        model.span_runners[key] = SpanRunner(model.parts, options, Precompiled(model, options, model.base.device))
    runner = model.span_runners[key]
    runner.precompiled.new_call()  # (each call checks its graphs' guards again, once per argument signature)
    return runner


def attach_stats(output, stats: GenerationStats):
    if not isinstance(output, torch.Tensor):
        output["tide_stats"] = stats
    return output
