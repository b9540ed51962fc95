"""Every private piece of transformers that Tide relies on, in one place.

- `stop_strings_as_criteria`: `generate` with a `custom_generate` callable (Tide's decode loops) drops the
  `tokenizer` argument before it builds the stop-string criterion, so Tide builds that criterion itself.
- Cache layer classes (`cache_layer_kinds`): which layers hold recurrent state or reuse another layer's K/V.
- Cache internals: a layer's `keys`/`values` tensors (which tree drafts compact in place on a plain
  `DynamicLayer`: `keep_path`, `keep_of_tail`), `crop`, `get_seq_length`; the cache's `is_sliding`,
  `get_mask_sizes` and `get_query_offset`, which `LengthView` answers for a chunk of positions.
- `use_gqa_in_sdpa` in transformers' SDPA attention, which decides whether grouped-query K/V heads are copied
  per query group (`repeat_kv`) before attention; `grouped_query_attention_in_place` answers it for Tide's
  masked multi-position passes on CPU.
- `custom_generate_repo`: `generate(custom_generate="<repo>")` calls the repo's `generate` function without the
  repo's name; a router repo's `generate.py` reads it from the running `GenerationMixin.generate`'s local
  `custom_generate`.

- `StaticLayer.get_mask_sizes` answers the layer's `max_cache_len`, a Python int that a compiled forward would
  take as a constant; `mask_sizes_from_tensors` has a full-attention static layer answer its tensors' length, which
  a graph can keep as a dynamic dimension (one graph for every cache length).

And one private piece of torch: dynamo's compile callbacks (`torch._dynamo.callback_handler`), through which
`CompileWatch` counts a call's compilations, recompilations and seconds spent compiling.

`check()` verifies them against the installed transformers and raises an error naming the piece that
changed; the test suite calls it.
"""

from __future__ import annotations

import inspect
import os
import re
import time
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import StaticLayer
from transformers.integrations import sdpa_attention

__all__ = ["is_preallocated_layer", "stop_strings_as_criteria", "LengthView", "layer_kv", "crop_layer", "layer_length",
           "crop_cache", "keep_path", "keep_of_tail", "plain_dynamic_layers", "is_static_layer", "keep_one_of_tail",
           "has_sliding_layers", "cache_layer_kinds", "unrecoverable_sliding_layers", "sliding_window_of",
           "grouped_query_attention_in_place", "custom_generate_repo", "CompileWatch", "mask_sizes_from_tensors",
           "check"]


def stop_strings_as_criteria(base, kwargs: dict) -> dict:
    """generate's keyword arguments with any stop strings (the call's, its generation_config's or the model's)
    turned into a `StopStringCriteria` among the call's stopping criteria.

    transformers 5.23's `generate` pops `tokenizer` and then, for a `custom_generate` callable, rebuilds the mode
    arguments without it, so its own stop-string criterion would fail for want of a tokenizer."""
    from transformers import StoppingCriteriaList, StopStringCriteria

    config = kwargs.get("generation_config")
    stop = kwargs.get("stop_strings") or getattr(config, "stop_strings", None) or base.generation_config.stop_strings
    if not stop:
        return kwargs
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("generate was given stop_strings (or its generation config has some) but no tokenizer: "
                         "pass tokenizer=... as well.")
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop))
    return {**kwargs, "stop_strings": None, "stopping_criteria": criteria}


def custom_generate_repo(depth: int = 16):
    """The repo (a Hub id or a local folder) that the running `generate(custom_generate=<repo>)` call loaded its
    decoding function from, or None where no such call is running in this thread.

    transformers 5.23's `generate` calls `custom_generate/generate.py`'s `generate(model=..., **arguments)` with the
    call's arguments but not the repo, which is still its local variable `custom_generate`."""
    import sys

    from transformers import GenerationMixin

    code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code is code:
            repo = frame.f_locals.get("custom_generate")
            return repo if isinstance(repo, (str, os.PathLike)) else None
        frame = frame.f_back
    return None


