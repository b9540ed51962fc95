"""`TideGenerationConfig`: how one generate call uses a router set (what `generate(..., tide_config=...)` takes).

Unset fields take the router repo's defaults (`TideConfig.generation`), then the class defaults;
`TideConfig.resolve_generation` merges them. Every error of `validate` names the field at fault.
"""

from __future__ import annotations

from .checks import check_choice, check_int, check_number, check_threshold_keys

__all__ = ["TideGenerationConfig", "GENERATION_FIELDS", "CHAIN_FIELDS", "SWITCHES", "MAX_DRAFT_TOPK",
           "MAX_DRAFT_NGRAM", "KV_STRATEGIES", "MODES", "KERNEL_MODES", "KV_FILLS", "FEW_ROW_LAYOUTS"]

KV_STRATEGIES = ("propagate", "recompute")
MODES = ("exit", "lossless", "auto")
KERNEL_MODES = ("auto", "torch", "kernel")
KV_FILLS = ("auto", "layerwise")
FEW_ROW_LAYOUTS = ("auto", "plain", "transposed", "packed")

# The options of one generate call (`TideGenerationConfig`), in `generate(..., tide_config=...)`.
GENERATION_FIELDS = ("exit_threshold", "thresholds", "min_layers", "kv_strategy", "mode", "prefill_exit", "batch_exits",
                     "max_draft", "draft_layer", "draft_topk", "draft_vocab_size", "draft_ngram", "head_drafts",
                     "compile", "compiled_modes", "compiled_chain", "machine_check", "row_skipping", "kernels",
                     "kv_fill", "few_row_layout")
