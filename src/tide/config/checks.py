"""The checks behind `TideConfig.validate` and `TideGenerationConfig.validate`: each error names the field."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_choice", "check_int", "check_number", "check_threshold_keys", "check_unit"]


def check_choice(name: str, value: Any, choices: tuple[str, ...], owner: str = "TideConfig") -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {list(choices)}, got {value!r}.")


def check_int(name: str, value: Any, minimum: int, owner: str = "TideConfig") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}.")


def check_number(name: str, value: Any, owner: str = "TideConfig") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite number, got {value!r}.")


def check_threshold_keys(name: str, thresholds: dict | None, checkpoints: list[int]) -> None:
    unknown = sorted((k for k in (thresholds or {}) if not str(k).lstrip("-").isdigit() or int(k) not in checkpoints),
                     key=str)
    if unknown:
        raise ValueError(f"{name} names layers that are not checkpoints: {unknown}; the checkpoints are {checkpoints}.")


def check_unit(name: str, value: Any) -> None:
    check_number(name, value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"TideConfig.{name} must be in (0, 1], got {value!r}.")
