"""Parity of the fused checkpoint_test op (Tide's exit test on the tuned exit head's state) with its PyTorch
reference, over dtypes, sizes, exit heads (none, full, a low-rank head's translated state) and norms.

Needs a CUDA device and a build (see test_router_exit.py).

    pytest hub_kernels/tide_kernels/tests
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference(hidden, translate_weight, translate_bias, down_bias, down_weight, up_bias, up_weight, layer_norm, eps,
              threshold):
    x = hidden.float()
    if translate_bias is not None:
        x = torch.addmm(translate_bias, x, translate_weight)
    elif translate_weight is not None:
        x = translate_weight
    state = x.to(hidden.dtype)
    if layer_norm:
        x = x - x.mean(-1, keepdim=True)
    inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    z = torch.nn.functional.silu(down_bias + (x @ down_weight) * inv_rms)
    scores = torch.sigmoid(up_bias + z @ up_weight).squeeze(-1)
    return scores, scores > threshold, state


def make_inputs(rows, hidden_size, bottleneck, head, dtype, layer_norm=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda") * scale

    hidden = (randn(rows, hidden_size, scale=3.0) + 0.5).to(dtype)
    weight = bias = None
    if head == "full":
        weight = torch.eye(hidden_size, device="cuda") + randn(hidden_size, hidden_size, scale=0.02)
        bias = randn(hidden_size, scale=0.1)
    elif head == "translated":
        weight = hidden.float() + randn(rows, hidden_size, scale=0.1)
    return [hidden, weight, bias, randn(bottleneck, scale=0.1), randn(hidden_size, bottleneck, scale=hidden_size ** -0.5),
            randn(1, scale=0.1), randn(bottleneck, 1, scale=bottleneck ** -0.5), layer_norm, 1e-6, 0.5]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("hidden_size, bottleneck", [(64, 16), (4096, 128), (100, 33)])
@pytest.mark.parametrize("head", ["none", "full", "translated"])
@pytest.mark.parametrize("layer_norm", [False, True])
def test_matches_reference(kernel, dtype, rows, hidden_size, bottleneck, head, layer_norm):
    args = make_inputs(rows, hidden_size, bottleneck, head, dtype, layer_norm)
    scores, exits, state = kernel.checkpoint_test(*args)
    want_scores, want_exits, want_state = reference(*args)
    assert scores.dtype == torch.float32 and exits.dtype == torch.bool and state.dtype == dtype
    assert scores.shape == exits.shape == (rows,) and state.shape == (rows, hidden_size)
    torch.testing.assert_close(scores, want_scores, atol=1e-4, rtol=0)
    torch.testing.assert_close(state, want_state, atol=0, rtol=0)
    decided = (want_scores - 0.5).abs() > 1e-4
    assert torch.equal(exits[decided], want_exits[decided])


def test_state_never_aliases_an_input_and_empty_rows(kernel):
    args = make_inputs(3, 256, 16, "none", torch.float32)
    state = kernel.checkpoint_test(*args)[2]
    assert state.data_ptr() != args[0].data_ptr() and torch.equal(state, args[0])
    args[0] = args[0][:0]
    scores, exits, state = kernel.checkpoint_test(*args)
    assert scores.shape == exits.shape == (0,) and state.shape == (0, 256)


def test_rejects_bad_inputs(kernel):
    args = make_inputs(2, 64, 16, "full", torch.bfloat16)
    bad = list(args)
    bad[4] = bad[4].half()
    with pytest.raises((RuntimeError, ValueError), match="float32"):
        kernel.checkpoint_test(*bad)
    bad = list(args)
    bad[4] = bad[4][:32]
    with pytest.raises((RuntimeError, ValueError), match="down_weight"):
        kernel.checkpoint_test(*bad)


def test_opcheck_and_compile(kernel):
    args = make_inputs(3, 128, 16, "full", torch.bfloat16, layer_norm=True)
    torch.library.opcheck(kernel.ops.checkpoint_test.default, tuple(args))
    compiled = torch.compile(kernel.checkpoint_test, fullgraph=True)
    for got, want in zip(compiled(*args), kernel.checkpoint_test(*args)):
        torch.testing.assert_close(got, want)
