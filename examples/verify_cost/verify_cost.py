"""What a forward pass over a few positions costs next to a decode step, in each of Tide's few-row layouts.

Speculative verification (Tide's lossless mode) runs the model over the drafted positions at once. It pays
only if that pass costs little more than a one-position decode step. This script measures, on random-init
12-layer Llamas of a few widths, the time of one forward over 1, 2, 4, 8 and 16 new positions after a 40-token
cache, with the plain `F.linear` and inside `tide.layers.fewrows.few_row_linears(layout=...)` for the transposed
product (`W @ x.T`) and MKL's packed weights, and which layouts Tide's own measurement (`tide.layers.fewrows.layouts`)
picks for the model.

    python examples/verify_cost/verify_cost.py --threads 2 --widths 192,384,768
"""

import argparse
import contextlib
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tide.layers import fewrows
from tide.models.architectures import resolve


POSITIONS = (1, 2, 4, 8, 16)
LAYOUTS = ("F.linear", "transposed", "packed")


def timings_ms(model, ids, cache_length: int, repeats: int) -> dict:
    """{(layout, positions): median ms}, both layouts interleaved so that drift hits them alike."""
    cache = DynamicCache(config=model.config)
    model(ids[:, :cache_length], past_key_values=cache, use_cache=True)
    times: dict = {}
    for repeat in range(repeats + 2):
        for positions in POSITIONS:
            for layout in LAYOUTS:
                with fewrows.few_row_linears(layout=layout) if layout in fewrows.LAYOUTS else contextlib.nullcontext():
                    start = time.perf_counter()
                    model(ids[:, cache_length:cache_length + positions], past_key_values=cache, use_cache=True)
                    seconds = time.perf_counter() - start
                cache.crop(-positions)
                if repeat >= 2:  # warm-up
                    times.setdefault((layout, positions), []).append(seconds)
    return {key: statistics.median(values) * 1000 for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--widths", default="192,384,768", help="hidden sizes (MLP 4x, head dim 64, 12 layers)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, vocabulary {args.vocab}; ms per forward after a "
          f"40-token cache (ratio to F.linear at 1 position: the decode step), median of {args.repeats}")
    print("| hidden | layout | " + " | ".join(str(n) for n in POSITIONS) + " |\n|---|---|" + "---|" * len(POSITIONS))
    for width in (int(w) for w in args.widths.split(",")):
        heads = max(width // 64, 1)
        config = LlamaConfig(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=12,
                             num_attention_heads=heads, num_key_value_heads=heads, vocab_size=args.vocab)
        model = LlamaForCausalLM(config).eval()
        fewrows.install([model])
        ids = torch.randint(0, args.vocab, (1, 64))
        with torch.no_grad():
            ms = timings_ms(model, ids, 40, args.repeats)
        one = ms[("F.linear", 1)]  # the decode step
        for layout in LAYOUTS:
            print(f"| {width} | {layout} | " + " | ".join(f"{ms[(layout, n)]:.1f} (x{ms[(layout, n)] / one:.2f})"
                                                     for n in POSITIONS) + " |")
        choice = fewrows.layouts(resolve(model))
        print(f"| {width} | Tide's choice | {fewrows.layouts_text(choice)} |" + " |" * (len(POSITIONS) - 1))


if __name__ == "__main__":
    main()
