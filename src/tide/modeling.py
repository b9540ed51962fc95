"""`TideForCausalLM`: a loaded HF causal LM plus its routers, behind the standard transformers API.

The wrapper does not fork the base model: `forward` is the base model's, unknown attributes are
forwarded to it, and `generate` runs transformers' own generation loop on the base model, with Tide's
decode step serving it only while a `tide_config` with an operating point is in force (`generation.py`).
File and Hub I/O lives in `hub/repos.py`; the decode step in `decode/exits/session.py`.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationMixin, PreTrainedModel

from .config import TideConfig
from .decode.cachepool import StaticCachePool
from .generation import generate_with_tide
from .heads.draftvocab import restricted_logits
from .heads.kernels import norm_params, router_exit
from .heads.router import CheckpointTest, RouterBank, exit_decision
from .hub.custom_generate import generate_with_router_repo
from .hub.repos import BaseModelTokenizerLoader, load_router_repo, push_router_repo, save_router_repo
from .layers import fewrows
from .layers.kvprobe import kv_plan
from .models.architectures import ModelParts, resolve

__all__ = ["TideForCausalLM"]


class TideForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = TideConfig
    base_model_prefix = "base"
    main_input_name = "input_ids"

    def __init__(self, config: TideConfig, base_model: PreTrainedModel | None = None):
        if base_model is None:
            raise ValueError(
                "TideForCausalLM wraps a loaded base model: use TideForCausalLM.from_base(model, config) or "
                "TideForCausalLM.from_pretrained(router_repo)."
            )
        super().__init__(config)
        self.base = base_model
        self.parts: ModelParts = resolve(base_model)
        kv_plan(self.parts)  # what a skipped layer computes: its K/V only, probed once per model here (kvprobe.py)
        config.validate(num_layers=self.parts.num_layers)
        self.routers = RouterBank(
            hidden_size=base_model.config.get_text_config().hidden_size,
            checkpoints=config.resolve_checkpoints(self.parts.num_layers),
            bottleneck=config.router_hidden_size,
            exit_head=config.exit_head,
            rank=config.exit_head_rank,
            draft_layers=config.draft_head_layers(self.parts.num_layers),
            draft_mlp=config.draft_head_mlp,
        )
        self.generation_config = base_model.generation_config
        self.last_stats = None
        self.span_runners: dict = {}  # compile options -> layers.spans.SpanRunner: compiled runs of layers, kept
        self.static_caches = StaticCachePool()  # lent to compiled calls, the same across calls (decode/cachepool.py)
        # token ids [n] the full model predicted most in calibration, most frequent first (draftvocab.py); None: none
        self.draft_vocabulary: torch.Tensor | None = None
        self.align_routers()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_base(cls, base_model: PreTrainedModel, config: TideConfig | None = None, seed: int | None = 0):
        """Wrap a loaded causal LM with freshly initialised routers (what calibration starts from). `config` is
        copied, never changed."""
        _check_not_tide(base_model)
        config = TideConfig() if config is None else copy.deepcopy(config)
        text = base_model.config.get_text_config()
        config.base_model_name_or_path = config.base_model_name_or_path or base_model.config.name_or_path or None
        config.base_model_type = text.model_type
        config.base_hidden_size = text.hidden_size
        config.base_num_layers = len(resolve(base_model).layers)
        config.validate()
        config.checkpoint_layers = config.resolve_checkpoints()
        if seed is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return cls(config, base_model)
        return cls(config, base_model)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, base_model=None, **kwargs):
        """Load a router repo (local directory or Hub id) and its base model (or reuse `base_model`)."""
        if base_model is not None:
            _check_not_tide(base_model)
        return load_router_repo(cls, pretrained_model_name_or_path, base_model=base_model, **kwargs)

    def save_pretrained(self, save_directory, push_to_hub: bool = False, custom_generate: bool = True, **kwargs):
        """Write the router repo: config JSON, router safetensors, a model card and (unless `custom_generate=False`)
        `custom_generate/`, which lets a plain transformers model run it. Never base weights."""
        save_router_repo(self, save_directory, custom_generate)
        if push_to_hub:
            self.push_to_hub(kwargs.pop("repo_id", None) or str(save_directory), custom_generate=custom_generate,
                             **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload the router repo files (and only those) to `repo_id` on the Hub; `custom_generate=False`: without
        the `custom_generate/` files."""
        return push_router_repo(self, repo_id, **kwargs)

    @classmethod
    def generate_with_router_repo(cls, model, **kwargs):
        """What a router repo's `custom_generate/generate.py` runs for `model.generate(..., custom_generate=<repo>,
        trust_remote_code=True)`: the repo's routers, loaded onto `model` once (`hub/custom_generate.py`), generate
        with the call's arguments and `tide_config`."""
        return generate_with_router_repo(cls, model, **kwargs)

    def _init_weights(self, module):  # routers are initialised in RouterBank; never touch the base.
        pass

    # ------------------------------------------------------------------ placement
    def align_routers(self) -> None:
        """Put each router on the device and dtype of its checkpoint layer (e.g. after a `device_map`)."""
        for layer in self.routers.checkpoints:
            param = next(self.parts.layers[layer].parameters())
            self.routers[layer].to(device=param.device, dtype=param.dtype)

    def route(self, layer: int, hidden: torch.Tensor, threshold: float):
        """Scores fp32 [...], exit mask bool [...] and exit states [..., H] at checkpoint `layer`.

        hidden: [..., H], the layer's raw output. The exit state is the checkpoint's exit head applied to it
        (`Router.exit_state`); norm, router, sigmoid and threshold on it go through `kernels.router_exit` (the
        fused CUDA kernel when loaded, else its PyTorch reference) when they share a device; across devices,
        step by step. Used both to score held-out tokens at calibration and to decide exits at generation.
        """
        self.routers.check_placement(layer, hidden)
        router = self.routers[layer]
        state = router.exit_state(hidden)
        router_device = router.down.weight.device
        norm_param = next(self.parts.norm.parameters(), None)
        norm_device = norm_param.device if norm_param is not None else hidden.device
        if router_device == norm_device == hidden.device:
            scores, exits = router_exit(state, self.parts.norm, router, threshold)
            return scores, exits, state
        scores = self.routers.score(layer, self.parts.final_norm(state.to(norm_device)).to(router_device))
        scores = scores.to(hidden.device)
        return scores, exit_decision(scores, threshold), state

    def exit_tests(self, thresholds: dict[int, float]) -> dict:
        """{layer: test} for the checkpoints in `thresholds`; test(hidden [N, H]) -> (scores, exits, exit states).

        A `CheckpointTest` (few small ops, the same result as `route` up to float rounding; on CUDA the fused
        kernel where one is loaded) where the final norm is one `norm_params` describes; `route` otherwise.
        """
        params = norm_params(self.parts.norm)
        tests = {}
        for layer, threshold in thresholds.items():
            router = self.routers[layer]
            self.routers.check_placement(layer, next(self.parts.layers[layer].parameters()))
            device = router.down.weight.device
            if params is None:
                tests[layer] = functools.partial(self.route, layer, threshold=threshold)
            else:
                weight, bias, kind, eps = params
                bias = None if bias is None else bias.to(device)
                tests[layer] = CheckpointTest(router, weight.to(device), bias, kind, eps, threshold)
        return tests

    def exit_logits(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of a token leaving after checkpoint `layer`: head(final_norm(exit head(hidden))).
        [..., H] -> [..., V]."""
        state = self.routers[layer].exit_state(hidden)
        return self.parts.logits_from_normed(self.parts.final_norm(state))

    def draft_logits(self, layer: int, hidden: torch.Tensor, context: torch.Tensor | None, vocab_size: int = 0):
        """Lossless drafts from checkpoint `layer`: (logits [..., V], the draft's normed state [..., H]).

        hidden: the token's layer output [..., H]; context: the full model's final normed state at the position
        before it ([..., H]; None where there is none, read as zeros). The checkpoint's draft head where it has
        one, else its exit head (which ignores the context). The normed state stands in for the context of the
        next draft in a chain, whose real one is not computed yet. `vocab_size` > 0: only the first that many
        ids of `draft_vocabulary` get logits (-inf elsewhere)."""
        return self._draft_function(layer, vocab_size)(hidden, context)

    def draft_function(self, layer: int, vocab_size: int = 0):
        """`draft_logits` of checkpoint `layer` as a function of (hidden, context) that compiled code can call (the
        draft vocabulary's head rows are looked up here, not inside it); None where `draft_logits` is replaced, on
        the model or in a subclass: callers then call that."""
        if "draft_logits" in self.__dict__ or type(self).draft_logits is not TideForCausalLM.draft_logits:
            return None
        return self._draft_function(layer, vocab_size)

    def _draft_function(self, layer: int, vocab_size: int):
        rows = self._draft_head(vocab_size) if vocab_size else None
        return functools.partial(_draft_logits, self.parts, self.routers[layer], rows, self.num_head_rows)

    @property
    def num_head_rows(self) -> int:
        """The head's rows: the logits' last dimension."""
        weight = getattr(self.parts.lm_head, "weight", None)
        return weight.shape[0] if weight is not None else self.base.config.get_text_config().vocab_size

    def check_draft_vocab_size(self, size: int) -> None:
        """Raise unless `draft_vocabulary` holds at least `size` ids."""
        held = 0 if self.draft_vocabulary is None else self.draft_vocabulary.numel()
        if size > held:
            raise ValueError(f"draft_vocab_size={size}, but these routers' draft vocabulary holds {held} tokens"
                             + (" (none: calibrate to make one)" if not held else "") + "; use at most that, or 0.")

    def _draft_head(self, size: int):
        """(ids [size] on the head's device, the head's rows for them or None): the first `size` ids of
        `draft_vocabulary`, kept until the vocabulary (replaced or changed in place) or the head's weight changes."""
        vocabulary, weight = self.draft_vocabulary, getattr(self.parts.lm_head, "weight", None)
        key = (size, vocabulary is not None and fewrows.copy_key(vocabulary),
               weight is not None and fewrows.copy_key(weight))
        held = self.__dict__.get("_draft_head_rows")
        if held is None or held[0] is not vocabulary or held[1] != key:  # (held[0] keeps the vocabulary alive)
            self.check_draft_vocab_size(size)
            on_head = weight is not None and weight.device.type != "meta"  # (an offloaded head: logits pick ids)
            ids = vocabulary[:size].to(weight.device if on_head else vocabulary.device)
            held = (vocabulary, key, ids, self.parts.head_rows(ids))
            self.__dict__["_draft_head_rows"] = held
        return held[2], held[3]

    # ------------------------------------------------------------------ the base model's API
    def __getattr__(self, name: str):
        """Attributes the wrapper does not have come from the base model (as peft's wrappers do)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self.__dict__.get("_modules", {}).get("base")
            if base is None or name.startswith("__"):
                raise
            return getattr(base, name)

    def forward(self, *args, **kwargs):
        return self.base(*args, **kwargs)

    def get_input_embeddings(self) -> nn.Module:
        return self.base.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.base.get_output_embeddings()

    def prepare_inputs_for_generation(self, *args, **kwargs):
        return self.base.prepare_inputs_for_generation(*args, **kwargs)

    @property
    def checkpoints(self) -> list[int]:
        return list(self.routers.checkpoints)

    def generate(self, *args, tide_config=None, **kwargs):
        """`generate` of the base model, with early exit while a `tide_config` operating point is in force."""
        return generate_with_tide(self, tide_config, *args, **kwargs)


def _check_not_tide(base_model) -> None:
    if isinstance(base_model, TideForCausalLM):
        raise ValueError("This model is already a Tide model (TideForCausalLM): use it directly, or pass its .base "
                         "(the base model it wraps) to put other routers on that base model.")


def _register_auto_classes() -> None:

    AutoConfig.register("tide", TideConfig, exist_ok=True)
    AutoModelForCausalLM.register(TideConfig, TideForCausalLM, exist_ok=True)
    AutoTokenizer.register(TideConfig, tokenizer_class=BaseModelTokenizerLoader, exist_ok=True)


_register_auto_classes()


def _draft_logits(parts: ModelParts, router, rows: tuple | None, num_head_rows: int, hidden: torch.Tensor,
                  context: torch.Tensor | None):
    """(logits, normed state) of `router`'s draft head (its exit head where it has none) on `hidden` and `context`;
    `rows`: (ids, their head rows) of a draft vocabulary, or None for the whole head."""
    if router.draft is None:
        state = router.exit_state(hidden)
    else:
        state = router.draft(hidden, torch.zeros_like(hidden) if context is None else context)
    normed = parts.final_norm(state)
    if rows is None:
        return parts.logits_from_normed(normed), normed
    return restricted_logits(parts, normed, *rows, num_head_rows), normed
