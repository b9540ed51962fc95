"""`TideForCausalLM.generate`: the config a call runs with, and the session that runs it.

Every call runs the base model's own `generate`. With no operating point it is the plain base model; otherwise
generate prepares the call and hands decoding to one of Tide's loops (`decode/`, through `custom_generate`):
exit mode's walk per step over an `ExitSession` (exitsession.py), or lossless mode's draft-verify cycles over a
`LosslessSession` (speculative.py). Each call's session lives in its own loop, so concurrent calls on one
model, from threads or asyncio tasks, each run their own configuration and the base model is never changed
per call. Exit-mode beam search alone runs transformers' beam loop, with the session active for that call's
context only (`dispatch.activated`).
"""

from __future__ import annotations

import copy
import time
import warnings

import torch
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

from .config import TideConfig, TideGenerationConfig
from .decode import exit_decode, generate_with_loop, lossless_decode
from .decode.baseline import BaseSession
from .decode.dispatch import activated, install
from .decode.exitsession import ExitSession
from .decode.speculative import LosslessSession, LosslessUnavailable
from .decode.stats import GenerationStats
from .heads.kernels import kernel_mode
from .layers.spans import SpanRunner, compile_options, options_key
from .models.compat import cache_layer_kinds, is_static_layer

__all__ = ["generate_with_tide", "resolve_run_config", "attach_stats", "lossless_problem"]

# Options only exit mode uses: a call that sets one runs in exit mode when the repo's default is "auto".
_EXIT_OPTIONS = {"exit_threshold", "thresholds", "min_layers", "kv_strategy", "prefill_exit", "batch_exits"}
_OWN_THRESHOLDS = {"exit_threshold", "thresholds"}  # a call that sets one exits whatever calibration measured
# A compiled call that sets one of these runs Tide's mode even where calibration timed it slower than the base
# model's compiled decode (`compiled_modes=False`).
_ASKS_A_MODE = _OWN_THRESHOLDS | {"mode", "max_draft", "draft_layer", "draft_topk"}
_DRAFT_OPTIONS = {"max_draft", "draft_layer", "draft_topk", "draft_vocab_size", "draft_ngram", "head_drafts"}
_OWN_SCHEME = {"draft_topk"}  # a compiled call that sets it drafts that way, not the fused chain
_NOT_WITH_LOSSLESS = ("assistant_model", "assistant_early_exit", "prompt_lookup_num_tokens", "output_hidden_states",
                      "output_attentions")


def resolve_run_config(model, tide_config) -> TideGenerationConfig | None:
    """The config a generate call runs with, or None for the plain base model."""
    if tide_config is False:
        return None
    if isinstance(tide_config, dict) and tide_config.get("mode") == "lossless" and "exit_threshold" in tide_config:
        raise ValueError(
            "tide_config: exit_threshold applies to mode='exit'. Lossless mode drafts from the exit head at "
            "draft_layer, up to max_draft tokens per verification; set those instead."
        )
    run = model.config.resolve_generation(tide_config)
    run.validate(checkpoints=model.checkpoints)
    model.check_draft_vocab_size(run.draft_vocab_size)
    if run.mode == "auto" and _EXIT_OPTIONS & _given_fields(tide_config):
        run.mode = "exit"  # the call set exit-mode options: it asks for exit mode
    if run.has_operating_point or run.mode != "exit":  # lossless drafts need no thresholds
        return run
    if tide_config is not None and not model.config.thresholds:
        warnings.warn(
            "tide_config was given, but these routers have no thresholds (not calibrated) and no exit_threshold "
            "was set, so the base model runs unchanged. Calibrate with tide.calibrate or pass exit_threshold.",
            stacklevel=3,
        )
    return None


def _given_fields(tide_config) -> set:
    """The generation fields a call's `tide_config` sets."""
    if isinstance(tide_config, dict):
        return set(tide_config)
    if isinstance(tide_config, TideGenerationConfig):
        blank = TideGenerationConfig().to_dict()
        return {k for k, v in tide_config.to_dict().items() if v != blank[k]}
    if isinstance(tide_config, TideConfig):
        return {"thresholds"} if tide_config.thresholds else set()
    return set()


