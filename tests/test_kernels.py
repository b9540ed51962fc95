"""The router-exit reference, the kernel loader and the Hub kernel's sources (CPU); kernel parity (GPU)."""

import importlib.util
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tide
import tide.heads.kernels as tk
from tide.models.architectures import resolve
from tide.heads.router import Router, checkpoint_test_reference
from tiny_models import FAMILIES, tiny_model

KERNEL_DIR = Path(__file__).resolve().parents[1] / "hub_kernels" / "tide_kernels"
LOCAL_KERNELS = os.environ.get("LOCAL_KERNELS")  # for the GPU tests; the others run without it


@pytest.fixture(autouse=True)
def fresh_loader(monkeypatch):
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    tk._load.cache_clear()
    yield
    tk._load.cache_clear()


def _randomized(norm: nn.Module) -> nn.Module:
    """The norm with random weights (and bias), so that w vs 1 + w and the bias matter."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + 0.5)
    return norm


def _composed(norm, router, hidden, threshold):
    scores = torch.sigmoid(router(norm(hidden)).float())
    return scores, scores > threshold


def _final_norm(family):
    return _randomized(resolve(tiny_model(family)).norm)


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_matches_the_model_norm_and_router(family):
    norm = _final_norm(family)
    assert tk.norm_params(norm) is not None, f"add {type(norm).__name__} to tide.heads.kernels.NORM_KINDS"
    torch.manual_seed(0)
    router, hidden = Router(32, 8), torch.randn(3, 5, 32) * 2 + 0.3  # [B, T, H]
    with torch.no_grad():
        scores, mask = tk.router_exit(hidden, norm, router, threshold=0.5)
        want_scores, want_mask = _composed(norm, router, hidden, 0.5)
    assert scores.shape == mask.shape == (3, 5) and scores.dtype == torch.float32 and mask.dtype == torch.bool
    torch.testing.assert_close(scores, want_scores, atol=1e-5, rtol=0)
    assert torch.equal(mask, want_mask)


@pytest.mark.parametrize("family, kind", [("llama", tk.RMS_NORM), ("gemma", tk.GEMMA_RMS_NORM),
                                          ("gpt2", tk.LAYER_NORM)])
def test_reference_direct_call(family, kind):
    norm = _final_norm(family)
    weight, bias, norm_kind, eps = tk.norm_params(norm)
    assert norm_kind == kind and (bias is not None) == (kind == tk.LAYER_NORM)
    router, hidden = Router(32, 16), torch.randn(8, 32)
    with torch.no_grad():
        scores, _ = tk.router_exit_reference(hidden, weight, bias, norm_kind, eps, router.down.weight,
                                             router.down.bias, router.up.weight, router.up.bias, 0.3)
        torch.testing.assert_close(scores, _composed(norm, router, hidden, 0.3)[0], atol=1e-5, rtol=0)


class _ScaledNorm(nn.Module):  # a norm the fused op does not know
    def forward(self, x):
        return x / x.abs().amax(-1, keepdim=True)


@pytest.mark.parametrize("norm", [_ScaledNorm(), nn.Identity(), nn.LayerNorm(32, elementwise_affine=False)])
def test_unknown_norm_runs_as_a_module(norm):
    router, hidden = Router(32, 4), torch.randn(2, 32)
    with torch.no_grad():
        scores, mask = tk.router_exit(hidden, norm, router, 0.5)
        want_scores, want_mask = _composed(norm, router, hidden, 0.5)
    torch.testing.assert_close(scores, want_scores)
    assert torch.equal(mask, want_mask)


def test_auto_falls_back_to_the_reference_on_cpu_and_logs_once(caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="tide"):
        assert tk.load_router_kernel() is tk.router_exit_reference
        assert tk.load_router_kernel("auto") is tk.router_exit_reference
        tk.router_exit(torch.randn(2, 32), _final_norm("llama"), Router(32, 4), 0.5)
    records = [r for r in caplog.records if r.name == "tide"]
    assert len(records) == 1 and "PyTorch reference" in records[0].getMessage()
    assert "CUDA is not available" in records[0].getMessage()


def test_torch_mode_forces_the_reference(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("kernels.get_kernel", _must_not_be_called)
    with tk.kernel_mode("torch"):
        assert tk.load_router_kernel() is tk.router_exit_reference


def test_kernel_mode_without_cuda_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="kernels='kernel'.*CUDA is not available"):
        tk.load_router_kernel("kernel")
    with tk.kernel_mode("kernel"), pytest.raises(RuntimeError, match="kernels='kernel'"):
        tk.router_exit(torch.randn(2, 32), _final_norm("llama"), Router(32, 4), 0.5)
    assert tk.load_router_kernel() is tk.router_exit_reference  # outside the context: "auto" again


def test_a_calls_kernels_option_is_in_force_while_its_exit_tests_run():
    """`tide_config={"kernels": ...}` is the mode that the op's CUDA implementation and the router-exit loader read
    (`_mode(None)`) while the call's exit tests run, and only then. On CPU every mode computes the reference: the
    same tokens."""
    model = tide.TideForCausalLM.from_base(tiny_model("llama"), tide.TideConfig(checkpoint_layers=[1]))
    seen, build = [], model.exit_tests

    def recording(thresholds):
        return {k: (lambda hidden, test=test: seen.append(tk._mode(None)) or test(hidden))
                for k, test in build(thresholds).items()}

    model.exit_tests = recording
    ids = torch.randint(4, 100, (1, 6))
    out = {}
    for mode in ("auto", "torch", "kernel"):
        seen.clear()
        out[mode] = model.generate(ids, do_sample=False, max_new_tokens=4,
                                   tide_config={"exit_threshold": 0.5, "kernels": mode})
        assert seen and set(seen) == {mode} and model.last_stats.switches["kernels"] == mode
    assert tk._mode(None) == "auto"
    assert torch.equal(out["torch"], out["auto"]) and torch.equal(out["kernel"], out["auto"])


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="auto, torch, kernel"):
        tk.load_router_kernel("triton")


def _must_not_be_called(*args, **kwargs):
    raise AssertionError("unexpected call")


class _FakeKernel:
    @staticmethod
    def router_exit(*args):
        return tk.router_exit_reference(*args)


def test_hub_kernel_is_pinned_and_only_our_repo_trusted(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("kernels.get_kernel", lambda *a, **kw: calls.append((a, kw)) or _FakeKernel)
    assert tk.load_router_kernel("kernel") is _FakeKernel.router_exit
    assert calls == [((tk.KERNEL_REPO,), dict(version=tk.KERNEL_VERSION, trust_remote_code=[tk.KERNEL_REPO]))]


def test_local_build_comes_from_local_kernels(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_KERNELS", f"someone/other=/nowhere:{tk.KERNEL_REPO}={tmp_path}")
    monkeypatch.setattr("kernels.get_local_kernel", lambda path: calls.append(path) or _FakeKernel)
    monkeypatch.setattr("kernels.get_kernel", _must_not_be_called)
    assert tk.load_router_kernel() is _FakeKernel.router_exit
    assert calls == [tmp_path]


def test_auto_falls_back_when_no_variant_matches(caplog, monkeypatch):
    def no_variant(*args, **kwargs):
        raise FileNotFoundError("Cannot find a build variant for this system")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("kernels.get_kernel", no_variant)
    with caplog.at_level(logging.INFO, logger="tide"):
        assert tk.load_router_kernel() is tk.router_exit_reference
    assert [r.levelno for r in caplog.records if r.name == "tide"] == [logging.WARNING]
    with pytest.raises(RuntimeError, match="build variant"):
        tk.load_router_kernel("kernel")


# --- the Hub kernel's sources ---------------------------------------------------------------------------------


def _build_toml():
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((KERNEL_DIR / "build.toml").read_text())


def test_build_toml_has_the_kernel_builder_sections():
    config = _build_toml()
    general = config["general"]
    assert general["name"] == "tide-kernels" and general["backends"] == ["cuda"]
    assert general["version"] == tk.KERNEL_VERSION and general["hub"]["repo-id"] == tk.KERNEL_REPO
    assert config["torch"]["src"] == ["torch-ext/torch_binding.cpp", "torch-ext/torch_binding.h"]
    assert sorted(config["kernel"]) == ["checkpoint_test", "router_exit"]
    for name, kernel in config["kernel"].items():
        assert kernel["backend"] == "cuda" and kernel["depends"] == ["torch"]
        assert kernel["cuda-capabilities"] == ["8.0", "9.0"]
        assert kernel["src"] == [f"{name}/{name}.cu", "common/reductions.cuh"]  # the header both include
    listed = [*config["torch"]["src"], *(s for k in config["kernel"].values() for s in k["src"])]
    assert [s for s in listed if not (KERNEL_DIR / s).is_file()] == []
    for path in ("torch-ext/tide_kernels/__init__.py", "torch-ext/tide_kernels/_meta.py", "README.md",
                 "tests/test_router_exit.py", "tests/test_checkpoint_test.py", "tests/conftest.py", "build_local.py"):
        assert (KERNEL_DIR / path).is_file(), path


def test_build_toml_passes_kernels_own_validation():
    rust = pytest.importorskip("kernels._rust")
    build = rust.Build.open(KERNEL_DIR)
    assert build.general.backends == [rust.Backend.CUDA]


def _build_local():
    spec = importlib.util.spec_from_file_location("tide_kernels_build_local", KERNEL_DIR / "build_local.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, name", [
    (("2.13.0+cu130", "13.0", True, "x86_64", "Linux"), "torch213-cxx11-cu130-x86_64-linux"),
    (("2.9.1", "12.8", True, "aarch64", "Linux"), "torch29-cxx11-cu128-aarch64-linux"),
    (("2.10.0a0+git1234", "12.6", False, "x86_64", "linux"), "torch210-cxx98-cu126-x86_64-linux"),
    (("2.13.0", "13.0", None, "AMD64", "Windows"), "torch213-cu130-x86_64-windows"),
])
def test_variant_name(args, name):
    assert _build_local().variant_name(*args) == name
    variants = pytest.importorskip("kernels.variants")
    assert variants.parse_variant(name).variant_str == name  # `kernels` reads it back unchanged


def test_variant_name_needs_cuda():
    with pytest.raises(ValueError, match="CUDA build of torch"):
        _build_local().variant_name("2.13.0+cpu", None, True, "x86_64", "Linux")


def test_staged_variant_is_what_kernels_loads(tmp_path):
    build_local = _build_local()
    ext, variant = "_tide_kernels_local", "torch213-cxx11-cu130-x86_64-linux"
    library = tmp_path / f"{ext}.cpython-311-x86_64-linux-gnu.so"  # what BuildExtension writes
    library.write_bytes(b"")
    meta = build_local.metadata(_build_toml(), ext, variant, ["8.0", "9.0"])
    out = build_local.stage_variant(tmp_path / "build" / variant, library, ext, meta, KERNEL_DIR)
    assert sorted(p.name for p in out.iterdir()) == ["__init__.py", "_meta.py", "_ops.py", library.name,
                                                     "metadata.json"]
    assert f"from . import {ext}" in (out / "_ops.py").read_text()
    rust = pytest.importorskip("kernels._rust")
    parsed = rust.Metadata.read_from_file(out / "metadata.json")
    assert parsed.name.python_name == "tide_kernels" and parsed.version == tk.KERNEL_VERSION
    assert parsed.backend.archs == ["8.0", "9.0"]


def _binding_schemas() -> list[str]:
    source = (KERNEL_DIR / "torch-ext" / "torch_binding.cpp").read_text()
    return ["".join(re.findall(r'"([^"]*)"', call)) for call in re.findall(r"ops\.def\((.*?)\);", source, re.S)]


def test_binding_defines_both_ops_with_the_tide_op_schema():
    schemas = {schema.split("(")[0]: schema for schema in _binding_schemas()}
    assert sorted(schemas) == ["checkpoint_test", "router_exit"]
    # the kernel's checkpoint_test takes what tide::checkpoint_test takes, so the op can hand its arguments on
    from tide.heads.router import checkpoint_test

    ours = str(checkpoint_test._opoverload._schema).split("(", 1)[1]
    theirs = schemas["checkpoint_test"].split("(", 1)[1]
    assert re.sub(r"\s", "", ours) == re.sub(r"\s", "", theirs).replace("Tensorscores,Tensorexits,Tensorstate",
                                                                       "Tensor,Tensor,Tensor")


@pytest.fixture(scope="module")
def cpu_stand_in(tmp_path_factory):
    """The torch-ext package over CPU ops with the binding's schemas, implemented by the references."""
    namespace = "_tide_kernels_cpu_stand_in"
    library = torch.library.Library(namespace, "DEF")
    for schema in _binding_schemas():
        library.define(schema)
    library.impl("router_exit", tk.router_exit_reference, "CPU")
    library.impl("checkpoint_test", checkpoint_test_reference, "CPU")
    package = tmp_path_factory.mktemp("pkg") / "tide_kernels"
    shutil.copytree(KERNEL_DIR / "torch-ext" / "tide_kernels", package)
    (package / "_ops.py").write_text(_build_local().OPS_PY.format(ext=namespace).replace(
        f"from . import {namespace}\n", ""))
    yield _import_package(package, "tide_kernels_cpu_stand_in")
    library._destroy()


