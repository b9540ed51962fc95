"""Router repos: save_pretrained writes three small files (never the base weights); push_to_hub uploads the
same files. Nothing is uploaded unless you pass --push.

    python examples/push_router_repo/push_router_repo.py --model Qwen/Qwen3-0.6B --push you/Qwen3-0.6B-tide
    python examples/push_router_repo/push_router_repo.py --tiny      # offline: save, inspect, reload
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # examples/_tiny.py

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import _tiny
import tide

parser = argparse.ArgumentParser(description="Save and push a Tide router repo")
parser.add_argument("--model", help="Hub id or local directory of a causal LM")
parser.add_argument("--tiny", action="store_true", help="tiny random-init model (the default without --model)")
parser.add_argument("--dataset", default="wikitext")
parser.add_argument("--dataset-config", default="wikitext-2-raw-v1")
parser.add_argument("--out", default="router-repo", help="local directory for the router repo")
parser.add_argument("--push", metavar="REPO", help="also upload to this Hub repo id (needs `hf auth login`)")
parser.add_argument("--private", action="store_true", help="create the Hub repo as private")
args = parser.parse_args()
tiny = args.tiny or not args.model
device = "cuda" if torch.cuda.is_available() else "cpu"

name = _tiny.model_dir(args)
base = AutoModelForCausalLM.from_pretrained(name, dtype="auto").to(device)
data = _tiny.calibration_data() if tiny else dict(dataset=args.dataset, dataset_config=args.dataset_config)
config = tide.TideConfig(checkpoint_interval=2, target_agreement=_tiny.TARGET if tiny else 0.99)
model = tide.calibrate(base, AutoTokenizer.from_pretrained(name), config=config, progress=False, **data)

# 1. Save: config.json, routers.safetensors, README.md (a generated model card).
model.save_pretrained(args.out)
for file in sorted(os.listdir(args.out)):
    print(f"{file:<22} {os.path.getsize(os.path.join(args.out, file)) / 1024:8.1f} KiB")
saved = json.load(open(os.path.join(args.out, "config.json")))
print("\nconfig.json:", {k: saved[k] for k in ("base_model_name_or_path", "base_model_type", "base_num_layers",
                                              "checkpoint_layers", "thresholds", "target_agreement")})
with safe_open(os.path.join(args.out, "routers.safetensors"), "pt") as f:
    print("routers.safetensors:", sorted(f.keys()), f.metadata())
print("README.md:", next(line for line in open(os.path.join(args.out, "README.md")) if line.startswith("# ")).strip())

# 2. Load it back. Without base_model=, from_pretrained loads the base by the name in config.json.
loaded = tide.TideForCausalLM.from_pretrained(args.out, base_model=base)
same = all(torch.equal(a, b) for a, b in zip(model.routers.state_dict().values(), loaded.routers.state_dict().values()))
print("\nreloaded routers identical:", same,
      "| thresholds identical:", loaded.config.thresholds == model.config.thresholds)

# 3. Push the same three files to the Hub, then anyone can load them by repo id.
if args.push:
    model.push_to_hub(args.push, private=args.private)
    print(f"pushed: https://huggingface.co/{args.push}\nload with tide.TideForCausalLM.from_pretrained({args.push!r})")
else:
    print("not pushed (pass --push USER/REPO to upload with model.push_to_hub)")