def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored (keys, values) of cache layer `layer`, each [B, H_kv, T, D]."""
    entry = cache.layers[layer]
    return entry.keys, entry.values


def crop_layer(cache, layer: int, length: int) -> None:
    """Crop one cache layer (`length` < 0 drops that many newest positions). A static layer only moves its length
    counter back: positions past it are overwritten before any query can see them (masks are causal)."""
    entry = cache.layers[layer]
    if is_static_layer(entry):
        if length > 0:
            raise ValueError("a static cache layer is cropped by a negative count of positions")
        if length and entry.is_initialized:
            entry.cumulative_length.sub_(-length)
        return
    entry.crop(length)


def crop_cache(cache, drop: int) -> None:
    """Drop the `drop` newest positions of every layer of `cache` (static layers too, unlike `Cache.crop`)."""
    if drop <= 0:
        return
    if not any(is_static_layer(layer) for layer in getattr(cache, "layers", ())):
        cache.crop(-drop)
        return
    for i in range(len(cache.layers)):
        crop_layer(cache, i, -drop)


def keep_path(cache, num_layers: int, tail: int, keep: list[int]) -> None:
    """`keep_of_tail` on every layer; where the kept positions are already the tail's first (a path of first
    children), one crop of the whole cache."""
    if keep == list(range(len(keep))):
        crop_cache(cache, tail - len(keep))
        return
    for layer in range(num_layers):
        keep_of_tail(cache, layer, tail, keep)


def keep_of_tail(cache, layer: int, tail: int, keep: list[int]) -> None:
    """Of the newest `tail` positions of cache layer `layer`, keep those at indices `keep` (ascending) among
    them, moved to the front of the tail in that order, and drop the rest. Plain `DynamicLayer`s and
    full-attention static layers only (a static layer only moves its length back)."""
    entry = cache.layers[layer]
    if keep != list(range(len(keep))):
        end = layer_length(cache, layer) - tail
        index = torch.tensor(keep, device=entry.keys.device) + end
        entry.keys[..., end:end + len(keep), :] = entry.keys.index_select(-2, index)  # (a gather: a copy)
        entry.values[..., end:end + len(keep), :] = entry.values.index_select(-2, index)
    if tail > len(keep):
        crop_layer(cache, layer, len(keep) - tail)


def plain_dynamic_layers(cache) -> bool:
    """True when every cache layer is a plain `DynamicLayer` (its keys/values are all its state)."""
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))


def keep_one_of_tail(cache, layer: int, tail: int, keep: int | None) -> None:
    """Drop the newest `tail` positions of cache layer `layer`, except the one at index `keep` among them."""
    entry = cache.layers[layer]
    if keep:  # move the kept position to the front of the tail, then crop the rest
        end = layer_length(cache, layer) - tail
        entry.keys[..., end, :] = entry.keys[..., end + keep, :]
        entry.values[..., end, :] = entry.values[..., end + keep, :]
    drop = tail - (keep is not None)
    if drop:
        crop_layer(cache, layer, -drop)


def layer_length(cache, layer: int) -> int:
    return int(cache.layers[layer].get_seq_length())  # a static layer's is a tensor


def is_static_layer(layer) -> bool:
    """A preallocated (`StaticCache`) full-attention layer: it writes at its length counter and never shrinks."""
    return isinstance(layer, StaticLayer) and not layer.is_sliding


def is_preallocated_layer(layer) -> bool:
    """A `StaticCache` layer, full-attention or sliding-window: preallocated tensors a compiled graph can keep."""
    return isinstance(layer, StaticLayer)


def has_sliding_layers(cache) -> bool:
    return any(getattr(cache, "is_sliding", None) or [])


def unrecoverable_sliding_layers(cache) -> list[int]:
    """Sliding-window cache layers that drop evicted positions at once (not recording their past), so a
    rejected draft could not be rolled back. Tide's lossless loop turns recording on."""
    sliding = getattr(cache, "is_sliding", None) or []
    return [i for i, is_sliding in enumerate(sliding) if is_sliding and not cache.is_recording_past(i)]


def cache_layer_kinds(config) -> list[str] | None:
    """What kind of cache layer transformers builds for each decoder layer of `config`: "attention", "sliding",
    "recurrent" (linear attention / state-space state, also when mixed with attention), "shared" (a layer that
    reuses another layer's K/V) or "indexed" (a sparse-attention indexer's keys besides the K/V). None if
    transformers cannot build a cache from this config."""
    from transformers.cache_utils import DummyLayer, LinearAttentionCacheLayerMixin

    try:
        cache = DynamicCache(config=config)
    except Exception:  # noqa: BLE001 - any config transformers cannot build a cache for
        return None
    kinds = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            kinds.append("recurrent")
        elif isinstance(layer, DummyLayer):
            kinds.append("shared")
        elif hasattr(layer, "update_indexer"):
            kinds.append("indexed")
        else:
            kinds.append("sliding" if getattr(layer, "is_sliding", False) else "attention")
    return kinds