def _import_package(package: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, package / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_torch_ext_package_calls_the_op_and_registers_its_fake(cpu_stand_in):
    norm, router = _final_norm("gpt2"), Router(32, 8)
    weight, bias, kind, eps = tk.norm_params(norm)
    args = (torch.randn(4, 32), weight.detach(), bias.detach(), kind, eps, router.down.weight.detach(),
            router.down.bias.detach(), router.up.weight.detach(), router.up.bias.detach(), 0.5)
    scores, mask = cpu_stand_in.router_exit(*args)
    torch.testing.assert_close(scores, tk.router_exit_reference(*args)[0])
    torch.library.opcheck(cpu_stand_in.ops.router_exit.default, args)  # schema + fake vs real


@pytest.mark.parametrize("translate", ["none", "full", "low_rank"])
def test_torch_ext_package_checkpoint_test_calls_the_op_and_registers_its_fake(cpu_stand_in, translate):
    args = _checkpoint_args(translate, "cpu", torch.float32)
    scores, exits, state = cpu_stand_in.checkpoint_test(*args)
    want = checkpoint_test_reference(*args)
    torch.testing.assert_close(scores, want[0])
    torch.testing.assert_close(state, want[2])
    torch.library.opcheck(cpu_stand_in.ops.checkpoint_test.default, args)


def _checkpoint_args(translate: str, device, dtype, rows: int = 4, hidden_size: int = 32, bottleneck: int = 8,
                     layer_norm: bool = False, seed: int = 0):
    """Arguments of the checkpoint test (tide::checkpoint_test) with a random router and exit head."""
    from tide.heads.router import CheckpointTest, Translator

    torch.manual_seed(seed)
    translator = None if translate == "none" else Translator(hidden_size, 4 if translate == "low_rank" else None)
    if translator is not None:
        with torch.no_grad():
            for p in translator.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    router = Router(hidden_size, bottleneck, translator)
    norm = _randomized(nn.LayerNorm(hidden_size) if layer_norm else nn.RMSNorm(hidden_size, eps=1e-6))
    weight, bias, kind, eps = tk.norm_params(norm)
    test = CheckpointTest(router.to(device), weight.to(device), None if bias is None else bias.to(device), kind, eps,
                          0.5)
    hidden = (torch.randn(rows, hidden_size, device=device) * 2 + 0.3).to(dtype)
    if isinstance(test.translate, nn.Module):
        translate_args = (test.translate(hidden.float()).detach(), None)
    else:
        translate_args = test.translate or (None, None)
    tensors = [None if t is None else t.detach() for t in (hidden, *translate_args, *test.down, *test.up)]
    return (*tensors, test.layer_norm, test.eps, test.threshold)


def test_checkpoint_kernel_falls_back_to_the_reference(monkeypatch):
    assert tk.load_checkpoint_kernel("torch") is checkpoint_test_reference
    assert tk.load_checkpoint_kernel("auto") is checkpoint_test_reference  # no CUDA here, or no build
    older = type("OlderBuild", (), {"router_exit": staticmethod(tk.router_exit_reference)})
    monkeypatch.setattr(tk, "_load_kernel", lambda: (older, "an older build"))
    tk._load.cache_clear()
    assert tk.load_checkpoint_kernel("auto") is checkpoint_test_reference
    assert tk.load_router_kernel("auto") is tk.router_exit_reference  # the older build's router_exit
    with pytest.raises(RuntimeError, match="no checkpoint_test; rebuild it"):
        tk.load_checkpoint_kernel("kernel")


def test_checkpoint_op_on_cuda_takes_the_kernel_for_few_rows_only(monkeypatch):
    """The op's CUDA implementation runs the fused kernel for up to FUSED_MAX_ROWS rows where the kernels mode is
    auto (more rows: the reference, which was faster there), and for any count in mode "kernel". Called directly,
    on CPU tensors, with a stand-in kernel that records its calls."""
    ran = []

    def fused(*args):
        ran.append(args[0].shape[0])
        return checkpoint_test_reference(*args)

    monkeypatch.setattr(tk, "load_checkpoint_kernel", lambda mode=None: fused)
    few, many = tk.FUSED_MAX_ROWS, tk.FUSED_MAX_ROWS + 1
    for rows, mode, expected in ((few, "auto", [few]), (many, "auto", []), (many, "kernel", [many])):
        ran.clear()
        args = _checkpoint_args("full", "cpu", torch.float32, rows=rows)
        with tk.kernel_mode(mode):
            assert torch.equal(tk._checkpoint_test_cuda(*args)[1], checkpoint_test_reference(*args)[1])
        assert ran == expected, (rows, mode)


def test_torch_ext_package_imports_without_the_op_library(tmp_path):
    package = tmp_path / "tide_kernels"
    shutil.copytree(KERNEL_DIR / "torch-ext" / "tide_kernels", package)
    (package / "_ops.py").write_text(_build_local().OPS_PY.format(ext="_tide_kernels_not_loaded").replace(
        "from . import _tide_kernels_not_loaded\n", ""))
    assert callable(_import_package(package, "tide_kernels_not_loaded").router_exit)


# --- GPU parity -------------------------------------------------------------------------------------------------


@pytest.fixture
def gpu_kernel(monkeypatch):
    """The fused kernel (from LOCAL_KERNELS or the Hub cache); skips where no build exists for this torch/CUDA."""
    if LOCAL_KERNELS:
        monkeypatch.setenv("LOCAL_KERNELS", LOCAL_KERNELS)
    try:
        return tk.load_router_kernel("kernel")
    except RuntimeError as err:
        if tk._local_build() is not None:
            raise
        pytest.skip(f"no build of the kernel for this torch/CUDA (see hub_kernels/tide_kernels/build_local.py): {err}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gemma", "gpt2"])
