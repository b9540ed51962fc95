"""Every example script runs end to end in its offline tiny mode (a fresh process each, in a temp dir), with
calibration's timing trials replaced by the suite's fixed values (tests/fixed_timing.py)."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# Runs a script with calibration's timing trials replaced by the suite's fixed values (tests/fixed_timing.py):
# the examples do not test timing, and their calibrations' trials took most of their time.
FIXED_TIMING = Path(__file__).resolve().parent / "fixed_timing.py"

# script, what its output must contain
SCRIPTS = {
    "quickstart/quickstart.py": "lossless output identical to the base model: True",
    "any_model_family/any_model_family.py": "mistral",
    "threshold_tuning/threshold_tuning.py": "oracle bound",
    "pipeline/pipeline_example.py": "TideForCausalLM",
    "push_router_repo/push_router_repo.py": "reloaded routers identical: True",
    "import_tide/import_tide.py": "recalibrated thresholds",
    "custom_generate_repo/time_custom_generate.py": "tokens identical to the wrapped model: True",
}


def test_each_example_is_one_script_and_a_readme():
    for script in SCRIPTS:
        folder = (EXAMPLES / script).parent
        assert (folder / "README.md").is_file(), folder
        assert [p.name for p in folder.glob("*.py")] == [Path(script).name], folder


def _run(script: str, cwd: Path) -> subprocess.CompletedProcess:
    # One thread: the tiny models are too small to gain from more, and spare cores keep other work fast.
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(FIXED_TIMING), str(EXAMPLES / script), "--tiny"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def example_runs(request, tmp_path_factory):
    """{script: its finished process}: the scripts this session's tests ask for, each in a fresh process and a temp
    dir of its own, as many at a time as this process has cores (each runs on one thread; most of a run is starting
    Python and importing torch and transformers)."""
    asked = (getattr(item, "callspec", None) for item in request.session.items if item.module is request.module)
    scripts = sorted({spec.params["script"] for spec in asked if spec is not None and "script" in spec.params})
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=max(1, min(cores, len(scripts)))) as pool:
        runs = {s: pool.submit(_run, s, tmp_path_factory.mktemp("example")) for s in scripts}
        return {s: run.result() for s, run in runs.items()}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_example_runs_in_tiny_mode(script, example_runs):
    out = example_runs[script]
    assert out.returncode == 0, f"{script} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    assert SCRIPTS[script] in out.stdout, out.stdout[-3000:]
    if script == "any_model_family/any_model_family.py":
        assert "DIFFERS" not in out.stdout


def test_the_real_model_bench_keeps_its_held_out_questions_apart(monkeypatch):
    """The real-model bench's chat questions: at least 60, split into calibration and held-out sets that share
    no question; its model cache folder follows $TIDE_CACHE."""
    monkeypatch.syspath_prepend(str(EXAMPLES / "bench_real"))
    import realmodel

    calibration, held = realmodel.questions()
    assert len(calibration) + len(held) >= 60 and len(held) >= 20
    assert not set(calibration) & set(held) and len(set(calibration)) == len(calibration)
    monkeypatch.setenv("TIDE_CACHE", "/somewhere")
    assert str(realmodel.cache_dir()) == "/somewhere/smollm2-135m-instruct"


def test_the_real_model_bench_loads_the_model_in_the_dtype_asked(monkeypatch, tmp_path):
    """`realmodel.load(device, dtype)` (the bench's --device and --dtype): the converted model in that dtype, float32
    by default, with its tokenizer."""
    import torch
    from tiny_models import tiny_model, tiny_tokenizer

    monkeypatch.syspath_prepend(str(EXAMPLES / "bench_real"))
    import realmodel

    tiny_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    monkeypatch.setattr(realmodel, "converted_model", lambda: tmp_path)
    model, tok = realmodel.load("cpu", "bfloat16")
    assert model.dtype == torch.bfloat16 and not model.training and tok is not None
    assert realmodel.load()[0].dtype == torch.float32