def generate_with_tide(model, tide_config, *args, **kwargs):
    model.last_stats = None
    tide_config = _with_compiled_chain(model, tide_config)
    run = resolve_run_config(model, tide_config)
    generation = model.config.resolve_generation(tide_config) if tide_config is not False else None
    compiled = generation is not None and generation.compile
    length = _static_cache_length(model, args, kwargs) if compiled else None
    if length is None:
        return _generate(model, tide_config, run, compiled, args, kwargs)
    if run is not None and run.mode != "exit":  # lossless can run: room for a whole draft after the last token
        length += (generation.max_draft or 0) + 1  # (`decode/fused.py`)
    rows = _inputs(args, kwargs).shape[0] * (_option(model, kwargs, "num_return_sequences") or 1)
    with model.static_caches.lend(model.base.config, length, rows, next(model.base.parameters())) as cache:
        return _generate(model, tide_config, run, compiled, args, {**kwargs, "past_key_values": cache})


def _with_compiled_chain(model, tide_config):
    """The call's `tide_config`, drafting the repo's `compiled_chain` where the call compiles and names no mode,
    thresholds, exit or draft option (calibration timed that chain faster than the base model's compiled decode
    and the default mode compiled)."""
    if tide_config is False or isinstance(tide_config, TideConfig):
        return tide_config
    generation = model.config.resolve_generation(tide_config)
    given = _given_fields(tide_config)
    if not (generation.compile and generation.compiled_chain)\
            or (_ASKS_A_MODE | _EXIT_OPTIONS | _DRAFT_OPTIONS) & given:
        return tide_config
    call = tide_config if isinstance(tide_config, dict) else {k: getattr(tide_config, k) for k in given}
    return {**call, "mode": "auto", "draft_topk": 1, "head_drafts": True, "draft_vocab_size": 0, "draft_ngram": 0,
            **generation.compiled_chain}


def _static_cache_length(model, args, kwargs) -> int | None:
    """The length of the static cache Tide lends a compiled call (`decode.cachepool`): what `generate` would make
    (its `max_length` - 1 positions). A call on token ids that passes no cache, keeps the cache on, does not return
    its cache, and runs no beams; None elsewhere (generate makes it, or there is none). (Not rounded up: on CPU a
    static cache's every position costs attention time, 5% a token on the shipped model at 256 positions against
    140, more than the one graph per new longest call that rounding would save.)"""
    inputs = _inputs(args, kwargs)
    if (kwargs.get("past_key_values") is not None or _no_cache(kwargs) or not isinstance(inputs, torch.Tensor)
            or inputs.dim() != 2 or kwargs.get("inputs_embeds") is not None
            or _option(model, kwargs, "cache_implementation") not in (None, "static")
            or _option(model, kwargs, "return_dict_in_generate") or (_option(model, kwargs, "num_beams") or 1) > 1):
        return None
    new_tokens = _option(model, kwargs, "max_new_tokens")
    max_length = inputs.shape[1] + new_tokens if new_tokens is not None else _option(model, kwargs, "max_length")
    if max_length is None:
        return None
    return max(int(max_length) - 1, int(_option(model, kwargs, "max_cache_len") or 0), 1)


