"""A router repo run by a plain transformers model, timed against the wrapped model.

`base.generate(..., custom_generate=<router repo>, trust_remote_code=True)` loads the repo's routers onto `base` on
its first call and keeps them there; this script times that first call, then alternates later calls with the same
call on the wrapped model (`TideForCausalLM`) and reports both, and checks that their tokens agree.

    taskset -c 1 env OMP_NUM_THREADS=1 python examples/custom_generate_repo/time_custom_generate.py \\
        --model src/tide/assets/tiny-llama
    python examples/custom_generate_repo/time_custom_generate.py --routers you/Qwen3-0.6B-tide --model Qwen/Qwen3-0.6B
    python examples/custom_generate_repo/time_custom_generate.py --tiny        # offline, seconds
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # examples/_tiny.py

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import _tiny
import tide
from tide.hub.custom_generate import routers_on

parser = argparse.ArgumentParser(description="Time a router repo's custom_generate against the wrapped model")
parser.add_argument("--model", help="Hub id or local directory of the base model")
parser.add_argument("--tiny", action="store_true", help="tiny random-init model (the default without --model)")
parser.add_argument("--routers", help="an existing router repo for the model; default: fresh routers saved to --out")
parser.add_argument("--out", default="custom-generate-routers", help="where fresh routers are saved")
parser.add_argument("--mode", default="lossless", choices=["lossless", "exit"], help="the Tide mode both paths run")
parser.add_argument("--rounds", type=int, help="timed calls per path, alternating (default 30; 5 with --tiny)")
parser.add_argument("--new-tokens", type=int, default=40)
parser.add_argument("--threads", type=int, default=1)
args = parser.parse_args()
torch.set_num_threads(args.threads)

name = _tiny.model_dir(args)
rounds = args.rounds or (5 if args.tiny or not args.model else 30)
base = AutoModelForCausalLM.from_pretrained(name)
tok = AutoTokenizer.from_pretrained(name)
repo = args.routers
if repo is None:  # uncalibrated routers: this times the path to Tide's loop, not what calibration would gain
    tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2)).save_pretrained(args.out)
    repo = args.out
options = {"mode": args.mode} if args.mode == "lossless" else {"mode": "exit", "exit_threshold": 0.5}
inputs = tok("The assignment statement evaluates the expression list", return_tensors="pt")
call = dict(**inputs, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
            tide_config=options)


def custom():
    return base.generate(**call, custom_generate=repo, trust_remote_code=True)


wrapped = tide.TideForCausalLM.from_pretrained(repo, base_model=base)  # the same base model, wrapped


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


first, out = timed(custom)
same = torch.equal(out, wrapped.generate(**call))
times = {"wrapped": [], "custom_generate": []}
for i in range(rounds):  # alternating, the order flipped each round: drift hits both paths alike
    for label in (("wrapped", "custom_generate") if i % 2 else ("custom_generate", "wrapped")):
        seconds, _ = timed((lambda: wrapped.generate(**call)) if label == "wrapped" else custom)
        times[label].append(seconds)
load_fn = [timed(lambda: base.load_custom_generate(repo, trust_remote_code=True))[0] for _ in range(rounds)]
lookup = [timed(lambda: routers_on(tide.TideForCausalLM, base, repo))[0] for _ in range(rounds)]

print(f"router repo {repo} on {name}: {args.new_tokens} new tokens, mode {args.mode}, {torch.get_num_threads()} "
      f"thread(s), {rounds} calls per path")
print(f"first custom_generate call (loads the routers): {first * 1e3:8.1f} ms")
for label, values in times.items():
    q = statistics.quantiles(values, n=4)
    print(f"{label:<16} median {statistics.median(values) * 1e3:8.2f} ms   quartiles {q[0] * 1e3:8.2f} .. "
          f"{q[2] * 1e3:8.2f} ms   min {min(values) * 1e3:8.2f} ms")
ratio = statistics.median(times["custom_generate"]) / statistics.median(times["wrapped"])
print(f"custom_generate / wrapped (medians): {ratio:.3f}")
print(f"what the custom_generate path adds per call: transformers' load_custom_generate "
      f"{statistics.median(load_fn) * 1e3:.2f} ms, Tide's lookup of the routers held on the model "
      f"{statistics.median(lookup) * 1e3:.3f} ms (medians)")
print(f"tokens identical to the wrapped model: {same}")
