"""Static caches lent to compiled calls: the same cache tensors, at the same addresses, call after call.

A compiled call (`tide_config={"compile": True}`) decodes on a static cache. transformers' `generate` makes a new
`StaticCache` on every call; its tensors are marked as static addresses, and on a GPU every CUDA graph that was
captured on the last call's cache is recorded again on the new one, at every call. `StaticCachePool` keeps a
model's static caches between calls and lends one to each call that would have asked `generate` for a fresh one,
reset (its tensors zeroed in place), sized as `generate` sizes it, never shorter than the last (one shape for
compiled graphs, as `generate` keeps `_previous_max_cache_length`). A lent cache belongs to one call at a time:
concurrent calls get caches of their own. Calls that return their cache (`return_dict_in_generate`) get a fresh
one from `generate`, so that no later call overwrites it. The free caches stay allocated between calls (as
transformers' own generate once kept one); `model.static_caches.clear()` frees them.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from transformers import StaticCache

__all__ = ["StaticCachePool"]


class StaticCachePool:
    """The free static caches of one model, by (length, rows, dtype, device): the `KEEP` most recently returned."""

    KEEP = 4

    def __init__(self):
        self._free: dict[tuple, StaticCache] = {}
        self._lock = threading.Lock()
        self.length = 0  # the longest cache lent so far: later calls get at least this (one shape)

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
        """A reset static cache of at least `length` positions for `rows` sequences, for the `with` block; `like`:
        a parameter of the model (its dtype and device, which the cache takes on its first update)."""
        with self._lock:
            self.length = max(self.length, length)
            key = (self.length, rows, like.dtype, like.device)
            cache = self._free.pop(key, None)
        if cache is None:
            cache = StaticCache(config=config, max_cache_len=key[0])
        else:
            cache.reset()
        try:
            yield cache
        finally:
            with self._lock:
                if key[0] == self.length:  # a shorter one would not be lent again
                    self._free.pop(key, None)
                    self._free[key] = cache  # (the newest last)
                    while len(self._free) > self.KEEP:  # batch sizes, dtypes, devices seen long ago
                        self._free.pop(next(iter(self._free)))