def sliding_window_of(cache, layer: int) -> int | None:
    """The window of cache layer `layer` (None for a full-attention layer)."""
    entry = cache.layers[layer]
    return getattr(entry, "sliding_window", None) if getattr(entry, "is_sliding", False) else None


class LengthView(Cache):
    """The cache as the backbone must see it to build masks for a chunk of positions starting at `start`.

    A sliding-window layer with `start` positions behind it sees at most its last `window - 1` of them (what
    `DynamicSlidingWindowLayer.update` returns while it records its past)."""

    def __init__(self, cache, start: int):  # a Cache for transformers' isinstance checks; the rest is `cache`'s
        self._cache, self._start = cache, start

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._start

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._start

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        layer = self._cache.layers[layer_idx] if layer_idx < len(getattr(self._cache, "layers", ())) else None
        if is_static_layer(layer):  # the masks span the whole preallocated cache
            return layer.get_mask_sizes(query_length)
        window = sliding_window_of(self._cache, layer_idx)
        if window is None or self._start < window:
            return self._start + query_length, 0
        return window - 1 + query_length, self._start - window + 1

    def __getattr__(self, name):
        return getattr(self._cache, name)


# Grouped-query attention over several query positions with a mask. transformers' SDPA path copies every K/V
# head once per query group (`repeat_kv`) whenever a mask is given, so a verification pass pays a copy of each
# layer's whole cache that a decode step (one query, no mask) does not: on a hidden-256 Qwen3 with 4 query and 2
# K/V heads, 10 layers over 2 positions took 4.27 / 5.55 ms at 60 / 480 cached tokens, and 3.97 / 4.48 ms with
# torch attending the K/V heads in place (`enable_gqa`, PyTorch >= 2.5), bit-identical (docs/benchmarks.md). On
# CUDA a mask keeps SDPA off the kernels that take `enable_gqa`, so only CPU passes change.
_GQA_IN_PLACE: ContextVar = ContextVar("tide_gqa_in_place", default=False)
_TORCH_GQA = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def _use_gqa_in_sdpa_for(original):
    def use_gqa_in_sdpa(attention_mask, key, value):
        # compiled: transformers' own decision (dynamo reads no ContextVar)
        if (not torch.compiler.is_compiling() and _GQA_IN_PLACE.get() and attention_mask is not None
                and attention_mask.dim() == 4 and attention_mask.shape[-2] > 1 and key.device.type == "cpu"
                and key.shape[-1] == value.shape[-1] <= 256):
            return True
        return original(attention_mask, key, value)

    use_gqa_in_sdpa.tide_original = original
    return use_gqa_in_sdpa


@contextmanager
def grouped_query_attention_in_place():
    """In this context (Tide's multi-position passes), transformers' SDPA attention over several masked query
    positions on CPU attends grouped-query K/V heads in place instead of copying them per query group."""
    if not _TORCH_GQA:
        yield
        return
    current = sdpa_attention.use_gqa_in_sdpa
    if not hasattr(current, "tide_original"):  # installed once per process; outside the context it is transformers'
        sdpa_attention.use_gqa_in_sdpa = _use_gqa_in_sdpa_for(current)
    token = _GQA_IN_PLACE.set(True)
    try:
        yield
    finally:
        _GQA_IN_PLACE.reset(token)


def mask_sizes_from_tensors(cache) -> None:
    """Every initialised full-attention `StaticLayer` of `cache` answers `get_mask_sizes` with its keys' length
    (the same number as its `max_cache_len`), read from the tensor, so that a compiled forward that builds its mask
    from the cache does not take the cache's length as a constant: the layer becomes a `TensorSizedStaticLayer`, the
    same layer with that one method (a class's method, which a precompiled graph can name: `decode/precompiled.py`)."""
    for layer in getattr(cache, "layers", ()):
        if type(layer) is StaticLayer and layer.is_initialized:
            layer.__class__ = TensorSizedStaticLayer


class TensorSizedStaticLayer(StaticLayer):
    """A `StaticLayer` whose masks span its keys' length read from the tensor (`mask_sizes_from_tensors`)."""

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0


