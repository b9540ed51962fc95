"""The graphs of `compile=True` calls (`layers/spans.SpanRunner.graph`: the cycles and steps), compiled ahead with
torch's AOT precompile (`torch.compile(...).aot_compile`, `torch.compiler.load_compiled_function`): their guards
run once per argument signature in a call, and `tide warmup` keeps them in Tide's cache folder, beside the cache
artifacts of `compilecache.py`, for a later process to load without tracing.

- **Guards once.** Dynamo checks a compiled function's guards at every call: about a millisecond on SmolLM2, which
  a compiled cycle paid every time (8.9% a token in bfloat16, docs/benchmarks.md). An AOT-compiled graph's guards
  run at its first call and again wherever the arguments' signature is new in the call (`_signature`: another
  cache or module object, a tensor of another shape or dtype, parameters moved to another dtype); each generate
  call starts afresh (`Precompiled.new_call`), so a module swapped between calls for one of another class or shape
  is seen.
- **Variants.** Arguments that no variant's guards pass compile another (a recompile, counted by `CompileWatch`),
  up to `MAX_VARIANTS`; past that, and for a graph `aot_compile` cannot capture whole, torch.compile runs the graph,
  with a log line.
- **Writing.** Inside `precompiling()` (`tide warmup` runs its calls there), each graph's first variant is saved
  (`<digest>.aot`, one file a graph). **Reading.** Any later call whose graph has a file loads it at its first call
  instead of compiling it. Artifacts made by a plain compile do not serve `aot_compile`, nor the other way round:
  inductor keys its caches otherwise.
- **The key** is everything the graph depends on that its guards cannot check: `compilecache.artifact_key` (the
  base and router configs, torch, the device, the compile options), the graph's own key and name, the transformers
  version and a digest of Tide's source (the Python the graph was traced from). A file made under another key is
  ignored with a log line.
- **What the guards check:** the arguments: every parameter's and input's shape and dtype, the cache's type and
  layers, the dynamic cache length's bounds. Guards that name objects of one process (functions, modules, globals)
  cannot be kept by an AOT-compiled function and are left out (`_serialisable`); the key stands for them in a file.
  Dynamo's marks of dynamic dimensions (`torch._dynamo.maybe_mark_dynamic`'s tensor attributes) are not kept, and
  the guards refuse a tensor that carries them, so they are taken off the arguments around each check and put back.
- **Whatever fails** (a file torch cannot load or save, arguments a loaded graph's guards refuse) compiles the graph
  as above, with a log line: never an error, never another graph's output.

This module decides nothing about what is compiled; `SpanRunner` asks it for a graph's function (`Precompiled.wrap`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import time
import types
from contextvars import ContextVar
from pathlib import Path

import torch

from . import compilecache

__all__ = ["Precompiled", "precompiling"]

logger = logging.getLogger(__name__)
_FORMAT = "tide-precompiled-1"
MAX_VARIANTS = 8  # variants of a graph (as torch.compile's recompile limit) before torch.compile takes it over
CHECKED_KEPT = 64  # argument signatures a graph remembers as passing its guards within a call
_PRECOMPILING: ContextVar[bool] = ContextVar("tide_precompiling", default=False)
# guard kinds that name an object of this process, which a saved function cannot check
_UNSAVED = ("DICT_VERSION", "NN_MODULE", "ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH", "CLOSURE_MATCH",
            "WEAKREF_ALIVE")
# dynamo's marks of dynamic dimensions on a tensor (`maybe_mark_dynamic` and its kin)
_MARKS = ("_has_dynamo_dim_marking", "_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices",
          "_dynamo_unbacked_indices", "_dynamo_strict_unbacked_indices", "_dynamo_static_indices")


@contextlib.contextmanager
def precompiling():
    """Inside the block, the graphs `compile=True` calls make are precompiled and saved (`tide warmup`)."""
    token = _PRECOMPILING.set(True)
    try:
        yield
    finally:
        _PRECOMPILING.reset(token)


class Precompiled:
    """The graphs of one model under one set of compile options on one device: AOT-compiled, their guards run once
    per argument signature in a call; loaded from and saved to Tide's cache folder (`tide warmup`)."""

    def __init__(self, model, options: dict, device):
        self.key = {**compilecache.artifact_key(model, options, device), "format": _FORMAT,
                    "transformers": _transformers_version(), "tide_source": _source_digest()}
        self.events: list[dict] = []  # what each graph did with its file: {"graph", "loaded"/"saved", "seconds"}
        self.graphs: list[_Graph] = []

    def wrap(self, function, key, name: str, options: dict, compiled):
        """The function to call for graph `key` (`function` under the code name `name`, compiled with `options`):
        loaded from its file where one holds it, else AOT-compiled at its first call (and saved inside
        `precompiling()`). `compiled()` gives the usual `torch.compile` function, the fallback."""
        file_key = {**self.key, "graph": repr(key), "name": name}
        if options.get("mode") == "reduce-overhead" and not _PRECOMPILING.get():
            return None  # (CUDA graphs: torch.compile's own)
        path = compilecache.cache_folder() / f"{name}-{compilecache.digest(file_key)[:24]}.aot"
        graph = _Graph(self, function, name, options, compiled, path, file_key)
        self.graphs.append(graph)
        return graph

    def new_call(self) -> None:
        """A generate call starts: every graph checks its guards again (once per argument signature), so a module
        swapped between calls for one of another class or shape is seen."""
        for graph in self.graphs:
            graph.checked.clear()


