"""The batched K/V fill of skipped layers writes what the layers' own code would write."""

import copy

import pytest
import torch
from transformers import DynamicCache

import tide
from tide.kvfill import fill_kv, fused_available
from tide.layercalls import capture_layer_calls, write_kv_only
from tiny_models import FAMILIES, tiny_model

FUSED = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma"}  # every other family fills layer by layer


def test_every_family_is_decided():
    for family in tide.ARCHITECTURES:
        assert (tide.ARCHITECTURES[family].kv_projections is not None) == (family in FUSED), family


@pytest.mark.parametrize("new_tokens", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_fill_equals_per_layer_writes(family, new_tokens):
    base = tiny_model(family)
    parts = tide.TideForCausalLM.from_base(base).parts
    torch.manual_seed(0)
    ids = torch.randint(4, 100, (2, 5 + new_tokens))
    cache = DynamicCache(config=base.config)
    with torch.no_grad():
        base(ids[:, :5], past_key_values=cache, use_cache=True)
    calls = capture_layer_calls(parts, input_ids=ids[:, 5:], past_key_values=cache, use_cache=True)
    layers = list(range(2, parts.num_layers))
    assert fused_available(parts, calls, layers) == (family in FUSED)
    hidden = torch.randn_like(calls[0].hidden)
    reference = copy.deepcopy(cache)
    fill_kv(parts, calls, layers, hidden, cache)
    for i in layers:
        write_kv_only(calls[i], parts, i, hidden, reference)
    for i in range(parts.num_layers):
        torch.testing.assert_close(cache.layers[i].keys, reference.layers[i].keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(cache.layers[i].values, reference.layers[i].values, atol=1e-5, rtol=1e-4)


def test_fused_fill_never_calls_the_layers():
    base = tiny_model("llama")
    parts = tide.TideForCausalLM.from_base(base).parts
    cache = DynamicCache(config=base.config)
    ids = torch.randint(4, 100, (1, 6))
    with torch.no_grad():
        base(ids[:, :5], past_key_values=cache, use_cache=True)
    calls = capture_layer_calls(parts, input_ids=ids[:, 5:], past_key_values=cache, use_cache=True)
    called = []
    hooks = [layer.register_forward_pre_hook(lambda *_: called.append(1)) for layer in parts.layers]
    fill_kv(parts, calls, list(range(parts.num_layers)), calls[0].hidden, cache)
    for h in hooks:
        h.remove()
    assert not called and cache.get_seq_length() == 6
