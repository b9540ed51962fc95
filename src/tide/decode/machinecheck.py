"""Whether a router repo's drafting scheme pays on the machine a call runs on, measured once and cached.

Calibration chose the repo's scheme by timing it on the machine that calibrated. What a cycle costs against a base
step depends on the CPU: a verification pass over a few positions streams the same weights as a step over one, but
the matrix kernels for a few rows can cost several single rows on one CPU and about one on another. So, before a
lossless call at the repo's defaults runs, `review` weighs the tokens a cycle is expected to emit (from the repo's
calibration record: `accepted_per_cycle`, the drafts its timings accepted a cycle) against what a cycle costs here
in base steps (`measure_cycle`); where the scheme does not pay by `MARGIN`, the call runs the base model instead (as
`max_draft=0` or `compiled_modes=False` do), and its plan's reason says why.

The measurement times the model's own linear layers in order (each decoder layer's, then the head), over one row and
over a cycle's verification width: the weights a pass streams, which is where a few positions cost more than one on
a CPU. A pass's other work (attention over the cache, norms, the framework's time per op) is about the same for one
position or a few: it is what a decode step of the base model takes beyond its linears (an eager step; for a
compiled call, Tide's compiled base step, compiled as the call compiles), added to both sides (and to each draft,
for its share of the layers). Eager calls compute the rows in the layout the call uses (`layers/fewrows.py`);
compiled calls as the call's compiled graphs do (its `CompileConfig`): `F.linear`, and with inductor on a CPU one
small compiled graph of a layer's linears with the call's options (by default Tide's `layers/rowproducts.py` pass:
products of a few rows lowered to inductor's reductions, which makes a lowered step's products about twice as fast
as the library's on SmolLM2), compiled once a process per row count. That is a proxy of the compiled graphs still:
timing those would compile both the cycle and the base decode. A cycle is one verification over its width plus its
drafts (each `draft_layer + 1` layers' linears and the head's share over `draft_vocab_size` rows).

The measurement is a proxy: it leaves out what the loops do around the passes, and on SmolLM2 it priced a tree's
cycle dearer than the trials' timing implied (docs/benchmarks.md). So calibration also measures it on the machine
that timed the scheme and records it beside the timing (`record_cycle_steps`: "cycle_steps"); elsewhere the check
scales that timing by the two measurements (the speedup timed there, times a cycle's steps there over its steps
here), and the proxy's bias falls out where it is the same on both machines. On the machine that timed it, the
timing decides alone (`timed_here`); a record without "cycle_steps" is weighed by the tokens a cycle emits, as
above.

A measurement is kept in Tide's cache folder (`machine/` beside `decode/compilecache.py`'s `compiled/`), one file
per key: the machine (CPU model or GPU name, threads), torch version, base and router configs, scheme, dtype,
device, eager or compiled (and the compile options), layout. A file that cannot be read or was made for another key
is ignored with a log line. This module does not change the scheme, time `generate` or write the router repo."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.fewrows import few_row_linears
from ..models.compat import CompileWatch
from . import compilecache
from .plan import PlanKind

__all__ = ["MARGIN", "Scheme", "review", "check", "check_defaults", "measure_cycle", "expected_tokens", "as_verified",
           "timed_here", "scheme_of", "cache_path", "decision_text", "machine_name", "record_cycle_steps"]

logger = logging.getLogger(__name__)
_FORMAT = "tide-machine-2"  # 2: compiled CPU calls priced with lowered products
# A scheme pays where the tokens a cycle emits over its cost in base steps reach this (the timings' own 2%).
MARGIN = 1.02
REPEATS = 5


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A drafting scheme as the check weighs it: `drafts` head drafts a cycle, verified over `width` positions."""

    draft_layer: int
    max_draft: int
    draft_topk: int = 1
    draft_vocab_size: int = 0
    draft_ngram: int = 0
    tree: bool = False  # one verification tree of `draft_topk` candidates (else a chain)
    verified: float | None = None  # the positions a cycle verified on average in calibration's timings, where recorded

    @property
    def width(self) -> float:
        """Positions a cycle verifies: as calibration's timings verified on average, else the widest."""
        if self.verified:
            return self.verified
        if self.tree:
            return 1 + self.draft_topk + (self.max_draft if self.draft_ngram else 0)
        return 1 + self.max_draft

    @property
    def drafts(self) -> float:
        """Head drafts a cycle: a tree's one step; a chain's cap, or fewer where its cycles verified fewer."""
        if self.tree:
            return 1
        return max(1, min(self.max_draft, self.verified - 1)) if self.verified else self.max_draft

    def record_key(self) -> tuple:
        return self.draft_layer, self.max_draft, self.draft_topk, self.draft_vocab_size or 0, self.draft_ngram or 0


