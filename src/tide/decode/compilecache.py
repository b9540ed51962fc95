"""Compiled work that persists between processes: torch's cache artifacts in a Tide cache folder.

A `compile=True` call traces and compiles its graphs (`lossless/graph.py`, `decode/baseline.py`, `layers/spans.py`).
`save` writes what torch compiled in this process (`torch.compiler.save_cache_artifacts`: inductor's generated code
and AOTAutograd's graphs) to one file per key; the first compiled call of a model in a later process `load`s it
(`torch.compiler.load_cache_artifacts`), so inductor finds its code made: dynamo still traces the Python, but no
kernel is generated or built again. `tide warmup REPO` runs compiled calls and saves (`tools/warmup.py`); so does
calibration, after compiled trials that compiled (`calibration/persist.py`).

The key is what decides the graphs: the base model's config, the router repo's (its checkpoints and draft settings),
the torch version, the device and the compile options. The folder is `compiled/` in Tide's cache folder
(`$TIDE_CACHE`, else `~/.cache/tide`). A file whose header names another key or torch version, or that torch cannot
load, is ignored with a log line, never an error. This module does not decide what is compiled,
nor keep any graph itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

__all__ = ["cache_folder", "artifact_key", "artifact_path", "digest", "load", "save", "read_keyed", "write_keyed"]

logger = logging.getLogger(__name__)
_FORMAT = "tide-compiled-1"


def cache_folder() -> Path:
    """`compiled/` in Tide's cache folder: `$TIDE_CACHE`, else `~/.cache/tide`."""
    return Path(os.environ.get("TIDE_CACHE") or Path.home() / ".cache" / "tide") / "compiled"


def artifact_key(model, options: dict, device) -> dict:
    """What the compiled graphs of `model` (a TideForCausalLM) depend on, as a dict (hashed into the file name)."""
    from ..layers.spans import options_key

    base = model.base.config.to_dict()
    routers = model.config.to_dict()
    for config in (base, routers):
        for volatile in ("_name_or_path", "transformers_version", "calibration"):
            config.pop(volatile, None)
    device = torch.device(device)
    kind = device.type if device.type != "cuda" else f"cuda:{torch.cuda.get_device_name(device)}"
    return {"format": _FORMAT, "torch": torch.__version__, "device": kind,
            "base": digest(base), "routers": digest(routers), "options": repr(options_key(options))}


def artifact_path(key: dict) -> Path:
    return cache_folder() / f"{digest(key)[:24]}.bin"


def load(model, options: dict, device) -> bool:
    """Load the persisted artifacts of `model` under `options` on `device`, once per model and key; True where
    they loaded. A stale or foreign file is ignored with a log line."""
    key = artifact_key(model, options, device)
    loaded = model.__dict__.setdefault("_tide_loaded_artifacts", set())
    name = digest(key)
    if name in loaded:
        return False
    loaded.add(name)
    path = artifact_path(key)
    if not path.is_file():
        return False
    payload = read_keyed(path, key, "compiled artifacts")
    if payload is None:
        return False
    try:
        torch.compiler.load_cache_artifacts(payload)
    except Exception as err:  # (torch's own format: whatever it raises, the call compiles as if there were none)
        logger.warning("Tide: ignoring compiled artifacts %s that torch could not load (%s)", path, err)
        return False
    logger.info("Tide: loaded compiled artifacts %s", path)
    return True


def save(model, options: dict, device) -> Path | None:
    """Write what torch compiled in this process so far, for `model` under `options` on `device` -> the file, or
    None where torch had nothing to save."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    payload, _info = saved
    key = artifact_key(model, options, device)
    path = artifact_path(key)
    write_keyed(path, key, payload)
    return path


def write_keyed(path: Path, key: dict, payload: bytes) -> None:
    """`payload` after a header line naming `key`, written atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.part")
    partial.write_bytes(json.dumps(key, sort_keys=True).encode() + b"\n" + payload)
    partial.replace(path)


def read_keyed(path: Path, key: dict, what: str) -> bytes | None:
    """The payload of a file `write_keyed` wrote for `key`; None, with a log line naming `what`, where the file
    cannot be read or names another key."""
    try:
        header, _, payload = path.read_bytes().partition(b"\n")
        found = json.loads(header)
    except (OSError, ValueError) as err:
        logger.warning("Tide: ignoring unreadable %s %s (%s)", what, path, err)
        return None
    key = json.loads(json.dumps(key))  # (as the header reads it back)
    if found != key:
        differs = sorted(k for k in set(key) | set(found) if key.get(k) != found.get(k))
        logger.warning("Tide: ignoring %s %s made for another %s", what, path, ", ".join(differs))
        return None
    return payload


def digest(value) -> str:
    """A hex digest of `value` as JSON (keys sorted; what JSON cannot hold, by its repr): the name of a cache file."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()
