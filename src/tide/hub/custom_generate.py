"""A router repo run by a plain transformers model: what the repo's `custom_generate/generate.py` calls.

`base.generate(**inputs, custom_generate=<router repo>, trust_remote_code=True)` makes transformers run the repo's
`generate.py` (written by `repos.write_custom_generate`), which calls `generate_with_router_repo`: it finds which
repo the call named, loads that repo's routers onto `base` the first time (the same checks as `from_pretrained`),
keeps the wrapped model on `base` for later calls, and runs the wrapped model's `generate` with the call's
arguments. It does not decode: the wrapped model's `generate` (`generation.py`) does, as for any Tide call.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..models import compat
from .repos import CONFIG_NAME, REPO_KWARGS, ROUTERS_NAME, load_router_repo

__all__ = ["generate_with_router_repo", "routers_on"]

# On the base model: {(repo, revision): (the local files' stamp, the wrapped model)}. A plain dict, which
# nn.Module does not register as a submodule (the wrapped model holds the base model: a module cycle otherwise).
CACHE_ATTRIBUTE = "_tide_router_repos"
_LOADING = threading.Lock()

# generate's named parameters, passed to a custom generate function whether or not the call set them (None then).
_NAMED = ("inputs", "generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
          "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask")


def generate_with_router_repo(cls, model, **kwargs):
    """`model.generate(**kwargs)` with the routers of the router repo the running call names as its
    `custom_generate`, loaded as `cls` (TideForCausalLM) onto `model` once; `tide_config` is the call's."""
    repo = compat.custom_generate_repo()
    if repo is None:
        raise RuntimeError("This is a Tide router repo's custom_generate function: call it through "
                           "model.generate(..., custom_generate=<router repo>, trust_remote_code=True).")
    if isinstance(model, cls):
        raise ValueError("This model already has Tide routers (a TideForCausalLM): call its generate without "
                         "custom_generate, or pass custom_generate to its base model (.base).")
    repo_kwargs = {k: kwargs.pop(k) for k in REPO_KWARGS if k in kwargs}
    wrapped = routers_on(cls, model, repo, **repo_kwargs)
    arguments = {k: v for k, v in kwargs.items() if not (k in _NAMED and v is None)}
    return wrapped.generate(**arguments)


def routers_on(cls, model, repo, **repo_kwargs):
    """`cls.from_pretrained(repo, base_model=model, **repo_kwargs)`, made once per model and repo and kept on
    `model`; made again where a local repo's files changed since."""
    key = (_repo_key(repo), repo_kwargs.get("revision"))
    stamp = _stamp(repo)
    held = model.__dict__.setdefault(CACHE_ATTRIBUTE, {})
    with _LOADING:
        entry = held.get(key)
        if entry is None or entry[0] != stamp:
            entry = held[key] = (stamp, load_router_repo(cls, repo, base_model=model, **repo_kwargs))
    wrapped = entry[1]
    wrapped.align_routers()  # (the base model may have moved since: routers follow its layers)
    return wrapped


def _repo_key(repo) -> str:
    """A local folder by its real path (two spellings, one repo); a Hub id as it is."""
    return os.path.realpath(repo) if os.path.isdir(repo) else str(repo)


def _stamp(repo) -> tuple | None:
    """(modification time, size) of a local repo's config and routers: a repo saved again loads again. None for a
    Hub id (its cached revision is what it is)."""
    if not os.path.isdir(repo):
        return None
    stats = [os.stat(Path(repo) / name) for name in (CONFIG_NAME, ROUTERS_NAME) if (Path(repo) / name).is_file()]
    return tuple((s.st_mtime_ns, s.st_size) for s in stats)