def scheme_of(model, plan) -> Scheme:
    """The drafting scheme a lossless `plan` runs."""
    options = plan.options
    layer = options.resolve_draft_layer(model.checkpoints, model.parts.num_layers)
    return Scheme(layer, options.max_draft, options.draft_topk, options.draft_vocab_size or 0,
                  options.draft_ngram or 0, tree=options.draft_topk > 1 and not plan.fused_chains)


def expected_tokens(record: dict, scheme: Scheme) -> float | None:
    """Tokens a cycle of `scheme` emits, from the repo's calibration record (as the config holds it, like every
    `record` here): 1 + the drafts its timing of that scheme
    accepted a cycle (`accepted_per_cycle`, compiled chains first); None where the record holds no such figure."""
    accepted = _from_timings(record, scheme, "accepted_per_cycle")
    return None if accepted is None else 1.0 + accepted


def as_verified(record: dict, scheme: Scheme) -> Scheme:
    """`scheme` verifying as many positions a cycle as its timings did on average (`verified_per_cycle`): a tree's
    n-gram branch, or a chain's full cap, comes only in some cycles. Where the record holds no such figure, a chain
    verifies what its cap gives at the drafts its timings accepted a cycle (`accepted_per_cycle`): the cap follows
    acceptance (`lossless.chain.next_cap`: the accepted count + 1 after a rejection), so a cycle drafts about the
    accepted count + 1, up to `max_draft`; a tree, or a record with neither figure, is priced at its widest. An
    average between two widths is priced between them (`measure_cycle`), its drafts likewise."""
    verified = _from_timings(record, scheme, "verified_per_cycle")
    if verified is None and not scheme.tree:
        accepted = _from_timings(record, scheme, "accepted_per_cycle")
        verified = None if accepted is None else 1 + min(scheme.max_draft, accepted + 1)
    return scheme if verified is None else dataclasses.replace(scheme, verified=max(1.0, round(verified, 2)))


def _from_timings(record: dict, scheme: Scheme, name: str) -> float | None:
    value = _recorded(record, scheme, name, compiled=True)
    return _recorded(record, scheme, name, compiled=False) if value is None else value


def timed_here(model, record: dict, scheme: Scheme, compiled: bool) -> float | None:
    """The speedup calibration measured for `scheme` (eager: over `generate`; compiled: over the compiled base), where
    it timed it on this machine (the same processor and threads: the record's `timing_machine`); None elsewhere."""
    if record.get("timing_machine") is None or record["timing_machine"] != machine_name(model):
        return None
    return _recorded(record, scheme, "measured", compiled)


def _recorded(record: dict, scheme: Scheme, name: str, compiled: bool) -> float | None:
    """`name` of the record's timing of `scheme`: among its compiled chains, or its eager drafting trials."""
    for fields, timing in _timings(record, compiled):
        if _key_of(fields) == scheme.record_key() and timing.get(name) is not None:
            return float(timing[name])
    return None


def _timings(record: dict, compiled: bool, trials: bool = True) -> list[tuple[dict, dict]]:
    """(a scheme's fields, its timing) in `record`: its compiled chains; or its chosen eager scheme, then (`trials`)
    the other drafting trials."""
    if compiled:
        return [(chain.get("chain") or {}, chain) for chain in record.get("compiled_chains") or []]
    selection = record.get("draft_selection") or {}
    drafts = [selection["chosen"]] if selection.get("chosen") else []
    if trials:
        drafts += selection.get("trials") or []
    return [(draft, draft) for draft in drafts]


