"""How an exit-mode beam search reaches transformers' beam loop without changing the base model per call.

Greedy and sampling calls run Tide's own decode loops (`decode/`) and never come here. For beams,
`install(base)` gives the base model, once for its lifetime, a `forward` that looks up the session active in
the caller's context (a `contextvars.ContextVar`); under `torch.compile` it is the base model's own forward. Inside
`activated(session)` they run that session's steps; everywhere else (other threads, other tasks, other
models, plain `base(...)` or `base.generate(...)`) they are the base model's own. Concurrent Tide calls on
one model therefore never see each other's sessions, and nothing is restored afterwards because nothing
was swapped.

A session is any object with a `base` attribute (the model it runs on) and a `forward`. The forward is installed
as layers' forwards are (`layers.calls.install_forward`).
"""

from __future__ import annotations

import functools
import types
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..layers.calls import INNER_FORWARD, call_own, install_forward

__all__ = ["install", "activated", "active_session", "base_forward"]

_ACTIVE: ContextVar = ContextVar("tide_active_session", default=None)


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
    inner = base.__dict__.get(INNER_FORWARD)  # a forward it already had as an attribute (e.g. accelerate hooks)
    return inner if inner is not None else types.MethodType(type(base).forward, base)


def install(base) -> None:
    """Give `base` its dispatching hooks (idempotent)."""
    install_forward(base, _forward_for)


@functools.cache
def _forward_for(cls):
    def forward(self, *args, **kwargs):
        # A compiled base model is the base model: dynamo reads no ContextVar and builds no bound method.
        session = None if torch.compiler.is_compiling() else active_session(self)
        if session is not None:
            return session.forward(*args, **kwargs)
        return call_own(self, cls, *args, **kwargs)

    # generate reads forward's signature (e.g. whether it takes position_ids): keep the class's.
    return functools.update_wrapper(forward, cls.forward)
