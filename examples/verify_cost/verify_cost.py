"""What a forward pass over a few positions costs next to a decode step, with and without Tide's few-row layout.

Speculative verification (Tide's lossless mode) runs the model over the drafted positions at once. It pays
only if that pass costs little more than a one-position decode step. This script measures, on random-init
12-layer Llamas of a few widths, the time of one forward over 1, 2, 4 and 8 new positions after a 40-token
cache, with the plain `F.linear` and inside `tide.fewrows.few_row_linears()` (W @ x.T where timed faster).

    python examples/verify_cost/verify_cost.py --threads 2 --widths 192,384,768
"""

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tide import fewrows


def forward_ms(model, ids, cache_length: int, positions: int, repeats: int) -> float:
    cache = DynamicCache(config=model.config)
    model(ids[:, :cache_length], past_key_values=cache, use_cache=True)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        model(ids[:, cache_length:cache_length + positions], past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - start)
        cache.crop(-positions)
    return statistics.median(times[2:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--widths", default="192,384,768", help="hidden sizes (MLP 4x, head dim 64, 12 layers)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads; ms per forward (ratio to 1 position)")
    print("| hidden | layout | 1 | 2 | 4 | 8 |\n|---|---|---|---|---|---|")
    for width in (int(w) for w in args.widths.split(",")):
        heads = max(width // 64, 1)
        config = LlamaConfig(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=12,
                             num_attention_heads=heads, num_key_value_heads=heads, vocab_size=args.vocab)
        model = LlamaForCausalLM(config).eval()
        fewrows.install([model])
        ids = torch.randint(0, args.vocab, (1, 48))
        with torch.no_grad():
            for layout in ("F.linear", "few-row"):
                ctx = fewrows.few_row_linears if layout == "few-row" else _nothing
                with ctx():
                    ms = [forward_ms(model, ids, 40, n, args.repeats) for n in (1, 2, 4, 8)]
                print(f"| {width} | {layout} | " + " | ".join(f"{m:.2f} (x{m / ms[0]:.2f})" for m in ms) + " |")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