def review(model, plan, compile_config=None):
    """`plan` (a `CallPlan`) as it runs on this machine: a lossless plan of the repo's own scheme becomes the base
    model's run where the scheme does not pay here (`check`), and so does an eager call's tried chain
    (`CallPlan.tried_chain`) where nothing can be weighed; its reason says what was weighed. A compiled call's costs
    are measured compiled as the call compiles (`compile_config`: the call's `CompileConfig`, None for its
    defaults)."""
    if plan.kind is not PlanKind.LOSSLESS or not plan.repo_scheme or not plan.options.machine_check:
        return plan
    with CompileWatch() as watch:  # (a compiled call's check compiles the base step: the call's stats count it)
        verdict = check(model, scheme_of(model, plan), plan.compile, plan.options.few_row_layout,
                        compile_config=compile_config)
    plan = dataclasses.replace(plan, checked_compiling=(watch.seconds, watch.graphs, watch.recompiles))
    if verdict is None and not plan.tried_chain:
        return plan
    if verdict is not None and verdict["pays"]:
        return dataclasses.replace(plan, reason=f"{plan.reason}; {decision_text(verdict)}")
    kind = PlanKind.BASE_COMPILED if plan.compile else PlanKind.BASE
    why = decision_text(verdict) if verdict is not None else ("the repo's calibration record holds no drafts "
                                                              "accepted a cycle for its compiled_chain")
    return dataclasses.replace(plan, kind=kind, reason=why, fused_chains=False)


def check_defaults(model, compiled: bool, remeasure: bool = False) -> tuple[str, dict | None]:
    """(why, the verdict) for a greedy call of one sequence at the repo's defaults, eager or compiled; the verdict
    is None where nothing is weighed (the call runs no drafting scheme of the repo's, or the record has no
    figure), and `why` says so."""
    plan = _default_plan(model, compiled)
    if plan.kind is not PlanKind.LOSSLESS or not plan.repo_scheme:
        return f"it runs {plan.kind}: {plan.reason}", None
    verdict = check(model, scheme_of(model, plan), compiled, plan.options.few_row_layout, remeasure)
    if verdict is None:
        return "the repo's calibration record holds no drafts accepted a cycle for its scheme", None
    return plan.reason, verdict


def _default_plan(model, compiled: bool):
    """The plan of a greedy call of one sequence at the repo's defaults, eager or compiled."""
    from .plan import plan_call

    ids = torch.zeros(1, 4, dtype=torch.long, device=model.base.device)
    return plan_call(model, {"compile": True} if compiled else None, (ids,), {"max_new_tokens": 8, "do_sample": False})


def record_cycle_steps(model) -> dict | None:
    """Write into the model's calibration record what a cycle of each default call's scheme (eager, compiled) costs
    here in base steps, by `measure_cycle`: "cycle_steps" beside the scheme's timing, which another machine's check
    scales by its own measurement (`check`). Run where the trials ran, on the threads they ran on. -> the record."""
    record = model.config.calibration
    if not record:
        return record
    for compiled in (False, True):
        plan = _default_plan(model, compiled)
        if plan.kind is not PlanKind.LOSSLESS or not plan.repo_scheme:
            continue
        scheme = as_verified(record, scheme_of(model, plan))
        timing = next((timing for fields, timing in _timings(record, compiled, trials=False)
                       if _key_of(fields) == scheme.record_key()), None)  # (eager: the chosen scheme's alone)
        if timing is not None and timing.get("measured") is not None:
            timing["cycle_steps"] = round(measure_cycle(model, scheme, compiled, plan.options.few_row_layout), 4)
    return record


def _key_of(fields: dict) -> tuple:
    return (fields.get("draft_layer"), fields.get("max_draft"), fields.get("draft_topk") or 1,
            fields.get("draft_vocab_size") or 0, fields.get("draft_ngram") or 0)


def machine_name(model) -> str:
    """The processor the measurements of `model` hold for, in words."""
    return _machine(next(model.base.parameters()).device)


