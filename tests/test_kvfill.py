"""The batched K/V fill of skipped layers writes what the layers' own code would write."""

import copy
import gc
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LogitsProcessorList

import tide
from tide.layers import kvfill
from tide.layers.kvfill import fill_kv, fused_available
from tide.layers.kvprobe import kv_plan
from tide.layers.calls import capture_layer_calls, write_kv_only
from generation_helpers import MarkDecodeSteps
from tiny_models import FAMILIES, tiny_model

# Every family in the table takes the batched path, including fused qkv (phi3, gpt2, gpt_neox, falcon), LayerNorm input
# norms (phi, gpt2, gpt_neox, opt, falcon), partial rotary (phi, gpt_neox), learned positions (gpt2, opt), alibi
# (falcon), k-norms (qwen3, gemma3_text) and per-layer-type rotary (gemma2, gemma3_text).
FUSED = set(FAMILIES)
# other configurations of those families: (family, config overrides, takes the batched path)
VARIANTS = [
    ("phi", dict(qk_layernorm=True), True),  # a LayerNorm k-norm (with bias)
    ("phi", dict(partial_rotary_factor=0.25), True),
    ("phi3", dict(partial_rotary_factor=0.5), True),
    ("gpt_neox", dict(rotary_pct=1.0), True),
    ("gpt_neox", dict(rotary_pct=0.5, attention_bias=False), True),
    ("falcon", dict(alibi=False), True),  # rotary, multi-query: [q | k | v]
    ("falcon", dict(multi_query=False, bias=True), True),  # [q, k, v] per head
    ("falcon", dict(alibi=False, new_decoder_architecture=True, num_kv_heads=2), True),  # K/V heads broadcast
    ("falcon", dict(alibi=False, new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1), True),
    ("qwen2", dict(attention_bias=True), True),
    ("gpt2", dict(n_inner=48, scale_attn_by_inverse_layer_idx=True), True),
    ("opt", dict(do_layer_norm_before=False), True),  # the norm follows attention: the probe sees k_proj read h
    ("opt", dict(enable_bias=False), True),
]


# types outside the table (probed): (config, takes the batched path); the others are left to their own code
_SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=6, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=256)
PROBED = {
    "stablelm": (dict(_SMALL, num_key_value_heads=2, use_qkv_bias=True), True),  # LayerNorm, partial rotary, biases
    "bloom": (dict(vocab_size=128, hidden_size=32, n_layer=6, n_head=4), True),  # alibi, fused qkv per head
    "gpt_bigcode": (dict(vocab_size=128, n_embd=32, n_layer=6, n_head=4, n_positions=256), True),  # multi-query
    "persimmon": (dict(_SMALL), True),  # LayerNorm k-norm, partial rotary, fused qkv
    "starcoder2": (dict(_SMALL, num_key_value_heads=2), True),
    # rotary on adjacent pairs from a table of sin and cos per position kept by the attention
    "gptj": (dict(vocab_size=128, n_embd=32, n_layer=6, n_head=4, rotary_dim=4, n_positions=256), True),
    "olmo2": (dict(_SMALL, num_key_value_heads=2), True),  # a k-norm over all heads at once
}


def _tiny(family, **overrides):
    if family not in PROBED:
        return tiny_model(family, **overrides)
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **dict(PROBED[family][0], **overrides))
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", sorted(PROBED))
def test_batched_fill_of_types_outside_the_table(family):
    _, parts, cache, calls = _decode_step(family, new_tokens=2)
    assert not parts.registered
    layers = list(range(1, parts.num_layers))
    hidden = torch.randn_like(calls[0].hidden) * 3
    assert fused_available(parts, calls, layers, hidden) == PROBED[family][1]
    _assert_fill_matches_per_layer(parts, calls, layers, hidden, cache)


def test_every_family_is_decided():
    assert set(tide.ARCHITECTURES) <= FUSED
    for family, spec in tide.ARCHITECTURES.items():
        assert (spec.kv_projections is not None) == (family in FUSED), family


