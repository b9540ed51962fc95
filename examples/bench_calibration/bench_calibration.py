"""Calibration throughput and peak memory for two sample counts (each in a fresh process).

Peak memory must not grow with the number of samples: calibration streams batches through a bounded
buffer and keeps only scalars for the held-out split.

    python examples/bench_calibration/bench_calibration.py --samples 256 1024
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def python_doc_paragraphs() -> list[str]:
    """English text every Python installation ships: the language reference topics."""
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for text in topics.values() for p in text.split("\n\n")]
    return [p for p in paragraphs if len(p) > 200]


def run_one(samples: int, layers: int, hidden: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import tide

    sys.path.insert(0, "tests")
    from tiny_models import tiny_tokenizer

    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    base = LlamaForCausalLM(config).eval()
    texts = python_doc_paragraphs()
    while len(texts) < samples:
        texts = texts + texts
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    model = tide.calibrate(base, tiny_tokenizer(), dataset=texts[:samples], num_samples=samples, max_length=256,
                           batch_size=8, progress=False)
    seconds = time.perf_counter() - start
    cal = model.config.calibration
    tokens = cal["train_tokens"] + cal["heldout_tokens"]
    return {
        "samples": samples,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "peak_rss_mb_before": round(before / 1024, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.layers, args.hidden)))
        return
    rows = []
    for n in args.samples:
        out = subprocess.run([sys.executable, __file__, "--one", str(n), "--layers", str(args.layers),
                              "--hidden", str(args.hidden)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]))
    print(f"peak RSS grows by {rows[-1]['peak_rss_mb'] - rows[0]['peak_rss_mb']:+.1f} MB from "
          f"{rows[0]['samples']} to {rows[-1]['samples']} samples")


if __name__ == "__main__":
    main()
