"""The probe of what a skipped layer must compute: its K/V and nothing more (no query projection, only the K/V rows
of a fused qkv projection), and K/V-only passes that follow it write what the layer's own code writes."""

import copy
import dataclasses

import pytest
import torch
from transformers import DynamicCache
from transformers.pytorch_utils import Conv1D

import tide
from tide.layers import kvprobe
from tide.layers.kvprobe import KVPlan, LayerPlan, clear_plans, kv_plan, write_kv
from tide.layers.calls import PartialRows, capture_layer_calls, write_kv_only
from tide.tools.support_matrix import check_forced_exit
from tiny_models import FAMILIES, tiny_model

# what each table family's K/V-only pass must compute: (linears run in full, linears computed in part)
EXPECTED = {
    "gpt2": ([], ["attn.c_attn"]),
    "gpt_neox": ([], ["attention.query_key_value"]),
    "falcon": ([], ["self_attention.query_key_value"]),
    "phi3": ([], ["self_attn.qkv_proj"]),
}
SEPARATE = ["self_attn.k_proj", "self_attn.v_proj"]


def _parts(family, **overrides):
    base = tiny_model(family, **overrides)
    return base, tide.TideForCausalLM.from_base(base).parts


@pytest.mark.parametrize("family", FAMILIES)
def test_the_probe_skips_the_query_projection_of_every_family(family):
    _, parts = _parts(family)
    plan = kv_plan(parts)
    assert plan.complete, plan.report()
    kv, partial = EXPECTED.get(family, (SEPARATE, []))
    for layer in plan.layers:
        assert layer.kv == kv and list(layer.partial) == partial, plan.report()
        if not partial:
            assert layer.skipped == ["self_attn.q_proj"], plan.report()


INPUT_NORM = {"gpt2": "ln_1", "opt": "self_attn_layer_norm"}  # the others: input_layernorm


@pytest.mark.parametrize("family", FAMILIES)
def test_the_probe_finds_which_outputs_become_keys_and_values(family):
    """Per layer: the rows of the K/V linears that reach the written keys and values (in the written order), the
    module they read, the written heads; and a sample of what the layer's own code writes."""
    _, parts = _parts(family)
    for layer in kv_plan(parts).layers:
        assert layer.kv_input == INPUT_NORM.get(family, "input_layernorm")
        heads, head_dim = layer.key_shape
        assert layer.value_shape == layer.key_shape
        keys, values = (torch.cat(list(rows.values())) for rows in (layer.key_rows, layer.value_rows))
        assert keys.numel() == values.numel() == heads * head_dim
        assert layer.sample.keys.shape[1] == heads and layer.sample.keys.shape[-1] == head_dim
    first = kv_plan(parts).layers[0]
    if family == "gpt2":  # c_attn: [q | k | v], 32 columns each
        assert torch.equal(first.key_rows["attn.c_attn"], torch.arange(32, 64))
        assert torch.equal(first.value_rows["attn.c_attn"], torch.arange(64, 96))
    if family == "gpt_neox":  # query_key_value: [q, k, v] per head of 8
        assert first.key_rows["attention.query_key_value"][:10].tolist() == [*range(8, 16), 32, 33]


