"""Architecture knowledge, as data: one table keyed by `config.model_type`.

Each entry says where a causal LM keeps its backbone, decoder layers, final norm (plus OPT's
`project_out`) and head, how a decoder layer receives the KV cache, whether it returns a tuple, and
which config attribute soft-caps the final logits. Nothing here runs a model; `resolve(model)` only
looks modules up and returns them as `ModelParts`.

A model type missing from the table is tried with a structural probe (`probe_spec`); if that fails,
the error lists the supported types and shows how to `register` one.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace

import torch
import transformers
from torch import nn

from .compat import cache_layer_kinds

__all__ = ["ArchSpec", "KVProjections", "ModelParts", "ARCHITECTURES", "register", "resolve", "supported_model_types",
           "refusal_reason"]


@dataclass(frozen=True)
class KVProjections:
    """The batched K/V fill of skipped layers (`kvfill.py`), on by default (`ArchSpec.kv_projections=None` turns it
    off).

    What is stacked is found on the model itself: the K/V linears (separate or the K/V rows of a fused qkv) and
    the input norm they read, by the probe (`kvprobe.kv_plan`); norms and the rotary convention recognised by what
    they compute (`layers/kvforms.py`); rotary from the layer calls' `position_embeddings` or the attention's table of
    sin and cos per position (none with alibi or learned positions). The stack is checked once against what each
    layer's own code wrote in the probe; a model whose layers do not fit fills layer by layer, and
    `kvfill.fill_path(parts)` says why.
    """

    k_norm: str | None = None  # per-head norm on K before rotary, when not the attention's `k_norm`/`k_layernorm`


@dataclass(frozen=True)
class ArchSpec:
    """Where things live in one model family (dotted paths from the `*ForCausalLM` module)."""

    backbone: str  # module whose forward embeds, builds masks/rotary, runs the layers and the final norm
    layers: str  # the nn.ModuleList of decoder layers
    norm: str  # final norm applied to the last layer's output
    lm_head: str = "lm_head"
    post_norm: str | None = None  # applied after the norm, before the head (OPT's project_out)
    cache_arg: str | int = "past_key_values"  # how a layer receives the cache: kwarg name or position
    returns_tuple: bool = False  # layer returns (hidden_states, ...) instead of a tensor
    softcap_attr: str | None = None  # config attribute holding the final-logit soft-cap
    logit_scale: float | None = None  # the head's logits are multiplied by this (probed models, e.g. Cohere, Granite)
    layer_types_attr: str | None = "layer_types"  # config attribute listing per-layer attention types
    query_proj: str | None = None  # separate query projection inside a layer (skipped on K/V-only passes)
    # the batched K/V fill of skipped layers (checked against the layers' own code; None: layer by layer)
    kv_projections: KVProjections | None = KVProjections()
    tree_drafts: bool = True  # positions come from position_ids, so lossless tree drafts can share one (not alibi)


_DECODER = ArchSpec(backbone="model", layers="model.layers", norm="model.norm", query_proj="self_attn.q_proj")

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": _DECODER,
    "mistral": _DECODER,
    "mixtral": _DECODER,
    "qwen2": _DECODER,
    "qwen3": _DECODER,
    "gemma": _DECODER,
    "gemma2": replace(_DECODER, softcap_attr="final_logit_softcapping"),  # per-layer-type rotary: filled per type
    "gemma3_text": replace(_DECODER, softcap_attr="final_logit_softcapping"),
    "phi3": replace(_DECODER, query_proj=None),  # fused qkv_proj: its K/V rows are stacked
    "phi": replace(_DECODER, norm="model.final_layernorm"),  # LayerNorm, partial rotary
    "gpt2": ArchSpec(backbone="transformer", layers="transformer.h", norm="transformer.ln_f", cache_arg=1),
    "gpt_neox": ArchSpec(
        backbone="gpt_neox",
        layers="gpt_neox.layers",
        norm="gpt_neox.final_layer_norm",
        cache_arg="layer_past",
    ),
    "opt": ArchSpec(
        backbone="model.decoder",
        layers="model.decoder.layers",
        norm="model.decoder.final_layer_norm",
        post_norm="model.decoder.project_out",
        query_proj="self_attn.q_proj",
    ),
    "falcon": ArchSpec(
        backbone="transformer",
        layers="transformer.h",
        norm="transformer.ln_f",
        cache_arg="layer_past",
        returns_tuple=True,
        tree_drafts=False,  # alibi biases follow the attention mask, not position_ids
    ),
}

_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "final_norm", "norm_f", "layer_norm", "ln_out")
_CACHE_ARGS = ("past_key_values", "past_key_value", "layer_past", "cache", "past_key_value_state")


def register(model_type: str, spec: ArchSpec) -> None:
    """Add or replace a model family, e.g. `tide.register("my_llama", ArchSpec(...))`."""
    ARCHITECTURES[model_type] = spec


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


@dataclass
class ModelParts:
    """The modules of one loaded model that Tide drives directly."""

    spec: ArchSpec
    backbone: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    post_norm: nn.Module | None
    lm_head: nn.Module
    softcap: float | None
    layer_types: list[str] | None
    registered: bool = True  # False for a probed model: nothing is assumed about its layers' arguments

    @property
    def uniform_layers(self) -> bool:
        """Every decoder layer receives the same arguments (one attention type, a registered family)."""
        return self.registered and (not self.layer_types or len(set(self.layer_types)) == 1)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own final norm: what the head (and every router) sees. [..., H] -> [..., H]."""
        return self.norm(hidden)

    def logits_from_normed(self, normed: torch.Tensor, head: tuple | None = None) -> torch.Tensor:
        """Head (+ OPT's project_out, + soft-cap) on a normed state. [..., H] -> [..., V], or with `head` (some
        rows of the head, from `head_rows`) only those rows' logits [..., n]."""
        if self.post_norm is not None:
            normed = self.post_norm(normed)
        logits = self.lm_head(normed) if head is None else nn.functional.linear(normed.to(head[0].device), *head)
        return self._scaled(logits)

    def logits_for_ids(self, normed: torch.Tensor, ids: torch.Tensor, rows: tuple | None = None) -> torch.Tensor:
        """Each row's logits for its own token ids, without the rest of the head. normed: [..., M, H] (leading
        dimensions: several states per row, e.g. several heads'), ids: [M, C] -> [..., M, C]. `rows`: the head's
        rows for `ids` already read, (weight [M, C, H], bias [M, C] or None). Where the head's rows cannot be read
        alone (`head_rows_readable`), the whole head runs."""
        if not self.head_rows_readable:
            logits = self.logits_from_normed(normed)
            return logits.gather(-1, ids.expand(*logits.shape[:-1], ids.shape[-1]))
        if self.post_norm is not None:
            normed = self.post_norm(normed)
        if rows is None:
            bias = self.lm_head.bias
            rows = self.lm_head.weight[ids], None if bias is None else bias[ids]
        weight, bias = rows
        logits = torch.einsum("...mh,mch->...mc", normed.to(weight.dtype), weight)  # [..., M, C]
        return self._scaled(logits if bias is None else logits + bias)

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's logit scale and soft-cap, on raw head outputs."""
        if self.spec.logit_scale is not None:
            logits = logits * self.spec.logit_scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @property
    def head_rows_readable(self) -> bool:
        """The head is a linear layer whose weight is loaded, so some of its rows can be computed alone (not where
        it is offloaded: accelerate's hooks bring the weight per call, and the whole head runs)."""
        return isinstance(self.lm_head, nn.Linear) and self.lm_head.weight.device.type != "meta"

    def head_rows(self, ids: torch.Tensor) -> tuple | None:
        """(weight [n, H], bias [n] or None): copies of the head's rows for token ids `ids`; None where they
        cannot be read (`head_rows_readable`)."""
        if not self.head_rows_readable:
            return None
        weight, bias = self.lm_head.weight, self.lm_head.bias
        with torch.no_grad():
            index = ids.to(weight.device)
            return weight.index_select(0, index), None if bias is None else bias.index_select(0, index)

    def layer_output(self, output) -> torch.Tensor:
        """The hidden state from whatever a decoder layer returns."""
        return output[0] if self.spec.returns_tuple or isinstance(output, tuple) else output


