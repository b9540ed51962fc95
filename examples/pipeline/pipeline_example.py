"""Tide behind transformers' pipeline: a loaded model with a tide_config per call, and a router repo by path.

    python examples/pipeline/pipeline_example.py --model Qwen/Qwen3-0.6B
    python examples/pipeline/pipeline_example.py --routers my-router-repo   # an existing router repo
    python examples/pipeline/pipeline_example.py --tiny                     # offline, seconds
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # examples/_tiny.py

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import _tiny
import tide

parser = argparse.ArgumentParser(description="Tide with transformers pipelines")
parser.add_argument("--model", help="Hub id or local directory of a causal LM (routers are calibrated for it)")
parser.add_argument("--tiny", action="store_true", help="tiny random-init model (the default without --model)")
parser.add_argument("--routers", help="an existing router repo (Hub id or directory); skips calibration")
parser.add_argument("--dataset", default="wikitext")
parser.add_argument("--dataset-config", default="wikitext-2-raw-v1")
args = parser.parse_args()
tiny = args.tiny or not args.model
device = "cuda" if torch.cuda.is_available() else "cpu"

repo = args.routers
if repo is None:  # make a router repo first
    name = _tiny.model_dir(args)
    data = _tiny.calibration_data() if tiny else dict(dataset=args.dataset, dataset_config=args.dataset_config)
    config = tide.TideConfig(checkpoint_interval=2, target_agreement=_tiny.TARGET if tiny else 0.99)
    base = AutoModelForCausalLM.from_pretrained(name, dtype="auto").to(device)
    tide.calibrate(base, AutoTokenizer.from_pretrained(name), config=config, progress=False, **data).save_pretrained(
        "pipeline-routers")
    repo, base = "pipeline-routers", None  # free the calibration copy

# 1. A TideForCausalLM object in a pipeline; tide_config goes through the pipeline call to generate().
model = tide.TideForCausalLM.from_pretrained(repo, dtype="auto").to(device)
tok = AutoTokenizer.from_pretrained(repo)  # after `import tide`: the base model's tokenizer
generator = pipeline("text-generation", model=model, tokenizer=tok)
prompt, greedy = "The assignment statement", dict(max_new_tokens=24, do_sample=False)
for label, tide_config in [("base model", False), ("calibrated", None), ("threshold 0.5", {"exit_threshold": 0.5}),
                           ("lossless", {"mode": "lossless"})]:
    text = generator(prompt, tide_config=tide_config, **greedy)[0]["generated_text"]
    stats = model.last_stats  # mode "base" when the plain base model ran
    if stats.mode == "base":
        note = "every layer"
    elif stats.mode == "lossless":
        note = f"{stats.accepted}/{stats.drafted} drafts kept"
    else:
        note = f"{stats.mean_layers:.2f} layers/token"
    print(f"{label:<14} {note:<20} {text!r}")

# 2. A router repo by name: after `import tide`, AutoModelForCausalLM resolves it to TideForCausalLM and
#    loads the base model named in its config; AutoTokenizer finds that base model's tokenizer.
generator = pipeline("text-generation", model=repo, device=device)
print(f"\npipeline(model={repo!r}) -> {type(generator.model).__name__} over {generator.model.config.base_model_type}")
print(generator(prompt, **greedy)[0]["generated_text"])
print(generator.model.last_stats.summary())
