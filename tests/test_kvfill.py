"""The batched K/V fill of skipped layers writes what the layers' own code would write."""

import copy
import gc

import pytest
import torch
from transformers import DynamicCache

import tide
from tide.layers import kvfill
from tide.layers.kvfill import fill_kv, fused_available
from tide.layers.kvprobe import kv_plan
from tide.layers.calls import capture_layer_calls, write_kv_only
from tiny_models import FAMILIES, tiny_model

FUSED = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma"}
# Why these fill layer by layer: fused qkv (phi3, gpt2, gpt_neox, falcon), LayerNorm + partial rotary (phi),
# learned positions (gpt2, opt), alibi (falcon), per-layer-type rotary and k-norms (gemma2, gemma3_text).
PER_LAYER = {"gpt2", "gpt_neox", "opt", "falcon", "phi", "phi3", "gemma2", "gemma3_text"}


def test_every_family_is_decided():
    assert not FUSED & PER_LAYER
    for family, spec in tide.ARCHITECTURES.items():
        assert family in FUSED | PER_LAYER, f"decide whether {family!r} takes the batched K/V fill"
        assert (spec.kv_projections is not None) == (family in FUSED), family


def _decode_step(family, new_tokens=1, prompt=5, batch=2, **overrides):
    """parts, the prefilled cache, and the layer calls of `new_tokens` decode tokens."""
    base = tiny_model(family, **overrides)
    parts = tide.TideForCausalLM.from_base(base).parts
    torch.manual_seed(0)
    ids = torch.randint(4, 100, (batch, prompt + new_tokens))
    cache = DynamicCache(config=base.config)
    with torch.no_grad():
        base(ids[:, :prompt], past_key_values=cache, use_cache=True)
    calls = capture_layer_calls(parts, input_ids=ids[:, prompt:], past_key_values=cache, use_cache=True)
    kv_plan(parts)  # the probe runs the layers once per model, on its own inputs: before the counts below
    return base, parts, cache, calls


def _assert_fill_matches_per_layer(parts, calls, layers, hidden, cache, atol=1e-5, rtol=1e-4):
    reference = copy.deepcopy(cache)
    fill_kv(parts, calls, layers, hidden, cache)
    for i in layers:
        write_kv_only(calls[i], parts, i, hidden, reference)
    for i in range(parts.num_layers):
        torch.testing.assert_close(cache.layers[i].keys, reference.layers[i].keys, atol=atol, rtol=rtol)
        torch.testing.assert_close(cache.layers[i].values, reference.layers[i].values, atol=atol, rtol=rtol)


@pytest.mark.parametrize("new_tokens", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_fill_equals_per_layer_writes(family, new_tokens):
    _, parts, cache, calls = _decode_step(family, new_tokens)
    layers = list(range(2, parts.num_layers))
    hidden = torch.randn_like(calls[0].hidden)
    assert fused_available(parts, calls, layers, hidden) == (family in FUSED)
    _assert_fill_matches_per_layer(parts, calls, layers, hidden, cache)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_batched_fill_on_full_sliding_windows(family):
    """A prompt longer than the window (8): the sliding cache layers evict, as they do for the layers' own writes."""
    _, parts, cache, calls = _decode_step(family, new_tokens=3, prompt=12)
    assert any(type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in cache.layers)
    layers = list(range(1, parts.num_layers))
    hidden = torch.randn_like(calls[0].hidden)
    assert fused_available(parts, calls, layers, hidden)
    _assert_fill_matches_per_layer(parts, calls, layers, hidden, cache)


def test_batched_fill_of_a_non_contiguous_set_and_in_bfloat16():
    _, parts, cache, calls = _decode_step("llama", new_tokens=2)
    hidden = torch.randn_like(calls[0].hidden)
    _assert_fill_matches_per_layer(parts, calls, [1, 3, 4], hidden, cache)
    base, parts, cache, calls = _decode_step("llama", new_tokens=2, dtype=torch.bfloat16)
    base.to(torch.bfloat16)
    _, parts, cache, calls = _decode_step("llama", new_tokens=2)
    parts.layers.to(torch.bfloat16)


def _layer_calls_during(parts, fn) -> int:
    called = []
    hooks = [layer.register_forward_pre_hook(lambda *_: called.append(1)) for layer in parts.layers]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return len(called)


def test_fused_fill_never_calls_the_layers_unless_forced(monkeypatch):
    _, parts, cache, calls = _decode_step("llama", batch=1)
    everything = list(range(parts.num_layers))
    assert _layer_calls_during(parts, lambda: fill_kv(parts, calls, everything, calls[0].hidden, cache)) == 0
    assert cache.get_seq_length() == 6
    cache.crop(-1)
    fill = lambda: fill_kv(parts, calls, everything, calls[0].hidden, cache, layerwise=True)  # noqa: E731
    assert _layer_calls_during(parts, fill) == parts.num_layers
    cache.crop(-1)
    monkeypatch.setenv("TIDE_KV_FILL", "layerwise")
    assert _layer_calls_during(parts, lambda: fill_kv(parts, calls, everything, calls[0].hidden, cache)) == parts.num_layers


def test_stack_follows_weight_changes_and_dies_with_the_model():
    base, parts, cache, calls = _decode_step("qwen3")
    hidden = torch.randn_like(calls[0].hidden)
    _assert_fill_matches_per_layer(parts, calls, [4, 5], hidden, cache)
    with torch.no_grad():
        parts.layers[5].self_attn.k_proj.weight.mul_(2)
        parts.layers[5].self_attn.k_norm.weight.add_(0.5)
        parts.layers[4].input_layernorm.weight.mul_(-1)
    _assert_fill_matches_per_layer(parts, calls, [4, 5], hidden, cache)
    assert parts.layers in kvfill._STACKS
    del base, parts, cache, calls
    gc.collect()
    assert len(kvfill._STACKS) == 0
