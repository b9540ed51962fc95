"""What calibration's compiled trials compiled, persisted for the calibrated repo's later processes.

With `compiled_trials`, calibration times the default mode and greedy drafts compiled (`timing.time_default_compiled`):
their first calls compile the graphs that the repo's `compile=True` calls run. `persist_compiled` writes what torch
compiled in this process (`decode.compilecache.save`, as `tide warmup` does) under the key of the repo as calibration
leaves it (the base model's config, the routers' config with its generation defaults, torch, the device, the compile
options a `compile=True` call takes by default), so that the saved repo's first compiled call in a later process
loads it (`compilecache.load`; a stale or foreign file is ignored there with a log line). Nothing is written where
the trials compiled nothing (no compiled trials, or every graph already made), and a write that fails is logged,
never raised: calibration's result does not depend on it. This module times and decides nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path

__all__ = ["persist_compiled"]

logger = logging.getLogger(__name__)


def persist_compiled(tide, graphs: int) -> Path | None:
    """Write the compiled work of this process for `tide` (a TideForCausalLM, its config final) where the compiled
    trials compiled `graphs` > 0 graphs -> the file written, or None (nothing compiled, nothing to save, or the write
    failed)."""
    if not graphs:
        return None
    from ..decode import compilecache
    from ..layers.spans import compile_options

    options = compile_options(getattr(tide.base.generation_config, "compile_config", None), tide.base.device.type)
    try:
        path = compilecache.save(tide, options, tide.base.device)
    except Exception as err:  # noqa: BLE001 - a cache not written costs a later process its compiling, nothing else
        logger.warning("Tide: the compiled trials' work was not persisted (%s)", err)
        return None
    if path is not None:
        logger.info("Tide: the compiled trials' work (%d graphs) persisted to %s", graphs, path)
    return path
