"""How often router repos' draft heads are right on held-out answers, scored the same way for each repo.

    python examples/bench_real/draft_top1.py --routers ROUTERS [ROUTERS ...] [--json OUT]

The base model (SmolLM2-135M-Instruct, float32) answers 8 held-out chat questions and the first user turns of 8
measurement-only ShareGPT conversations (16,671 and later) greedily, 64 tokens each (`draft_scale.held_sets`). At
every answer position, teacher-forced, each repo's draft head at its draft layer drafts the next token from the
token's state there and the full model's final normed state before it, over the repo's own draft vocabulary (the
size its compiled chain names, else its default); the figure is how often that first draft is the full model's
greedy token (as `draft_scale.py` scores heads in training), and the top-3 rate beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import draft_scale  # noqa: E402
import realmodel  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", nargs="+", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    import tide

    torch.set_num_threads(args.threads)
    base, tok = realmodel.load()
    sets = draft_scale.held_sets(base, tok)
    out = {}
    for routers in args.routers:
        model = tide.TideForCausalLM.from_pretrained(routers, base_model=base)
        generation = model.config.generation or {}
        chain = generation.get("compiled_chain") or generation
        layer = chain.get("draft_layer", model.checkpoints[0])
        vocab = chain.get("draft_vocab_size", 0)
        head_w = model.parts.lm_head.weight
        scores = {}
        with torch.no_grad():
            for name, rows in sets.items():
                hits = top3 = total = 0
                for x, context, final, scored in rows:
                    full = (final @ head_w.T).argmax(-1)
                    best = model.draft_logits(layer, x, context, vocab)[0].topk(3, -1).indices
                    hits += (best[:, 0] == full)[scored].sum().item()
                    top3 += (best == full[:, None]).any(-1)[scored].sum().item()
                    total += scored.sum().item()
                scores[name] = {"top1": round(hits / total, 4), "top3": round(top3 / total, 4), "positions": total}
        out[routers] = {"draft_layer": layer, "draft_vocab_size": vocab, **scores}
        print(routers, json.dumps(out[routers]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
