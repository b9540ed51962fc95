"""Tiny random-init configs for any causal-LM model type in transformers, derived from its config class.

`tiny_config("qwen2")` takes the config class's defaults and shrinks every size it knows by name: layers,
widths, heads, experts, vocabulary, positions. Nested text configs (`text_config`) are shrunk the same way.
Where the generic shrink cannot work, `OVERRIDES` adds a few per-type values. `VARIANTS` names the configurations
of a family whose switches take other code paths in its modeling file (Falcon's layouts, positions and attention
implementations): `tiny_model("falcon[mha-sequential,rotary,sdpa]")` builds one. Nothing is downloaded.

Used by the support matrix (`tide.tools.support_matrix`), the tests and the examples' offline mode.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

__all__ = ["VOCAB", "NUM_LAYERS", "OVERRIDES", "VARIANTS", "tiny_config", "tiny_model"]

VOCAB = 128
NUM_LAYERS = 4
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS

# Attribute names -> tiny values. Only attributes the config already has are touched.
_SIZES = {
    "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "dim": HIDDEN, "model_dim": HIDDEN,
    "num_hidden_layers": NUM_LAYERS, "n_layer": NUM_LAYERS, "n_layers": NUM_LAYERS, "num_layers": NUM_LAYERS,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "num_kv_heads": KV_HEADS, "n_kv_heads": KV_HEADS,
    "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM,
    "decoder_layers": NUM_LAYERS, "encoder_layers": NUM_LAYERS,
    "decoder_attention_heads": HEADS, "encoder_attention_heads": HEADS, "decoder_ffn_dim": 64, "encoder_ffn_dim": 64,
    "intermediate_size": 64, "ffn_dim": 64, "n_inner": 64, "ffn_hidden_size": 64, "d_ff": 64,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 16,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1,
    "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256, "max_seq_len": 256,
    "sliding_window": 8, "attention_window": 8,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
    "qk_head_dim": 8, "word_embed_proj_dim": 16,
    "first_k_dense_replace": 1, "num_nextn_predict_layers": 0, "n_group": 1, "topk_group": 1,
    "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
}

# Per-type values the generic shrink cannot guess (attribute -> value).
OVERRIDES: dict[str, dict] = {
    "falcon": dict(new_decoder_architecture=False, multi_query=True, alibi=True),
    "opt": dict(word_embed_proj_dim=16),
    "qwen2": dict(use_sliding_window=True, max_window_layers=2),
    "gemma3_text": dict(sliding_window_pattern=2),
    "phi3": dict(pad_token_id=0),
    "deepseek_v2": dict(num_experts_per_tok=2),  # None by default, which the model cannot run
    "nemotron": dict(num_key_value_heads=KV_HEADS),  # None by default, which its attention divides by
}



def _falcon_variants() -> dict[str, tuple[str, dict]]:
    """Every Falcon configuration transformers builds, by the code paths it takes: the layout (the old one's
    multi-query or per-head fused qkv, parallel or sequential blocks; the new one's one or two input norms; the new
    layout ignores `multi_query` and does not build with `parallel_attn=False`), alibi or rotary positions, eager or
    SDPA attention. The plain "falcon" row is the first of them."""
    old = dict(new_decoder_architecture=False)
    layouts = {
        "mq": dict(old, multi_query=True, parallel_attn=True),
        "mq-sequential": dict(old, multi_query=True, parallel_attn=False),
        "mha": dict(old, multi_query=False, num_kv_heads=HEADS, parallel_attn=True),
        "mha-sequential": dict(old, multi_query=False, num_kv_heads=HEADS, parallel_attn=False),  # Falcon-RW
        "new": dict(new_decoder_architecture=True, parallel_attn=True, num_ln_in_parallel_attn=2),  # Falcon-40B
        "new-1ln": dict(new_decoder_architecture=True, parallel_attn=True, num_ln_in_parallel_attn=1),  # Falcon-11B
    }
    variants = {}
    for layout, values in layouts.items():
        for positions in ("alibi", "rotary"):
            for attention in ("eager", "sdpa"):
                if (layout, positions, attention) != ("mq", "alibi", "eager"):  # the "falcon" row
                    variants[f"falcon[{layout},{positions},{attention}]"] = (
                        "falcon", dict(values, alibi=positions == "alibi", attn_implementation=attention))
    return variants


# Named configurations of a family that take other code paths: name -> (model type, config values; the attention
# implementation as `attn_implementation`). The support matrix gives each a row.
VARIANTS: dict[str, tuple[str, dict]] = _falcon_variants()


def _set(config: PretrainedConfig, name: str, value) -> None:
    try:
        setattr(config, name, value)
    except AttributeError:  # a read-only property derived from other fields
        pass


def _shrink(config: PretrainedConfig, model_type: str) -> None:
    for name, value in _SIZES.items():
        if name in config.__dict__ and config.__dict__[name] is not None:
            _set(config, name, value)
    if isinstance(config.__dict__.get("qk_rope_head_dim"), int):  # multi-head latent attention: rotary on part
        _set(config, "head_dim", config.qk_rope_head_dim)
        _set(config, "num_key_value_heads", HEADS)
    if isinstance(config.__dict__.get("rotary_dim"), int):  # partial rotary (GPT-J, CodeGen)
        _set(config, "rotary_dim", HEAD_DIM // 2)
    num_layers = next((getattr(config, n) for n in ("num_hidden_layers", "n_layer", "num_layers") if
                       isinstance(getattr(config, n, None), int)), NUM_LAYERS)
    for name in ("layer_types", "mlp_layer_types", "layers_block_type"):
        types = getattr(config, name, None)
        if isinstance(types, (list, tuple)) and types:
            _set(config, name, [types[i % len(types)] for i in range(num_layers)])
    for name, value in OVERRIDES.get(model_type, {}).items():
        _set(config, name, value)
    for special in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, special, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, special, {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}[special])
        elif isinstance(value, list):
            setattr(config, special, [v for v in value if v < VOCAB] or None)


def tiny_config(model_type: str, **overrides) -> PretrainedConfig:
    """A tiny config of `model_type` (defaults of its config class, shrunk; or a name in `VARIANTS`), with
    `overrides` applied last."""
    if model_type in VARIANTS:
        model_type, values = VARIANTS[model_type]
        values = {k: v for k, v in values.items() if k != "attn_implementation"}
        return tiny_config(model_type, **dict(values, **overrides))
    config = AutoConfig.for_model(model_type)
    for sub in ("text_config", "decoder"):
        nested = getattr(config, sub, None)
        if isinstance(nested, PretrainedConfig):
            _shrink(nested, getattr(nested, "model_type", model_type))
    _shrink(config, model_type)
    for special, value in (("eos_token_id", 1), ("bos_token_id", 2)):
        if getattr(config, special, None) is None:
            setattr(config, special, value)
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def tiny_model(model_type: str, seed: int = 0, attn_implementation: str | None = None, **overrides):
    """A random-init causal LM of `model_type` (or a name in `VARIANTS`) built from `tiny_config`, in eval mode, on
    CPU, with eager attention unless `attn_implementation` or the variant names another."""
    if attn_implementation is None:
        attn_implementation = VARIANTS.get(model_type, ("", {}))[1].get("attn_implementation", "eager")
    config = tiny_config(model_type, **overrides)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()