class _Graph:
    """A graph's function: AOT-compiled (or loaded from its file) at its first call, another variant compiled where
    the arguments pass no variant's guards (a recompile); `torch.compile`'s where AOT compiling fails."""

    def __init__(self, store: Precompiled, function, name: str, options: dict, compiled, path: Path, key: dict):
        self.store, self.function, self.name = store, function, name
        self.options, self.compiled, self.path, self.key = options, compiled, path, key  # (key: the file's)
        self.variants: list = []  # the AOT-compiled or loaded functions, the first loaded or saved
        self.fallback = None  # torch.compile's, where AOT compiling failed
        # argument signature (`_signature`) -> the variant whose guards it passed in this call (cleared past
        # CHECKED_KEPT, and by `Precompiled.new_call`)
        self.checked: dict[tuple, object] = {}
        self._loaded = False

    def __call__(self, *args):
        if self.fallback is not None:
            return self.fallback(*args)
        signature = _signature(args)
        fn = self.checked.get(signature)
        if fn is None:  # (the guards cost about a millisecond on SmolLM2: once per signature a call)
            fn = self._variant(args)
            if fn is None:
                return self.fallback(*args)
            if len(self.checked) >= CHECKED_KEPT:
                self.checked.clear()
            self.checked[signature] = fn
        return fn.fn(*args)

    def _variant(self, args):
        """The variant whose guards pass `args`: loaded from the file at the first call, else one that passed, else
        one compiled now; None where compiling failed (`self.fallback` then runs the graph)."""
        if not self._loaded:
            self._loaded = True
            loaded = self.path.is_file() and self._load()
            if loaded:
                self.variants.append(loaded)
        taken = _take_marks(args)
        try:
            fn = next((f for f in self.variants if f.guard_check(*args)), None)
        finally:
            _put_back(taken)
        if fn is None and len(self.variants) >= MAX_VARIANTS:
            logger.warning("Tide: the graph %s was compiled %d times; torch.compile runs it from now on", self.name,
                           len(self.variants))
            self.fallback = self.compiled()
            return None
        if fn is None:
            if self.variants and self.path.is_file():
                logger.warning("Tide: the precompiled graph %s does not take these arguments; compiling it", self.name)
            fn = self._compile(args, save=not self.variants and _PRECOMPILING.get())
            if fn is None:
                self.fallback = self.compiled()
                return None
            self.variants.append(fn)
        return fn

    def _load(self):
        start = time.perf_counter()
        payload = compilecache.read_keyed(self.path, self.key, "precompiled graph")
        if payload is None:
            return None
        try:
            fn = torch.compiler.load_compiled_function(io.BytesIO(payload), f_globals=self.function.__globals__)
        except Exception as err:  # noqa: BLE001 - torch's own format: whatever it raises, the graph compiles instead
            logger.warning("Tide: ignoring the precompiled graph %s that torch could not load (%s)", self.path, err)
            return None
        self._event("loaded", time.perf_counter() - start)
        return fn

    def _compile(self, args, save: bool):
        """The graph AOT-compiled on `args` (`save`: kept in its file) -> its function, or None where it cannot be
        captured whole. Guards that name an object of this process cannot be kept by an AOT-compiled function and are
        left out (`_serialisable`): which objects the graph reads is the key's, and `Precompiled.new_call` clears
        what passed at each call."""
        from ..layers.spans import own_code
        from ..models.compat import CompileWatch

        start = time.perf_counter()
        options = {**self.options, "fullgraph": True,
                   "options": {**(self.options.get("options") or {}), "guard_filter_fn": _serialisable}}
        try:
            fn = torch.compile(own_code(self.function, self.name), **options).aot_compile((args, {}))
            payload = type(fn).serialize(fn).serialized_data if save else None
        except Exception as err:  # noqa: BLE001 - a graph not AOT-compiled is compiled as usual
            logger.warning("Tide: the graph %s could not be compiled ahead of its calls (%s); compiling it with "
                           "torch.compile", self.name, err)
            return None
        seconds = time.perf_counter() - start
        CompileWatch.note(seconds, recompile=bool(self.variants))  # (aot_compile runs no dynamo callback)
        if save:
            try:
                compilecache.write_keyed(self.path, self.key, payload)
            except OSError as err:
                logger.warning("Tide: could not keep the precompiled graph in %s (%s)", self.path, err)
            self._event("saved", seconds)
        return fn

    def _event(self, what: str, seconds: float) -> None:
        self.store.events.append({"graph": self.name, what: True, "seconds": round(seconds, 3)})


