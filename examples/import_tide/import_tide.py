"""Bring routers trained with TIDE (`tide-inference`) into Tide, then recalibrate them.

    python examples/import_tide/import_tide.py --model meta-llama/Llama-3.2-1B --router path/to/router.pt
    python examples/import_tide/import_tide.py --tiny      # writes a stand-in router.pt with random weights
"""

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # examples/_tiny.py

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import _tiny
import tide

parser = argparse.ArgumentParser(description="Import TIDE routers")
parser.add_argument("--model", help="the base model the TIDE routers were trained on (Hub id or directory)")
parser.add_argument("--tiny", action="store_true", help="tiny random-init model (the default without --model)")
parser.add_argument("--router", help="TIDE's router.pt (default: write a stand-in in TIDE's format)")
parser.add_argument("--dataset", default="wikitext")
parser.add_argument("--dataset-config", default="wikitext-2-raw-v1")
parser.add_argument("--out", default="imported-routers")
args = parser.parse_args()
tiny = args.tiny or not args.model
device = "cuda" if torch.cuda.is_available() else "cpu"

name = _tiny.model_dir(args)
base = AutoModelForCausalLM.from_pretrained(name, dtype="auto").to(device)
tok = AutoTokenizer.from_pretrained(name)

if args.router is None:  # TIDE's format: plain tensors and ints, routers hidden -> 128 -> 1 without biases
    torch.manual_seed(0)
    hidden, layers = base.config.hidden_size, base.config.num_hidden_layers
    torch.save({"hidden_dim": hidden, "bottleneck_dim": 128, "router_layers": {
        k: {"down.weight": torch.randn(128, hidden) * 0.1, "up.weight": torch.randn(1, 128) * 0.1}
        for k in range(1, layers, 2)}}, "router.pt")  # includes the last layer, which TIDE counts as an exit
    args.router = "router.pt"

# 1. Import: read with torch.load(weights_only=True), keep the exits before the last layer, zero biases.
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = tide.convert_tide_routers(args.router, base)
for w in caught:
    print("warning:", w.message)
c = model.config
g = c.generation_config
inputs = tok("The assignment statement", return_tensors="pt").to(device)
model.generate(**inputs, max_new_tokens=24, do_sample=False)
print(f"imported checkpoints {model.checkpoints} with TIDE's operating point (exit_threshold={g.exit_threshold}, "
      f"min_layers={g.min_layers}): {model.last_stats.mean_layers:.2f} layers/token, no guarantee")

# 2. TIDE trained these routers on raw states; Tide scores the final-norm view, so their scores shift.
#    Recalibrate: fine-tune the imported routers and pick thresholds with Tide's guarantee.
c.set_generation_defaults(exit_threshold=None, min_layers=0)  # the calibrated thresholds at every checkpoint
c.target_agreement = _tiny.TARGET if tiny else 0.99
data = _tiny.calibration_data() if tiny else dict(dataset=args.dataset, dataset_config=args.dataset_config)
model = tide.calibrate(model, tok, progress=False, **data)
print("recalibrated thresholds:", {k: round(v, 3) for k, v in c.thresholds.items()})
model.generate(**inputs, max_new_tokens=24, do_sample=False)
print(model.last_stats.summary())

# 3. Save in Tide's format: config.json + routers.safetensors + README.md (no pickle).
model.save_pretrained(args.out)
print(f"\nwrote {args.out}: {sorted(os.listdir(args.out))}")
