"""Parity of the fused router_exit op with its PyTorch reference, over dtypes, shapes and norm kinds.

Needs a CUDA device and a build: the kernel is loaded with `kernels.get_local_kernel` from
TIDE_KERNELS_BUILD (default: this kernel's folder, which `build_local.py` or `kernel-builder build-and-copy`
fill with build/<variant>/).

    pytest hub_kernels/tide_kernels/tests
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

RMS_NORM, GEMMA_RMS_NORM, LAYER_NORM = 0, 1, 2
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Inputs are rounded to the dtype first and both sides compute in fp32, so only summation order differs.
ATOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}


def reference(hidden, norm_weight, norm_bias, norm_kind, eps, down_weight, down_bias, up_weight, up_bias,
              threshold):
    x = hidden.float()  # [B, H]
    if norm_kind == LAYER_NORM:
        x = x - x.mean(-1, keepdim=True)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = x * (norm_weight.float() + (1.0 if norm_kind == GEMMA_RMS_NORM else 0.0))
    if norm_bias is not None:
        x = x + norm_bias.float()
    z = F.silu(F.linear(x, down_weight.float(), down_bias.float()))  # [B, R]
    scores = torch.sigmoid(F.linear(z, up_weight.float(), up_bias.float()).squeeze(-1))  # [B]
    return scores, scores > threshold


def make_inputs(batch, hidden_size, bottleneck, norm_kind, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    hidden = randn(batch, hidden_size, scale=3.0) + 0.5  # an offset, so LayerNorm's centering matters
    norm_weight = randn(hidden_size, scale=0.2) + (0.0 if norm_kind == GEMMA_RMS_NORM else 1.0)
    norm_bias = randn(hidden_size, scale=0.1) if norm_kind == LAYER_NORM else None
    down_weight = randn(bottleneck, hidden_size, scale=hidden_size ** -0.5)
    down_bias = randn(bottleneck, scale=0.1)
    up_weight = randn(1, bottleneck, scale=bottleneck ** -0.5)
    up_bias = randn(1, scale=0.1)
    return [hidden, norm_weight, norm_bias, norm_kind, 1e-6, down_weight, down_bias, up_weight, up_bias, 0.5]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("hidden_size", [64, 4096])
@pytest.mark.parametrize("bottleneck", [16, 128])
@pytest.mark.parametrize("norm_kind", [RMS_NORM, GEMMA_RMS_NORM, LAYER_NORM])
def test_matches_reference(kernel, dtype, batch, hidden_size, bottleneck, norm_kind):
    args = make_inputs(batch, hidden_size, bottleneck, norm_kind, dtype)
    scores, mask = kernel.router_exit(*args)
    want_scores, want_mask = reference(*args)
    assert scores.dtype == torch.float32 and mask.dtype == torch.bool
    assert scores.shape == mask.shape == (batch,)
    torch.testing.assert_close(scores, want_scores, atol=ATOL[dtype], rtol=0)
    decided = (want_scores - args[-1]).abs() > ATOL[dtype]  # away from the threshold, decisions agree
    assert torch.equal(mask[decided], want_mask[decided])


@pytest.mark.parametrize("hidden_size", [1, 100, 16384])
def test_odd_and_large_hidden_sizes(kernel, hidden_size):
    args = make_inputs(5, hidden_size, 24, LAYER_NORM, torch.bfloat16)
    torch.testing.assert_close(kernel.router_exit(*args)[0], reference(*args)[0], atol=1e-4, rtol=0)


def test_strided_rows_and_empty_batch(kernel):
    args = make_inputs(4, 256, 16, RMS_NORM, torch.float16)
    args[0] = torch.randn(4, 3, 256, device="cuda", dtype=torch.float16)[:, 1]  # row stride 768
    torch.testing.assert_close(kernel.router_exit(*args)[0], reference(*args)[0], atol=1e-4, rtol=0)
    args[0] = args[0][:0]
    scores, mask = kernel.router_exit(*args)
    assert scores.shape == mask.shape == (0,)


def test_runs_on_the_current_stream(kernel):
    args = make_inputs(8, 4096, 128, RMS_NORM, torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        scores, _ = kernel.router_exit(*args)
    stream.synchronize()
    torch.testing.assert_close(scores, reference(*args)[0], atol=1e-4, rtol=0)


def test_rejects_mismatched_inputs(kernel):
    args = make_inputs(2, 64, 16, RMS_NORM, torch.float32)
    bad_dtype = list(args)
    bad_dtype[5] = bad_dtype[5].half()
    with pytest.raises((RuntimeError, ValueError), match="dtype"):
        kernel.router_exit(*bad_dtype)
    bad_kind = list(args)
    bad_kind[3] = 7
    with pytest.raises((RuntimeError, ValueError), match="norm_kind"):
        kernel.router_exit(*bad_kind)


def test_opcheck_and_compile(kernel):
    args = make_inputs(3, 128, 16, LAYER_NORM, torch.bfloat16)
    torch.library.opcheck(kernel.ops.router_exit.default, tuple(args))
    compiled = torch.compile(kernel.router_exit, fullgraph=True)
    torch.testing.assert_close(compiled(*args)[0], kernel.router_exit(*args)[0])
