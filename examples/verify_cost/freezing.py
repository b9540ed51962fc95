"""Few-position passes inside compiled graphs: SmolLM2-135M's compiled forward over 1 and 3 new positions on a
static cache, with and without inductor's `freezing` (weights folded in as constants and, on CPU, prepacked for
oneDNN), in float32 and bfloat16.

Lossless verification pays where a pass over a few positions costs about one decode step. Outside graphs that
depends on the row count's kernel (`dtype_rows.py`); inside them, on what inductor makes of the weights. Both
widths are compiled (one graph each, `dynamic=False`) and timed interleaved, after a 200-token prefill, writing the
same cache slots each time.

    python examples/verify_cost/freezing.py --threads 1
"""

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from transformers import StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench_real"))
import realmodel  # noqa: E402

from tide.models.compat import crop_cache  # noqa: E402

WIDTHS = (1, 3)
PAST = 200


@torch.no_grad()
def timed(model, freezing: bool, repeats: int) -> dict:
    cache = StaticCache(config=model.config, max_cache_len=PAST + 8)
    ids = torch.randint(0, model.config.vocab_size, (1, PAST + 8))
    model(ids[:, :PAST], past_key_values=cache, use_cache=True)
    forwards = {w: torch.compile(model.forward, dynamic=False) for w in WIDTHS}  # one graph a width
    inputs = {w: dict(input_ids=ids[:, PAST:PAST + w], position_ids=torch.arange(PAST, PAST + w)[None])
              for w in WIDTHS}
    start = time.perf_counter()
    with inductor_config.patch(freezing=freezing):
        for w in WIDTHS:
            for _ in range(2):
                forwards[w](**inputs[w], past_key_values=cache, use_cache=True)
                crop_cache(cache, w)
    compile_s = time.perf_counter() - start
    times = {w: [] for w in WIDTHS}
    for _ in range(repeats):
        for w in WIDTHS:
            t = time.perf_counter()
            forwards[w](**inputs[w], past_key_values=cache, use_cache=True)
            times[w].append((time.perf_counter() - t) * 1e3)
            crop_cache(cache, w)  # the same slots again next time
    torch._dynamo.reset()
    return {"compile_s": round(compile_s, 1), **{f"{w} pos ms": round(statistics.median(t), 2)
                                                 for w, t in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base, _ = realmodel.load()
    rows = []
    for dtype in args.dtypes:
        model = copy.deepcopy(base).to(getattr(torch, dtype))
        for freezing in (False, True):
            row = {"dtype": dtype, "freezing": freezing, **timed(model, freezing, args.repeats)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(json.dumps({"threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
