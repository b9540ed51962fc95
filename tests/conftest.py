import os
import sys

# No test touches the network: Hub code paths resolve from local directories and caches.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (`make test` runs a worker a core) each worker takes one thread: the tiny models gain
# nothing from more, and two workers' threads on one core slow both.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


# The files that take longest (about 85% of the suite's time, measured on 2 cores with `--durations=0`), longest
# first: pytest-xdist hands whole files to workers in collection order, so the long ones start first and the workers
# finish together.
LONGEST_FILES = ("test_compile.py", "test_fused_cycles.py", "test_tree_drafts.py", "test_compile_once.py",
                 "test_sampling_joint.py", "test_exit_graph.py", "test_examples.py", "test_cli.py",
                 "test_support_matrix.py", "test_lossless.py", "test_structure.py", "test_repo.py",
                 "test_machine_check.py", "test_distributed.py", "test_default_mode.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the others keep their order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def eager_compiled_baseline(monkeypatch):
    """`tide bench`'s compiled baseline (the base model's compiled static-cache decode) and its compiled lossless row
    captured by dynamo without inductor's code generation (the eager backend): for tests that run the bench or the
    demo and read nothing of inductor's code; inductor itself is tested in tests/test_compile.py."""
    from transformers import CompileConfig

    import tide.tools.bench

    compiled = tide.tools.bench.compiled_static_decoder

    def eager_backend(base, cache_len, compile_options=None, **kwargs):
        return compiled(base, cache_len, dict(fullgraph=True, dynamic=False, backend="eager"), **kwargs)

    monkeypatch.setattr(tide.tools.bench, "compiled_static_decoder", eager_backend)
    monkeypatch.setattr(tide.tools.bench, "TIDE_COMPILE_CONFIG", CompileConfig(backend="eager"))


# ---------------------------------------------------------------------- fixed timings (tests/fixed_timing.py)
@pytest.fixture(scope="session", autouse=True)
def _fixed_timing():
    """Calibration's timing trials return fixed values in every test (and in session- or module-scoped
    fixtures), unless the test is marked `real_timing`."""
    import fixed_timing

    bindings = fixed_timing.bindings()
    with pytest.MonkeyPatch.context() as patch:
        for module, attr, _real, fake in bindings:
            patch.setattr(module, attr, fake)
        yield bindings


@pytest.fixture(autouse=True)
def _real_timing(request, _fixed_timing, monkeypatch):
    """`@pytest.mark.real_timing`: this test times on the machine (the real `measure_costs`, `measured_speedup`,
    `measure_cycle`)."""
    if request.node.get_closest_marker("real_timing"):
        for module, attr, real, _fake in _fixed_timing:
            monkeypatch.setattr(module, attr, real)
