"""Few-row linears: each layout computes F.linear's product, only where it was asked for or measured fastest."""

import copy
import functools
import gc
import itertools
import os
import pickle
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tide
from tide.layers import fewrows
from tiny_models import FAMILIES, tiny_model


needs_mkl_pack = pytest.mark.skipif(not fewrows._HAS_MKL_PACK, reason="this PyTorch build has no MKL packed linear")


@pytest.fixture
def layout_calls(monkeypatch):
    """(layout, row count) of each call that took a few-row layout."""
    calls = []

    def counting(name, original):
        def run(x, weight, bias, *rest):
            calls.append((name, x.numel() // x.shape[-1]))
            return original(x, weight, bias, *rest)
        return run

    monkeypatch.setattr(fewrows, "_transposed", counting("transposed", fewrows._transposed))
    monkeypatch.setattr(fewrows, "_packed", counting("packed", fewrows._packed))
    return calls


LAYOUT_FUNCTIONS = [pytest.param("transposed", id="transposed"),
                    pytest.param("packed", id="packed", marks=needs_mkl_pack)]


@pytest.mark.parametrize("layout", LAYOUT_FUNCTIONS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 24), (1, 3, 24), (2, 4, 24), (16, 24)])
def test_each_layout_is_the_linear_product(shape, bias, layout):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        out = getattr(fewrows, f"_{layout}")(x, linear.weight, linear.bias)
    assert out.shape == (*shape[:-1], 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_only_inside_the_context_on_cpu_for_few_rows(layout_calls):
    linear, sub = nn.Linear(8, 8), type("QuantLinear", (nn.Linear,), {})(8, 8)
    fewrows.install([nn.ModuleList([linear, sub])])
    assert "forward" in linear.__dict__ and "forward" not in sub.__dict__  # subclasses keep their own forward
    with torch.no_grad():
        linear(torch.randn(4, 8))
        assert layout_calls == []  # outside the context
        with fewrows.few_row_linears(layout="transposed"):
            linear(torch.randn(1, 8))  # one row: the single-row kernel is already the fast one
            linear(torch.randn(fewrows.MAX_ROWS + 1, 8))
            assert layout_calls == []
            linear(torch.randn(1, 3, 8))
            assert layout_calls == [("transposed", 3)]


def test_each_row_count_takes_the_layout_measured_for_it(layout_calls, monkeypatch):
    monkeypatch.setattr(fewrows, "layouts", lambda parts: {2: "plain", 4: "transposed", 8: "packed", 16: "plain"})
    monkeypatch.setattr(fewrows, "_packable", lambda weight: True)
    linear = nn.Linear(8, 8)
    fewrows.install([linear])
    with torch.no_grad(), fewrows.few_row_linears(parts=object()):
        for rows in (2, 3, 4, 7, 8, 15, 16, fewrows.MAX_ROWS + 1):
            linear(torch.randn(rows, 8))
    assert layout_calls == [("transposed", 4), ("transposed", 7), ("packed", 8), ("packed", 15)]


def test_an_all_plain_choice_leaves_the_dispatch_off(monkeypatch):
    """Where F.linear was measured fastest for every row count, the context costs nothing per linear."""
    monkeypatch.setattr(fewrows, "layouts", lambda parts: dict.fromkeys(fewrows.MEASURED_ROWS, "plain"))
    with fewrows.few_row_linears(parts=object()):
        assert fewrows._ACTIVE.get() is None
    with fewrows.few_row_linears(layout="transposed"):
        assert fewrows._ACTIVE.get() is not None


def test_few_row_linears_needs_a_model_or_a_layout():
    with pytest.raises(ValueError, match="parts"):
        with fewrows.few_row_linears():
            pass
    with pytest.raises(ValueError, match="layout"):
        with fewrows.few_row_linears(layout="sideways"):
            pass


@needs_mkl_pack
def test_packed_layout_only_for_float32_without_gradients(layout_calls):
    linear = nn.Linear(8, 8)
    fewrows.install([linear])
    x = torch.randn(3, 8)
    with fewrows.few_row_linears(layout="packed"):
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias))  # the weight wants grads
        assert layout_calls == []
        with torch.no_grad():
            linear.to(torch.bfloat16)(x.to(torch.bfloat16))
            assert layout_calls == []
            linear.float()(x)
    assert layout_calls == [("packed", 3)]


