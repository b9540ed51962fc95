"""Tiny random-init models, one per supported family, built locally (no downloads)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import tide

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=6, num_attention_heads=4, intermediate_size=64)
_LLAMA_LIKE = dict(_COMMON, num_key_value_heads=2, max_position_embeddings=256)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(_LLAMA_LIKE),
    "mistral": dict(_LLAMA_LIKE, sliding_window=8),
    "mixtral": dict(_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(_LLAMA_LIKE, use_sliding_window=True, sliding_window=8, max_window_layers=3),
    "qwen3": dict(_LLAMA_LIKE, head_dim=8),
    "gemma": dict(_LLAMA_LIKE, head_dim=8),
    "gemma2": dict(_LLAMA_LIKE, head_dim=8, sliding_window=8, final_logit_softcapping=30.0),
    "gemma3_text": dict(_LLAMA_LIKE, head_dim=8, sliding_window=8, sliding_window_pattern=2,
                        final_logit_softcapping=30.0),
    "phi": dict(_COMMON, max_position_embeddings=256),
    "phi3": dict(_LLAMA_LIKE, pad_token_id=0),
    "gpt2": dict(vocab_size=VOCAB, n_embd=32, n_layer=6, n_head=4, n_positions=256),
    "gpt_neox": dict(_COMMON, max_position_embeddings=256),
    "opt": dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=6, num_attention_heads=4, ffn_dim=64,
                word_embed_proj_dim=16, max_position_embeddings=256),
    "falcon": dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=6, num_attention_heads=4, alibi=True,
                   new_decoder_architecture=False, multi_query=True),
}

FAMILIES = sorted(TINY_CONFIGS)


def tiny_config(model_type: str, **overrides):
    kwargs = dict(TINY_CONFIGS[model_type], **overrides)
    kwargs.setdefault("eos_token_id", 1)
    kwargs.setdefault("bos_token_id", 2)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, seed: int = 0, attention: str = "eager", **overrides):
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    config._attn_implementation = attention
    model = AutoModelForCausalLM.from_config(config)
    return model.eval()


def noisy_tide(model_type: str = "llama", heads: tuple = ("translator",), attention: str = "eager",
               model_overrides: dict | None = None, **config):
    """(Tide model, its base): a checkpoint after every second layer (`checkpoint_interval` in `config` sets
    another), and the routers' `heads` (exit heads "translator", draft heads "draft") perturbed so that they are
    right only sometimes: lossless drafts get accepted and rejected. `attention`: the base model's attention
    implementation; `model_overrides`: the base model's config fields that differ from TINY_CONFIGS'."""
    base = tiny_model(model_type, attention=attention, **(model_overrides or {}))
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(**{"checkpoint_interval": 2, **config}))
    torch.manual_seed(1)
    with torch.no_grad():
        for k in model.checkpoints:
            modules = [getattr(model.routers[k], name) for name in heads]
            for p in (p for module in modules if module is not None for p in module.parameters()):
                p.add_(torch.randn_like(p) * 0.3)
    return model, base


def llama_repo(thresholds: bool = True, **generation):
    """A tiny Llama wrapped with a checkpoint every 2 layers, each at threshold 0.5 (`thresholds`) or none, and
    `generation` as its repo's default generation options."""
    model = tide.TideForCausalLM.from_base(tiny_model("llama"), tide.TideConfig(checkpoint_interval=2))
    if thresholds:
        model.config.thresholds = {str(k): 0.5 for k in model.checkpoints}
    if generation:
        model.config.set_generation_defaults(**generation)
    return model


def short_ids(rows: int = 1) -> torch.Tensor:
    """[rows, 5] token ids (3..99), the same on every call."""
    return torch.randint(3, 100, (rows, 5), generator=torch.Generator().manual_seed(0))


def prompt_ids(length: int = 9, seed: int = 0) -> torch.Tensor:
    """[1, length] random token ids (4..99), from `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    return torch.randint(4, 100, (1, length))


def tiny_tokenizer(pad: bool = False):
    """A character-level tokenizer over printable ASCII (ids < VOCAB); no pad token unless asked."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    vocab["\n"] = len(vocab)
    assert len(vocab) <= VOCAB
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    from tokenizers import decoders

    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        pad_token="<pad>" if pad else None,
    )


def sample_texts(n: int = 40) -> list[str]:
    """English text that any Python installation has: the standard library's own docstrings."""
    import collections, functools, itertools, json, os, pathlib, re, textwrap  # noqa: E401

    docs = []
    for mod in (os, re, json, pathlib, textwrap, itertools, functools, collections):
        for name in sorted(dir(mod)):
            doc = getattr(getattr(mod, name), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 80:
                docs.append(doc.strip()[:200])
    return docs[:n]
