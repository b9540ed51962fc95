"""`TideConfig` (the saved description of a router set) and `TideGenerationConfig` (how one generate call uses it).

The split follows transformers' own model config / `GenerationConfig`. A `TideConfig` is a transformers
`PreTrainedConfig` (model type ``"tide"``), so a router repo's ``config.json`` loads through `AutoConfig` once
`tide` is imported. It holds where the routers sit, how they were calibrated and what that gave, and the base
model's identity (its name and the three numbers routers depend on: model type, hidden size, layer count,
which loading checks); never the base model's weights or config. Its `generation` field keeps the repo's
default generation options (e.g. the draft scheme calibration chose), which a call's `tide_config` overrides.

Validation lives in the two `validate` methods; every error names the field at fault.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from transformers import PreTrainedConfig

__all__ = ["TideConfig", "TideGenerationConfig", "GENERATION_FIELDS", "MAX_DRAFT_TOPK", "LABEL_RULES", "KV_STRATEGIES",
           "MODES", "EXIT_HEADS", "DRAFT_HEADS", "SWITCHES", "KERNEL_MODES", "KV_FILLS", "FEW_ROW_LAYOUTS"]

LABEL_RULES = ("top1", "cosine")
EXIT_HEADS = ("tuned", "lens")
DRAFT_HEADS = ("context", "exit")
KV_STRATEGIES = ("propagate", "recompute")
MODES = ("exit", "lossless", "auto")
KERNEL_MODES = ("auto", "torch", "kernel")
KV_FILLS = ("auto", "layerwise")
FEW_ROW_LAYOUTS = ("auto", "plain", "transposed", "packed")

# The options of one generate call (`TideGenerationConfig`), in `generate(..., tide_config=...)`.
GENERATION_FIELDS = ("exit_threshold", "thresholds", "min_layers", "kv_strategy", "mode", "prefill_exit", "batch_exits",
                     "max_draft", "draft_layer", "draft_topk", "draft_vocab_size", "draft_ngram", "head_drafts",
                     "compile", "compiled_modes", "compiled_chain", "row_skipping", "kernels", "kv_fill",
                     "few_row_layout")
# The fields of `TideGenerationConfig.compiled_chain`: a greedy draft chain, what a compiled call drafts.
CHAIN_FIELDS = ("draft_layer", "max_draft", "draft_vocab_size", "draft_ngram")
# Of those, the engine's switches: how Tide computes, never what (the same tokens, up to float rounding). For
# comparisons and diagnosis; a call's values are in its stats (`GenerationStats.switches`).
SWITCHES = ("row_skipping", "kernels", "kv_fill", "few_row_layout")
MAX_DRAFT_TOPK = 8  # tree drafts: candidates verified together with the token before them
MAX_DRAFT_NGRAM = 8  # n-gram drafts: the longest n-gram matched


class TideGenerationConfig:
    r"""
    How one `generate` call uses the routers: what `generate(..., tide_config=...)` accepts (this class or a
    dict of its fields). Unset fields take the router repo's defaults (`TideConfig.generation`), then these
    defaults.

    Args:
        exit_threshold (`float`, *optional*):
            One threshold at every checkpoint instead of the calibrated ones. `1.0` never exits; a negative value
            exits every token at the first checkpoint consulted.
        thresholds (`dict[str, float]`, *optional*):
            Per-checkpoint thresholds (keyed by layer index as a string) instead of the calibrated ones, e.g.
            from `tide.calibration.run.thresholds_for_target`.
        min_layers (`int`, *optional*, defaults to 0):
            Layers every token runs before any router is consulted.
        kv_strategy (`str`, *optional*, defaults to `"propagate"`):
            How skipped layers get K/V for an exited token: `"propagate"` or `"recompute"`.
        mode (`str`, *optional*, defaults to `"exit"`):
            `"exit"` (early exit), `"lossless"` (self-speculative decoding: drafts from the draft or exit
            head at `draft_layer`, verified by the full model; output identical to the base model's) or
            `"auto"`: lossless mode where the call allows it (one sequence, no beams, token ids) and no
            `exit_threshold` is given, exit mode otherwise. Calibration makes `"auto"` the repo's default when
            it timed lossless mode faster than exit mode.
        prefill_exit (`bool`, *optional*, defaults to `False`):
            Let prompt tokens exit early too (with propagated K/V).
        batch_exits (`bool`, *optional*, defaults to `True`):
            Exit mode on a batch of several sequences with the calibrated thresholds. Calibration sets it to
            `False` where exits that paid for one sequence timed no faster than the base model on a batch; such
            batches then run the base model. A call that sets `exit_threshold` or `thresholds` always exits.
        max_draft (`int`, *optional*, defaults to 8):
            Lossless mode: most draft tokens per verification; 0 runs the base model's own `generate`.
        draft_layer (`int`, *optional*):
            Lossless mode: the checkpoint whose draft head (or exit head) drafts tokens. If unset, the first
            checkpoint at or after a quarter of the stack.
        draft_topk (`int`, *optional*, defaults to 1):
            Lossless mode: 1 drafts a chain of up to `max_draft` tokens. k > 1 drafts one tree per cycle instead:
            the draft head's k best tokens for the next position and, with `draft_ngram`, the n-gram continuation
            (up to `max_draft` deep) as a branch, verified together in one pass with a tree mask. Greedy decoding
            follows the full model's tokens down the tree; sampling accepts children by the multi-draft rule, so
            the output keeps the base model's distribution. Models whose attention cannot take a tree mask
            (sliding windows, alibi) draft chains instead.
        draft_vocab_size (`int`, *optional*, defaults to 0):
            Lossless mode: drafts rank only the `draft_vocab_size` tokens the full model predicted most often in
            calibration (the head's rows for them: n / V of the head's cost); 0 drafts over the whole
            vocabulary. At most the router repo's `draft_vocabulary` size. A token outside costs a rejected draft,
            never output. Calibration sets it where a restricted draft timed faster.
        draft_ngram (`int`, *optional*, defaults to 0):
            Lossless mode: where the last n tokens (n = `draft_ngram` down to 2) occurred before, in the prompt or
            the output, draft the tokens that followed them then (up to `max_draft`; they cost no layer and no
            head), and the exit head's drafts elsewhere. 0: head drafts only. Calibration sets it where it timed
            no slower.
        head_drafts (`bool`, *optional*, defaults to `True`):
            Lossless mode: draft from the draft (or exit) head where no n-gram continuation is found. `False` with
            `draft_ngram` drafts n-gram continuations only; a cycle without one is a plain decode step through
            Tide's loop. Calibration sets it where no head scheme paid and n-gram drafts alone timed faster.
        compile (`bool`, *optional*, defaults to `False`):
            Compile Tide's runs of layers (between checkpoints; drafting's shallow layers; verification's deep
            layers, padded to the widest draft) with `torch.compile` on a static cache, as transformers compiles a
            static-cache decode: the call's `compile_config` (`CompileConfig`) gives the options, and on a GPU
            its default `mode="reduce-overhead"` captures CUDA graphs. Implies `cache_implementation="static"`.
            The first call compiles (seconds); later calls of the same shapes replay.
        compiled_modes (`bool`, *optional*, defaults to `True`):
            With `compile=True`: run the repo's default mode compiled. Calibration sets it to `False` where that
            timed no faster than the base model's own compiled static-cache decode, which such calls then run
            instead (the baseline a compiled call is measured by). A call that sets `mode`, thresholds or draft
            options runs them regardless.
        compiled_chain (`dict`, *optional*):
            With `compile=True`: lossless mode drafting this greedy chain (`{"draft_layer": 3, "max_draft": 1,
            "draft_vocab_size": 1536, "draft_ngram": 0}`), each cycle one compiled graph (`tide.decode.fused`).
            Calibration with `compiled_trials` sets it where such a chain timed faster than both the base model's
            compiled static-cache decode and the default mode compiled; a compiled call that sets no mode,
            thresholds, exit or draft option then runs it.
        row_skipping (`bool`, *optional*, defaults to `True`):
            Exit mode on a batch, `kv_strategy="propagate"`: a row that exits leaves the running batch (its later
            layers' K/V filled at once from its state). `False`: exited rows ride along until every row has left,
            their outputs discarded. The same tokens either way.
        kernels (`str`, *optional*, defaults to `"auto"`):
            Exit mode's checkpoint tests on CUDA: `"auto"` (the fused kernel `tide-transformers/tide-kernels` where
            it loads, for up to `tide.heads.kernels.FUSED_MAX_ROWS` rows; else the PyTorch reference), `"torch"`
            (always the reference) or `"kernel"` (the kernel for any row count, an error where it cannot load).
            CPU tensors always take the reference.
        kv_fill (`str`, *optional*, defaults to `"auto"`):
            Exit mode, `kv_strategy="propagate"`: how skipped layers get their K/V. `"auto"`: one batched
            computation for all of them where the model's layers stack (`tide.layers.kvfill`), else layer by
            layer; `"layerwise"`: always layer by layer, each layer's own code up to its cache write.
        few_row_layout (`str`, *optional*, defaults to `"auto"`):
            The CPU layout of the model's linears in Tide's passes over 2-16 positions (lossless verification,
            n-gram chunks, recompute's chunks; `tide.layers.fewrows`): `"auto"` (the layout measured fastest
            for each row count, once per model and process), or `"plain"`, `"transposed"`, `"packed"` forced.
    """

    def __init__(self, exit_threshold: float | None = None, thresholds: dict | None = None, min_layers: int = 0,
                 kv_strategy: str = "propagate", mode: str = "exit", prefill_exit: bool = False,
                 batch_exits: bool = True, max_draft: int = 8, draft_layer: int | None = None, draft_topk: int = 1,
                 draft_vocab_size: int = 0, draft_ngram: int = 0, head_drafts: bool = True, compile: bool = False,
                 compiled_modes: bool = True, compiled_chain: dict | None = None, row_skipping: bool = True,
                 kernels: str = "auto", kv_fill: str = "auto", few_row_layout: str = "auto"):
        self.exit_threshold, self.min_layers = exit_threshold, min_layers
        self.kv_strategy, self.mode = kv_strategy, mode
        self.prefill_exit, self.batch_exits = prefill_exit, batch_exits
        self.max_draft, self.draft_layer, self.draft_topk = max_draft, draft_layer, draft_topk
        self.draft_vocab_size, self.compile, self.compiled_modes = draft_vocab_size, compile, compiled_modes
        self.draft_ngram, self.head_drafts = draft_ngram, head_drafts
        self.compiled_chain = None if compiled_chain is None else dict(compiled_chain)
        self.row_skipping, self.kernels, self.kv_fill = row_skipping, kernels, kv_fill
        self.few_row_layout = few_row_layout
        self.thresholds = None if thresholds is None else {str(k): v for k, v in thresholds.items()}
        self.validate()

    @classmethod
    def from_value(cls, value, defaults: "TideGenerationConfig | None" = None) -> "TideGenerationConfig":
        """`defaults` updated with `value`: None, a dict of `GENERATION_FIELDS`, or a `TideGenerationConfig`
        (its fields that differ from the class defaults)."""
        merged = (defaults or cls()).to_dict()
        if isinstance(value, TideGenerationConfig):
            blank = cls().to_dict()
            merged.update({k: v for k, v in value.to_dict().items() if v != blank[k]})
        elif isinstance(value, dict):
            unknown = sorted(set(value) - set(GENERATION_FIELDS))
            if unknown:
                raise ValueError(f"tide_config: unknown key(s) {unknown}; "
                                 f"generation accepts {list(GENERATION_FIELDS)}.")
            merged.update(value)
        elif isinstance(value, TideConfig):  # another router set's saved defaults and thresholds
            merged.update(value.generation or {})
            if value.thresholds:
                merged["thresholds"] = dict(value.thresholds)
        elif value is not None:
            raise TypeError(f"tide_config must be a TideGenerationConfig or a dict, got {type(value).__name__}.")
        return cls(**merged)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in GENERATION_FIELDS}

    def __repr__(self) -> str:
        return f"TideGenerationConfig({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def __eq__(self, other) -> bool:
        return isinstance(other, TideGenerationConfig) and self.to_dict() == other.to_dict()

    def validate(self, checkpoints: list[int] | None = None) -> None:
        """Check every field (and, given the model's checkpoints, the ones that name a layer)."""
        _check_choice("kv_strategy", self.kv_strategy, KV_STRATEGIES, owner="tide_config")
        _check_choice("mode", self.mode, MODES, owner="tide_config")
        _check_choice("kernels", self.kernels, KERNEL_MODES, owner="tide_config")
        _check_choice("kv_fill", self.kv_fill, KV_FILLS, owner="tide_config")
        _check_choice("few_row_layout", self.few_row_layout, FEW_ROW_LAYOUTS, owner="tide_config")
        _check_int("min_layers", self.min_layers, minimum=0, owner="tide_config")
        _check_int("max_draft", self.max_draft, minimum=0, owner="tide_config")
        if self.draft_layer is not None:
            _check_int("draft_layer", self.draft_layer, minimum=0, owner="tide_config")
        _check_int("draft_topk", self.draft_topk, minimum=1, owner="tide_config")
        if self.draft_topk > MAX_DRAFT_TOPK:
            raise ValueError(f"tide_config.draft_topk must be at most {MAX_DRAFT_TOPK} "
                             f"(candidates verified in one pass), got {self.draft_topk}.")
        _check_int("draft_vocab_size", self.draft_vocab_size, minimum=0, owner="tide_config")
        _check_int("draft_ngram", self.draft_ngram, minimum=0, owner="tide_config")
        if not (self.head_drafts or self.draft_ngram):
            raise ValueError("tide_config.head_drafts=False drafts n-gram continuations only: set draft_ngram too "
                             "(e.g. 3), or leave head_drafts on.")
        if self.draft_ngram > MAX_DRAFT_NGRAM:
            raise ValueError(f"tide_config.draft_ngram must be at most {MAX_DRAFT_NGRAM} (tokens matched), got "
                             f"{self.draft_ngram}.")
        if 0 < self.draft_vocab_size < MAX_DRAFT_TOPK:
            raise ValueError(f"tide_config.draft_vocab_size must be 0 (the whole vocabulary) or at least "
                             f"{MAX_DRAFT_TOPK} (the most candidates a draft offers), got {self.draft_vocab_size}.")
        for name in ("prefill_exit", "batch_exits", "head_drafts", "compile", "compiled_modes", "row_skipping"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"tide_config.{name} must be True or False, got {getattr(self, name)!r}.")
        if self.exit_threshold is not None:
            _check_number("exit_threshold", self.exit_threshold, owner="tide_config")
            if self.exit_threshold > 1.0:
                raise ValueError(f"tide_config.exit_threshold must be <= 1.0 (1.0 never exits), "
                                 f"got {self.exit_threshold}.")
        for key, value in (self.thresholds or {}).items():
            _check_number(f"thresholds[{key!r}]", value, owner="tide_config")
        chain = self.compiled_chain
        if chain is not None:
            if not isinstance(chain, dict) or set(chain) - set(CHAIN_FIELDS) or "draft_layer" not in chain:
                raise ValueError(f"tide_config.compiled_chain must be None or a dict with draft_layer and any of "
                                 f"{list(CHAIN_FIELDS[1:])}, got {chain!r}.")
            TideGenerationConfig(**chain, mode="lossless")  # each field checked as the call's own would be
        if checkpoints is None:
            return
        if chain is not None and chain["draft_layer"] not in checkpoints:
            raise ValueError(f"tide_config.compiled_chain drafts from layer {chain['draft_layer']}, which is not a "
                             f"checkpoint: pick one of {checkpoints}.")
        _check_threshold_keys("tide_config.thresholds", self.thresholds, checkpoints)
        if self.draft_layer is not None and self.draft_layer not in checkpoints:
            raise ValueError(
                f"tide_config.draft_layer={self.draft_layer} is not a checkpoint; lossless drafts come from a "
                f"checkpoint's exit head: pick one of {checkpoints}."
            )
        if checkpoints and self.min_layers > checkpoints[-1] + 1:
            raise ValueError(
                f"tide_config.min_layers={self.min_layers} is past the last checkpoint (layer {checkpoints[-1]}, "
                f"i.e. after {checkpoints[-1] + 1} layers): no token could ever exit. Lower min_layers."
            )

    @property
    def switches(self) -> dict:
        """The engine switches (`SWITCHES`) as {name: value}: what a call's stats record."""
        return {k: getattr(self, k) for k in SWITCHES}

    def consulted_checkpoints(self, checkpoints: list[int]) -> list[int]:
        """The checkpoints whose routers are consulted: those after at least `min_layers` layers."""
        return [k for k in checkpoints if k + 1 >= self.min_layers]

    def threshold_for(self, layer: int) -> float:
        """The threshold in force at checkpoint `layer` (the override, else `thresholds`, else never exit)."""
        if self.exit_threshold is not None:
            return float(self.exit_threshold)
        if self.thresholds is not None and str(layer) in self.thresholds:
            return float(self.thresholds[str(layer)])
        return 1.0

    @property
    def has_operating_point(self) -> bool:
        """True when a token can exit: an `exit_threshold` override, or a calibrated threshold below 1.0 (all at
        1.0: calibration found that no checkpoint pays, and exit mode runs the base model)."""
        return self.exit_threshold is not None or any(t < 1.0 for t in (self.thresholds or {}).values())

    def resolve_draft_layer(self, checkpoints: list[int], num_layers: int) -> int:
        """The checkpoint lossless mode drafts from: set, else the first at or after a quarter of the stack."""
        if self.draft_layer is not None:
            return self.draft_layer
        return next((k for k in checkpoints if k + 1 >= num_layers // 4), checkpoints[-1])


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
            from . import __version__

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
                _check_number(f"thresholds[{key!r}]", value)
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
        _check_choice("label", self.label, LABEL_RULES)
        _check_choice("exit_head", self.exit_head, EXIT_HEADS)
        _check_choice("draft_head", self.draft_head, DRAFT_HEADS)
        _check_int("draft_head_mlp", self.draft_head_mlp, minimum=0)
        if self.exit_head_rank is not None:
            _check_int("exit_head_rank", self.exit_head_rank, minimum=1)
        _check_int("checkpoint_interval", self.checkpoint_interval, minimum=1)
        _check_int("router_hidden_size", self.router_hidden_size, minimum=1)
        _check_unit("target_agreement", self.target_agreement)
        _check_unit("confidence", self.confidence)
        if self.confidence >= 1.0:
            raise ValueError("TideConfig.confidence must be below 1 (a bound held with certainty excludes every exit); "
                             f"got {self.confidence}. Use e.g. 0.95 or 0.99.")
        _check_unit("cosine_threshold", self.cosine_threshold)
        if self.generation is not None and not isinstance(self.generation, dict):
            raise ValueError(f"TideConfig.generation must be a dict of generation options, got {self.generation!r}.")
        unknown = sorted(set(self.generation or {}) - set(GENERATION_FIELDS))
        if unknown:
            raise ValueError(f"TideConfig.generation: unknown key(s) {unknown}; it accepts {list(GENERATION_FIELDS)}.")
        generation = self.generation_config  # validates the defaults
        for key, value in (self.thresholds or {}).items():
            _check_number(f"thresholds[{key!r}]", value)
        if self.checkpoint_layers is not None:
            layers = self.checkpoint_layers
            if not layers or any(k < 0 for k in layers) or sorted(set(layers)) != layers:
                raise ValueError(
                    f"TideConfig.checkpoint_layers must be a non-empty, strictly increasing list of 0-based "
                    f"layer indices, got {layers}."
                )
        if num_layers is not None or self.checkpoint_layers is not None:
            checkpoints = self.resolve_checkpoints(num_layers) if num_layers is not None else self.checkpoint_layers
            _check_threshold_keys("TideConfig.thresholds", self.thresholds, checkpoints)
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
        a dict of `GENERATION_FIELDS` or a `TideGenerationConfig`)."""
        defaults = self.generation_config
        defaults.thresholds = dict(self.thresholds) if self.thresholds else None
        return TideGenerationConfig.from_value(overrides, defaults)


def _check_choice(name: str, value: Any, choices: tuple[str, ...], owner: str = "TideConfig") -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {list(choices)}, got {value!r}.")


def _check_int(name: str, value: Any, minimum: int, owner: str = "TideConfig") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}.")


def _check_number(name: str, value: Any, owner: str = "TideConfig") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite number, got {value!r}.")


def _check_threshold_keys(name: str, thresholds: dict | None, checkpoints: list[int]) -> None:
    unknown = sorted((k for k in (thresholds or {}) if not str(k).lstrip("-").isdigit() or int(k) not in checkpoints),
                     key=str)
    if unknown:
        raise ValueError(f"{name} names layers that are not checkpoints: {unknown}; the checkpoints are {checkpoints}.")


def _check_unit(name: str, value: Any) -> None:
    _check_number(name, value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"TideConfig.{name} must be in (0, 1], got {value!r}.")