def decision_text(verdict: dict) -> str:
    """The check's verdict in words."""
    what = "the chain" if verdict["scheme"].get("tree") is False else "the tree"
    if verdict.get("timed") is not None and "cycle_steps" not in verdict:
        return (f"{what} {'pays' if verdict['pays'] else 'does not pay'} on this machine: calibration timed it "
                f"here at x{verdict['timed']:.2f}")
    if verdict.get("timed") is not None:
        weighed = (f"calibration timed it at x{verdict['timed']:.2f} where a cycle cost {verdict['timed_steps']:.2f} "
                   f"base steps; it costs {verdict['cycle_steps']:.2f} here: x{verdict['expected']:.2f} expected")
    else:
        weighed = (f"a cycle costs {verdict['cycle_steps']:.2f} base steps, {verdict['tokens_expected']:.2f} tokens "
                   "expected")
    return f"{what} {'pays' if verdict['pays'] else 'does not pay'} on this machine: {weighed}"


def check(model, scheme: Scheme, compiled: bool, layout: str = "auto", remeasure: bool = False,
          compile_config=None) -> dict | None:
    """The verdict on `scheme` here: {"pays", "cycle_steps", "tokens_expected", "scheme", "key", "measured_s"};
    None where the record holds no figure to weigh. Measured once per key (kept on the model and in the cache
    folder), unless `remeasure`. Where calibration timed the scheme on this machine, its timing decides instead
    ({"pays", "timed", "scheme"}): a measurement of the scheme itself rather than of the linears it runs. Where it
    timed it elsewhere and recorded a cycle's steps there, that timing scaled by the steps there over the steps here
    decides (also {"timed", "timed_steps", "expected"})."""
    record = model.config.calibration or {}
    timed = timed_here(model, record, scheme, compiled)
    if timed is not None:
        return {"pays": timed >= MARGIN, "timed": timed, "scheme": dataclasses.asdict(scheme)}
    tokens = expected_tokens(record, scheme)
    if tokens is None:
        return None
    scheme = as_verified(record, scheme)
    key = _key(model, scheme, compiled, layout, compile_config)
    name = compilecache.digest(key)
    memo = model.__dict__.setdefault("_tide_machine_checks", {})
    cost = None if remeasure else memo.get(name) or _read(key)
    cached = cost is not None
    if cost is None:
        start = time.perf_counter()
        cost = {"cycle_steps": measure_cycle(model, scheme, compiled, layout, compile_config=compile_config),
                "measured_s": round(time.perf_counter() - start, 3)}
        _write(key, cost)
    memo[name] = cost
    verdict = {"pays": tokens / cost["cycle_steps"] >= MARGIN, "cycle_steps": cost["cycle_steps"],
               "tokens_expected": tokens, "scheme": dataclasses.asdict(scheme), "key": key,
               "measured_s": cost.get("measured_s"), "cached": cached}
    timed, there = (_recorded(record, scheme, field, compiled) for field in ("measured", "cycle_steps"))
    if timed is not None and there is not None:
        expected = timed * there / cost["cycle_steps"]
        verdict.update(pays=expected >= MARGIN, timed=timed, timed_steps=there, expected=expected)
    return verdict


@torch.no_grad()
def measure_cycle(model, scheme: Scheme, compiled: bool, layout: str = "auto", repeats: int = REPEATS,
                  compile_config=None) -> float:
    """What a cycle of `scheme` costs here in base steps, from the model's linears timed over one row and over the
    cycle's width (interleaved, medians of `repeats` after two warm-ups); compiled: as `compile_config` (a
    `CompileConfig`, None for the defaults) compiles them."""
    parts = model.parts
    layers = [[m for m in layer.modules() if isinstance(m, nn.Linear)] for layer in parts.layers]
    head = [m for m in parts.lm_head.modules() if isinstance(m, nn.Linear)]
    low, high = math.floor(scheme.width), math.ceil(scheme.width)  # (a width between two: priced between them)
    counts = sorted({1, low, high})
    times = {(rows, part): [] for rows in counts for part in ("layers", "head")}
    options = _graph_options(model, compile_config) if compiled else None
    if options is None:  # (one timed pass over every layer's linears; else one compiled graph's call a layer)
        layers = [[m for layer in layers for m in layer]]
    with few_row_linears(parts, "plain" if compiled else layout):
        for i in range(repeats + 2):
            for rows in counts:
                for part, groups in (("layers", layers), ("head", [head])):
                    seconds = sum(_pass_seconds(linears, rows, compiled, options) for linears in groups)
                    if i >= 2:
                        times[rows, part].append(seconds)
    med = {k: statistics.median(v) for k, v in times.items()}
    linears = med[1, "layers"] + med[1, "head"]
    # the step's other work (attention, norms, the framework's time per op), about the same for a few positions:
    # an eager step's, or a compiled one's (Tide's compiled base step, which a call that does not pay runs)
    step = _compiled_step_seconds(model, repeats, compile_config) if compiled else _step_seconds(model, repeats)
    rest = max(step - linears, 0.0)
    share = (scheme.draft_layer + 1) / parts.num_layers
    vocab = scheme.draft_vocab_size / _head_rows(head) if scheme.draft_vocab_size else 1.0
    draft = share * (med[1, "layers"] + rest) + vocab * med[1, "head"]
    verify = sum(med[low, part] + (scheme.width - low) * (med[high, part] - med[low, part])
                 for part in ("layers", "head")) + rest
    return (verify + scheme.drafts * draft) / (linears + rest)


