"""`TideConfig` (the saved description of a router set) and `TideGenerationConfig` (how one generate call uses it).

The split follows transformers' own model config / `GenerationConfig`. A `TideConfig` is a transformers
`PreTrainedConfig` (model type ``"tide"``), so a router repo's ``config.json`` loads through `AutoConfig` once
`tide` is imported. It holds where the routers sit, how they were calibrated and what that gave, and the base
model's identity (its name and the three numbers routers depend on: model type, hidden size, layer count,
which loading checks); never the base model's weights or config. Its `generation` field keeps the repo's
default generation options (e.g. the draft scheme calibration chose), which a call's `tide_config` overrides.

`TideGenerationConfig` and its fields live in `config/generation.py`, re-exported here. Validation lives in the two
`validate` methods (`config/checks.py`); every error names the field at fault.
"""

from __future__ import annotations

import warnings
from typing import Any

from transformers import PreTrainedConfig

from .checks import check_choice, check_int, check_number, check_threshold_keys, check_unit
from .generation import (CHAIN_FIELDS, FEW_ROW_LAYOUTS, GENERATION_FIELDS, KERNEL_MODES, KV_FILLS, KV_STRATEGIES,
                         MAX_DRAFT_NGRAM, MAX_DRAFT_TOPK, MODES, SWITCHES, TideGenerationConfig)

__all__ = ["TideConfig", "TideGenerationConfig", "GENERATION_FIELDS", "MAX_DRAFT_TOPK", "LABEL_RULES", "KV_STRATEGIES",
           "MODES", "EXIT_HEADS", "DRAFT_HEADS", "SWITCHES", "KERNEL_MODES", "KV_FILLS", "FEW_ROW_LAYOUTS",
           "CHAIN_FIELDS", "MAX_DRAFT_NGRAM"]

LABEL_RULES = ("top1", "cosine")
EXIT_HEADS = ("tuned", "lens")
DRAFT_HEADS = ("context", "exit")