def _get(root: nn.Module, path: str | None) -> nn.Module | None:
    if path is None:
        return None
    module = root
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def resolve(model: nn.Module) -> ModelParts:
    """Find the backbone, layers, final norm and head of a loaded causal LM."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    refusal = refusal_reason(model)
    if refusal:
        raise ValueError(f"Tide cannot run early exit on model type {model_type!r}: {refusal}.")
    spec = ARCHITECTURES.get(model_type)
    if spec is None:
        return _probe_parts(model)
    parts = _parts_from_spec(model, spec)
    if parts is None:
        raise ValueError(
            f"Tide's entry for model type {model_type!r} does not match this model "
            f"({type(model).__name__}): check tide.ARCHITECTURES[{model_type!r}]."
        )
    return parts


def _parts_from_spec(model: nn.Module, spec: ArchSpec) -> ModelParts | None:
    backbone, layers, lm_head = _get(model, spec.backbone), _get(model, spec.layers), _get(model, spec.lm_head)
    if backbone is None or not isinstance(layers, nn.ModuleList) or lm_head is None:
        return None
    norm = _get(model, spec.norm)
    config = model.config
    softcap = getattr(config, spec.softcap_attr, None) if spec.softcap_attr else None
    layer_types = getattr(config, spec.layer_types_attr, None) if spec.layer_types_attr else None
    return ModelParts(
        spec=spec,
        backbone=backbone,
        layers=layers,
        norm=norm if norm is not None else nn.Identity(),  # e.g. OPT with do_layer_norm_before=False
        post_norm=_get(model, spec.post_norm),
        lm_head=lm_head,
        softcap=float(softcap) if softcap else None,
        layer_types=list(layer_types) if layer_types else None,
    )


def refusal_reason(model: nn.Module) -> str | None:
    """Why per-token early exit cannot be exact on this model, or None. Read from the config and the cache
    layout transformers would build for it; nothing runs."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; Tide exits from a decoder-only stack"
    if getattr(config, "encoder_layers", None) or getattr(config, "num_encoder_layers", None):
        return "it is the decoder half of an encoder-decoder architecture; Tide exits from a decoder-only stack"
    if getattr(model, "_is_stateful", False):
        return "it carries recurrent state that every token must update through every layer"
    forward = inspect.signature(model.forward).parameters
    supports_cache = getattr(model, "_supports_default_dynamic_cache", lambda: True)()
    if "past_key_values" not in forward and "cache" in forward:
        return (f"transformers {transformers.__version__} passes the KV cache as `cache`, and Tide is built on "
                "transformers 5.23's `past_key_values`; install transformers>=5.23,<5.24")
    if "past_key_values" not in forward or not supports_cache:
        return "it does not decode on transformers' KV cache (DynamicCache), which Tide's skipped layers write"
    kinds = cache_layer_kinds(config.get_text_config()) or []
    stateful = [i for i, kind in enumerate(kinds) if kind == "recurrent"]
    if stateful:
        return (f"decoder layers {stateful} carry recurrent state (linear attention or state-space layers) that "
                "every token must update, so they cannot be skipped")
    shared = [i for i, kind in enumerate(kinds) if kind == "shared"]
    if shared:
        return f"decoder layers {shared} reuse other layers' KV cache, which a skipped layer would leave unwritten"
    if "indexed" in kinds:
        return ("its attention keeps sparse-attention indexer keys besides the K/V, written after the K/V, which a "
                "skipped layer's K/V-only pass does not fill")
    return None


