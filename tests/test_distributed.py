"""Calibration on several processes (torchrun / accelerate launch, gloo on CPU) against one process."""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("distributed_calibration.py")


MODES = ("fixed", "train", "share")


def _cores() -> int:
    """The cores this process may run on (what the processes it launches inherit), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _launch(processes: int, out) -> None:
    """One torchrun launch of `processes` processes that calibrates in every mode of MODES, into out/<mode>.json."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    out.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([torchrun, "--nproc_per_node", str(processes), "--master_port", str(29500 + processes),
                             str(SCRIPT), str(out), *MODES], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """{processes: folder of <mode>.json}: calibrations on 1 and on 2 processes, one launch each; both at once
    where this process has more than one core (starting the processes is most of a launch's time)."""
    out = {processes: tmp_path_factory.mktemp("distributed") / str(processes) for processes in (1, 2)}
    with ThreadPoolExecutor(max_workers=2 if _cores() > 1 else 1) as pool:
        for launch in [pool.submit(_launch, processes, folder) for processes, folder in out.items()]:
            launch.result()  # a launch's failure (or skip) raised here
    return out


def _run(processes: int, mode: str, launches) -> dict:
    return json.loads((launches[processes] / f"{mode}.json").read_text())


def test_same_scores_give_identical_thresholds(launches):
    """Untrained routers (no steps): the held-out scores are the same numbers on 1 or 2 processes, gathered in
    another order, and the thresholds must be identical."""
    one, two = _run(1, "fixed", launches), _run(2, "fixed", launches)
    assert two["world"] == 2 and one["world"] == 1
    assert two["heldout_tokens"] == one["heldout_tokens"] and two["train_tokens"] == one["train_tokens"]
    assert two["thresholds"] == one["thresholds"]
    assert two["expected_agreement"] == one["expected_agreement"]
    # the check through the decode step: the same token lists, split between the processes, the counts summed
    assert one["decode_validation"] is not None, "nothing exited: the check through the decode step did not run"
    drop = ("tokens_per_rank",)
    assert {k: v for k, v in two["decode_validation"].items() if k not in drop} == \
        {k: v for k, v in one["decode_validation"].items() if k not in drop}


def test_trained_on_two_processes_matches_one_within_tolerance(launches):
    one, two = _run(1, "train", launches), _run(2, "train", launches)
    assert two["same_weights_on_every_process"], "all-reduced updates must leave every process with the same routers"
    # Each process steps on its own shard and the gradients are averaged: not the same minibatches as one
    # process, so the weights differ slightly. Stated tolerance (docs/scaling.md): per checkpoint, the relative
    # difference of all its weights (exit head and router) below 0.1, and held-out agreement within 0.05.
    for layer in ("1", "3"):
        keys = [k for k in one["weights"] if k.startswith(f"routers.{layer}.")]
        a = torch.cat([torch.tensor(one["weights"][k]).flatten() for k in keys])
        b = torch.cat([torch.tensor(two["weights"][k]).flatten() for k in keys])
        assert (a - b).norm() <= 0.1 * a.norm(), (layer, float((a - b).norm() / a.norm()))
    assert abs(one["expected_agreement"] - two["expected_agreement"]) <= 0.05
    assert two["decode_validation"] is None or two["decode_validation"]["tokens"] > 0


def test_each_process_does_a_share_of_every_data_phase(launches):
    """From the calibration record: on 2 processes, each streamed about half the training and held-out tokens, took
    half of each head step's minibatch rows and decoded part of the validation tokens; the shares add up to the
    one-process work (the validated tokens: per round, as the bound counts them)."""
    for mode in MODES:
        one, two = _run(1, mode, launches)["work_per_rank"], _run(2, mode, launches)["work_per_rank"]
        assert one["processes"] == 1 and two["processes"] == 2
        for phase in ("training", "held-out scoring"):
            for unit in ("texts", "tokens"):
                shares = two[phase][unit]
                assert len(shares) == 2 and all(s > 0 for s in shares), (mode, phase, unit, shares)
                assert sum(shares) == one[phase][unit][0], (mode, phase, unit, shares, one[phase][unit])
                assert max(shares) <= 0.75 * sum(shares), (mode, phase, unit, shares)  # a share, not all
        if mode == "train":  # head steps: each process takes half of every minibatch
            rows = two["training"]["head_step_rows"]
            assert all(r > 0 for r in rows) and max(rows) <= 0.6 * one["training"]["head_step_rows"][0], rows
    for mode in MODES:
        one, two = _run(1, mode, launches), _run(2, mode, launches)
        assert one["decode_validation"] is not None and two["decode_validation"] is not None, (mode, "nothing exited")
        decoded = two["work_per_rank"]["decode validation"]["tokens"]
        assert decoded == two["decode_validation"]["tokens_per_rank"] and all(t > 0 for t in decoded), decoded
        # per round (the check may lower the budget and decode again) the shares add up to the tokens checked (a
        # token list is the unit: the split is as even as their lengths allow); one process checks them alone, and
        # stops a round that can no longer pass where processes decode their whole shares
        checked, alone = two["decode_validation"]["tokens"], one["decode_validation"]
        assert sum(decoded) % checked == 0
        assert alone["tokens"] < checked if alone.get("stopped_early") else alone["tokens"] == checked
    seconds = two["phase_seconds_per_rank"]
    assert all(len(s) == 2 for s in seconds.values()) and all(s > 0 for s in seconds["training"])
    assert "on 2 processes, each one's share: training" in two["table"]


