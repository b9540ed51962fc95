"""Few-row linears: the transposed layout computes F.linear's product, only where it was asked for."""

import copy
import functools
import pickle
import time
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tide
from tide import fewrows
from tiny_models import FAMILIES, tiny_model


@pytest.fixture
def transposed_calls(monkeypatch):
    """The row counts of the calls that took the few-row layout."""
    calls, original = [], fewrows._transposed

    def counting(x, weight, bias):
        calls.append(x.numel() // x.shape[-1])
        return original(x, weight, bias)

    monkeypatch.setattr(fewrows, "_transposed", counting)
    return calls


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 24), (1, 3, 24), (2, 4, 24), (16, 24)])
def test_transposed_layout_is_the_linear_product(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    out = fewrows._transposed(x, linear.weight, linear.bias)
    assert out.shape == (*shape[:-1], 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_only_inside_the_context_on_cpu_for_few_rows(transposed_calls):
    linear, sub = nn.Linear(8, 8), type("QuantLinear", (nn.Linear,), {})(8, 8)
    fewrows.install([nn.ModuleList([linear, sub])])
    assert "forward" in linear.__dict__ and "forward" not in sub.__dict__  # subclasses keep their own forward
    with torch.no_grad():
        linear(torch.randn(4, 8))
        assert transposed_calls == []  # outside the context
        with fewrows.few_row_linears():
            linear(torch.randn(1, 8))  # one row: the single-row kernel is already the fast one
            linear(torch.randn(fewrows.MAX_ROWS + 1, 8))
            assert transposed_calls == []
            linear(torch.randn(1, 3, 8))
            assert transposed_calls == [3]


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


def test_install_is_idempotent_and_a_deep_copy_dispatches_for_the_copy(transposed_calls):
    linear = nn.Linear(8, 8)
    fewrows.install([linear])
    first = linear.__dict__["forward"]
    fewrows.install([linear])
    assert linear.__dict__["forward"] is first
    twin = copy.deepcopy(linear)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
        with fewrows.few_row_linears():
            assert torch.count_nonzero(twin(torch.randn(3, 8))) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_stays_token_identical_with_the_transposed_layout(family, transposed_calls, monkeypatch):
    monkeypatch.setenv("TIDE_FEW_ROW_LAYOUT", "on")
    base = tiny_model(family)
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2))
    torch.manual_seed(0)
    ids = torch.randint(4, 100, (1, 9))
    ref = base.generate(ids, do_sample=False, max_new_tokens=12)
    out = model.generate(ids, do_sample=False, max_new_tokens=12,
                         tide_config={"mode": "lossless", "draft_layer": 1, "max_draft": 3})
    assert torch.equal(out, ref)
    if family != "gpt2":  # GPT-2's projections are Conv1D, not nn.Linear
        assert transposed_calls  # verification passes took the transposed layout


def _slow(function):
    def slowed(*args, **kwargs):
        time.sleep(0.002)
        return function(*args, **kwargs)
    return slowed


@pytest.mark.parametrize("slow", ["plain", "transposed"])
def test_the_measurement_picks_the_faster_layout(slow, monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    if slow == "transposed":
        monkeypatch.setattr(fewrows, "_transposed", _slow(fewrows._transposed))
    else:
        monkeypatch.setattr(fewrows, "F", types.SimpleNamespace(linear=_slow(F.linear)))
    assert fewrows._measure([model]) is (slow == "plain")


def test_no_transposed_layout_for_weights_off_cpu():
    assert fewrows._measure([nn.Linear(8, 8, device="meta")]) is False


def test_the_choice_is_measured_once_per_model_and_can_be_forced(monkeypatch, transposed_calls):
    measured = []
    monkeypatch.setattr(fewrows, "_measure", lambda modules: measured.append(len(modules)) or False)
    monkeypatch.delenv("TIDE_FEW_ROW_LAYOUT", raising=False)
    base = tiny_model("llama")
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2))
    ids = torch.randint(4, 100, (1, 9))
    lossless = {"mode": "lossless", "draft_layer": 1, "max_draft": 3}
    ref = base.generate(ids, do_sample=False, max_new_tokens=8)
    for _ in range(2):
        assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=8, tide_config=lossless), ref)
    assert measured == [base.config.num_hidden_layers + 1] and transposed_calls == []  # once; measured slower
    monkeypatch.setenv("TIDE_FEW_ROW_LAYOUT", "on")
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=8, tide_config=lossless), ref)
    assert transposed_calls and len(measured) == 1
    monkeypatch.setenv("TIDE_FEW_ROW_LAYOUT", "sometimes")
    with pytest.raises(ValueError, match="TIDE_FEW_ROW_LAYOUT"):
        fewrows.transposed_pays(model.parts)