class CompileWatch:
    """torch.compile's work while the `with` block runs, from dynamo's compile callbacks: `seconds` spent compiling
    (CUDA graph recordings included), `graphs` (frames dynamo compiled) and `recompiles` (of those, a function
    compiled again because its guards failed). The callbacks are process-wide: compilations by another thread in
    the meantime count too."""

    _active: list = []  # the watches whose blocks are running (`note`)

    def __init__(self):
        self.seconds, self.graphs, self.recompiles = 0.0, 0, 0
        self._started = 0.0

    @classmethod
    def note(cls, seconds: float, recompile: bool = False) -> None:
        """Count a graph compiled where dynamo's callbacks do not run (`torch.compile(...).aot_compile`); a
        `recompile` where it is another variant of a function already compiled."""
        for watch in cls._active:
            watch.seconds += seconds
            watch.graphs += 1
            watch.recompiles += recompile

    def _start(self, args) -> None:
        self._started = time.perf_counter()

    def _end(self, args) -> None:
        self.seconds += time.perf_counter() - self._started
        if getattr(args.callback_trigger, "name", "") == "DYNAMO":
            self.graphs += 1
            match = re.search(r"(\d+)/(\d+)", str(args.compile_id))
            self.recompiles += bool(match and int(match.group(2)) > 0)

    def __enter__(self) -> CompileWatch:
        CompileWatch._active.append(self)
        handler = getattr(torch._dynamo, "callback_handler", None)
        if handler is not None:
            handler.register_start_callback(self._start)
            handler.register_end_callback(self._end)
        return self

    def __exit__(self, *exc) -> None:
        CompileWatch._active.remove(self)
        handler = getattr(torch._dynamo, "callback_handler", None)
        for remove, callback in ((getattr(handler, "remove_start_callback", None), self._start),
                                 (getattr(handler, "remove_end_callback", None), self._end)):
            try:
                remove(callback)
            except (TypeError, ValueError):  # (`torch._dynamo.reset()` clears the callbacks)
                pass


def check() -> None:
    """Raise RuntimeError naming every private transformers piece above that is missing or changed."""
    from transformers import DynamicCache, GenerationMixin, LlamaConfig

    problems = []
    if "custom_generate" not in inspect.signature(GenerationMixin.generate).parameters:
        problems.append("GenerationMixin.generate no longer takes custom_generate (Tide's decode loops run through it)")
    elif "load_custom_generate" not in inspect.unwrap(GenerationMixin.generate).__code__.co_names:
        problems.append("GenerationMixin.generate no longer loads a custom_generate repo's function itself (a router "
                        "repo's custom_generate/generate.py reads the repo from that call's custom_generate)")
    for name in ("get_mask_sizes", "get_query_offset", "crop", "get_seq_length", "is_sliding", "is_recording_past",
                 "activate_past_recording"):
        if not hasattr(DynamicCache, name):
            problems.append(f"DynamicCache.{name} is gone")
    config = LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=8, vocab_size=8)
    cache = DynamicCache(config=config)
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    try:
        keys, values = layer_kv(cache, 0)
        crop_layer(cache, 0, -1)
        if keys.shape[2] != 3 or layer_length(cache, 0) != 2:
            problems.append("cache layers no longer hold keys/values as [B, H, T, D] or crop differently")
        if not plain_dynamic_layers(cache):
            problems.append("DynamicCache no longer builds transformers.cache_utils.DynamicLayer layers")
        keep_one_of_tail(cache, 0, 1, None)
        if layer_length(cache, 0) != 1:
            problems.append("a DynamicLayer's length is no longer its keys' length")
    except (AttributeError, IndexError, TypeError) as err:
        problems.append(f"cache layers changed: {err}")
    decide = getattr(sdpa_attention.use_gqa_in_sdpa, "tide_original", getattr(sdpa_attention, "use_gqa_in_sdpa", None))
    if decide is None or list(inspect.signature(decide).parameters) != ["attention_mask", "key", "value"]:
        problems.append("transformers.integrations.sdpa_attention.use_gqa_in_sdpa(attention_mask, key, value) changed")
    elif "use_gqa_in_sdpa" not in sdpa_attention.sdpa_attention_forward.__code__.co_names:
        problems.append("sdpa_attention_forward no longer asks use_gqa_in_sdpa whether to repeat K/V heads")

    if "max_cache_len" not in StaticLayer.get_mask_sizes.__code__.co_names:
        problems.append("StaticLayer.get_mask_sizes no longer answers max_cache_len (which mask_sizes_from_tensors "
                        "replaces)")
    handler = getattr(torch._dynamo, "callback_handler", None)
    if not all(hasattr(handler, name) for name in ("register_start_callback", "register_end_callback",
                                                   "remove_start_callback", "remove_end_callback")):
        problems.append("torch._dynamo.callback_handler (compile callbacks, which count compilations) changed")
    if problems:
        raise RuntimeError("Tide relies on transformers internals that changed: " + "; ".join(problems) + ".")
