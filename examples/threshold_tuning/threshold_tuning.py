"""Choosing an operating point: what calibration picked, what a perfect router could reach, and a sweep of
threshold overrides measured on held-out text the way generation runs (teacher-forced decode steps).

    python examples/threshold_tuning/threshold_tuning.py --model Qwen/Qwen3-0.6B
    python examples/threshold_tuning/threshold_tuning.py --tiny      # offline, seconds, random weights
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # examples/_tiny.py

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import _tiny
import tide
from tide.calibration.data import load_texts
from tide.calibration.evaluate import oracle_speedup, teacher_forced

parser = argparse.ArgumentParser(description="Tide threshold tuning")
parser.add_argument("--model", help="Hub id or local directory of a causal LM")
parser.add_argument("--tiny", action="store_true", help="tiny random-init model (the default without --model)")
parser.add_argument("--dataset", default="wikitext")
parser.add_argument("--dataset-config", default="wikitext-2-raw-v1")
parser.add_argument("--heldout-split", default="test", help="split for the sweep (never the calibration split)")
parser.add_argument("--heldout-texts", type=int, default=8, help="held-out texts for the sweep (128 tokens each)")
parser.add_argument("--target", type=float, default=0.99)
args = parser.parse_args()
tiny = args.tiny or not args.model
device = "cuda" if torch.cuda.is_available() else "cpu"

name = _tiny.model_dir(args)
base = AutoModelForCausalLM.from_pretrained(name, dtype="auto").to(device)
tok = AutoTokenizer.from_pretrained(name)
data = _tiny.calibration_data() if tiny else dict(dataset=args.dataset, dataset_config=args.dataset_config)
if tiny:
    heldout = _tiny.sample_texts(64)[-3:]  # not among the 48 calibration texts
else:
    heldout = [t for t in load_texts(args.dataset, dataset_config=args.dataset_config, split=args.heldout_split)
               if len(t) > 200][: args.heldout_texts]
tokens = [tok(text)["input_ids"][:48 if tiny else 128] for text in heldout]

# Checkpoints after every other layer; the guarantee: agreement >= target with 95% confidence.
config = tide.TideConfig(checkpoint_interval=2, target_agreement=_tiny.TARGET if tiny else args.target, confidence=0.95)
model = tide.calibrate(base, tok, config=config, progress=False, **data)
print("calibrated thresholds:", {k: round(v, 3) for k, v in model.config.thresholds.items()})

# The most any router could save: every token leaves at the first checkpoint whose top-1 already matches.
num_layers = model.parts.num_layers
print(f"oracle bound: x{oracle_speedup(model, tokens):.2f} in layers with checkpoints {model.checkpoints}, "
      f"x{oracle_speedup(model, tokens, list(range(num_layers - 1))):.2f} with a checkpoint after every layer\n")

# Overrides a generate() call can pass as tide_config (1.0 never exits; a negative value always exits).
sweep = {"calibrated": {}, "exit_threshold=1.0": {"exit_threshold": 1.0}}
sweep.update({f"exit_threshold={t}": {"exit_threshold": t} for t in (0.9, 0.7, 0.5)})
sweep["0.5, min_layers=4"] = {"exit_threshold": 0.5, "min_layers": 4}
sweep["always exit"] = {"exit_threshold": -1}
print(f"{'operating point':<22} {'agreement':>9} {'ppl change':>10} {'layers/token':>12}")
for label, overrides in sweep.items():
    q = teacher_forced(model, tokens, overrides)
    print(f"{label:<22} {q.agreement:9.3f} {q.ppl_delta:+10.3f} {q.mean_layers:12.2f}")

# To keep one: model.generate(..., tide_config={"exit_threshold": 0.7}) per call, or
# model.config.set_generation_defaults(exit_threshold=0.7); model.save_pretrained(...) to make it the repo's default.
