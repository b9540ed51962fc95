"""What verifying a few positions costs next to one decode step, in float32 and in bfloat16, on SmolLM2-135M.

Lossless decoding pays only if a pass over the drafted positions costs little more than one decode step. On CPUs
whose MKL/oneDNN kernels differ by row count, that depends on the dtype as much as on the machine. This script
times the real model's forward over 1, 2, 3, 4 and 8 new positions after a 200-token cache (the converted
SmolLM2-135M-Instruct of `examples/bench_real`), each dtype in turn, the position counts interleaved, and prints
the median milliseconds and the ratio to one position.

    python examples/verify_cost/dtype_rows.py --threads 1
"""

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench_real"))
import realmodel  # noqa: E402

POSITIONS = (1, 2, 3, 4, 8)


@torch.no_grad()
def timings_ms(model, prompt: torch.Tensor, repeats: int) -> dict:
    cache = DynamicCache(config=model.config)
    model(prompt, past_key_values=cache, use_cache=True)
    times = {p: [] for p in POSITIONS}
    for _ in range(repeats):
        for p in POSITIONS:
            ids = prompt[:, :p]
            start = time.perf_counter()
            model(ids, past_key_values=cache, use_cache=True)
            times[p].append((time.perf_counter() - start) * 1e3)
            cache.crop(-p)
    return {p: statistics.median(t) for p, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base, _ = realmodel.load()
    prompt = torch.randint(0, base.config.vocab_size, (1, 200))
    rows = {}
    for dtype in ("float32", "bfloat16"):
        model = copy.deepcopy(base).to(getattr(torch, dtype))
        timings_ms(model, prompt, 3)  # warm-up
        ms = timings_ms(model, prompt, args.repeats)
        rows[dtype] = {p: {"ms": round(v, 2), "x": round(v / ms[1], 2)} for p, v in ms.items()}
        print(dtype, " ".join(f"{p} pos: {v:.1f} ms x{v / ms[1]:.2f}" for p, v in ms.items()), flush=True)
    print(json.dumps({"threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