def _probe_parts(model: nn.Module) -> ModelParts:
    """Parts of an unregistered model: guessed from its structure, then checked numerically on one short forward
    (which also reads whether the layers return tuples and any scale on the head's logits)."""
    spec = probe_spec(model)
    parts = _parts_from_spec(model, spec)
    if parts is None:
        raise ValueError(_unsupported_message(model, "no decoder layer list, final norm and head found"))
    seen = _observe(model, parts)
    if seen.passes_state:
        raise ValueError(
            f"Tide cannot run early exit on model type {getattr(model.config, 'model_type', None)!r}: its decoder "
            "layers hand extra outputs to the next layer (e.g. sparse-attention indices), which a skipped layer "
            "would not produce."
        )
    reproduces, scale = _head_scale(model, parts, seen)
    if not reproduces:
        raise ValueError(_unsupported_message(model, "its final norm and head do not reproduce its logits"))
    parts = _parts_from_spec(model, replace(spec, returns_tuple=seen.returns_tuple, logit_scale=scale))
    parts.registered = False
    return parts


@dataclass
class _Observation:
    """What one short forward of a probed model showed."""

    logits: torch.Tensor  # the model's own logits, fp32
    last_output: torch.Tensor | None  # the last decoder layer's hidden state
    returns_tuple: bool  # the layers return (hidden_states, ...)
    passes_state: bool  # layer 0 returns a tensor besides its hidden state that the backbone hands to layer 1


