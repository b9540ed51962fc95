"""The exit tests' switch to their fused CUDA kernels: the router exit step (final norm -> router -> sigmoid ->
threshold) and the decode loop's checkpoint test (the same on the exit head's state, `tide::checkpoint_test`).

The PyTorch references are the implementations: fp32 arithmetic, used on CPU and whenever the kernel is
unavailable (`router_exit_reference` here, `checkpoint_test_reference` in `heads/router.py`). On CUDA the Hub
kernel `tide-transformers/tide-kernels` (sources in `hub_kernels/tide_kernels/`) computes the same thing in one
launch each: `load_router_kernel` returns its `router_exit`, and this module registers its `checkpoint_test`
as the CUDA implementation of the `tide::checkpoint_test` op, which compiled graphs call as one node.
A generate call's `kernels` option (`auto|torch|kernel`, `TideGenerationConfig.kernels`) picks the path for the
call (`kernel_mode`); the path taken is logged once.

This module does not decide where checkpoints are, move tensors between devices or touch the KV cache.
"""

from __future__ import annotations

import functools
import logging
import os
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import KERNEL_MODES
from .router import (GEMMA_RMS_NORM, LAYER_NORM, RMS_NORM, checkpoint_test,  # the op's norm_kind
                     checkpoint_test_reference, exit_decision)

__all__ = ["FUSED_MAX_ROWS", "GEMMA_RMS_NORM", "KERNEL_REPO", "KERNEL_VERSION", "LAYER_NORM", "RMS_NORM",
           "kernel_mode", "load_checkpoint_kernel", "load_router_kernel", "norm_params", "router_exit",
           "router_exit_reference"]

logger = logging.getLogger("tide")

KERNEL_REPO = "tide-transformers/tide-kernels"
KERNEL_VERSION = 1  # `version` in hub_kernels/tide_kernels/build.toml
# The mode in force where a call gives none: a generate call's `kernels` option while it runs (`kernel_mode`).
_MODE: ContextVar = ContextVar("tide_kernels", default="auto")


# Final norms the op reproduces, by class name: a substring rule would be wrong (Gemma3nRMSNorm scales by w,
# Qwen3NextRMSNorm by 1 + w). Exact in fp32; in fp16/bf16 Llama-style norms round to the dtype before the
# weight, the op does not. Other norms run as modules.
NORM_KINDS = {
    "LlamaRMSNorm": RMS_NORM, "MistralRMSNorm": RMS_NORM, "MixtralRMSNorm": RMS_NORM, "Qwen2RMSNorm": RMS_NORM,
    "Qwen3RMSNorm": RMS_NORM, "Phi3RMSNorm": RMS_NORM,
    "GemmaRMSNorm": GEMMA_RMS_NORM, "Gemma2RMSNorm": GEMMA_RMS_NORM, "Gemma3RMSNorm": GEMMA_RMS_NORM,
}


def router_exit_reference(hidden, norm_weight, norm_bias, norm_kind, eps, down_weight, down_bias, up_weight,
                          up_bias, threshold):
    """scores fp32 [B] = sigmoid(up(silu(down(norm(hidden))))), exit_mask bool [B] = scores > threshold.

    hidden [B, H]; norm_weight [H]; norm_bias [H] or None; down_weight [R, H]; down_bias [R];
    up_weight [1, R]; up_bias [1]. norm_kind: RMS_NORM, GEMMA_RMS_NORM or LAYER_NORM.
    """
    x = hidden.float()  # [B, H]
    shape = (x.shape[-1],)
    bias = None if norm_bias is None else norm_bias.float()
    if norm_kind == LAYER_NORM:
        x = F.layer_norm(x, shape, norm_weight.float(), bias, eps)  # [B, H]
    else:
        weight = norm_weight.float() + 1.0 if norm_kind == GEMMA_RMS_NORM else norm_weight.float()
        x = F.rms_norm(x, shape, weight, eps)  # [B, H]
        if bias is not None:
            x = x + bias
    z = F.silu(F.linear(x, down_weight.float(), down_bias.float()))  # [B, R]
    scores = torch.sigmoid(F.linear(z, up_weight.float(), up_bias.float()).squeeze(-1))  # [B]
    return scores, exit_decision(scores, threshold)


def load_router_kernel(mode: str | None = None) -> Callable:
    """The router-exit function to use: the fused kernel's `router_exit` or `router_exit_reference`.

    mode (default: the one `kernel_mode` set, else "auto"): "torch" always returns the reference; "auto" tries the
    kernel on CUDA and falls back to the reference; "kernel" raises if the kernel cannot be loaded.
    A local build is used when `LOCAL_KERNELS` holds `tide-transformers/tide-kernels=<dir>`.
    """
    module = _load(_mode(mode))
    return router_exit_reference if module is None else module.router_exit


def load_checkpoint_kernel(mode: str | None = None) -> Callable:
    """The checkpoint-test function for CUDA tensors: the fused kernel's `checkpoint_test`, or
    `checkpoint_test_reference` (same arguments and results). `mode` as in `load_router_kernel`; "kernel" also
    raises when the loaded build predates `checkpoint_test`."""
    mode = _mode(mode)
    module = _load(mode)
    fused = getattr(module, "checkpoint_test", None)
    if fused is None and module is not None and mode == "kernel":
        raise RuntimeError(f"kernels='kernel', but this build of {KERNEL_REPO} has no checkpoint_test; rebuild it "
                           "(hub_kernels/tide_kernels/build_local.py) or use kernels='auto'.")
    return checkpoint_test_reference if fused is None else fused


