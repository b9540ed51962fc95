"""English training text that every Python installation already has.

The demo model in ``tide/assets/tiny-llama`` was trained on this corpus: the
running interpreter's own documentation, i.e. the help topics in
``pydoc_data.topics`` (split into paragraphs) plus the docstrings of the
standard-library modules and their public classes and functions.  Nothing is
downloaded and nothing is read from disk beyond importing modules.  The text is
the Python documentation (PSF licence).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import io
import pkgutil
import re
import sys
import warnings

_MIN_CHARS, _MAX_CHARS = 80, 2000
# Modules that open windows, print, start things, or are test / IDE packages.
_SKIP = {"antigravity", "this", "idlelib", "tkinter", "lib2to3", "ensurepip", "venv", "pydoc_data",
         "webbrowser", "pty", "tty", "curses", "msvcrt", "winreg", "winsound"}
_SKIP_PREFIXES = ("_", "test", "turtle")


def _paragraphs(text: str) -> list[str]:
    out = []
    for para in re.split(r"\n\s*\n", inspect.cleandoc(text)):
        para = para.strip()
        if _MIN_CHARS <= len(para) <= _MAX_CHARS:
            out.append(para)
    return out


def _quiet_import(name: str):
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - ImportError, SystemExit, platform errors ...
        return None


def _modules() -> list:
    """Top-level stdlib modules, then their submodules (packages walked one by one)."""
    names = getattr(sys, "stdlib_module_names", ())
    mods = []
    for name in sorted(n for n in names if n not in _SKIP and not n.startswith(_SKIP_PREFIXES)):
        mod = _quiet_import(name)
        if mod is None:
            continue
        mods.append(mod)
        subs = sorted(info.name for info in pkgutil.walk_packages(
            getattr(mod, "__path__", []), name + ".", onerror=lambda _: None)
            if not any(part.startswith(("_", "test")) for part in info.name.split(".")[1:]))
        mods.extend(m for m in map(_quiet_import, subs) if m is not None)
    return mods


def _docstrings() -> list[str]:
    docs, seen = [], set()
    for mod in _modules():
        docs.append(inspect.getdoc(mod) or "")
        for attr in sorted(a for a in (getattr(mod, "__all__", None) or dir(mod)) if isinstance(a, str)):
            obj = getattr(mod, attr, None)
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            if id(obj) in seen or not str(getattr(obj, "__module__", "")).lstrip("_").startswith(
                    mod.__name__.split(".")[0]):
                continue  # already seen, or re-exported from another package
            seen.add(id(obj))
            docs.append(obj.__doc__ or "")
            if inspect.isclass(obj):
                for meth in sorted(vars(obj)):
                    if not meth.startswith("_") and inspect.isroutine(getattr(obj, meth, None)):
                        docs.append(getattr(obj, meth).__doc__ or "")
    return docs


def corpus_texts() -> list[str]:
    """All paragraphs (80..2000 chars), de-duplicated, in a deterministic order."""
    from pydoc_data.topics import topics

    raw = [topics[k] for k in sorted(topics)] + _docstrings()
    seen, out = set(), []
    for text in raw:
        for para in _paragraphs(text):
            if para not in seen:
                seen.add(para)
                out.append(para)
    return out


def split_corpus(texts: list[str] | None = None, heldout_fraction: float = 0.05,
                 seed: int = 0) -> tuple[list[str], list[str]]:
    """Stable (train, held_out) split: each text goes by a hash of (seed, text)."""
    texts = corpus_texts() if texts is None else texts
    train, held = [], []
    for text in texts:
        h = hashlib.sha256(f"{seed}\0{text}".encode()).digest()
        (held if int.from_bytes(h[:8], "big") / 2**64 < heldout_fraction else train).append(text)
    return train, held