def _decode_step(family, new_tokens=1, prompt=5, batch=2, dtype=torch.float32, **overrides):
    """parts, the prefilled cache, and the layer calls of `new_tokens` decode tokens."""
    base = _tiny(family, **overrides).to(dtype)
    _perturb_norms(base)  # a random affine on every norm (a fresh model's are ones and zeros), so a wrong fold shows
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
    """`fill_kv` (batched where it can) writes what `fill_kv(..., layerwise=True)` and each layer's own code (every
    linear computed) write."""
    layerwise, own = copy.deepcopy(cache), copy.deepcopy(cache)
    fill_kv(parts, calls, layers, hidden, cache)
    fill_kv(parts, calls, layers, hidden, layerwise, layerwise=True)
    for i in layers:
        write_kv_only(calls[i], parts, i, hidden, own, skips={})
    for reference in (layerwise, own):
        for i in range(parts.num_layers):
            torch.testing.assert_close(cache.layers[i].keys, reference.layers[i].keys, atol=atol, rtol=rtol)
            torch.testing.assert_close(cache.layers[i].values, reference.layers[i].values, atol=atol, rtol=rtol)


@pytest.mark.parametrize("new_tokens", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_fill_equals_per_layer_writes(family, new_tokens):
    _, parts, cache, calls = _decode_step(family, new_tokens)
    layers = list(range(2, parts.num_layers))
    hidden = torch.randn_like(calls[0].hidden) * 3
    assert fused_available(parts, calls, layers, hidden) == (family in FUSED)
    _assert_fill_matches_per_layer(parts, calls, layers, hidden, cache)


@pytest.mark.parametrize("family, overrides, batched", VARIANTS, ids=lambda v: str(v) if not isinstance(v, dict) else
                         ",".join(f"{k}={x}" for k, x in v.items()))
def test_batched_fill_of_other_configurations(family, overrides, batched):
    _, parts, cache, calls = _decode_step(family, new_tokens=2, **overrides)
    layers = list(range(1, parts.num_layers))
    hidden = torch.randn_like(calls[0].hidden) * 3
    assert fused_available(parts, calls, layers, hidden) == batched
    _assert_fill_matches_per_layer(parts, calls, layers, hidden, cache)


def test_a_stack_that_does_not_reproduce_the_layers_is_not_used(monkeypatch):
    """The stack is checked against what each layer's own code wrote in the probe: here the only rotary it knows is
    wrong (a family whose keys were rotated another way), and every layer fills through its own code."""
    from tide.layers.kvforms import Rotary

    monkeypatch.setattr(kvfill, "ROTARY_FORMS", (Rotary(adjacent=True),))
    _, parts, cache, calls = _decode_step("llama")
    kvfill.clear_stacks()
    hidden = torch.randn_like(calls[0].hidden)
    assert not fused_available(parts, calls, [2, 3], hidden)
    _assert_fill_matches_per_layer(parts, calls, [2, 3], hidden, cache)
    _, parts, cache, calls = _decode_step("gpt2")  # no rotary: still batched
    assert fused_available(parts, calls, [2, 3], hidden)


def _perturb_norms(base):
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in base.named_parameters():
            if "norm" in name or ".ln" in name:
                param.add_(torch.randn_like(param) * 0.2)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_batched_fill_on_full_sliding_windows(family):
    """A prompt longer than the window (8): the sliding cache layers evict, as they do for the layers' own writes."""
    _, parts, cache, calls = _decode_step(family, new_tokens=3, prompt=12)
    assert any(type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in cache.layers)
    layers = list(range(1, parts.num_layers))
    hidden = torch.randn_like(calls[0].hidden)
    assert fused_available(parts, calls, layers, hidden)
    _assert_fill_matches_per_layer(parts, calls, layers, hidden, cache)


def test_batched_fill_of_a_non_contiguous_set():
    _, parts, cache, calls = _decode_step("llama", new_tokens=2)
    hidden = torch.randn_like(calls[0].hidden)
    _assert_fill_matches_per_layer(parts, calls, [1, 3, 4], hidden, cache)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "gpt_neox", "falcon", "phi"])
def test_batched_fill_in_bfloat16(family):
    _, parts, cache, calls = _decode_step(family, new_tokens=2, dtype=torch.bfloat16)
    hidden = torch.randn_like(calls[0].hidden)
    assert hidden.dtype == torch.bfloat16 and fused_available(parts, calls, [1, 2, 4, 5], hidden)
    _assert_fill_matches_per_layer(parts, calls, [1, 2, 4, 5], hidden, cache, atol=3e-2, rtol=3e-2)


def _layer_calls_during(parts, fn) -> int:
    called = []
    hooks = [layer.register_forward_pre_hook(lambda *_: called.append(1)) for layer in parts.layers]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return len(called)