def test_processes_on_cores_of_their_own_share_the_timing_trials(launches):
    """Launched plainly (no affinity set), the two processes each take cores of their own (calibration's
    `pin_cores` default), time the drafting schemes between them (the same schemes one process times alone),
    and every process keeps the same selection as one process. On one core they share it, and the main process
    times alone."""
    one, two = _run(1, "share", launches), _run(2, "share", launches)
    assert two["same_selection_on_every_process"]
    timed = [{k: v for k, v in run["draft_selection"]["chosen"].items() if k != "cycle_steps"} for run in (one, two)]
    assert timed[0] == timed[1]  # (a cycle's steps are measured afresh by each run: `machinecheck.measure_cycle`)
    if _cores() < 2:  # (the cores this process may use, not the machine's: `taskset -c 0` leaves one of many)
        # one core: nothing to pin; the processes share it, and the main process times every scheme alone
        assert two["cores_per_rank"][0] == two["cores_per_rank"][1], two["cores_per_rank"]
        assert "schemes_timed_per_rank" not in two["draft_selection"]
        return
    first, second = (set(c) for c in two["cores_per_rank"])
    assert first and second and not first & second, two["cores_per_rank"]
    assert one["draft_selection"]["trials"], "no drafting scheme was timed"
    assert ([t["measured"] for t in two["draft_selection"]["trials"]]
            == [t["measured"] for t in one["draft_selection"]["trials"]])
    shares = two["draft_selection"]["schemes_timed_per_rank"]
    assert all(s > 0 for s in shares) and max(shares) < sum(shares), shares
    assert all(n > 0 for n in two["timed_per_rank"]) and sum(two["timed_per_rank"]) >= one["timed_per_rank"][0]


@pytest.mark.parametrize("env, parent, asked", [
    ({"ACCELERATE_USE_CPU": "True"}, ["python", "accelerate", "launch", "--num_processes", "2", "--cpu", "x"], 2),
    ({"ACCELERATE_USE_CPU": "True"}, ["python", "accelerate", "launch", "--cpu", "--num-processes=4", "x"], 4),
    ({"ACCELERATE_USE_CPU": "True"}, ["python", "accelerate", "launch", "--num_processes", "1", "--cpu", "x"], 1),
    ({"ACCELERATE_USE_CPU": "True", "WORLD_SIZE": "2"}, ["torchrun", "launch", "--num_processes", "2"], 1),
    ({"ACCELERATE_USE_CPU": "False"}, ["python", "accelerate", "launch", "--num_processes", "2", "x"], 1),
    ({"ACCELERATE_USE_CPU": "True"}, ["python", "accelerate", "launch", "--num_processes", "2", "--cpu",
                                      "--mpirun_hostfile", "h", "x"], 1),
    ({}, ["python", "accelerate", "launch", "--num_processes", "2", "--cpu", "x"], 1),
])
def test_processes_asked_of_a_plain_accelerate_cpu_launch(monkeypatch, env, parent, asked):
    """`accelerate launch --num_processes N --cpu` starts one process and tells it nothing of N: Tide reads N from
    the launcher's command line, and only there."""
    from tide.calibration.distributed import processes_asked_of_accelerate
    for name in ("ACCELERATE_USE_CPU", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert processes_asked_of_accelerate(parent) == asked


@pytest.mark.parametrize("fork", [True, False], ids=["fork", "no-fork"])
def test_the_cli_starts_the_processes_accelerate_did_not(monkeypatch, capsys, tmp_path, fork):
    """`tide calibrate` under such a launch goes on as rank 0 of N and starts ranks 1..N-1 with its own arguments and
    torchrun's environment (forks of itself where the system forks, else new interpreters); its status is the
    worst of theirs."""
    import json
    import subprocess
    from tide.tools import cli
    started = []

    class Started:
        def __init__(self, command, env):
            started.append(command)
            (tmp_path / f"{env['RANK']}.json").write_text(json.dumps(env))
            self.pid = os.getpid()

        def wait(self):
            return 0

    environ = {k: v for k, v in os.environ.items()  # (rank 0's environment is set in this process: a copy,
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    monkeypatch.setattr(os, "environ", environ)  # dropped after the test, or later calibrations would wait for rank 1)
    monkeypatch.setattr(cli, "processes_asked_of_accelerate", lambda: 1 if "WORLD_SIZE" in os.environ else 2)
    if not fork:
        monkeypatch.delattr(os, "fork")
        monkeypatch.setattr(subprocess, "Popen", Started)
    monkeypatch.setattr(cli, "cmd_calibrate",
                        lambda args: (tmp_path / f"{os.environ['RANK']}.json").write_text(json.dumps(dict(os.environ))))
    argv = ["calibrate", "m", "--dataset", "d", "--out", "o"]
    assert cli.main(argv) == 0
    rank0, rank1 = (json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1))
    assert (rank1["RANK"], rank1["WORLD_SIZE"], rank0["RANK"], rank0["WORLD_SIZE"]) == ("1", "2", "0", "2")
    assert rank1["MASTER_PORT"] == rank0["MASTER_PORT"]
    assert started == ([] if fork else [[sys.executable, "-m", "tide.tools.cli", *argv]])
    assert "started 1 process of the 2 asked for" in capsys.readouterr().err