def test_kernel_matches_reference_on_gpu(gpu_kernel, family, dtype):
    norm = _final_norm(family).to("cuda", dtype)
    router = Router(32, 16).to("cuda", dtype)
    hidden = torch.randn(4, 3, 32, device="cuda", dtype=dtype)
    with torch.no_grad():
        scores, mask = tk.router_exit(hidden, norm, router, 0.5, mode="kernel")
        weight, bias, kind, eps = tk.norm_params(norm)
        want, want_mask = tk.router_exit_reference(hidden.reshape(-1, 32), weight, bias, kind, eps,
                                                   router.down.weight, router.down.bias, router.up.weight,
                                                   router.up.bias, 0.5)
    assert scores.shape == mask.shape == (4, 3) and scores.is_cuda
    torch.testing.assert_close(scores.reshape(-1), want, atol=1e-4, rtol=0)
    decided = (want - 0.5).abs() > 1e-4
    assert torch.equal(mask.reshape(-1)[decided], want_mask[decided])


@pytest.mark.gpu
@pytest.mark.parametrize("hidden_size, bottleneck", [(64, 16), (4096, 128)])
def test_kernel_runs_without_host_sync(gpu_kernel, hidden_size, bottleneck):
    torch.manual_seed(0)
    norm, router = nn.LayerNorm(hidden_size).cuda(), Router(hidden_size, bottleneck).cuda()
    weight, bias, kind, eps = tk.norm_params(norm)
    args = (torch.randn(8, hidden_size, device="cuda"), weight.detach(), bias.detach(), kind, eps,
            router.down.weight.detach(), router.down.bias.detach(), router.up.weight.detach(),
            router.up.bias.detach(), 0.5)
    torch.cuda.set_sync_debug_mode("error")
    try:
        scores, _ = gpu_kernel(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(scores, tk.router_exit_reference(*args)[0], atol=1e-5, rtol=0)


@pytest.fixture
def gpu_checkpoint_kernel(gpu_kernel):
    fused = tk.load_checkpoint_kernel("kernel")
    assert fused is not checkpoint_test_reference
    return fused


@pytest.mark.gpu
@pytest.mark.parametrize("hidden_size, bottleneck", [(32, 8), (4096, 48)])
@pytest.mark.parametrize("layer_norm", [False, True])
@pytest.mark.parametrize("translate", ["none", "full", "low_rank"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_checkpoint_kernel_matches_reference_on_gpu(gpu_checkpoint_kernel, dtype, translate, layer_norm, hidden_size,
                                                    bottleneck):
    args = _checkpoint_args(translate, "cuda", dtype, rows=5, hidden_size=hidden_size, bottleneck=bottleneck,
                            layer_norm=layer_norm)
    scores, exits, state = gpu_checkpoint_kernel(*args)
    want_scores, want_exits, want_state = checkpoint_test_reference(*args)
    assert scores.dtype == torch.float32 and exits.dtype == torch.bool and state.dtype == dtype
    torch.testing.assert_close(scores, want_scores, atol=1e-4, rtol=0)
    torch.testing.assert_close(state, want_state, atol=0, rtol=0)  # the same GEMM, the same rounding
    decided = (want_scores - 0.5).abs() > 1e-4
    assert torch.equal(exits[decided], want_exits[decided])


@pytest.mark.gpu
def test_checkpoint_op_on_cuda_is_the_kernel_and_passes_opcheck(gpu_checkpoint_kernel):
    from tide.heads.router import checkpoint_test

    args = _checkpoint_args("full", "cuda", torch.bfloat16, rows=3, hidden_size=256, bottleneck=32)
    for got, want in zip(checkpoint_test(*args), gpu_checkpoint_kernel(*args)):
        assert torch.equal(got, want)
    torch.library.opcheck(checkpoint_test, args)


@pytest.mark.gpu
def test_checkpoint_kernel_runs_without_host_sync_and_in_a_cuda_graph(gpu_checkpoint_kernel):
    args = _checkpoint_args("full", "cuda", torch.bfloat16, rows=2, hidden_size=1024, bottleneck=64)
    want = gpu_checkpoint_kernel(*args)
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu_checkpoint_kernel(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gpu_checkpoint_kernel(*args)  # warm-up on the side stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = gpu_checkpoint_kernel(*args)
    args[0].mul_(-1.0)  # replay reads the new state
    graph.replay()
    flipped = gpu_checkpoint_kernel(*args)
    for got, want_now, _ in zip(captured, flipped, want):
        assert torch.equal(got, want_now)
    assert not torch.equal(captured[2], want[2])


def test_the_gpu_timing_script_runs_on_cpu(tmp_path):
    """examples/gpu/time_checkpoint_test.py (part of the GPU run) on CPU: the reference only, tiny shapes."""
    spec = importlib.util.spec_from_file_location(
        "time_checkpoint_test", KERNEL_DIR.parents[1] / "examples" / "gpu" / "time_checkpoint_test.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = script.main(["--device", "cpu", "--repeats", "2", "--shapes", "2", "64", "16",
                       "--json", str(tmp_path / "t.json")])
    row = out["rows"][0]
    assert row["fused_us"] is None and row["reference_us"] > 0 and row["layer_us"] > 0
    assert (tmp_path / "t.json").is_file()