# Keys that transformers itself writes into every config.json, never "unknown".
_TRANSFORMERS_KEYS = {"model_type", "transformers_version", "architectures", "_name_or_path", "name_or_path",
                      "torch_dtype", "dtype"}


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
            matrix (for wide models: rank 64 on a 4096-wide model costs ~3% of the full map). Draft heads take
            the same rank.
        draft_head (`str`, *optional*, defaults to `"context"`):
            What lossless mode drafts from. `"context"`: at each checkpoint in the first half of the stack, a
            learned draft head that reads the token's state there and the full model's final normed state at
            the position before it (`router.DraftHead`, trained in calibration); `"exit"`: the checkpoint's
            exit head alone.
        draft_head_mlp (`int`, *optional*, defaults to 256):
            Width of the draft heads' two-layer term on the token's state and the context (0: affine heads).
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
        generation (`dict`, *optional*):
            The repo's default generation options (`TideGenerationConfig` fields, e.g. the draft scheme
            calibration chose); a call's `tide_config` overrides them. Generation fields given to `TideConfig`
            directly (e.g. `TideConfig(min_layers=2)`, or the top-level keys of older config files) land here.
        base_model_name_or_path (`str`, *optional*):
            Hub id or local path of the base model the routers were trained on.
        base_model_revision (`str`, *optional*):
            Revision of the base model.
        base_model_type, base_hidden_size, base_num_layers (*optional*):
            The base model's `model_type`, hidden size and decoder layer count, checked when routers are loaded.
        calibration (`dict`, *optional*):
            The calibration summary as saved (see docs/router-repo-format.md); written by `tide.calibrate`.
            `tide.records.CalibrationRecord.from_dict` reads it as typed records.
        tide_version (`str`, *optional*):
            The Tide version that wrote the config.
    """

    model_type = "tide"

    checkpoint_layers: list[int] | None = None
    checkpoint_interval: int = 4
    router_hidden_size: int = 128
    exit_head: str = "tuned"
    exit_head_rank: int | None = None
    draft_head: str = "context"
    draft_head_mlp: int = 256
    label: str = "top1"
    cosine_threshold: float = 0.98
    target_agreement: float = 0.99
    confidence: float = 0.95
    thresholds: dict[str, float] | None = None
    generation: dict | None = None
    base_model_name_or_path: str | None = None
    base_model_revision: str | None = None
    base_model_type: str | None = None
    base_hidden_size: int | None = None
    base_num_layers: int | None = None
    calibration: dict | None = None
    tide_version: str | None = None

    def __post_init__(self, **kwargs: Any):
        defaults = {k: kwargs.pop(k) for k in list(kwargs) if k in GENERATION_FIELDS and k != "thresholds"}
        if defaults:
            self.generation = {**(self.generation or {}), **defaults}
        unknown = sorted(k for k in kwargs if k not in _TRANSFORMERS_KEYS)
        if unknown:
            warnings.warn(
                f"TideConfig: ignoring unknown keys {unknown} (written by a newer Tide version?).",
                stacklevel=3,
            )
        kwargs = {k: v for k, v in kwargs.items() if k in _TRANSFORMERS_KEYS}
        super().__post_init__(**kwargs)
        if self.tide_version is None:
            from .. import __version__

            self.tide_version = __version__
        if self.checkpoint_layers is not None:
            if not isinstance(self.checkpoint_layers, (list, tuple)) or any(
                    isinstance(k, bool) or not isinstance(k, int) for k in self.checkpoint_layers):
                raise ValueError(f"TideConfig.checkpoint_layers must be a list of integer layer indices, got "
                                 f"{self.checkpoint_layers!r}.")
            self.checkpoint_layers = list(self.checkpoint_layers)
        if self.thresholds is not None:
            if not isinstance(self.thresholds, dict):
                raise ValueError(f"TideConfig.thresholds must be a dict {{layer: threshold}}, got {self.thresholds!r}.")
            for key, value in self.thresholds.items():
                check_number(f"thresholds[{key!r}]", value)
            self.thresholds = {str(k): float(v) for k, v in self.thresholds.items()}
        self.validate()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """A saved config (what `from_pretrained` and `AutoConfig` read): like unknown top-level keys, generation
        options this version does not know (written by a newer Tide?) are ignored with a warning."""
        generation = config_dict.get("generation")
        unknown = sorted(set(generation) - set(GENERATION_FIELDS)) if isinstance(generation, dict) else []
        if unknown:
            warnings.warn(f"TideConfig: ignoring unknown generation keys {unknown} (written by a newer Tide version?).",
                          stacklevel=2)
            config_dict = {**config_dict, "generation": {k: v for k, v in generation.items() if k not in unknown}}
        return super().from_dict(config_dict, **kwargs)

    # ------------------------------------------------------------------ validation
    def validate(self, num_layers: int | None = None) -> None:
        """Check every field; raise `ValueError` naming the first bad one."""
        num_layers = num_layers or self.base_num_layers
        check_choice("label", self.label, LABEL_RULES)
        check_choice("exit_head", self.exit_head, EXIT_HEADS)
        check_choice("draft_head", self.draft_head, DRAFT_HEADS)
        check_int("draft_head_mlp", self.draft_head_mlp, minimum=0)
        if self.exit_head_rank is not None:
            check_int("exit_head_rank", self.exit_head_rank, minimum=1)
        check_int("checkpoint_interval", self.checkpoint_interval, minimum=1)
        check_int("router_hidden_size", self.router_hidden_size, minimum=1)
        check_unit("target_agreement", self.target_agreement)
        check_unit("confidence", self.confidence)
        if self.confidence >= 1.0:
            raise ValueError("TideConfig.confidence must be below 1 (a bound held with certainty excludes every exit); "
                             f"got {self.confidence}. Use e.g. 0.95 or 0.99.")
        check_unit("cosine_threshold", self.cosine_threshold)
        if self.generation is not None and not isinstance(self.generation, dict):
            raise ValueError(f"TideConfig.generation must be a dict of generation options, got {self.generation!r}.")
        unknown = sorted(set(self.generation or {}) - set(GENERATION_FIELDS))
        if unknown:
            raise ValueError(f"TideConfig.generation: unknown key(s) {unknown}; it accepts {list(GENERATION_FIELDS)}.")
        try:
            generation = self.generation_config  # validates the defaults
        except ValueError as err:
            raise ValueError(f"TideConfig.generation (the repo's default generation options, \"generation\" in its "
                             f"config.json) is not valid: {err} Fix or remove that entry, or recalibrate.") from err
        for key, value in (self.thresholds or {}).items():
            check_number(f"thresholds[{key!r}]", value)
        if self.checkpoint_layers is not None:
            layers = self.checkpoint_layers
            if not layers or any(k < 0 for k in layers) or sorted(set(layers)) != layers:
                raise ValueError(
                    f"TideConfig.checkpoint_layers must be a non-empty, strictly increasing list of 0-based "
                    f"layer indices, got {layers}."
                )
        if num_layers is not None or self.checkpoint_layers is not None:
            checkpoints = self.resolve_checkpoints(num_layers) if num_layers is not None else self.checkpoint_layers
            check_threshold_keys("TideConfig.thresholds", self.thresholds, checkpoints)
        if num_layers is not None:
            self._validate_against(num_layers)
            generation.validate(checkpoints=self.resolve_checkpoints(num_layers))

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

    # ------------------------------------------------------------------ derived values
    def draft_head_layers(self, num_layers: int | None = None) -> list[int]:
        """The checkpoints that get a context draft head: those in the first half of the stack (drafting from
        deeper layers cannot pay for its verification), none with `draft_head="exit"`."""
        num_layers = num_layers or self.base_num_layers
        if self.draft_head != "context":
            return []
        return [k for k in self.resolve_checkpoints(num_layers) if k < num_layers // 2]

    def resolve_checkpoints(self, num_layers: int | None = None) -> list[int]:
        """The checkpoint layer indices, explicit or from the interval."""
        if self.checkpoint_layers is not None:
            return list(self.checkpoint_layers)
        num_layers = num_layers or self.base_num_layers
        if num_layers is None:
            raise ValueError("TideConfig: checkpoint_layers is unset and the number of layers is unknown.")
        step = self.checkpoint_interval
        return [k for k in range(step - 1, num_layers - 1, step)]

    @property
    def generation_config(self) -> TideGenerationConfig:
        """The repo's default generation options (a new object; change them with `set_generation_defaults`)."""
        return TideGenerationConfig(**(self.generation or {}))

    def set_generation_defaults(self, **changes) -> None:
        """Set default generation options saved with the repo (e.g. `draft_layer=3, max_draft=2`)."""
        updated = TideGenerationConfig.from_value(changes, self.generation_config)
        blank = TideGenerationConfig().to_dict()
        self.generation = {k: v for k, v in updated.to_dict().items() if v != blank[k] and k != "thresholds"} or None

    def resolve_generation(self, overrides=None) -> TideGenerationConfig:
        """The options a call runs with: the repo's defaults and calibrated thresholds, then `overrides` (None,
        a dict of `GENERATION_FIELDS`, a `TideGenerationConfig`, or another `TideConfig`: its saved defaults and
        thresholds)."""
        defaults = self.generation_config
        defaults.thresholds = dict(self.thresholds) if self.thresholds else None
        if isinstance(overrides, TideConfig):  # another router set's saved defaults and thresholds
            merged = {**defaults.to_dict(), **(overrides.generation or {})}
            if overrides.thresholds:
                merged["thresholds"] = dict(overrides.thresholds)
            return TideGenerationConfig(**merged)
        return TideGenerationConfig.from_value(overrides, defaults)