def _step_seconds(model, repeats: int) -> float:
    """The median seconds of one eager decode step of the base model (one position after 32 on a dynamic cache)."""
    from transformers import DynamicCache

    device = next(model.base.parameters()).device
    ids = torch.zeros(1, 33, dtype=torch.long, device=device)
    times = []
    for i in range(repeats + 2):
        cache = DynamicCache(config=model.base.config)
        model.base(ids[:, :32], past_key_values=cache, use_cache=True)
        _sync(device)
        start = time.perf_counter()
        model.base(ids[:, 32:], past_key_values=cache, use_cache=True)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _compiled_step_seconds(model, repeats: int, compile_config=None, new_tokens: int = 16) -> float:
    """The median seconds of a decode step of Tide's compiled base model (`compile=True, compiled_modes=False`, with
    `compile_config`): a call of 1 + `new_tokens` tokens less a call of 1. Its first call compiles the step, which
    a later call that runs the base model compiled reuses."""
    device = next(model.base.parameters()).device
    config = model.base.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    special = {pad, *(config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id])}
    # (a prompt of tokens that are neither padding nor the end: generate masks padding, and a masked step runs eagerly)
    token = next(t for t in range(1, model.base.config.vocab_size) if t not in special)
    ids = torch.full((1, 8), token, dtype=torch.long, device=device)
    kwargs = dict(do_sample=False, pad_token_id=pad,
                  tide_config={"compile": True, "compiled_modes": False, "compiled_chain": None})
    if compile_config is not None:
        kwargs["compile_config"] = compile_config
    last = model.last_stats

    def call(tokens: int) -> float:
        _sync(device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        _sync(device)
        return time.perf_counter() - start

    call(2)
    times = [(call(1 + new_tokens) - call(1)) / new_tokens for _ in range(repeats)]
    model.last_stats = last  # (the check's calls are not the user's)
    return max(statistics.median(times), 1e-9)


def _graph_options(model, compile_config) -> dict | None:
    """The torch.compile options a compiled call's graphs take on this model (`spans.compile_options`) where the
    check times its linears in a compiled graph of their own (inductor on a CPU, which may write few-row products
    itself: `layers/rowproducts.py`); None where they are timed as `F.linear` (another backend, or a GPU)."""
    from ..layers.spans import compile_options

    options = compile_options(compile_config, model.base.device.type)
    return options if options["backend"] == "inductor" and model.base.device.type == "cpu" else None


def _pass_seconds(linears: list, rows: int, plain: bool, options: dict | None = None) -> float:
    """One pass of `rows` rows through `linears` in order: the modules' own forward (eager, the few-row layout in
    force), or `F.linear` (as compiled graphs compute them), or (`options`) one graph of them compiled with those
    options, where inductor may write one of the products itself (`rowproducts.lowers`)."""
    if not linears:
        return 0.0
    weight = linears[0].weight
    inputs = [torch.randn(1, rows, m.in_features, dtype=weight.dtype, device=m.weight.device) for m in linears]
    if options is not None and _any_lowered(linears, rows):  # (compiled once a process for these shapes and
        # options: the check's warm-up passes compile it. Where none is, as a big vocabulary's head: the library's)
        run = _compiled_linears(tuple((m.in_features, m.out_features, m.bias is not None) for m in linears), rows,
                                weight.dtype, options)
        weights, biases = [m.weight for m in linears], [m.bias for m in linears]
        start = time.perf_counter()
        run(inputs, weights, biases)
        return time.perf_counter() - start
    _sync(weight.device)
    start = time.perf_counter()
    for module, x in zip(linears, inputs):
        F.linear(x, module.weight, module.bias) if plain else module(x)
    _sync(weight.device)
    return time.perf_counter() - start


def _any_lowered(linears: list, rows: int) -> bool:
    from ..layers.rowproducts import lowers

    return any(lowers(rows, m.in_features, m.out_features, m.weight.dtype, m.weight.device) for m in linears)


def _linear_pass(inputs, weights, biases):
    return [F.linear(x, w, b) for x, w, b in zip(inputs, weights, biases)]


_LINEAR_GRAPHS: dict = {}


def _compiled_linears(shapes: tuple, rows: int, dtype, options: dict):
    """A compiled `_linear_pass` for linears of `shapes` ((in, out, bias?) each) over `rows` rows, with `options`:
    a decoder layer's products as its compiled step computes them. The weights are arguments, so one graph serves
    every layer of the model; each key gets a code object of its own, so that no key's graph counts against
    another's recompile limit."""
    from ..layers.spans import options_key, own_code

    key = (shapes, rows, str(dtype), options_key(options))
    if key not in _LINEAR_GRAPHS:
        name = f"tide_check_linears_{abs(hash(key)):x}"
        _LINEAR_GRAPHS[key] = torch.compile(own_code(_linear_pass, name), **{**options, "fullgraph": True,
                                                                               "dynamic": False})
    return _LINEAR_GRAPHS[key]


def _head_rows(head: list) -> int:
    return max((m.out_features for m in head), default=1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _machine(device: torch.device) -> str:
    """The processor a measurement holds for: a GPU's name, else the CPU's model and the threads torch uses."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{_cpu_name()}:{torch.get_num_threads()} threads"


@functools.cache
def _cpu_name() -> str:
    """The CPU's model name (read once a process: every lossless call at a repo's scheme asks for it)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), name)
    except OSError:
        pass
    return name


