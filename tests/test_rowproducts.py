"""Products of a few rows lowered to inductor's reductions on a CPU (`tide.layers.rowproducts`): what the pass takes,
that its results are the library's to rounding, and that a row's result does not depend on the rows beside it."""

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from tide.layers.rowproducts import CPU_INDUCTOR_OPTIONS, HALF_MAX_ELEMENTS, MAX_INPUTS, MAX_ROWS, lowers
from tide.layers.spans import compile_options


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Counters from zero, and every graph compiled afresh (a graph inductor's cache holds runs no pass to count)."""
    from torch._inductor import config

    counters.clear()
    with config.patch(fx_graph_cache=False):
        yield
    torch._dynamo.reset()


def _mlp(dtype=torch.float32, hidden=64, inner=96, bias=True):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(hidden, inner, bias=False), nn.SiLU(), nn.Linear(inner, hidden, bias=bias)).to(dtype)


def _compiled(module):
    return torch.compile(module, fullgraph=True, dynamic=False, options=CPU_INDUCTOR_OPTIONS)


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
def test_few_rows_are_lowered_and_equal_the_library_to_rounding(rows):
    mlp = _mlp()
    x = torch.randn(1, rows, 64)
    with torch.no_grad():
        out = _compiled(mlp)(x)
        torch.testing.assert_close(out, mlp(x), rtol=1e-5, atol=1e-5)
    assert counters["tide"]["few_row_products"] == 2  # the product without a bias (mm) and the one with (addmm)


def test_a_row_computes_the_same_bits_beside_other_rows():
    """Verification's positions get exactly what a decode step of one position gets (float32)."""
    mlp = _compiled(_mlp())
    x = torch.randn(1, 3, 64)
    with torch.no_grad():
        together = mlp(x)
        alone = torch.cat([mlp(x[:, i:i + 1]) for i in range(3)], 1)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("rows, hidden, lowered", [(MAX_ROWS + 1, 64, 0), (2, MAX_INPUTS + 64, 1)])
def test_more_rows_or_longer_rows_stay_with_the_library(rows, hidden, lowered):
    """Too many rows: neither product is lowered; rows longer than `MAX_INPUTS`: the first is not, and the second
    (32 inputs to more than `MAX_INPUTS` outputs) is: the outputs have no bound."""
    mlp = _mlp(hidden=hidden, inner=32)
    x = torch.randn(1, rows, hidden)
    with torch.no_grad():
        torch.testing.assert_close(_compiled(mlp)(x), mlp(x), rtol=1e-5, atol=1e-5)
    assert counters["tide"]["few_row_products"] == lowered


def test_the_bounds_by_dtype():
    """float32: up to `MAX_ROWS` rows of up to `MAX_INPUTS` inputs, any outputs (a 262,144-token head); half
    precision: rows x inputs at most `HALF_MAX_ELEMENTS`; a CPU only."""
    f32, bf16 = torch.float32, torch.bfloat16
    assert lowers(MAX_ROWS, MAX_INPUTS, 262144, f32, "cpu") and not lowers(MAX_ROWS + 1, 64, 64, f32, "cpu")
    assert not lowers(1, MAX_INPUTS + 1, 64, f32, "cpu") and not lowers(1, 64, 64, f32, "cuda")
    assert not lowers(1, 64, 64, torch.float64, "cpu")
    assert lowers(3, HALF_MAX_ELEMENTS // 3, 49152, bf16, "cpu")
    assert not lowers(4, HALF_MAX_ELEMENTS // 3, 49152, bf16, "cpu") and not lowers(2, MAX_INPUTS, 64, bf16, "cpu")


def test_bfloat16_products_accumulate_in_float32():
    mlp = _mlp(torch.bfloat16)
    x = torch.randn(1, 2, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        out = _compiled(mlp)(x)
        reference = _mlp(torch.float32)(x.float())
    assert out.dtype == torch.bfloat16 and counters["tide"]["few_row_products"] == 2
    torch.testing.assert_close(out.float(), reference, rtol=0.03, atol=0.03)


def test_cpu_graphs_take_the_pass_unless_the_call_says_otherwise():
    """On a CPU, inductor's default mode takes `CPU_INDUCTOR_OPTIONS`; options the call's `compile_config` names
    win, and another backend, mode or device takes nothing."""
    from transformers import CompileConfig

    assert compile_options(None, "cpu")["options"] == CPU_INDUCTOR_OPTIONS
    assert compile_options(CompileConfig(options={"freezing": True}), "cpu")["options"] == {
        **CPU_INDUCTOR_OPTIONS, "freezing": True}
    mine = {"post_grad_custom_post_pass": None}
    assert compile_options(CompileConfig(options=mine), "cpu")["options"] == mine
    assert compile_options(CompileConfig(backend="eager"), "cpu")["options"] is None
    assert compile_options(CompileConfig(mode="max-autotune-no-cudagraphs"), "cpu")["options"] is None
    assert compile_options(None, "cuda")["options"] is None and compile_options(None)["options"] is None
