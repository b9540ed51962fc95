"""The same Tide code on models of different families: calibrate, exit mode, lossless mode.

    python examples/any_model_family/any_model_family.py --model Qwen/Qwen3-0.6B gpt2 EleutherAI/pythia-160m
    python examples/any_model_family/any_model_family.py --tiny      # tiny llama, gpt2, falcon, mistral
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # examples/_tiny.py

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import _tiny
import tide

parser = argparse.ArgumentParser(description="Tide on several model families")
parser.add_argument("--model", nargs="+", help="Hub ids or local directories of causal LMs")
parser.add_argument("--tiny", action="store_true", help="tiny random-init models (the default without --model)")
parser.add_argument("--dataset", default="wikitext")
parser.add_argument("--dataset-config", default="wikitext-2-raw-v1")
parser.add_argument("--target", type=float, default=0.99)
args = parser.parse_args()
tiny = args.tiny or not args.model
device = "cuda" if torch.cuda.is_available() else "cpu"
names = [_tiny.build(f"tiny-model/{t}", t) for t in ("llama", "gpt2", "falcon", "mistral")] if tiny else args.model
data = _tiny.calibration_data() if tiny else dict(dataset=args.dataset, dataset_config=args.dataset_config)
print("Model types in Tide's table:", ", ".join(tide.supported_model_types()), "(others are probed)\n")

rows = []
for name in names:
    base = AutoModelForCausalLM.from_pretrained(name, dtype="auto").to(device)
    tok = AutoTokenizer.from_pretrained(name)
    config = tide.TideConfig(checkpoint_interval=2, target_agreement=_tiny.TARGET if tiny else args.target)
    model = tide.calibrate(base, tok, config=config, progress=False, **data)  # no per-family code anywhere

    inputs = tok("The assignment statement", return_tensors="pt").to(device)
    greedy = dict(max_new_tokens=24, do_sample=False)
    reference = model.generate(**inputs, **greedy, tide_config=False)  # the plain base model
    model.generate(**inputs, **greedy, tide_config={"mode": "exit"})  # calibrated thresholds
    stats = model.last_stats  # mode "base": calibration timed the exits slower than the base model, turned them off
    exit_layers = (f"{stats.mean_layers:.2f} of {model.parts.num_layers}" if stats.mode != "base"
                   else "exits off (not faster)")
    same = torch.equal(model.generate(**inputs, **greedy, tide_config={"mode": "lossless"}), reference)
    lossless = "identical to the base" if same else "DIFFERS from the base"
    rows.append((base.config.model_type, str(model.checkpoints), exit_layers, lossless))

print(f"{'model type':<12} {'checkpoints':<14} {'exit mode: layers/token':<24} lossless mode")
for row in rows:
    print(f"{row[0]:<12} {row[1]:<14} {row[2]:<24} {row[3]}")
