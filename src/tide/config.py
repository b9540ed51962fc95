"""`TideConfig`: where the routers sit, how they were calibrated, and how generation uses them.

A `TideConfig` is a transformers `PreTrainedConfig` (model type ``"tide"``), so a router repo's
``config.json`` loads through `AutoConfig` once `tide` is imported. It never holds the base model's
weights or its config: only the name of the base and the three numbers that routers depend on
(model type, hidden size, layer count), which loading checks.

Validation lives in `TideConfig.validate` alone; every error names the field at fault.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

from transformers import PreTrainedConfig

__all__ = ["TideConfig", "INFERENCE_FIELDS", "LABEL_RULES", "KV_STRATEGIES", "MODES", "EXIT_HEADS"]

LABEL_RULES = ("top1", "cosine")
EXIT_HEADS = ("tuned", "lens")
KV_STRATEGIES = ("propagate", "recompute")
MODES = ("exit", "lossless")

# The fields a `generate(..., tide_config=...)` call may override.
INFERENCE_FIELDS = ("exit_threshold", "min_layers", "kv_strategy", "mode", "prefill_exit", "max_draft", "draft_layer")

# Keys that transformers itself writes into every config.json, never "unknown".
_TRANSFORMERS_KEYS = {"model_type", "transformers_version", "architectures", "_name_or_path", "name_or_path", "torch_dtype", "dtype"}


class TideConfig(PreTrainedConfig):
    r"""
    Configuration of a Tide router set.

    Args:
        checkpoint_layers (`list[int]`, *optional*):
            0-based indices of the decoder layers after which a token may exit. The last layer is never a
            checkpoint (leaving there is not an exit). If unset, every `checkpoint_interval`-th layer.
        checkpoint_interval (`int`, *optional*, defaults to 4):
            Used when `checkpoint_layers` is unset: checkpoints after layers 3, 7, 11, ... (never the last).
        router_hidden_size (`int`, *optional*, defaults to 128):
            Bottleneck width of each router MLP (hidden → r → 1).
        exit_head (`str`, *optional*, defaults to `"tuned"`):
            How an exiting state becomes logits. `"tuned"`: a learned affine map per checkpoint (initialised to
            the identity, trained in calibration to match the full model's distribution) before the model's own
            final norm and head; `"lens"`: the final norm and head applied to the raw state.
        exit_head_rank (`int`, *optional*):
            With `exit_head="tuned"`, a low-rank map `h + U(V h) + b` of this rank instead of a full `H x H`
            matrix (for wide models: rank 64 on a 4096-wide model costs ~3% of the full map).
        label (`str`, *optional*, defaults to `"top1"`):
            Calibration label: `"top1"` (the checkpoint's exit, through its exit head and the model's own final
            norm and head, has the full model's top-1) or `"cosine"` (cosine(h_checkpoint, h_final) >
            `cosine_threshold`).
        cosine_threshold (`float`, *optional*, defaults to 0.98):
            The `"cosine"` label's threshold.
        target_agreement (`float`, *optional*, defaults to 0.99):
            Top-1 agreement of all tokens with the full model that calibrated thresholds guarantee on held-out
            text, checked through the decode step.
        confidence (`float`, *optional*, defaults to 0.95):
            Confidence of that guarantee (one-sided Clopper-Pearson bound on the disagreement rate).
        thresholds (`dict[str, float]`, *optional*):
            Calibrated per-checkpoint score thresholds, keyed by the layer index as a string.
        exit_threshold (`float`, *optional*):
            Overrides the calibrated thresholds at every checkpoint. `1.0` never exits; a negative value
            exits every token at the first checkpoint at or after `min_layers`.
        min_layers (`int`, *optional*, defaults to 0):
            Number of layers every token runs before any router is consulted.
        kv_strategy (`str`, *optional*, defaults to `"propagate"`):
            How skipped layers get K/V for an exited token: `"propagate"` or `"recompute"`.
        mode (`str`, *optional*, defaults to `"exit"`):
            `"exit"` (early exit) or `"lossless"` (self-speculative decoding: drafts from the exit head at
            `draft_layer`, verified by the full model; output identical to the base model's).
        prefill_exit (`bool`, *optional*, defaults to `False`):
            Let prompt tokens exit early too (with propagated K/V).
        max_draft (`int`, *optional*, defaults to 8):
            Lossless mode: most draft tokens per verification; 0 runs the base model's own `generate`
            (calibration sets it to 0 when no drafting scheme beat the base model when timed).
        draft_layer (`int`, *optional*):
            Lossless mode: the checkpoint whose exit head drafts tokens (0-based layer index). If unset, the one
            calibration chose, else the first checkpoint at or after a quarter of the stack.
        base_model_name_or_path (`str`, *optional*):
            Hub id or local path of the base model the routers were trained on.
        base_model_revision (`str`, *optional*):
            Revision of the base model.
        base_model_type, base_hidden_size, base_num_layers (*optional*):
            The base model's `model_type`, hidden size and decoder layer count, checked when routers are loaded.
        calibration (`dict`, *optional*):
            The calibration summary (see docs/router-repo-format.md); written by `tide.calibrate`.
        tide_version (`str`, *optional*):
            The Tide version that wrote the config.
    """

    model_type = "tide"

    checkpoint_layers: list[int] | None = None
    checkpoint_interval: int = 4
    router_hidden_size: int = 128
    exit_head: str = "tuned"
    exit_head_rank: int | None = None
    label: str = "top1"
    cosine_threshold: float = 0.98
    target_agreement: float = 0.99
    confidence: float = 0.95
    thresholds: dict[str, float] | None = None
    exit_threshold: float | None = None
    min_layers: int = 0
    kv_strategy: str = "propagate"
    mode: str = "exit"
    prefill_exit: bool = False
    max_draft: int = 8
    draft_layer: int | None = None
    base_model_name_or_path: str | None = None
    base_model_revision: str | None = None
    base_model_type: str | None = None
    base_hidden_size: int | None = None
    base_num_layers: int | None = None
    calibration: dict | None = None
    tide_version: str | None = None

    def __post_init__(self, **kwargs: Any):
        unknown = sorted(k for k in kwargs if k not in _TRANSFORMERS_KEYS)
        if unknown:
            warnings.warn(
                f"TideConfig: ignoring unknown keys {unknown} (written by a newer Tide version?).",
                stacklevel=3,
            )
        kwargs = {k: v for k, v in kwargs.items() if k in _TRANSFORMERS_KEYS}
        super().__post_init__(**kwargs)
        if self.tide_version is None:
            from . import __version__

            self.tide_version = __version__
        if self.checkpoint_layers is not None:
            self.checkpoint_layers = [int(k) for k in self.checkpoint_layers]
        if self.thresholds is not None:
            self.thresholds = {str(k): float(v) for k, v in self.thresholds.items()}
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self, num_layers: int | None = None) -> None:
        """Check every field; raise `ValueError` naming the first bad one."""
        num_layers = num_layers or self.base_num_layers
        _check_choice("label", self.label, LABEL_RULES)
        _check_choice("kv_strategy", self.kv_strategy, KV_STRATEGIES)
        _check_choice("mode", self.mode, MODES)
        _check_choice("exit_head", self.exit_head, EXIT_HEADS)
        if self.exit_head_rank is not None:
            _check_int("exit_head_rank", self.exit_head_rank, minimum=1)
        if self.draft_layer is not None:
            _check_int("draft_layer", self.draft_layer, minimum=0)
        _check_int("checkpoint_interval", self.checkpoint_interval, minimum=1)
        _check_int("router_hidden_size", self.router_hidden_size, minimum=1)
        _check_int("min_layers", self.min_layers, minimum=0)
        _check_int("max_draft", self.max_draft, minimum=0)
        _check_unit("target_agreement", self.target_agreement)
        _check_unit("confidence", self.confidence)
        _check_unit("cosine_threshold", self.cosine_threshold)
        if not isinstance(self.prefill_exit, bool):
            raise ValueError(f"TideConfig.prefill_exit must be True or False, got {self.prefill_exit!r}.")
        if self.exit_threshold is not None:
            _check_number("exit_threshold", self.exit_threshold)
            if self.exit_threshold > 1.0:
                raise ValueError(
                    f"TideConfig.exit_threshold must be <= 1.0 (1.0 never exits), got {self.exit_threshold}."
                )
        for key, value in (self.thresholds or {}).items():
            _check_number(f"thresholds[{key!r}]", value)
        if self.checkpoint_layers is not None:
            layers = self.checkpoint_layers
            if not layers or any(k < 0 for k in layers) or sorted(set(layers)) != layers:
                raise ValueError(
                    f"TideConfig.checkpoint_layers must be a non-empty, strictly increasing list of 0-based "
                    f"layer indices, got {layers}."
                )
        if num_layers is not None:
            self._validate_against(num_layers)

    def _validate_against(self, num_layers: int) -> None:
        layers = self.resolve_checkpoints(num_layers)
        if not layers:
            raise ValueError(
                f"TideConfig.checkpoint_interval={self.checkpoint_interval} leaves no checkpoint in a "
                f"{num_layers}-layer model; use a smaller interval or set checkpoint_layers."
            )
        if layers[-1] >= num_layers - 1:
            raise ValueError(
                f"TideConfig.checkpoint_layers={layers}: the last usable checkpoint of a {num_layers}-layer "
                f"model is layer {num_layers - 2} (leaving after the last layer is not an exit)."
            )
        if self.draft_layer is not None and self.draft_layer not in layers:
            raise ValueError(
                f"TideConfig.draft_layer={self.draft_layer} is not a checkpoint; lossless drafts come from a "
                f"checkpoint's exit head: pick one of {layers}."
            )
        if self.min_layers > layers[-1] + 1:
            raise ValueError(
                f"TideConfig.min_layers={self.min_layers} is past the last checkpoint (layer {layers[-1]}, "
                f"i.e. after {layers[-1] + 1} layers): no token could ever exit. Lower min_layers."
            )

    # ------------------------------------------------------------------ derived values
    def resolve_checkpoints(self, num_layers: int | None = None) -> list[int]:
        """The checkpoint layer indices, explicit or from the interval."""
        if self.checkpoint_layers is not None:
            return list(self.checkpoint_layers)
        num_layers = num_layers or self.base_num_layers
        if num_layers is None:
            raise ValueError("TideConfig: checkpoint_layers is unset and the number of layers is unknown.")
        step = self.checkpoint_interval
        return [k for k in range(step - 1, num_layers - 1, step)]

    def consulted_checkpoints(self, checkpoints: list[int]) -> list[int]:
        """The checkpoints whose routers are consulted: those after at least `min_layers` layers."""
        return [k for k in checkpoints if k + 1 >= self.min_layers]

    def threshold_for(self, layer: int) -> float:
        """The threshold in force at checkpoint `layer` (override, else calibrated, else never exit)."""
        if self.exit_threshold is not None:
            return float(self.exit_threshold)
        if self.thresholds is not None and str(layer) in self.thresholds:
            return float(self.thresholds[str(layer)])
        return 1.0

    def resolve_draft_layer(self, num_layers: int | None = None) -> int:
        """The checkpoint lossless mode drafts from: set, else the first at or after a quarter of the stack."""
        if self.draft_layer is not None:
            return self.draft_layer
        layers = self.resolve_checkpoints(num_layers)
        quarter = (num_layers or self.base_num_layers or 0) // 4
        return next((k for k in layers if k + 1 >= quarter), layers[-1])

    @property
    def has_operating_point(self) -> bool:
        """True when generation has thresholds to use (an override or calibrated ones)."""
        return self.exit_threshold is not None or bool(self.thresholds)

    def with_overrides(self, overrides: "TideConfig | dict | None") -> "TideConfig":
        """A copy with inference fields taken from `overrides` (a dict of `INFERENCE_FIELDS` or a config)."""
        if isinstance(overrides, TideConfig):
            changes = {k: getattr(overrides, k) for k in INFERENCE_FIELDS}
            if overrides.thresholds:
                changes["thresholds"] = overrides.thresholds
        elif isinstance(overrides, dict):
            bad = sorted(set(overrides) - set(INFERENCE_FIELDS))
            if bad:
                raise ValueError(
                    f"tide_config: unknown key(s) {bad}; generation accepts {list(INFERENCE_FIELDS)}."
                )
            changes = dict(overrides)
        elif overrides is None:
            changes = {}
        else:
            raise TypeError(f"tide_config must be a TideConfig or a dict, got {type(overrides).__name__}.")
        merged = copy.deepcopy(self)
        for key, value in changes.items():
            setattr(merged, key, value)
        merged.validate()
        return merged


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"TideConfig.{name} must be one of {list(choices)}, got {value!r}.")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"TideConfig.{name} must be an integer >= {minimum}, got {value!r}.")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"TideConfig.{name} must be a finite number, got {value!r}.")


def _check_unit(name: str, value: Any) -> None:
    _check_number(name, value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"TideConfig.{name} must be in (0, 1], got {value!r}.")