@torch.no_grad()
def _observe(model: nn.Module, parts: ModelParts) -> _Observation:
    seen = {"extra": set(), "next_inputs": set()}

    def last(_m, _a, out):
        seen.update(tuple=isinstance(out, tuple), h=out[0] if isinstance(out, tuple) else out)

    def first(_m, _a, out):
        if isinstance(out, tuple):
            seen["extra"] = {id(v) for v in out[1:] if isinstance(v, torch.Tensor)}

    def second(_m, args, kwargs):
        seen["next_inputs"] = {id(v) for v in list(args[1:]) + list(kwargs.values()) if isinstance(v, torch.Tensor)}

    hooks = [parts.layers[-1].register_forward_hook(last)]
    if parts.num_layers > 1:
        hooks += [parts.layers[0].register_forward_hook(first),
                  parts.layers[1].register_forward_pre_hook(second, with_kwargs=True)]
    try:
        device = next(model.parameters()).device
        logits = model(input_ids=torch.arange(1, 5, device=device).unsqueeze(0), use_cache=False).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return _Observation(logits, seen.get("h"), seen.get("tuple", False), bool(seen["extra"] & seen["next_inputs"]))


def _head_scale(model: nn.Module, parts: ModelParts, seen: _Observation) -> tuple[bool, float | None]:
    """Does head(final_norm(last layer output)) reproduce the model's logits, and up to which scale (a config
    value; None: unscaled)?"""
    if seen.last_output is None:
        return False, None
    mine = parts.logits_from_normed(parts.final_norm(seen.last_output)).float()
    if mine.shape != seen.logits.shape:
        return False, None
    if torch.allclose(mine, seen.logits, atol=1e-4, rtol=1e-3):
        return True, None
    fitted = float((mine * seen.logits).sum() / (mine * mine).sum().clamp(min=1e-12))
    scale = _config_scale(model.config, fitted)
    return scale is not None and torch.allclose(mine * scale, seen.logits, atol=1e-4, rtol=1e-3), scale


def _config_scale(config, fitted: float) -> float | None:
    """The config value that scales the head's logits (by multiplying or dividing), matched to the fitted one."""
    for value in config.get_text_config().to_dict().values():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1):
            for scale in (float(value), 1.0 / float(value)):
                if math.isclose(scale, fitted, rel_tol=1e-3):
                    return scale
    return None


def _unsupported_message(model: nn.Module, why: str) -> str:
    return (
        f"Tide does not know model type {getattr(model.config, 'model_type', None)!r} and probing failed ({why}). "
        f"Supported types: {', '.join(supported_model_types())}. Register it with tide.register('<model_type>', "
        "tide.ArchSpec(backbone='model', layers='model.layers', norm='model.norm', lm_head='lm_head', ...)); "
        "see tide/models/architectures.py for the fields."
    )


def probe_spec(model: nn.Module) -> ArchSpec:
    """Guess an `ArchSpec` for an unregistered model from transformers' own metadata: the backbone is
    `base_model_prefix`, the head `get_output_embeddings()`, the layers the backbone's module list with one entry
    per hidden layer, the final norm a norm after them; how layers take the cache, from their signature."""
    prefix = getattr(model, "base_model_prefix", "model")
    backbone = getattr(model, prefix, None)
    num_layers = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    if backbone is None:  # e.g. Llama 4: prefix "language_model", backbone under "model"
        prefix = next((n for n, m in model.named_children() if any(
            isinstance(c, nn.ModuleList) and len(c) == num_layers for c in m.children())), prefix)
        backbone = getattr(model, prefix, None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = next((n for n, m in model.named_children() if m is head), None)
    if backbone is not None and head_name is not None:
        children = list(backbone.named_children())
        lists = [(n, m) for n, m in children if isinstance(m, nn.ModuleList) and len(m) > 1]
        layers_name = next((n for n, m in lists if len(m) == num_layers), lists[0][0] if len(lists) == 1 else None)
        norm_name = next((n for n in _NORM_NAMES if isinstance(getattr(backbone, n, None), nn.Module)), None)
        if norm_name is None and layers_name is not None:  # the last norm-like child registered after the layers
            after = [n for n, m in children[[n for n, _ in children].index(layers_name) + 1:]
                     if "norm" in type(m).__name__.lower()]
            norm_name = after[-1] if after else None
        if layers_name and norm_name:
            layer = getattr(backbone, layers_name)[0]
            params = inspect.signature(type(layer).forward).parameters
            cache_arg = next((n for n in _CACHE_ARGS if n in params), "past_key_values")
            return ArchSpec(
                backbone=prefix,
                layers=f"{prefix}.{layers_name}",
                norm=f"{prefix}.{norm_name}",
                lm_head=head_name,
                cache_arg=cache_arg,
                tree_drafts=False,  # a probed family may place positions in its mask (alibi): chain drafts only
            )
    raise ValueError(_unsupported_message(model, "no decoder layer list, final norm and head found"))
