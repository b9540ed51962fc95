"""The folder a router repo is saved into: the files it holds, which of them Tide may replace, and moving a save's
files into place all or nothing.

A save replaces only files Tide wrote (`check_save_directory` refuses a folder holding anyone else's, before any
work), and `replace_all` moves the new files in so that a failure part-way puts every replaced file back.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

__all__ = ["CONFIG_NAME", "ROUTERS_NAME", "CARD_NAME", "REPO_FILES", "CUSTOM_GENERATE_NAME",
           "CUSTOM_REQUIREMENTS_NAME", "CUSTOM_GENERATE_FILES", "DISTRIBUTION", "check_save_directory",
           "replace_all", "remove_custom_generate"]

CONFIG_NAME = "config.json"
ROUTERS_NAME = "routers.safetensors"
CARD_NAME = "README.md"
REPO_FILES = (CONFIG_NAME, ROUTERS_NAME, CARD_NAME)
# What `generate(custom_generate=<repo>, trust_remote_code=True)` runs, and what it needs installed.
CUSTOM_GENERATE_NAME = "custom_generate/generate.py"
CUSTOM_REQUIREMENTS_NAME = "custom_generate/requirements.txt"
CUSTOM_GENERATE_FILES = (CUSTOM_GENERATE_NAME, CUSTOM_REQUIREMENTS_NAME)
DISTRIBUTION = "tide-transformers"

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
_OWN_MOVE = "save the routers to a directory of their own, or move that file"


def check_save_directory(out: Path, custom_generate: bool = True) -> None:
    """Refuse `out` where a save could not write there or would replace (or remove) a file Tide did not write: a
    path that is a file, another model's weights or config, a README, routers file or `custom_generate/` file of
    someone else's (the `custom_generate/` files only where this save writes them)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a directory: a router repo is a folder of files. Pass the path of a "
                         "directory (a new one, or a router repo to replace); the file is left as it is.")
    if not out.is_dir():
        return
    weights = sorted(p.name for p in out.iterdir()
                     if p.name != ROUTERS_NAME and (p.suffix in _WEIGHT_SUFFIXES or p.name.endswith(".index.json")))
    if weights:
        raise ValueError(f"{out} holds model weights ({', '.join(weights[:3])}); "
                         "a router repo needs a directory of its own (saving here would replace that model's "
                         "config.json): choose another directory.")
    config = out / CONFIG_NAME
    if config.is_file():
        data = _read_json(config)
        if not isinstance(data, dict) or data.get("model_type") != "tide":
            kind = data.get("model_type") if isinstance(data, dict) else None
            raise ValueError(f"{config} belongs to another model (model_type {kind!r}); save the routers to a "
                             "directory of their own.")
    names = (CARD_NAME, ROUTERS_NAME) + (CUSTOM_GENERATE_FILES if custom_generate else ())
    for name in names:
        path = out / name
        if path.exists() and not (path.is_file() and written_by_tide(path)):
            raise ValueError(f"{path} was not written by Tide and would be replaced; {_OWN_MOVE}.")


def written_by_tide(path: Path) -> bool:
    """Whether the repo file `path` is one Tide wrote: the card's library tag, the routers' metadata, the script's
    docstring, the requirements' one line."""
    if path.name == ROUTERS_NAME:
        return _routers_metadata(path) is not None
    text = path.read_text(errors="replace")
    if path.name == CARD_NAME:
        return "library_name: tide-transformers" in text
    if path.name == Path(CUSTOM_REQUIREMENTS_NAME).name:
        return re.fullmatch(rf"{re.escape(DISTRIBUTION)}>=[\w.+!-]+\s*", text) is not None
    return "written by Tide" in text


def _routers_metadata(path: Path) -> dict | None:
    """The metadata of a routers file Tide wrote (it names the Tide version), or None."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception:  # noqa: BLE001 - any file safetensors cannot read is not Tide's
        return None
    return metadata if "tide_version" in metadata else None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def replace_all(new: Path, out: Path, names, mode: int) -> None:
    """Move the files `names` (relative paths) from the folder `new` into `out`, each with permissions `mode`. The
    files they replace are kept in `new` until all are in place: where a move fails, every file moved so far is put
    back (and folders made for them removed), then the error is raised."""
    kept, made = new / ".replaced", []
    done: list[tuple[Path, Path | None]] = []  # (a file moved in, where the file it replaced is kept, or None)
    try:
        for name in names:
            target, source = out / name, new / name
            for folder in [out] + [out / p for p in reversed(Path(name).parents[:-1])]:
                if not folder.is_dir():
                    folder.mkdir()
                    made.append(folder)
            os.chmod(source, mode)  # (a writer may have used a private temporary file: safetensors does)
            old = kept / name if os.path.lexists(target) else None
            if old is not None:
                old.parent.mkdir(parents=True, exist_ok=True)
                os.replace(target, old)
            done.append((target, old))
            os.replace(source, target)
    except BaseException:
        _put_back(done, made)
        raise


def _put_back(done: list, made: list) -> None:
    """Undo `replace_all`'s moves, last first: a replaced file back in place, a new one removed, new folders too."""
    for target, old in reversed(done):
        if old is not None:
            os.replace(old, target)
        else:
            target.unlink(missing_ok=True)
    for folder in reversed(made):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def remove_custom_generate(out: Path) -> None:
    """Remove the `custom_generate/` files an earlier save wrote (those Tide wrote only), and the folder if empty."""
    for name in CUSTOM_GENERATE_FILES:
        path = out / name
        if path.is_file() and written_by_tide(path):
            path.unlink()
    folder = out / Path(CUSTOM_GENERATE_NAME).parent
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
