"""K/V for skipped layers (interim: per-layer `write_kv_only`; the batched path replaces this)."""

from __future__ import annotations

from .layercalls import write_kv_only

__all__ = ["fill_kv"]


def fill_kv(parts, calls, layers, hidden, cache) -> None:
    for i in layers:
        write_kv_only(calls[i], parts, i, hidden, cache)