def _decode_calls(base, parts, new_tokens, prompt=5, batch=2):
    torch.manual_seed(0)
    ids = torch.randint(4, 100, (batch, prompt + new_tokens))
    cache = DynamicCache(config=base.config)
    with torch.no_grad():
        base(ids[:, :prompt], past_key_values=cache, use_cache=True)
    return cache, capture_layer_calls(parts, input_ids=ids[:, prompt:], past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("new_tokens", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_lean_kv_only_pass_writes_what_the_layer_writes(family, new_tokens):
    base, parts = _parts(family)
    cache, calls = _decode_calls(base, parts, new_tokens)
    hidden = torch.randn_like(calls[0].hidden)
    reference = copy.deepcopy(cache)
    for i in range(parts.num_layers):
        write_kv(calls[i], parts, i, hidden, cache)
        write_kv_only(calls[i], parts, i, hidden, reference, skips={})  # every linear computed in full
    for mine, theirs in zip(cache.layers, reference.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("rows", [torch.arange(4, 12), torch.tensor([1, 2, 5, 6, 9, 10])])
def test_partial_rows_compute_those_outputs_and_zeros_elsewhere(conv, rows):
    torch.manual_seed(0)
    module = Conv1D(12, 6) if conv else torch.nn.Linear(6, 12)
    with torch.no_grad():
        module.bias.normal_()
    x = torch.randn(2, 3, 6)
    part = PartialRows(module, rows)
    assert PartialRows.supports(module)
    assert isinstance(part.rows, slice) == (rows.numel() == 8)
    out, full = part(module, x), module(x)
    torch.testing.assert_close(out[..., rows], full[..., rows])
    others = torch.ones(12, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(out[..., others], torch.zeros_like(out[..., others]))
    with torch.no_grad():  # a gathered copy follows in-place changes of the weight
        module.weight.mul_(-2)
    torch.testing.assert_close(part(module, x)[..., rows], module(x)[..., rows])


def test_a_linear_subclass_with_its_own_forward_is_computed_in_part_only_if_it_acts_as_a_linear():
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    class Same(torch.nn.Linear):
        def forward(self, x):
            return x @ self.weight.T + self.bias

    assert not PartialRows.supports(Scaled(4, 6)) and PartialRows.supports(Same(4, 6))


def test_a_skip_that_would_change_the_kv_is_refused_with_the_reason():
    """Here the keys depend on the queries through a comparison, which no gradient sees: the probe's gradient
    says the query projection does not reach the K/V, and the confirmation catches it."""
    base, parts = _parts("llama")
    seen = {}
    for layer in parts.layers:
        attn = layer.self_attn
        attn.q_proj.register_forward_hook(lambda _m, _a, out: seen.update(q=(out > 0).float().mean().detach()))
        attn.k_proj.register_forward_hook(lambda _m, _a, out: out + seen["q"])
    clear_plans()  # wrapping probed the layers before these hooks; probe them as they are now
    plan = kv_plan(parts)
    assert not plan.complete
    assert "self_attn.q_proj (skipping it changed the K/V the layer writes)" in plan.report()
    assert all(not layer.skips for layer in plan.layers)


def test_the_probe_runs_inside_inference_mode_and_reports_a_failure():
    base, parts = _parts("gpt2")
    cache, calls = _decode_calls(base, parts, 1)
    with torch.inference_mode():
        write_kv(calls[3], parts, 3, calls[0].hidden, cache)
    assert kv_plan(parts).complete
    _, parts = _parts("llama")
    parts.layers[0].self_attn.k_proj.register_forward_hook(lambda *_: 1 / 0)
    clear_plans()
    plan = kv_plan(parts)
    assert plan.reason.startswith("the probe failed (ZeroDivisionError") and "probe not used" in plan.report()
    assert plan.skips(0) == {}


def test_the_stronger_check_catches_a_layer_that_computes_its_queries(monkeypatch):
    """Without the probe's plan the K/V-only pass computes GPT-2's whole c_attn: the support matrix's forced-exit
    check must fail on it (on the per-layer fill, the repo's default here; the batched fill calls no linear
    module)."""
    base = tiny_model("gpt2")
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_layers=[1], kv_fill="layerwise"))
    check_forced_exit(model, base)
    empty = KVPlan([LayerPlan() for _ in model.parts.layers])
    monkeypatch.setattr(kvprobe, "kv_plan", lambda parts: empty)
    with pytest.raises(AssertionError, match="computed attn.c_attn's outputs that do not reach its K/V"):
        check_forced_exit(model, base)


def test_bench_reports_a_skipped_layers_kv_as_a_fraction_of_a_layer(monkeypatch):
    from tide.tools.bench import kv_fill_costs, kv_fill_costs_text

    for family, batched in (("llama", True), ("gpt2", True), ("gpt2", False)):
        model = tide.TideForCausalLM.from_base(tiny_model(family), tide.TideConfig(checkpoint_layers=[1]))
        if not batched:  # a family that fills layer by layer
            monkeypatch.setattr(model.parts, "spec", dataclasses.replace(model.parts.spec, kv_projections=None))
        with torch.inference_mode():
            costs = kv_fill_costs(model, prompt_length=4, repeats=2)
        assert (costs["batched"] is not None) == batched
        assert costs["per_layer"] > 0 and costs["per_layer_everything"] > 0 and costs["probe_complete"]
        assert ("in part: attn.c_attn" in costs["probe"] if family == "gpt2"
                else "skipped: self_attn.q_proj" in costs["probe"])
        assert "a skipped layer's K/V, as a fraction of a layer" in kv_fill_costs_text(costs)
