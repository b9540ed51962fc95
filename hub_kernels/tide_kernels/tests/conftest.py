"""The kernel under test: a local build, loaded with `kernels.get_local_kernel` from TIDE_KERNELS_BUILD (default:
this kernel's folder, which `build_local.py` or `kernel-builder build-and-copy` fill with build/<variant>/)."""

import os
from pathlib import Path

import pytest
import torch

KERNEL_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kernels import get_local_kernel

    try:
        return get_local_kernel(Path(os.environ.get("TIDE_KERNELS_BUILD", KERNEL_DIR)))
    except Exception as err:  # no build for this torch/CUDA
        pytest.skip(f"no local build of the kernel: {err}")
