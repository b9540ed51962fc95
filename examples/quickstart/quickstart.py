"""Quickstart: calibrate routers for a causal LM, save them, load them back, generate with early exit.

    python examples/quickstart/quickstart.py --model Qwen/Qwen3-0.6B
    python examples/quickstart/quickstart.py --tiny      # offline, seconds, random weights
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # examples/_tiny.py

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import _tiny
import tide

parser = argparse.ArgumentParser(description="Tide quickstart")
parser.add_argument("--model", help="Hub id or local directory of a causal LM")
parser.add_argument("--tiny", action="store_true", help="tiny random-init model (the default without --model)")
parser.add_argument("--dataset", default="wikitext", help="calibration text: Hub dataset, local file or directory")
parser.add_argument("--dataset-config", default="wikitext-2-raw-v1")
parser.add_argument("--target", type=float, default=0.99, help="top-1 agreement the thresholds guarantee")
parser.add_argument("--out", default="quickstart-routers", help="where to write the router repo")
args = parser.parse_args()
tiny = args.tiny or not args.model
device = "cuda" if torch.cuda.is_available() else "cpu"

name = _tiny.model_dir(args)
base = AutoModelForCausalLM.from_pretrained(name, dtype="auto").to(device)
tok = AutoTokenizer.from_pretrained(name)

# 1. Train one router per checkpoint and pick thresholds with a statistical guarantee on held-out text.
data = _tiny.calibration_data() if tiny else dict(dataset=args.dataset, dataset_config=args.dataset_config)
config = tide.TideConfig(checkpoint_interval=2, target_agreement=_tiny.TARGET if tiny else args.target)
model = tide.calibrate(base, tok, config=config, **data)
cal = model.config.calibration
for layer, row in cal["checkpoints"].items():
    print(f"checkpoint {layer:>3}: threshold {row['threshold']:.3f}, expected exit rate {row['exit_rate']:.1%}")
print(f"expected: agreement {cal['expected_agreement']:.3f}, {cal['expected_mean_layers']:.2f} layers per token "
      f"of {model.config.base_num_layers} (a perfect router: {cal['oracle_mean_layers']:.2f})")

# 2. A router repo is three small files; the base model is referenced by name, never copied.
model.save_pretrained(args.out)
print(f"\n{args.out}: {sorted(os.listdir(args.out))}")
model = tide.TideForCausalLM.from_pretrained(args.out, dtype="auto").to(device)  # loads the base by name

# 3. Early exit with the calibrated thresholds. (A plain generate() runs the repo's default mode: exit, or
#    "auto" when calibration timed lossless mode faster; see the calibration table.)
inputs = tok("The assignment statement", return_tensors="pt").to(device)
out = model.generate(**inputs, max_new_tokens=24, do_sample=False, tide_config={"mode": "exit"})
print("\nexit mode:", repr(tok.decode(out[0], skip_special_tokens=True)))
print(model.last_stats.summary() if model.last_stats.mode != "base" else
      "(calibration timed exit mode slower than the base model here and turned its exits off: the base model ran)")

# 4. Lossless mode: the same tokens as the base model, drafted from an exit head and verified.
lossless = model.generate(**inputs, max_new_tokens=24, do_sample=False, tide_config={"mode": "lossless"})
stats = model.last_stats
if stats.mode == "base":  # calibration timed the drafting schemes and none beat the base model here
    print("\nlossless mode: no draft pays on this model and machine; the base model ran unchanged")
else:
    print(f"\nlossless mode: {stats.drafted} tokens drafted from layer {stats.checkpoints[0]}, "
          f"{stats.accepted} accepted, {stats.verify_passes} verification passes")
reference = model.generate(**inputs, max_new_tokens=24, do_sample=False, tide_config=False)  # the plain base
print("lossless output identical to the base model:", torch.equal(lossless, reference))
