"""Placeholder: the early-exit decode step arrives with generation support."""

from __future__ import annotations


def generate_with_tide(model, tide_config, *args, **kwargs):
    return model.base.generate(*args, **kwargs)