def test_fused_fill_never_calls_the_layers_unless_forced():
    _, parts, cache, calls = _decode_step("llama", batch=1)
    everything = list(range(parts.num_layers))
    assert _layer_calls_during(parts, lambda: fill_kv(parts, calls, everything, calls[0].hidden, cache)) == 0
    assert cache.get_seq_length() == 6
    cache.crop(-1)
    fill = lambda: fill_kv(parts, calls, everything, calls[0].hidden, cache, layerwise=True)  # noqa: E731
    assert _layer_calls_during(parts, fill) == parts.num_layers


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


@contextmanager
def _own_forward_calls(parts, deep: list[int], decoding: list):
    """{layer: how many times its own forward (the class's, not Tide's dispatch) ran while `decoding`}."""
    counts, classes = {}, {type(parts.layers[i]) for i in deep}
    index = {id(parts.layers[i]): i for i in deep}
    originals = {cls: cls.forward for cls in classes}

    def counting(original):
        def forward(self, *args, **kwargs):
            if decoding and id(self) in index:
                counts[index[id(self)]] = counts.get(index[id(self)], 0) + 1
            return original(self, *args, **kwargs)
        return forward

    for cls in classes:
        cls.forward = counting(originals[cls])
    try:
        yield counts
    finally:
        for cls, forward in originals.items():
            cls.forward = forward


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("family", FAMILIES + ["stablelm", "bloom", "gpt_bigcode"])
def test_forced_exit_generation_is_the_same_batched_and_layerwise(family, rows):
    """Every decode token exits at the first checkpoint (layer 1), so every deep layer's K/V comes from `fill_kv`:
    batched, no deep layer's own forward runs in a decode step; layer by layer (`kv_fill="layerwise"`), each runs
    (to its cache write)."""
    base = _tiny(family)
    _perturb_norms(base)
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2))
    kv_plan(model.parts)  # the probe runs the layers once per model, on its own inputs
    torch.manual_seed(0)
    ids = torch.randint(4, 100, (rows, 9))
    deep = list(range(2, model.parts.num_layers))

    def generate(kv_fill):
        decoding = []
        with _own_forward_calls(model.parts, deep, decoding) as counts:
            out = model.generate(ids, tide_config={"exit_threshold": -1, "kv_fill": kv_fill}, do_sample=False,
                                 max_new_tokens=40, output_scores=True, return_dict_in_generate=True,
                                 logits_processor=LogitsProcessorList([MarkDecodeSteps(decoding)]))
        assert out["tide_stats"].exits == {"1": rows * 39}
        assert out["tide_stats"].switches["kv_fill"] == kv_fill
        return out, counts

    batched, batched_calls = generate("auto")
    layerwise, layerwise_calls = generate("layerwise")
    assert batched["tide_stats"].arg_captures >= 2  # the layer arguments' window of 31 positions was captured again
    assert batched_calls == {}, f"deep layers' own forwards ran in decode steps: {batched_calls}"
    assert set(layerwise_calls) == set(deep)
    assert torch.equal(batched.sequences, layerwise.sequences)
    for a, b in zip(batched.scores, layerwise.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# Families outside the table whose layers once filled layer by layer (their query projection called, returning zeros):
# the stack now reproduces their keys, recognised by what the layers compute and checked against their own code.
# family -> how the keys are rotated, as `fill_path` reports it
BATCHED = {
    "olmo": "pairs (i, i + d/2)",  # a parameter-free LayerNorm that keeps no eps
    "olmo2": "pairs (i, i + d/2); k-norm over all heads",  # no input norm, a k-norm before the head split
    "olmo3": "pairs (i, i + d/2); k-norm over all heads",  # also sliding and full layers
    "olmoe": "pairs (i, i + d/2); k-norm over all heads",
    "cohere": "adjacent pairs",  # LayerNorm without bias, parallel blocks
    "cohere2": "adjacent pairs; 1 of 4 layers without rotary",  # full layers have no rotary
    "gptj": "adjacent pairs, cos/sin halved; sin and cos from the attention's position table",  # partial rotary
    "smollm3": "pairs (i, i + d/2); 1 of 4 layers without rotary",  # NoPE layers
    "nemotron": "pairs (i, i + d/2)",  # LayerNorm with 1 + w, partial rotary
    "exaone4": "pairs (i, i + d/2); k-norm over each head; 1 of 4 layers without rotary",
    "ernie4_5": "adjacent pairs, cos/sin halved",
    "nanochat": "pairs (i, i + d/2), sin negated; k-norm over each head",  # weightless norms
    "gpt_oss": "pairs (i, i + d/2), cos/sin doubled",  # cos/sin of half a head, for both halves
}


def _forced_exit_linear_calls(family, **overrides):
    """A tiny `family` model (checkpoints every other layer) generating with every decode token forced out at layer
    1: {linear name: the max |output| of each call} over the skipped layers' linears in decode steps, its tokens and
    the reference's (the base model's own forward, hooked), and the model."""
    from tide.layers.kvprobe import is_linear
    from tide.models import tiny
    from tide.tools.support_matrix import reference_forced_exit

    base = tiny.tiny_model(family, **overrides)
    _perturb_norms(base)
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2))
    kv_plan(model.parts)  # the probe runs the layers once per model, on its own inputs
    ids = torch.randint(4, 100, (1, 7), generator=torch.Generator().manual_seed(0))
    expected = reference_forced_exit(base, model.parts, ids, 1, 6, suppress=[base.generation_config.eos_token_id])
    decoding, calls = [], {}

    def count(name, out):
        if decoding:
            calls.setdefault(name.rpartition(".")[2], []).append(float(out.abs().max()))

    hooks = [m.register_forward_hook(lambda _m, _a, out, name=name: count(name, out))
             for j in range(2, model.parts.num_layers)
             for name, m in model.parts.layers[j].named_modules() if is_linear(m)]
    try:
        out = model.generate(ids, do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=0,
                             tide_config={"exit_threshold": -1.0},
                             logits_processor=LogitsProcessorList([MarkDecodeSteps(decoding)]))
    finally:
        for h in hooks:
            h.remove()
    assert model.last_stats.exits == {"1": 5}
    return calls, out, expected, model