def _key(model, scheme: Scheme, compiled: bool, layout: str, compile_config=None) -> dict:
    """What a measurement depends on, as a dict (hashed into the file name)."""
    weight = next(model.base.parameters())
    base, routers = model.base.config.to_dict(), model.config.to_dict()
    for config in (base, routers):
        for volatile in ("_name_or_path", "transformers_version", "calibration", "generation"):
            config.pop(volatile, None)
    return {"format": _FORMAT, "torch": torch.__version__, "machine": _machine(weight.device),
            "base": compilecache.digest(base), "routers": compilecache.digest(routers),
            "scheme": dataclasses.asdict(scheme), "dtype": str(weight.dtype), "compiled": compiled,
            "layout": "plain" if compiled else layout,
            "compile": _compile_key(model, compile_config) if compiled else None}


def _compile_key(model, compile_config) -> list:
    from ..layers.spans import compile_options, options_key

    return [list(item) for item in options_key(compile_options(compile_config, model.base.device.type))]


def cache_path(key: dict) -> Path:
    """The file of a measurement: `machine/` in Tide's cache folder (`$TIDE_CACHE`, else `~/.cache/tide`)."""
    return compilecache.cache_folder().parent / "machine" / f"{compilecache.digest(key)[:24]}.json"


def _read(key: dict) -> dict | None:
    path = cache_path(key)
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        cost = saved["cost"]
        if saved["key"] != json.loads(json.dumps(key)):
            logger.warning("Tide: ignoring the machine check %s made for another key", path)
            return None
        if not float(cost["cycle_steps"]) > 0:
            raise ValueError(f"cycle_steps {cost['cycle_steps']!r}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.warning("Tide: ignoring an unreadable machine check %s (%s)", path, err)
        return None
    return cost


def _write(key: dict, cost: dict) -> None:
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_text(json.dumps({"key": key, "cost": cost}, sort_keys=True))
        partial.replace(path)  # (atomic: a reader never sees half a file)
    except OSError as err:  # a read-only cache folder: the check holds for this process only
        logger.warning("Tide: could not keep the machine check in %s (%s)", path, err)