def _serialisable(entries) -> list[bool]:
    """The guards a saved function keeps: not global ones, nor any that names an object of this process."""
    return [not (e.is_global or e.guard_type in _UNSAVED or any(t in _UNSAVED for t in (e.derived_guard_types or ())))
            for e in entries]


def _signature(args) -> tuple:
    """What the saved guards check of `args` that can change between calls without a new argument object: each
    tensor's shape, strides, dtype and device; each module's (by identity) parameters' dtype and device; every other
    object by identity, numbers by value. The guards of a loaded graph run where it changes."""
    out = []
    for value in args:
        if isinstance(value, torch.Tensor):
            out.append((value.shape, value.stride(), value.dtype, value.device))
        elif isinstance(value, (tuple, list)):
            out.append(_signature(value))
        elif isinstance(value, dict):
            out.append((tuple(value), _signature(tuple(value.values()))))
        elif isinstance(value, torch.nn.Module):
            weight = next(value.parameters(), None)
            out.append((id(value), None if weight is None else (weight.dtype, weight.device)))
        elif isinstance(value, (int, float, str, bool, type(None))):
            out.append(value)
        elif isinstance(value, types.MethodType):  # (a bound method is a new object at every attribute lookup)
            out.append((id(value.__self__), id(value.__func__)))
        elif isinstance(getattr(value, "layers", None), list):  # a cache: its first layer's tensors too
            first = vars(value.layers[0]).values() if value.layers else ()
            out.append((id(value), _signature(tuple(t for t in first if isinstance(t, torch.Tensor)))))
        else:
            out.append(id(value))
    return tuple(out)


def _take_marks(args) -> list:
    """Take dynamo's dynamic-dimension marks off every tensor in `args` (caches' layer tensors included) -> what to
    put back (`_put_back`)."""
    taken = []
    for tensor in _tensors(args):
        for name in _MARKS:
            if name in tensor.__dict__:
                taken.append((tensor, name, tensor.__dict__.pop(name)))
    return taken


def _put_back(taken: list) -> None:
    for tensor, name, value in taken:
        setattr(tensor, name, value)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif not isinstance(value, torch.nn.Module) and isinstance(getattr(value, "layers", None), list):
        for layer in value.layers:  # a cache
            yield from (t for t in vars(layer).values() if isinstance(t, torch.Tensor))


@functools.cache
def _source_digest() -> str:
    """A digest of Tide's Python source: a graph is traced from it, and a saved graph cannot check it."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:24]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__