@pytest.mark.parametrize("family", sorted(BATCHED))
def test_skipped_layers_call_no_linear_in_decode_steps(family):
    """Forward hooks on every linear of the skipped layers during forced-exit decode steps: none is called (the
    batched fill computes their K/V from stacked weights), and the tokens are the reference's."""
    calls, out, expected, model = _forced_exit_linear_calls(family)
    assert kvfill.fill_path(model.parts) == f"batched (rotary on {BATCHED[family]})"
    assert calls == {}, calls
    assert torch.equal(out, expected)


def test_a_layer_the_stack_does_not_reproduce_fills_layer_by_layer_without_its_query(monkeypatch):
    """Where no known rotary convention reproduces a layer's keys (here only Llama's is known, and Cohere rotates
    adjacent pairs), `fill_path` says so, and the skipped layers run their own code to the cache write: the query
    projection is called there but computes nothing (zeros), and the tokens are still the reference's."""
    from tide.layers.kvforms import Rotary

    monkeypatch.setattr(kvfill, "ROTARY_FORMS", (Rotary(),))
    calls, out, expected, model = _forced_exit_linear_calls("cohere")
    assert kvfill.fill_path(model.parts).startswith("layer by layer: layer 0: no rotary convention Tide knows")
    assert set(calls) == {"q_proj", "k_proj", "v_proj"}, calls
    assert max(calls["q_proj"]) == 0.0 and min(calls["k_proj"]) > 0.0
    assert torch.equal(out, expected)


@pytest.mark.parametrize("family, why", [
    ("deepseek_v2", "layer 0: its keys (1, 16) and values (1, 4) (heads, head size) differ in shape"),  # latent
    ("llama4_text", "layer 0: its calls' rotary is not a (cos, sin) pair (e.g. complex frequencies)"),
    ("moshi", "layer 0: its calls carry no rotary (position_embeddings), and the stack does not reproduce its keys"),
])
def test_fill_path_says_why_a_model_fills_layer_by_layer(family, why):
    from tide.models import tiny
    from tide.tools.support_matrix import kv_fill_note

    model = tide.TideForCausalLM.from_base(tiny.tiny_model(family), tide.TideConfig(checkpoint_layers=[1]))
    assert kvfill.fill_path(model.parts).startswith(f"layer by layer: {why}")
    assert kv_fill_note(model.parts).startswith(f"K/V of skipped layers filled layer by layer ({why}")
    llama = tide.TideForCausalLM.from_base(tiny.tiny_model("llama"), tide.TideConfig(checkpoint_layers=[1]))
    assert kv_fill_note(llama.parts) == ""