def _generate(model, tide_config, run, compiled: bool, args, kwargs):
    if run is not None and compiled and not run.compiled_modes and not _ASKS_A_MODE & _given_fields(tide_config):
        run = None  # calibration timed Tide's modes no faster than the base model's compiled decode
    if run is not None and run.mode == "auto":
        asks = {**kwargs, "cache_implementation": "static"} if compiled and "past_key_values" not in kwargs else kwargs
        fits = lossless_problem(model, args, asks) is None  # (compiled: on the static cache that Tide asks for)
        run.mode = "lossless" if fits else "exit"
        if not fits and (not run.has_operating_point or _no_cache(kwargs)):
            run = None  # nothing to exit with, or exit mode cannot run the call either (no KV cache): the base model
    if run is not None and run.mode == "exit" and _batch_exits_off(model, run, tide_config, args, kwargs):
        run = None
    if run is None:  # no thresholds, or calibration found that no checkpoint pays: the base model runs unchanged
        return _base_generate(model, compiled, args, kwargs)
    if "use_cache" not in kwargs and not _no_cache(kwargs):
        _ask(kwargs, "use_cache", True)  # Tide decodes on the KV cache, also for models whose config turns it off (MPT)
    if run.mode == "lossless":
        problem = lossless_problem(model, args, kwargs)
        if problem:
            raise LosslessUnavailable(problem)
        if run.max_draft == 0:  # calibration found that no drafting scheme pays on this model and machine
            return _base_generate(model, compiled, args, kwargs)
        session, loop = LosslessSession(model, run, _spans(model, run, kwargs)), lossless_decode
        # compiled: a chain as one graph a cycle (`decode/fused.py`) outran the repo's tree in the general loop
        # (docs/benchmarks.md); a call that names `draft_topk` keeps it
        session.fused_chain_first = compiled and not _OWN_SCHEME & _given_fields(tide_config)
    else:
        if _no_cache(kwargs):
            raise ValueError("Tide's exit mode decodes on the KV cache (skipped layers still get their K/V); drop "
                             "use_cache=False, or pass tide_config=False to run the base model without exits.")
        session, loop = ExitSession(model, run, _spans(model, run, kwargs)), exit_decode
    with kernel_mode(run.kernels):  # the exit tests' path for this call (its context only)
        return _run(model, session, loop, args, kwargs)


def _run(model, session, loop, args, kwargs):
    """`generate` with `session` decoding through `loop`, timed; the session's stats on the output and the model."""
    start = time.perf_counter()
    if loop is exit_decode and (_option(model, kwargs, "num_beams") or 1) > 1:
        install(model.base)  # beams: transformers' beam loop, with this session's forward in this context
        with activated(session):
            output = model.base.generate(*args, **kwargs)
    else:
        output = generate_with_loop(model.base, session, loop, args, kwargs)
    session.stats.wall_time_s = time.perf_counter() - start
    model.last_stats = session.stats
    return attach_stats(output, session.stats)


def _base_generate(model, compiled: bool, args, kwargs):
    """The base model's own decode: `generate` as the caller would run it, or with `compile=True` the base model's
    compiled static-cache decode (`decode.baseline.BaseSession`), the baseline a compiled call is measured by."""
    if not compiled or (_option(model, kwargs, "num_beams") or 1) > 1:  # beams: transformers' own beam search
        return model.base.generate(*args, **kwargs)
    return _run(model, BaseSession(model, _compile_options(model, kwargs)), exit_decode, args, kwargs)


def _compile_options(model, kwargs: dict) -> dict:
    """torch.compile options for a call with `compile=True`, which runs on a static cache: `kwargs` then asks
    generate for one, or must pass one."""
    cache = kwargs.get("past_key_values")
    if cache is not None and not all(is_static_layer(layer) for layer in cache.layers):
        raise ValueError("tide_config compile=True runs compiled passes on a static cache; pass a StaticCache as "
                         "past_key_values, or none (Tide asks generate for cache_implementation='static').")
    if cache is None:
        implementation = kwargs.get("cache_implementation") or getattr(kwargs.get("generation_config"),
                                                                       "cache_implementation", None)
        if implementation not in (None, "static"):
            raise ValueError(f"tide_config compile=True runs on a static cache, but the call asks for "
                             f"cache_implementation={implementation!r}; drop it or pass 'static'.")
        _ask(kwargs, "cache_implementation", "static")
    config = kwargs.get("generation_config") or model.base.generation_config
    return compile_options(kwargs.get("compile_config") or getattr(config, "compile_config", None))


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
    if not run.compile:
        return SpanRunner(model.parts)
    options = _compile_options(model, kwargs)
    key = options_key(options)
    if key not in model.span_runners:
        model.span_runners[key] = SpanRunner(model.parts, options)
    return model.span_runners[key]