# The fields of `TideGenerationConfig.compiled_chain`: greedy drafts (a chain, or with `draft_topk` a tree), what a
# compiled call drafts.
CHAIN_FIELDS = ("draft_layer", "max_draft", "draft_vocab_size", "draft_ngram", "draft_topk")
# Of the generation fields, the engine's switches: how Tide computes, never what (the same tokens, up to float
# rounding). For comparisons and diagnosis; a call's values are in its stats (`GenerationStats.switches`).
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
            "draft_vocab_size": 1536, "draft_ngram": 0}`), each cycle one compiled graph (`tide.decode.lossless.graph`);
            with `"draft_topk": k`, the head's k best candidates for the next position
            (`tide.decode.lossless.graphtree`). Calibration with `compiled_trials` sets it where such a chain timed
            faster than both the base model's compiled static-cache decode and the default mode compiled; a compiled
            call that sets no mode, thresholds, exit or draft option then runs it. An eager call at the defaults of a
            repo whose eager default drafts nothing (`max_draft=0`, no exits) tries it too: it runs where
            `machine_check` finds that it pays eagerly on this machine, and the base model otherwise.
        machine_check (`bool`, *optional*, defaults to `True`):
            Lossless mode at the repo's own drafting scheme (a call that names no mode or draft option): weigh the
            tokens a cycle is expected to emit (the repo's calibration record) against what a cycle costs on this
            machine in base steps, measured once per machine, repo, scheme, dtype, device and eager or compiled
            and kept in Tide's cache folder (`tide.decode.machinecheck`); where the scheme does not pay here, the
            call runs the base model, and its stats' `plan` says why. `False` runs the scheme unweighed.
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
                 compiled_modes: bool = True, compiled_chain: dict | None = None, machine_check: bool = True,
                 row_skipping: bool = True,
                 kernels: str = "auto", kv_fill: str = "auto", few_row_layout: str = "auto"):
        self.exit_threshold, self.min_layers = exit_threshold, min_layers
        self.kv_strategy, self.mode = kv_strategy, mode
        self.prefill_exit, self.batch_exits = prefill_exit, batch_exits
        self.max_draft, self.draft_layer, self.draft_topk = max_draft, draft_layer, draft_topk
        self.draft_vocab_size, self.compile, self.compiled_modes = draft_vocab_size, compile, compiled_modes
        self.draft_ngram, self.head_drafts = draft_ngram, head_drafts
        self.machine_check = machine_check
        # (copies of the dicts given; anything else is kept for `validate` to name)
        self.compiled_chain = dict(compiled_chain) if isinstance(compiled_chain, dict) else compiled_chain
        self.row_skipping, self.kernels, self.kv_fill = row_skipping, kernels, kv_fill
        self.few_row_layout = few_row_layout
        self.thresholds = {str(k): v for k, v in thresholds.items()} if isinstance(thresholds, dict) else thresholds
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
        check_choice("kv_strategy", self.kv_strategy, KV_STRATEGIES, owner="tide_config")
        check_choice("mode", self.mode, MODES, owner="tide_config")
        check_choice("kernels", self.kernels, KERNEL_MODES, owner="tide_config")
        check_choice("kv_fill", self.kv_fill, KV_FILLS, owner="tide_config")
        check_choice("few_row_layout", self.few_row_layout, FEW_ROW_LAYOUTS, owner="tide_config")
        check_int("min_layers", self.min_layers, minimum=0, owner="tide_config")
        check_int("max_draft", self.max_draft, minimum=0, owner="tide_config")
        if self.draft_layer is not None:
            check_int("draft_layer", self.draft_layer, minimum=0, owner="tide_config")
        check_int("draft_topk", self.draft_topk, minimum=1, owner="tide_config")
        if self.draft_topk > MAX_DRAFT_TOPK:
            raise ValueError(f"tide_config.draft_topk must be at most {MAX_DRAFT_TOPK} "
                             f"(candidates verified in one pass), got {self.draft_topk}.")
        check_int("draft_vocab_size", self.draft_vocab_size, minimum=0, owner="tide_config")
        check_int("draft_ngram", self.draft_ngram, minimum=0, owner="tide_config")
        if not (self.head_drafts or self.draft_ngram):
            raise ValueError("tide_config.head_drafts=False drafts n-gram continuations only: set draft_ngram too "
                             "(e.g. 3), or leave head_drafts on.")
        if self.draft_ngram > MAX_DRAFT_NGRAM:
            raise ValueError(f"tide_config.draft_ngram must be at most {MAX_DRAFT_NGRAM} (tokens matched), got "
                             f"{self.draft_ngram}.")
        if 0 < self.draft_vocab_size < MAX_DRAFT_TOPK:
            raise ValueError(f"tide_config.draft_vocab_size must be 0 (the whole vocabulary) or at least "
                             f"{MAX_DRAFT_TOPK} (the most candidates a draft offers), got {self.draft_vocab_size}.")
        for name in ("prefill_exit", "batch_exits", "head_drafts", "compile", "compiled_modes", "machine_check",
                     "row_skipping"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"tide_config.{name} must be True or False, got {getattr(self, name)!r}.")
        if self.exit_threshold is not None:
            check_number("exit_threshold", self.exit_threshold, owner="tide_config")
            if self.exit_threshold > 1.0:
                raise ValueError(f"tide_config.exit_threshold must be <= 1.0 (1.0 never exits), "
                                 f"got {self.exit_threshold}.")
        if self.thresholds is not None and not isinstance(self.thresholds, dict):
            raise ValueError(f"tide_config.thresholds must be None or a dict of thresholds keyed by checkpoint layer "
                             f"(e.g. {{'3': 0.9}}), got {self.thresholds!r}.")
        for key, value in (self.thresholds or {}).items():
            check_number(f"thresholds[{key!r}]", value, owner="tide_config")
        if self.mode == "lossless" and self.exit_threshold is not None:
            raise ValueError("tide_config: exit_threshold applies to mode='exit'. Lossless mode drafts from the exit "
                             "head at draft_layer, up to max_draft tokens per verification; set those instead, or "
                             "mode='exit' to exit at that threshold.")
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
        check_threshold_keys("tide_config.thresholds", self.thresholds, checkpoints)
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
