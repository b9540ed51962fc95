"""What a generate call will run, decided once from the call alone: its `CallPlan`.

`plan_call` reads the call (its `tide_config`, the repo's defaults and calibration, generate's own arguments) and
changes none of them: it resolves the call's options once, picks what runs (the base model's own `generate`, its
compiled static-cache decode, exit mode or lossless mode), says why, and raises the errors of a call that cannot
run. `tide.generation` then builds the plan's session and runs it.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from dataclasses import dataclass

import torch
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

from ..config import TideConfig, TideGenerationConfig
from ..models.compat import cache_layer_kinds
from .lossless.verifier import LosslessUnavailable

__all__ = ["CallPlan", "PlanKind", "KINDS", "plan_call", "call_options", "lossless_problem", "per_layer_outputs",
           "call_inputs", "no_cache", "option"]



class PlanKind(str, enum.Enum):
    """What a call runs. The values are the words the stats and the plan's reason use (a kind compares equal to
    its value)."""

    BASE = "base"  # the base model's own `generate`
    BASE_COMPILED = "base (compiled)"  # its compiled static-cache decode (`decode.baseline.BaseSession`)
    EXIT = "exit"
    LOSSLESS = "lossless"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # f-strings give the value


KINDS = tuple(kind.value for kind in PlanKind)

# Options only exit mode uses: a call that sets one runs in exit mode when the repo's default is "auto".
_EXIT_OPTIONS = {"exit_threshold", "thresholds", "min_layers", "kv_strategy", "prefill_exit", "batch_exits"}
_OWN_THRESHOLDS = {"exit_threshold", "thresholds"}  # a call that sets one exits whatever calibration measured
# A compiled call that sets one of these runs Tide's mode even where calibration timed it slower than the base
# model's compiled decode (`compiled_modes=False`).
_ASKS_A_MODE = _OWN_THRESHOLDS | {"mode", "max_draft", "draft_layer", "draft_topk"}
_DRAFT_OPTIONS = {"max_draft", "draft_layer", "draft_topk", "draft_vocab_size", "draft_ngram", "head_drafts"}
_OWN_SCHEME = {"draft_topk"}  # a compiled call that sets it drafts that way, not the fused chain
# What a compiled call drafting the repo's `compiled_chain` sets besides the chain's own fields.
_CHAIN_CALL = {"mode": "auto", "draft_topk": 1, "head_drafts": True, "draft_vocab_size": 0, "draft_ngram": 0}
_NOT_WITH_LOSSLESS = ("assistant_model", "assistant_early_exit", "prompt_lookup_num_tokens")
# generate's per-layer outputs, which Tide's modes do not return (exited tokens skip layers; verification runs several
# positions a pass): a call that asks for them (and a dict output) runs the base model or is refused.
_PER_LAYER_OUTPUTS = ("output_hidden_states", "output_attentions")


@dataclass(frozen=True)
class CallPlan:
    """What one generate call runs, and why.

    kind: a `PlanKind`: the base model's own `generate`, its compiled static-cache decode
        (`decode.baseline.BaseSession`), exit mode or lossless mode.
    options: the call's resolved options (None with `tide_config=False`).
    compile: the run compiles (Tide's compiled spans, or the base model's compiled forward).
    cache_length: the positions of the static cache lent to the call (`decode.cachepool`); None: none is lent.
    reason: one sentence: why this kind.
    fused_chains: compiled lossless: greedy chains may run as one graph a cycle (`lossless/graph.py`), which outran
        the repo's tree drafted and verified (docs/benchmarks.md); a call that names `draft_topk` keeps its scheme
        (one graph a cycle too, `lossless/graphtree.py`).
    kv_cache: Tide asks generate for the KV cache where the call leaves `use_cache` unset (Tide's loops decode on
        it, also for models whose config turns it off, such as MPT).
    repo_scheme: lossless: the call drafts the repo's own scheme (it names no mode or draft option), which
        `decode.machinecheck.review` weighs against this machine's costs.
    tried_chain: an eager call drafts the repo's `compiled_chain` where its eager default drafts nothing: it runs
        the chain only where the check finds that it pays here, and the base model otherwise (a record with no
        figure to weigh included).
    checked_compiling: (seconds, graphs, recompiles) the machine check compiled for the call (a compiled call's
        check compiles the base model's compiled step, which the call then runs or not): the call's stats count it.
    """

    kind: PlanKind
    options: TideGenerationConfig | None
    compile: bool
    cache_length: int | None
    reason: str
    fused_chains: bool = False
    kv_cache: bool = False
    repo_scheme: bool = False
    tried_chain: bool = False
    checked_compiling: tuple = (0.0, 0, 0)


def plan_call(model, tide_config, args: tuple, kwargs: dict) -> CallPlan:
    """The plan of `model.generate(*args, tide_config=tide_config, **kwargs)`; raises where the call cannot run."""
    if tide_config is False:
        return CallPlan(PlanKind.BASE, None, False, None, "the call passed tide_config=False")
    call, options, given, chain = call_options(model, tide_config)
    options.validate(checkpoints=model.checkpoints)
    model.check_draft_vocab_size(options.draft_vocab_size)
    if options.mode == "auto" and _EXIT_OPTIONS & given:
        options.mode = "exit"  # the call set exit-mode options: it asks for exit mode
    length = _static_cache_length(model, args, kwargs) if options.compile else None
    if length is not None and options.mode != "exit":  # lossless can run: room for a whole draft after the last
        length += (options.max_draft or 0) + 1  # token (`lossless/graph.py`); a tree's siblings and n-gram branch
        if options.draft_topk > 1:  # (`lossless/graphtree.py`)
            length += options.draft_topk
    if options.mode == "exit" and not options.has_operating_point:  # (lossless drafts need no thresholds)
        if call is not None and not model.config.thresholds:
            warnings.warn(
                "tide_config was given, but these routers have no thresholds (not calibrated) and no exit_threshold "
                "was set, so the base model runs unchanged. Calibrate with tide.calibrate or pass exit_threshold.",
                stacklevel=3,
            )
        why = "calibration found that no checkpoint pays" if options.thresholds else "no thresholds"
        return _base(model, options, length, kwargs, f"{why} and no exit_threshold: exit mode has nothing to exit with")
    if options.compile and not options.compiled_modes and not _ASKS_A_MODE & given:
        return _base(model, options, length, kwargs, "calibration timed no mode faster than the compiled base")
    if chain:
        reason = (f"a{' compiled' if options.compile else 'n eager'} call that names no mode drafts the repo's "
                  "compiled_chain")
    elif "mode" in given:
        reason = f"the call asked for {options.mode}"
    elif options.mode == "exit":
        reason = "the call set exit options" if _EXIT_OPTIONS & given else "thresholds, and exit mode is the default"
    else:
        reason = f"the default mode is {options.mode}"
    plan = _mode_plan(model, options, given, length, reason, args, kwargs)
    if plan.kind is PlanKind.LOSSLESS and (chain or not (_ASKS_A_MODE | _DRAFT_OPTIONS) & given):
        plan = dataclasses.replace(plan, repo_scheme=True, tried_chain=chain and not options.compile)
    return plan


def _mode_plan(model, options, given: set, length, reason: str, args, kwargs) -> CallPlan:
    """The plan of a call that has a Tide mode to run (thresholds to exit with, or lossless drafts)."""
    compiled, lent = options.compile, length is not None
    static = {**kwargs, "cache_implementation": "static"}  # (a lent cache is a static one)
    if options.mode == "auto":  # lossless where it can run the call (compiled: on the static cache Tide asks for)
        problem = lossless_problem(model, args, static if compiled and (lent or "past_key_values" not in kwargs)
                                   else kwargs)
        options.mode = "exit" if problem else "lossless"
        if problem and (not options.has_operating_point or no_cache(kwargs) or per_layer_outputs(model, kwargs)):
            ends = ("exit mode has no thresholds" if not options.has_operating_point else "exit mode needs the KV "
                    "cache" if no_cache(kwargs) else "exit mode does not return them either")
            return _base(model, options, length, kwargs, f"lossless cannot run the call and {ends}: {problem}")
        reason += f", but lossless cannot run the call: {problem}" if problem else ", and lossless can run the call"
    if options.mode == "exit" and _batch_exits_off(model, options, given, args, kwargs):
        return _base(model, options, length, kwargs, "a batch, and batch exits are off")
    if options.mode == "lossless":
        problem = lossless_problem(model, args, static if lent else kwargs)
        if problem:
            raise LosslessUnavailable(problem)
        if options.max_draft == 0:
            return _base(model, options, length, kwargs, "calibration found that no drafting scheme pays "
                         "(max_draft=0)", kv_cache=True)
        return CallPlan(PlanKind.LOSSLESS, options, compiled, length, reason, kv_cache=True,
                        fused_chains=compiled and not _OWN_SCHEME & given)
    outputs = per_layer_outputs(model, kwargs)
    if outputs:
        raise ValueError(f"Tide's exit mode does not return {outputs} (exited tokens skip layers); drop them, or "
                         "pass tide_config=False for the base model's own generate, which returns them.")
    if no_cache(kwargs):
        raise ValueError("Tide's exit mode decodes on the KV cache (skipped layers still get their K/V); drop "
                         "use_cache=False, or pass tide_config=False to run the base model without exits.")
    return CallPlan(PlanKind.EXIT, options, compiled, length, reason, kv_cache=True)


def _base(model, options, length, kwargs, reason: str, kv_cache: bool = False) -> CallPlan:
    """The base model runs: compiled (`decode.baseline.BaseSession`, the baseline a compiled call is measured by)
    where the call compiles and runs no beams, else its own `generate` (beams: transformers' own beam search)."""
    if options.compile and (option(model, kwargs, "num_beams") or 1) <= 1 and not per_layer_outputs(model, kwargs):
        return CallPlan(PlanKind.BASE_COMPILED, options, True, length, reason, kv_cache=kv_cache)
    return CallPlan(PlanKind.BASE, options, False, length, reason, kv_cache=kv_cache)


def call_options(model, tide_config):
    """(the call's `tide_config`, its options resolved, the fields it sets, whether it drafts the repo's
    `compiled_chain`). A compiled call that names no mode, thresholds, exit or draft option drafts that chain
    (calibration timed it faster than the base model's compiled decode and the default mode compiled). So does such
    an eager call where the repo's eager default drafts nothing and exits nowhere (calibration timed no eager scheme
    faster than the base model on its machine): there the chain is only tried, and runs where this machine's check
    says it pays eagerly (`decode.machinecheck.review`; `CallPlan.tried_chain`)."""
    options = model.config.resolve_generation(tide_config)
    given = _given_fields(tide_config)
    eager_default = (not options.compile and options.max_draft == 0 and not options.has_operating_point
                     and options.machine_check)
    if isinstance(tide_config, TideConfig) or not (options.compiled_chain and (options.compile or eager_default)) \
            or (_ASKS_A_MODE | _EXIT_OPTIONS | _DRAFT_OPTIONS) & given:
        return tide_config, options, given, False
    chain = {**_CHAIN_CALL, **options.compiled_chain}
    call = tide_config if isinstance(tide_config, dict) else {k: getattr(tide_config, k) for k in given}
    call = {**call, **chain}
    return call, TideGenerationConfig.from_value(chain, options), set(call), True


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


def _static_cache_length(model, args, kwargs) -> int | None:
    """The length of the static cache Tide lends a compiled call (`decode.cachepool`): what `generate` would make
    (its `max_length` - 1 positions). A call on token ids that passes no cache, keeps the cache on, does not return
    its cache, and runs no beams; None elsewhere (generate makes it, or there is none). The pool rounds it up to its
    bucket (`cachepool`), which the one-graph cycles read as a dynamic dimension."""
    inputs = call_inputs(args, kwargs)
    if (kwargs.get("past_key_values") is not None or no_cache(kwargs) or not isinstance(inputs, torch.Tensor)
            or inputs.dim() != 2 or kwargs.get("inputs_embeds") is not None
            or option(model, kwargs, "cache_implementation") not in (None, "static")
            or option(model, kwargs, "return_dict_in_generate") or (option(model, kwargs, "num_beams") or 1) > 1):
        return None
    new_tokens = option(model, kwargs, "max_new_tokens")
    max_length = inputs.shape[1] + new_tokens if new_tokens is not None else option(model, kwargs, "max_length")
    if max_length is None:
        return None
    return max(int(max_length) - 1, int(option(model, kwargs, "max_cache_len") or 0), 1)


def _batch_exits_off(model, options, given: set, args, kwargs) -> bool:
    """True for a call on several sequences whose calibrated exits calibration timed no faster than the base
    model on a batch (`batch_exits=False`), unless the call gives its own thresholds."""
    if options.batch_exits or _OWN_THRESHOLDS & given:
        return False
    inputs = call_inputs(args, kwargs)
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    rows = 1 if inputs is None else inputs.shape[0]
    return rows * (option(model, kwargs, "num_return_sequences") or 1) * (option(model, kwargs, "num_beams") or 1) > 1


def lossless_problem(model, args, kwargs) -> str | None:
    """Why lossless mode cannot run this call (a message saying what to do), or None."""
    inputs = call_inputs(args, kwargs)
    if inputs is not None and inputs.shape[0] != 1:
        return (f"mode='lossless' decodes one sequence at a time (batch size 1), got a batch of {inputs.shape[0]}; "
                "loop over the rows or use mode='exit' for batches.")
    if (option(model, kwargs, "num_return_sequences") not in (None, 1)
            or option(model, kwargs, "num_beams") not in (None, 1)):
        return "mode='lossless' supports greedy and sampling with one sequence (no beams, num_return_sequences=1)."
    if kwargs.get("inputs_embeds") is not None:
        return "mode='lossless' drafts from token ids; pass input_ids instead of inputs_embeds."
    given = [name for name in _NOT_WITH_LOSSLESS if option(model, kwargs, name)] + per_layer_outputs(model, kwargs)
    if given:
        return f"mode='lossless' is Tide's own speculative decoding and does not combine with {given}; drop them."
    if no_cache(kwargs):
        return "mode='lossless' verifies drafts against the KV cache; drop use_cache=False."
    layers = _layers_without_rollback(model, kwargs)
    if layers:
        asked = kwargs.get("past_key_values") is None  # the static cache the call asks for (compile=True does)
        where = ("the static cache this call runs on (compile=True or cache_implementation='static' asks for one)"
                 if asked else "this call's cache (a static one)")
        fix = ("Drop compile=True and cache_implementation (eager lossless runs on a DynamicCache, which keeps them)"
               if asked else "Pass a DynamicCache (or none) and let generate create it")
        return (f"mode='lossless' needs sliding-window cache layers that can roll back rejected drafts, and layers "
                f"{layers} of {where} drop evicted positions at once. {fix}, or use mode='exit'.")
    return ((model.config.calibration or {}).get("draft_selection") or {}).get("unavailable")


def per_layer_outputs(model, kwargs) -> list[str]:
    """The per-layer outputs (hidden states, attentions) the call asks generate to return, as keywords or in its
    generation config (the call's or the model's); none where it returns no dict, which would not hold them."""
    if not option(model, kwargs, "return_dict_in_generate"):
        return []
    return [name for name in _PER_LAYER_OUTPUTS if option(model, kwargs, name)]


def _layers_without_rollback(model, kwargs) -> list[int]:
    """Sliding-window layers of the call's cache (passed, or the static one it asks generate for) that cannot keep
    evicted positions until a draft is accepted or cropped."""
    cache = kwargs.get("past_key_values")
    if cache is not None:
        return [i for i, layer in enumerate(getattr(cache, "layers", None) or []) if getattr(layer, "is_sliding", False)
                and not getattr(layer, "record_past", False) and not hasattr(layer, "activate_past_recording")]
    if option(model, kwargs, "cache_implementation") not in ALL_STATIC_CACHE_IMPLEMENTATIONS:
        return []
    return [i for i, kind in enumerate(cache_layer_kinds(model.base.config) or []) if kind == "sliding"]


def no_cache(kwargs) -> bool:
    """The call turns the KV cache off (use_cache=False, as a keyword or in its generation_config)."""
    if "use_cache" in kwargs:
        return kwargs["use_cache"] is False
    return getattr(kwargs.get("generation_config"), "use_cache", None) is False


def call_inputs(args, kwargs):
    """The call's prompt ids, however generate was given them (None: none)."""
    return args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))


def option(model, kwargs, name):
    """A generation option as generate will see it: the call's keyword, its generation_config, the model's."""
    if name in kwargs:
        return kwargs[name]
    return getattr(kwargs.get("generation_config") or model.base.generation_config, name, None)