def attach_stats(output, stats: GenerationStats):
    if not isinstance(output, torch.Tensor):
        output["tide_stats"] = stats
    return output


def _batch_exits_off(model, run, tide_config, args, kwargs) -> bool:
    """True for a call on several sequences whose calibrated exits calibration timed no faster than the base
    model on a batch (`batch_exits=False`), unless the call gives its own thresholds."""
    if run.batch_exits or _OWN_THRESHOLDS & _given_fields(tide_config):
        return False
    inputs = _inputs(args, kwargs)
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    rows = 1 if inputs is None else inputs.shape[0]
    return rows * (_option(model, kwargs, "num_return_sequences") or 1) * (_option(model, kwargs, "num_beams") or 1) > 1


def lossless_problem(model, args, kwargs) -> str | None:
    """Why lossless mode cannot run this call (a message saying what to do), or None."""
    inputs = _inputs(args, kwargs)
    if inputs is not None and inputs.shape[0] != 1:
        return (f"mode='lossless' decodes one sequence at a time (batch size 1), got a batch of {inputs.shape[0]}; "
                "loop over the rows or use mode='exit' for batches.")
    if (_option(model, kwargs, "num_return_sequences") not in (None, 1)
            or _option(model, kwargs, "num_beams") not in (None, 1)):
        return "mode='lossless' supports greedy and sampling with one sequence (no beams, num_return_sequences=1)."
    if kwargs.get("inputs_embeds") is not None:
        return "mode='lossless' drafts from token ids; pass input_ids instead of inputs_embeds."
    given = [name for name in _NOT_WITH_LOSSLESS if kwargs.get(name)]
    if given:
        return f"mode='lossless' is Tide's own speculative decoding and does not combine with {given}; drop them."
    if _no_cache(kwargs):
        return "mode='lossless' verifies drafts against the KV cache; drop use_cache=False."
    layers = _layers_without_rollback(model, kwargs)
    if layers:
        return (f"mode='lossless' needs sliding-window cache layers that can roll back rejected drafts, and layers "
                f"{layers} of this call's cache (a static one) drop evicted positions at once. Pass a DynamicCache "
                "(or none) and let generate create it, or use mode='exit'.")
    return ((model.config.calibration or {}).get("draft_selection") or {}).get("unavailable")


def _layers_without_rollback(model, kwargs) -> list[int]:
    """Sliding-window layers of the call's cache (passed, or the static one it asks generate for) that cannot keep
    evicted positions until a draft is accepted or cropped."""
    cache = kwargs.get("past_key_values")
    if cache is not None:
        return [i for i, layer in enumerate(getattr(cache, "layers", None) or []) if getattr(layer, "is_sliding", False)
                and not getattr(layer, "record_past", False) and not hasattr(layer, "activate_past_recording")]
    if _option(model, kwargs, "cache_implementation") not in ALL_STATIC_CACHE_IMPLEMENTATIONS:
        return []
    return [i for i, kind in enumerate(cache_layer_kinds(model.base.config) or []) if kind == "sliding"]


def _no_cache(kwargs) -> bool:
    """The call turns the KV cache off (use_cache=False, as a keyword or in its generation_config)."""
    if "use_cache" in kwargs:
        return kwargs["use_cache"] is False
    return getattr(kwargs.get("generation_config"), "use_cache", None) is False


def _inputs(args, kwargs):
    """The call's prompt ids, however generate was given them (None: none)."""
    return args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))


def _option(model, kwargs, name):
    """A generation option as generate will see it: the call's keyword, its generation_config, the model's."""
    if name in kwargs:
        return kwargs[name]
    return getattr(kwargs.get("generation_config") or model.base.generation_config, name, None)
