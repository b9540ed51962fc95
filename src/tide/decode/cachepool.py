"""Static caches lent to compiled calls: the same cache tensors, at the same addresses, call after call.

A compiled call (`tide_config={"compile": True}`) decodes on a static cache. transformers' `generate` makes a new
`StaticCache` on every call; its tensors are marked as static addresses, and on a GPU every CUDA graph that was
captured on the last call's cache is recorded again on the new one, at every call. `StaticCachePool` keeps a
model's static caches between calls and lends one to each call that would have asked `generate` for a fresh one,
reset (its tensors zeroed in place), at least as long as `generate` would make it, rounded up to a bucket
(`bucket`: at least `MIN_BUCKET` positions, four buckets a doubling above it), so that calls of nearby lengths share
one cache and one shape. Tide's one-graph cycles and exit steps read the cache's length from its tensors, marked as
a dynamic dimension (`dynamic_length`), so one graph serves every bucket: a longer prompt makes no graph again. A
lent cache belongs to one call at a time: concurrent calls get caches of their own. Calls that return their cache
(`return_dict_in_generate`) get a fresh one from `generate`, so that no later call overwrites it. The free caches
stay allocated between calls (as transformers' own generate once kept one); `model.static_caches.clear()` frees
them. This module neither compiles nor decides what a call runs.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from transformers import StaticCache

__all__ = ["MIN_BUCKET", "StaticCachePool", "bucket", "dynamic_length", "slots"]

MIN_BUCKET = 256


def bucket(length: int) -> int:
    """The cache length lent for `length` positions: at least `MIN_BUCKET`, and above it four buckets a doubling
    (a length in (2^k, 2^(k+1)] rounded up to a multiple of 2^(k-2)): at most a quarter more positions than asked,
    each of which costs attention time every cycle, and few shapes (on a GPU each is a CUDA graph recorded once)."""
    length = int(length)
    if length <= MIN_BUCKET:
        return MIN_BUCKET
    step = 1 << ((length - 1).bit_length() - 3)
    return -(-length // step) * step


def dynamic_length(cache) -> None:
    """Mark the length dimension of every initialised layer's keys and values of a static `cache` as dynamic, for
    graphs that read it with `slots`: compiled once, they serve caches of any length (where the backend cannot keep
    it dynamic, it specialises, as before)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            for tensor in (layer.keys, layer.values):
                torch._dynamo.maybe_mark_dynamic(tensor, 2)


def slots(cache) -> int:
    """The positions a static `cache` holds, read from its tensors (inside a graph: the dynamic dimension)."""
    return cache.layers[0].keys.shape[2]


class StaticCachePool:
    """The free static caches of one model, by (bucket, rows, dtype, device): the `KEEP` most recently returned."""

    KEEP = 4

    def __init__(self):
        self._free: dict[tuple, StaticCache] = {}
        self._lock = threading.Lock()
        self.length = 0  # the longest cache lent so far

    def __deepcopy__(self, memo):  # a copied model gets an empty pool of its own (a lock cannot be copied)
        return StaticCachePool()

    def __getstate__(self):  # pickled (e.g. sent to another process): empty
        return {}

    def __setstate__(self, state):
        self.__init__()

    def clear(self) -> None:
        """Drop the free caches (their memory goes back once nothing else holds them); later calls make new ones."""
        with self._lock:
            self._free.clear()
            self.length = 0

    @contextmanager
    def lend(self, config, length: int, rows: int, like: torch.Tensor):
        """A reset static cache of `bucket(length)` positions for `rows` sequences, for the `with` block; `like`:
        a parameter of the model (its dtype and device, which the cache takes on its first update)."""
        with self._lock:
            self.length = max(self.length, bucket(length))
            key = (bucket(length), rows, like.dtype, like.device)
            cache = self._free.pop(key, None)
        if cache is None:
            cache = StaticCache(config=config, max_cache_len=key[0])
        else:
            cache.reset()
        try:
            yield cache
        finally:
            with self._lock:
                self._free.pop(key, None)
                self._free[key] = cache  # (the newest last)
                while len(self._free) > self.KEEP:  # lengths, batch sizes, dtypes, devices seen long ago
                    self._free.pop(next(iter(self._free)))
