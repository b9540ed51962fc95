"""Calibration phase by phase on the shipped model, on one process or several (docs/scaling.md).

Run under a launcher, one thread per process (calibration gives each CPU process cores of its own):

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 1 examples/bench_calibration/bench_phases.py
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/bench_calibration/bench_phases.py

(`accelerate launch --num_processes 2 --multi_gpu` starts two CPU processes too, through torchrun; with `--cpu`,
accelerate starts one, which only `tide calibrate` notices and mends.)

The main process prints one JSON line: wall seconds, seconds per phase (every process's), each process's share
of the data phases, and the calibration's outcome (thresholds, expected agreement) to compare runs.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import tide
from tide.tools.demo import DEMO_MODEL_DIR
from tide.tools.demo_corpus import split_corpus
from tide.calibration.distributed import Processes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--checkpoint-interval", type=int, default=2)
    parser.add_argument("--timing-budget-s", type=float, default=None)
    parser.add_argument("--no-pin-cores", action="store_true", help="leave the processes' cores as launched")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    train, _ = split_corpus()
    start = time.perf_counter()
    model = tide.calibrate(base, tokenizer, dataset=train,
                           config=tide.TideConfig(checkpoint_interval=args.checkpoint_interval),
                           num_samples=args.samples, max_length=128, batch_size=16, progress=False,
                           timing_budget_s=args.timing_budget_s, pin_cores=not args.no_pin_cores)
    wall = time.perf_counter() - start
    procs = Processes.current(model.base.device)
    if procs.is_main:
        cal = model.config.calibration
        print(json.dumps({"processes": procs.world, "samples": args.samples, "wall_s": round(wall, 1),
                          "phase_seconds": cal["phase_seconds"],
                          "phase_seconds_per_rank": cal.get("phase_seconds_per_rank"),
                          "work_per_rank": cal["work_per_rank"], "thresholds": model.config.thresholds,
                          "expected_agreement": cal["expected_agreement"],
                          "decode_validation": cal["decode_validation"],
                          "mode": model.config.generation_config.mode, "timing_budget": cal.get("timing_budget")}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
