"""Run by tests/test_distributed.py under `torchrun --nproc_per_node N` (N = 1 or 2): for each mode given
("fixed": untrained routers, "train"), calibrate a tiny model on fixed texts and write what came out (rank 0) as
JSON to OUT_DIR/<mode>.json. Both modes run in one launch: starting the processes is most of the time."""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import tide  # noqa: E402
from tide.calibration.run import calibration_table  # noqa: E402
from tide.calibration.distributed import Processes  # noqa: E402
import fixed_timing  # noqa: E402
import tide.calibration.trials  # noqa: E402
from tiny_models import sample_texts, tiny_model, tiny_tokenizer  # noqa: E402

out_dir, modes = sys.argv[1], sys.argv[2:]
torch.set_num_threads(1)
timed = []  # the drafting schemes this process timed ("share" mode)


def fake_speedup(model, prompts, tide_config, **kwargs) -> float:
    """A fixed speed per scheme (deeper chains faster), so that every process would decide alike."""
    timed.append(tide_config)
    return 1.0 + 0.01 * tide_config.get("max_draft", 0) + 0.001 * (tide_config.get("draft_layer") or 0)


for mode in modes:
    train = mode == "train"
    steps = dict(head_steps=40, passes=2) if train else dict(head_steps=0, passes=0)
    trials = dict(measure_costs=False, draft_trials=0)
    if mode == "share":  # launched plainly, each process took cores of its own: the schemes' timings are shared out
        fixed_timing.install()
        tide.calibration.trials.measured_speedup = fake_speedup
        trials = dict(measure_costs=True, draft_trials=3, compiled_trials=False)
    model = tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=sample_texts(24), num_samples=24,
                           max_length=48, batch_size=4,
                           config=tide.TideConfig(checkpoint_layers=[1, 3], target_agreement=0.6),
                           validation_tokens=64, progress=False, **steps, **trials)
    procs = Processes.current(model.base.device)
    weights = {k: v.tolist() for k, v in model.routers.state_dict().items()}
    gathered = procs.broadcast(weights)  # the main process's weights, to compare with every process's own
    same = all(torch.allclose(torch.tensor(weights[k]), torch.tensor(gathered[k])) for k in weights)
    identical = procs.sum([0.0 if same else 1.0])[0] == 0.0
    selection = model.config.calibration["draft_selection"]
    same_selection = procs.sum([0.0 if procs.broadcast(selection) == selection else 1.0])[0] == 0.0
    timed_per_rank = [int(n[0]) for n in procs.per_rank([len(timed)])]
    cores = [None] * procs.world
    if procs.world > 1:
        torch.distributed.all_gather_object(cores, sorted(os.sched_getaffinity(0)))
    timed.clear()
    if procs.is_main:
        cal = model.config.calibration
        with open(os.path.join(out_dir, f"{mode}.json"), "w") as f:
            json.dump({"world": procs.world, "thresholds": model.config.thresholds, "weights": weights,
                       "heldout_tokens": cal["heldout_tokens"], "train_tokens": cal["train_tokens"],
                       "expected_agreement": cal["expected_agreement"], "same_weights_on_every_process": identical,
                       "decode_validation": cal["decode_validation"], "work_per_rank": cal["work_per_rank"],
                       "phase_seconds_per_rank": cal.get("phase_seconds_per_rank"),
                       "draft_selection": cal["draft_selection"], "cpus": os.cpu_count(),
                       "timed_per_rank": timed_per_rank, "cores_per_rank": cores,
                       "same_selection_on_every_process": same_selection,
                       "table": calibration_table(model.config)}, f)
if torch.distributed.is_initialized():  # leave together: a process that exits while another is still in a
    torch.distributed.barrier()  # collective can abort ("terminate called without an active exception")
    torch.distributed.destroy_process_group()
