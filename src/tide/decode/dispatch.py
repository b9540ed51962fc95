"""How an exit-mode beam search reaches transformers' beam loop without changing the base model per call.

Greedy and sampling calls run Tide's own decode loops (`decode/`) and never come here. For beams,
`install(base)` gives the base model, once for its lifetime, a `forward` that looks up the session active in
the caller's context (a `contextvars.ContextVar`); under `torch.compile` it is the base model's own forward. Inside
`activated(session)` they run that session's steps; everywhere else (other threads, other tasks, other
models, plain `base(...)` or `base.generate(...)`) they are the base model's own. Concurrent Tide calls on
one model therefore never see each other's sessions, and nothing is restored afterwards because nothing
was swapped.

A session is any object with a `base` attribute (the model it runs on) and a `forward`. This module imports
nothing of Tide.
"""

from __future__ import annotations

import functools
import types
from contextlib import contextmanager
from contextvars import ContextVar

import torch

__all__ = ["install", "activated", "active_session", "base_forward"]

_ACTIVE: ContextVar = ContextVar("tide_active_session", default=None)
_INNER_FORWARD = "_tide_inner_forward"  # a forward the base model already had as an attribute (e.g. accelerate hooks)


def active_session(base):
    """The session running on `base` in this context, or None."""
    session = _ACTIVE.get()
    return session if session is not None and session.base is base else None


@contextmanager
def activated(session):
    """Make `session` the one its base model's hooks dispatch to, in this context only."""
    token = _ACTIVE.set(session)
    try:
        yield session
    finally:
        _ACTIVE.reset(token)


def base_forward(base):
    """The base model's own forward, whatever session is active."""
    inner = base.__dict__.get(_INNER_FORWARD)
    return inner if inner is not None else types.MethodType(type(base).forward, base)


def install(base) -> None:
    """Give `base` its dispatching hooks (idempotent)."""
    if getattr(base, "_tide_dispatch_installed", False):
        return
    if "forward" in base.__dict__:
        object.__setattr__(base, _INNER_FORWARD, base.__dict__["forward"])
    # Bound methods (not closures over `base`) so that a deep copy of the model dispatches for the copy.
    object.__setattr__(base, "forward", types.MethodType(_forward_for(type(base)), base))
    object.__setattr__(base, "_tide_dispatch_installed", True)


@functools.cache
def _forward_for(cls):
    def forward(self, *args, **kwargs):
        # A compiled base model is the base model: dynamo reads no ContextVar and builds no bound method.
        session = None if torch.compiler.is_compiling() else active_session(self)
        if session is not None:
            return session.forward(*args, **kwargs)
        inner = self.__dict__.get(_INNER_FORWARD)
        return inner(*args, **kwargs) if inner is not None else cls.forward(self, *args, **kwargs)

    # generate reads forward's signature (e.g. whether it takes position_ids): keep the class's.
    return functools.update_wrapper(forward, cls.forward)