@needs_mkl_pack
def test_a_packed_copy_follows_its_weight():
    linear = nn.Linear(8, 8)
    fewrows.install([linear])
    x = torch.randn(3, 8)
    with torch.no_grad(), fewrows.few_row_linears(layout="packed"):
        before = linear(x)
        linear.weight.mul_(2)  # changed in place: packed again
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias))
        assert not torch.allclose(linear(x), before)
    gc.collect()
    held = len(fewrows._PACKED)
    del linear
    gc.collect()  # an installed linear refers to itself through its forward
    assert len(fewrows._PACKED) == held - 1  # the copy goes with its weight


def test_a_forward_set_by_someone_else_is_kept():
    linear = nn.Linear(8, 8)
    hooked = functools.partial(nn.Linear.forward, linear)  # as accelerate's hooks set it
    linear.forward = hooked
    fewrows.install([linear])
    assert linear.__dict__["forward"] is hooked


def test_an_installed_linear_pickles():
    linear = nn.Linear(8, 8)
    fewrows.install([linear])
    twin = pickle.loads(pickle.dumps(linear))
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), linear(x))
    fewrows.install([twin])  # the copy can be installed again
    assert twin.__dict__["forward"].__func__ is fewrows.forward


@pytest.mark.parametrize("layout", LAYOUT_FUNCTIONS)
def test_install_is_idempotent_and_a_deep_copy_dispatches_for_the_copy(layout):
    linear = nn.Linear(8, 8)
    fewrows.install([linear])
    first = linear.__dict__["forward"]
    fewrows.install([linear])
    assert linear.__dict__["forward"] is first
    twin = copy.deepcopy(linear)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
        with fewrows.few_row_linears(layout=layout):
            assert torch.count_nonzero(twin(torch.randn(3, 8))) == 0
            assert torch.count_nonzero(linear(torch.randn(3, 8))) > 0


@pytest.mark.parametrize("layout", LAYOUT_FUNCTIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_stays_token_identical_in_each_layout(family, layout, layout_calls):
    base = tiny_model(family)
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2))
    torch.manual_seed(0)
    ids = torch.randint(4, 100, (1, 9))
    ref = base.generate(ids, do_sample=False, max_new_tokens=12)
    for scheme in ({"max_draft": 3}, {"max_draft": 1, "draft_topk": 3}):  # a chain, a tree
        out = model.generate(ids, do_sample=False, max_new_tokens=12,
                             tide_config={"mode": "lossless", "draft_layer": 1, "few_row_layout": layout, **scheme})
        assert torch.equal(out, ref) and model.last_stats.switches["few_row_layout"] == layout
    if family != "gpt2":  # GPT-2's projections are Conv1D, not nn.Linear
        assert {name for name, _ in layout_calls} == {layout}  # verification passes took the layout


