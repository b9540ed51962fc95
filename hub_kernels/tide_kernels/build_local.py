#!/usr/bin/env python3
"""Build the router-exit kernel for this machine's torch and CUDA, in kernel-builder's layout, without Nix.

    python hub_kernels/tide_kernels/build_local.py [--out DIR] [--unique-id ID]

Compiles the sources listed in build.toml with torch's BuildExtension (needs a CUDA build of torch, nvcc
and setuptools; ninja makes it faster) and writes DIR/build/<variant>/ (DIR defaults to this folder), e.g.
build/torch213-cxx11-cu130-x86_64-linux/, holding the op library, the Python package, a generated
`_ops.py` and `metadata.json`. `kernels.get_local_kernel(DIR)` then loads it as it would the Hub build, and
Tide uses it when `LOCAL_KERNELS=tide-transformers/tide-kernels=DIR`.

Only this one variant is built, for the CUDA capabilities in build.toml unless TORCH_CUDA_ARCH_LIST is
set. Hub releases are built for every supported torch/CUDA by kernel-builder (`kernel-builder build-and-upload`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# What kernel-builder generates beside torch_binding.cpp.
REGISTRATION_H = """#pragma once

#include <Python.h>

#define _CONCAT(A, B) A##B
#define CONCAT(A, B) _CONCAT(A, B)

#define _STRINGIFY(A) #A
#define STRINGIFY(A) _STRINGIFY(A)

// TORCH_LIBRARY that expands NAME, so that NAME can be a macro (TORCH_EXTENSION_NAME).
#define TORCH_LIBRARY_EXPAND(NAME, MODULE) TORCH_LIBRARY(NAME, MODULE)
#define TORCH_LIBRARY_IMPL_EXPAND(NAME, DEVICE, MODULE) TORCH_LIBRARY_IMPL(NAME, DEVICE, MODULE)

// Lets the op library be imported as a Python module of that name.
#define REGISTER_EXTENSION(NAME)                                                                      \\
  PyMODINIT_FUNC CONCAT(PyInit_, NAME)() {                                                            \\
    static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, STRINGIFY(NAME), nullptr, 0, nullptr}; \\
    return PyModule_Create(&module);                                                                  \\
  }
"""

OPS_PY = '''import torch
from . import {ext}
ops = torch.ops.{ext}


def add_op_namespace_prefix(op_name: str) -> str:
    """Prefix op by namespace."""
    return f"{ext}::{{op_name}}"
'''


def variant_name(torch_version: str, cuda_version: str | None, cxx11_abi: bool | None, machine: str,
                 system: str) -> str:
    """kernel-builder's build variant, e.g. ("2.13.0+cu130", "13.0", True, "x86_64", "Linux") ->
    "torch213-cxx11-cu130-x86_64-linux". The C++ ABI tag is written on Linux only, as `kernels` expects."""
    torch_match = re.match(r"(\d+)\.(\d+)", torch_version)
    if torch_match is None:
        raise ValueError(f"Cannot read a torch version from {torch_version!r}.")
    cuda_match = re.match(r"(\d+)\.(\d+)", cuda_version or "")
    if cuda_match is None:
        raise ValueError(f"The kernel needs a CUDA build of torch (torch.version.cuda is {cuda_version!r}).")
    system = system.lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine.lower(), machine.lower())
    abi = "" if cxx11_abi is None or system != "linux" else ("-cxx11" if cxx11_abi else "-cxx98")
    return f"torch{torch_match[1]}{torch_match[2]}{abi}-cu{cuda_match[1]}{cuda_match[2]}-{machine}-{system}"


def local_variant() -> str:
    """The variant of the torch installed here."""
    import torch

    return variant_name(torch.__version__, torch.version.cuda, torch.compiled_with_cxx11_abi(),
                        platform.machine(), platform.system())


def read_config(kernel_dir: Path = HERE) -> dict:
    import tomllib  # Python 3.11+

    return tomllib.loads((kernel_dir / "build.toml").read_text(encoding="utf-8"))


def metadata(config: dict, ext: str, variant: str, archs: list[str]) -> dict:
    """metadata.json for one variant, in the fields `kernels` reads."""
    general = config["general"]
    return {
        "name": general["name"],
        "id": f"{ext}_{variant.replace('-', '_')}",
        "version": general["version"],
        "license": general["license"],
        "python-depends": [],
        "backend": {"type": "cuda", "archs": archs},
    }


def stage_variant(variant_dir: Path, library: Path, ext: str, meta: dict, kernel_dir: Path = HERE) -> Path:
    """Lay out build/<variant>/: the Python package, `_ops.py`, the op library `<ext>.*.so`, metadata.json."""
    package = kernel_dir / "torch-ext" / meta["name"].replace("-", "_")
    if variant_dir.exists():
        shutil.rmtree(variant_dir)
    shutil.copytree(package, variant_dir, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (variant_dir / "_ops.py").write_text(OPS_PY.format(ext=ext), encoding="utf-8")
    shutil.copy2(library, variant_dir / library.name)
    (variant_dir / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return variant_dir


def cuda_archs(config: dict) -> list[str]:
    """TORCH_CUDA_ARCH_LIST if set, else the cuda-capabilities of build.toml."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return [arch for arch in re.split(r"[;\s]+", env) if arch]
    return sorted({cap for kernel in config["kernel"].values() for cap in kernel.get("cuda-capabilities", [])})


def compile_library(ext: str, sources: list[str], include_dirs: list[str], work: Path, cuda: bool = True) -> Path:
    """Compile the op library `ext` with setuptools and torch's BuildExtension, without loading it here
    (a second copy of the same op namespace in one process aborts). cuda=False: C++ sources only."""
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    flags = {"cxx": ["-O3"], "nvcc": ["-O3"]} if cuda else {"cxx": ["-O3"]}
    extension = (CUDAExtension if cuda else CppExtension)(ext, sources, include_dirs=include_dirs,
                                                          extra_compile_args=flags)
    setup(name=ext, ext_modules=[extension], cmdclass={"build_ext": BuildExtension},
          script_args=["--quiet", "build_ext", "--build-lib", str(work / "lib"), "--build-temp", str(work / "tmp")])
    return next((work / "lib").glob(f"{ext}.*so"))


def build(out: Path = HERE, unique_id: str = "local") -> Path:
    """Compile the op library for this torch/CUDA and stage it under out/build/<variant>/."""
    config = read_config()
    variant = local_variant()
    ext = f"_{config['general']['name'].replace('-', '_')}_{unique_id}"
    archs = cuda_archs(config)
    sources = [*config["torch"]["src"], *(s for k in config["kernel"].values() for s in k["src"])]
    sources = [str(HERE / s) for s in sources if s.endswith((".cpp", ".cu"))]
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
    with tempfile.TemporaryDirectory(prefix="tide-kernels-") as work:
        (Path(work) / "registration.h").write_text(REGISTRATION_H, encoding="utf-8")
        library = compile_library(ext, sources, [work, str(HERE / "torch-ext")], Path(work))
        return stage_variant(out / "build" / variant, library, ext, metadata(config, ext, variant, archs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write build/<variant>/ into")
    parser.add_argument("--unique-id", default="local", help="suffix of the op namespace (default: local)")
    args = parser.parse_args(argv)
    variant_dir = build(args.out.resolve(), args.unique_id)
    print(variant_dir)
    print(f"Use it with: LOCAL_KERNELS=tide-transformers/tide-kernels={args.out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
