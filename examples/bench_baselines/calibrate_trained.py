"""Calibrate routers for a model trained by `examples/tiny-model/train.py`, with the demo's recipe.

The demo's settings (a checkpoint after every layer, target agreement 0.9, 1,024 texts of the training corpus, Python's
own documentation), plus `compiled_trials=True` and no cap on the timing trials, so that the repo also holds what a
`compile=True` call drafts (`compiled_chain`). One thread, as the benches time it.

    python examples/bench_baselines/calibrate_trained.py MODEL_DIR OUT_DIR

Then time it: `bench_baselines.py --model MODEL_DIR --routers OUT_DIR --compile --text heldout` (README.md here).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tide.tools.demo import _calibrate
from tide.tools.demo_corpus import split_corpus


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a trained model's folder (with its tokenizer)")
    parser.add_argument("out", help="where to write the router repo")
    parser.add_argument("--num-samples", type=int, default=1024)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    start = time.perf_counter()
    model = _calibrate(base, tokenizer, split_corpus()[0], args.num_samples, compiled_trials=True, timing_budget_s=None)
    model.save_pretrained(args.out)
    print(f"calibrated in {time.perf_counter() - start:.0f} s; repo defaults {model.config.generation}")


if __name__ == "__main__":
    main()
