"""Calibration time on a model with a 262,144-token vocabulary: a random-init Llama with Gemma-3-270M's shapes.

    python examples/bench_calibration/big_vocab.py --threads 2
    python examples/bench_calibration/big_vocab.py --threads 1 --samples 64 --profile /tmp/big.prof

The model (seeded): 18 layers, hidden 640, MLP 2,048, 4 query heads and 1 K/V head of 256, tied embeddings over
262,144 tokens (about 270M parameters, 168M of them the embedding the head shares). Its weights are random, so what
calibration keeps says nothing of a trained model; what each phase costs does. The text is the shipped corpus
(`tide.tools.demo_corpus`, Python documentation paragraphs) through the demo model's tokenizer.

`tide.calibrate` runs at its defaults (`TideConfig()`, 512 texts); `--samples` and `--option KEY=JSON` change them.
Prints one JSON line: wall seconds, seconds per phase (the calibration record's `phase_seconds`), the load average
before and after, the held-out exit top-1 per checkpoint (`label_rate`), the draft heads' held-out top-1
(`draft_top1`), the measured costs, exit mode's timing, the schemes timed and kept, and those the measured costs
ruled out (`untimed`). `--profile FILE` also writes a cProfile of the calibration there and prints its 25
costliest functions (own time) to stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import tide
from tide.tools.demo import DEMO_MODEL_DIR
from tide.tools.demo_corpus import split_corpus

VOCAB = 262_144


def big_vocab_model(seed: int = 0) -> LlamaForCausalLM:
    """The random-init 262k-vocabulary model, seeded."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=2048,
                         tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    return LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, help="calibrate's num_samples (default: its own)")
    parser.add_argument("--option", action="append", default=[], help="KEY=JSON: another calibrate option")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", help="write a cProfile of the calibration to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = big_vocab_model(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    train, _ = split_corpus()
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    if args.samples:
        options["num_samples"] = args.samples
    load_before = os.getloadavg()
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    model = tide.calibrate(base, tokenizer, dataset=train, config=tide.TideConfig(), progress=False, **options)
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - start
    cal = model.config.calibration
    if profiler:
        profiler.dump_stats(args.profile)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue(), file=sys.stderr)
    selection = cal.get("draft_selection") or {}
    print(json.dumps({
        "threads": args.threads, "options": options, "parameters": sum(p.numel() for p in base.parameters()),
        "wall_s": round(wall, 1), "phase_seconds": cal["phase_seconds"],
        "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
        "train_tokens": cal["train_tokens"], "heldout_tokens": cal["heldout_tokens"],
        "exit_top1": {k: round(v["label_rate"], 4) for k, v in cal["checkpoints"].items()},
        "draft_top1": cal.get("draft_top1"),
        "trials": [{k: t.get(k) for k in ("draft_layer", "max_draft", "draft_topk", "draft_vocab_size",
                                          "draft_ngram", "estimate", "measured")} for t in selection.get("trials", [])],
        "chosen": selection.get("chosen"), "untimed": selection.get("untimed"),
        "thresholds": model.config.thresholds, "mode": model.config.generation_config.mode,
        "expected_layer_cost": cal.get("expected_layer_cost"), "exit_timing": cal.get("exit_timing"),
        "costs": {k: (cal.get("costs") or {}).get(k) for k in ("layer_s", "head", "capture", "checkpoint",
                                                              "step_extra", "cycle_extra", "verify_extras")},
        "timing_budget": cal.get("timing_budget"),
    }))


if __name__ == "__main__":
    main()
