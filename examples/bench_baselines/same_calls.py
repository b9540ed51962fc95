"""Tokens and stats of 120 calls on tiny models, for comparing two versions of Tide call by call.

    PYTHONPATH=OLD/src python examples/bench_baselines/same_calls.py before.json
    python examples/bench_baselines/same_calls.py after.json      # then compare the two files

Llama, GPT-2, OPT and Gemma 2 (the tests' tiny models, draft and exit heads perturbed so that drafts are accepted and
rejected) x exit mode (propagate, recompute, compiled), lossless chains and trees (with and without n-gram drafts,
eager and compiled) and the compiled base x greedy, sampled (temperature 0.8, top-k 20) and greedy with a repetition
penalty: 24 new tokens after a prompt that repeats itself. Compiled calls trace with the eager backend. Each call's
output tokens and `GenerationStats` (times left out) are written, or the error it raised.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import CompileConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from tiny_models import noisy_tide, prompt_ids  # noqa: E402

CONFIGS = {
    "exit": {"mode": "exit"},
    "exit recompute": {"mode": "exit", "kv_strategy": "recompute"},
    "exit compiled": {"mode": "exit", "compile": True},
    "chain 3": {"mode": "lossless", "max_draft": 3},
    "chain 3 ngram": {"mode": "lossless", "max_draft": 3, "draft_ngram": 3},
    "tree 2": {"mode": "lossless", "max_draft": 2, "draft_topk": 2},
    "tree 3 ngram": {"mode": "lossless", "max_draft": 2, "draft_topk": 3, "draft_ngram": 3},
    "chain compiled": {"mode": "lossless", "max_draft": 2, "draft_ngram": 3, "compile": True},
    "tree compiled": {"mode": "lossless", "max_draft": 2, "draft_topk": 2, "compile": True},
    "base compiled": {"compile": True, "compiled_modes": False},
}
DECODING = [dict(do_sample=False), dict(do_sample=True, temperature=0.8, top_k=20),
            dict(do_sample=False, repetition_penalty=1.3)]


def calls() -> dict:
    out = {}
    for family in ("llama", "gpt2", "opt", "gemma2"):
        model, _ = noisy_tide(family, heads=("translator", "draft"))
        ids = torch.cat([prompt_ids(6, seed=3)] * 3, 1)
        for name, config in CONFIGS.items():
            for i, decoding in enumerate(DECODING):
                torch.manual_seed(1)
                try:
                    tokens = model.generate(ids, max_new_tokens=24, compile_config=CompileConfig(backend="eager"),
                                            tide_config=config, **decoding)
                except Exception as err:  # (a call a version refuses: its message is compared too)
                    out[f"{family}/{name}/{i}"] = {"error": f"{type(err).__name__}: {err}"}
                    continue
                stats = {k: v for k, v in model.last_stats.to_dict().items()
                         if "time" not in k and not k.endswith("_s") and "ms" not in k}
                out[f"{family}/{name}/{i}"] = {"tokens": tokens[0].tolist(), "stats": stats}
    return out


if __name__ == "__main__":
    results = calls()
    Path(sys.argv[1]).write_text(json.dumps(results, indent=0, sort_keys=True, default=str))
    print(len(results), "calls,", sum("error" in v for v in results.values()), "refused")