def _slow_layouts(monkeypatch, slow):
    """Make the measurement see the `slow` layouts take a second per linear and the others no time at all."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(fewrows, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))

    def slowed(function):
        def run(*args, **kwargs):
            clock.now += 1.0
            return function(*args, **kwargs)
        return run

    for name in slow:
        if name == "plain":
            monkeypatch.setattr(fewrows, "F", types.SimpleNamespace(linear=slowed(F.linear)))
        else:
            monkeypatch.setattr(fewrows, f"_{name}", slowed(getattr(fewrows, f"_{name}")))


@pytest.mark.parametrize("slow, chosen", [
    (["transposed", "packed"], "plain"),
    (["plain", "packed"], "transposed"),
    pytest.param(["plain", "transposed"], "packed", marks=needs_mkl_pack),
])
def test_the_measurement_picks_the_fastest_layout(slow, chosen, monkeypatch):
    _slow_layouts(monkeypatch, slow)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert fewrows._measure([model]) == dict.fromkeys(fewrows.MEASURED_ROWS, chosen)


@needs_mkl_pack
def test_no_packed_layout_where_a_copy_would_not_fit_in_memory_or_the_weights_are_not_float32(monkeypatch):
    _slow_layouts(monkeypatch, ["plain", "transposed"])  # packed wins wherever it is measured
    everywhere = functools.partial(dict.fromkeys, fewrows.MEASURED_ROWS)
    monkeypatch.setattr(fewrows, "_available_bytes", lambda: 1000)  # two 8 x 8 weights: 512 bytes
    assert fewrows._measure([nn.Linear(8, 8), nn.Linear(8, 8)]) == everywhere("plain")
    monkeypatch.setattr(fewrows, "_available_bytes", lambda: None)  # unknown: not a reason
    assert fewrows._measure([nn.Linear(8, 8), nn.Linear(8, 8)]) == everywhere("packed")
    assert fewrows._measure([nn.Linear(8, 8), nn.Linear(8, 8).double()]) == everywhere("plain")


def test_plain_layout_for_weights_off_cpu():
    assert fewrows._measure([nn.Linear(8, 8, device="meta")]) == dict.fromkeys(fewrows.MEASURED_ROWS, "plain")


def test_the_choice_is_measured_once_per_model_and_can_be_forced(monkeypatch, layout_calls):
    measured = []
    monkeypatch.setattr(fewrows, "_measure", lambda modules: measured.append(len(modules))
                        or dict.fromkeys(fewrows.MEASURED_ROWS, "plain"))
    base = tiny_model("llama")
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2))
    ids = torch.randint(4, 100, (1, 9))
    lossless = {"mode": "lossless", "draft_layer": 1, "max_draft": 3}
    ref = base.generate(ids, do_sample=False, max_new_tokens=8)
    for _ in range(2):
        assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=8, tide_config=lossless), ref)
    assert measured == [base.config.num_hidden_layers + 1] and layout_calls == []  # once; plain measured fastest
    forced = {**lossless, "few_row_layout": "transposed"}
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=8, tide_config=forced), ref)
    assert layout_calls and {name for name, _ in layout_calls} == {"transposed"} and len(measured) == 1
    with pytest.raises(ValueError, match="few_row_layout must be one of"):
        model.generate(ids, do_sample=False, max_new_tokens=8, tide_config={**lossless, "few_row_layout": "sometimes"})


def test_recompute_chunks_take_the_calls_layout(layout_calls):
    """kv_strategy="recompute" recomputes stale K/V in chunks of several positions: in the call's `few_row_layout`."""
    model = tide.TideForCausalLM.from_base(tiny_model("llama"), tide.TideConfig(checkpoint_layers=[1]))

    def scripted(thresholds):  # per call: a token that leaves at layer 1, then one that runs deep and redoes it
        exits = itertools.cycle([True, False])

        def test(hidden):
            leave = torch.full(hidden.shape[:1], next(exits))
            return leave.float(), leave, hidden
        return {1: test}

    model.exit_tests = scripted
    ids = torch.randint(4, 100, (1, 9))
    config = {"exit_threshold": 0.5, "kv_strategy": "recompute"}
    plain = model.generate(ids, do_sample=False, max_new_tokens=6, tide_config={**config, "few_row_layout": "plain"})
    assert layout_calls == [] and model.last_stats.recomputed_positions > 0
    forced = model.generate(ids, do_sample=False, max_new_tokens=6,
                            tide_config={**config, "few_row_layout": "transposed"})
    assert {name for name, _ in layout_calls} == {"transposed"} and torch.equal(forced, plain)


def test_available_memory_is_read_where_the_platform_tells_it():
    available = fewrows._available_bytes()
    if os.path.exists("/proc/meminfo"):
        assert available > 2**20