# Rows up to which the fused checkpoint test runs where the mode is "auto". It takes one block per row: on an
# H200 in bf16 it ran x2.3-2.6 faster than the reference's ops at 1-4 rows (hidden 2048) and x1.15 at 1 row (hidden
# 4096), but x0.51 at 8 rows (hidden 4096), where 8 blocks leave the GPU idle (docs/gpu.md). More rows (batches in
# exit mode) run the reference; mode "kernel" runs the kernel for any count.
FUSED_MAX_ROWS = 4


@checkpoint_test.register_kernel("cuda")
def _checkpoint_test_cuda(hidden, translate_weight, translate_bias, down_bias, down_weight, up_bias, up_weight,
                          layer_norm, eps, threshold):
    mode = _mode(None)
    many = hidden.shape[0] > FUSED_MAX_ROWS and mode == "auto"
    test = checkpoint_test_reference if many else load_checkpoint_kernel(mode)
    return test(hidden, translate_weight, translate_bias, down_bias, down_weight, up_bias, up_weight, layer_norm,
                eps, threshold)


@contextmanager
def kernel_mode(mode: str):
    """The exit tests in this context (a generate call, its thread or task) take `mode`'s path: "auto", "torch" or
    "kernel", as in `load_router_kernel`. Compiled graphs keep the path they were captured with."""
    token = _MODE.set(_mode(mode))
    try:
        yield
    finally:
        _MODE.reset(token)


def _mode(mode: str | None) -> str:
    mode = mode or _MODE.get()
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels mode must be one of {', '.join(KERNEL_MODES)}, got {mode!r}.")
    return mode


@functools.cache
def _load(mode: str):
    """The kernel module, or None where the references run (mode "torch", or "auto" without a kernel)."""
    if mode == "torch":
        logger.info("Tide exit tests: PyTorch reference (kernels='torch').")
        return None
    try:
        kernel, source = _load_kernel()
    except Exception as err:  # no CUDA, no matching build variant, Hub unreachable, ...
        if mode == "kernel":
            raise RuntimeError(
                f"kernels='kernel', but the fused router kernel {KERNEL_REPO} (version {KERNEL_VERSION}) could "
                f"not be loaded: {err}. Use kernels='auto' to fall back to the PyTorch reference."
            ) from err
        log = logger.warning if torch.cuda.is_available() else logger.info
        log("Tide exit tests: PyTorch reference (fused kernel unavailable: %s).", err)
        return None
    logger.info("Tide exit tests: fused CUDA kernels from %s.", source)
    return kernel


def _load_kernel():
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available")
    import kernels

    local = _local_build()
    if local is not None:
        return kernels.get_local_kernel(local), str(local)
    # Only Tide's own kernel repo is allow-listed, not every untrusted publisher.
    module = kernels.get_kernel(KERNEL_REPO, version=KERNEL_VERSION, trust_remote_code=[KERNEL_REPO])
    return module, f"{KERNEL_REPO} (version {KERNEL_VERSION})"


def _local_build() -> Path | None:
    """The directory that `LOCAL_KERNELS` (`repo_id=path:repo_id=path`, as in `kernels`) gives our repo."""
    for entry in os.environ.get("LOCAL_KERNELS", "").split(":"):
        repo_id, _, path = entry.partition("=")
        if repo_id == KERNEL_REPO and path:
            return Path(path)
    return None


def norm_params(norm: nn.Module):
    """(weight, bias, norm_kind, eps) for a final norm the fused op reproduces, else None."""
    if isinstance(norm, nn.LayerNorm):
        if len(norm.normalized_shape) != 1 or norm.weight is None:
            return None
        return norm.weight, norm.bias, LAYER_NORM, float(norm.eps)
    kind = NORM_KINDS.get(type(norm).__name__)
    if isinstance(norm, nn.RMSNorm) and norm.eps is not None and len(norm.normalized_shape) == 1:
        kind = RMS_NORM
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if kind is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        return None
    return weight, None, kind, float(eps)


def router_exit(hidden: torch.Tensor, norm: nn.Module, router: nn.Module, threshold: float, mode: str | None = None):
    """Scores fp32 [...] and exit mask bool [...] of `router` on `norm(hidden)`. hidden: [..., H].

    `router` has `down` and `up` nn.Linear layers (tide.heads.router.Router). A norm that `norm_params` does not
    know is run as a module and the router on its output, in the reference path.
    """
    params = norm_params(norm)
    if params is None:
        scores = torch.sigmoid(router(norm(hidden)).float())
        return scores, exit_decision(scores, threshold)
    fn = load_router_kernel(mode)
    if not hidden.is_cuda:
        fn = router_exit_reference
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    down, up = router.down, router.up
    scores, mask = fn(flat, *params, down.weight, down.bias, up.weight, up.bias, float(threshold))
    return scores.view(hidden.shape[:-1]), mask.view(hidden.shape[:-1])
