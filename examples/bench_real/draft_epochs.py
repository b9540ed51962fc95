"""Is the draft head short of text or short of steps? SmolLM2's layer-3 draft head trained for several passes over
one fixed set of ShareGPT answer tokens, scored after each.

    python examples/bench_real/draft_epochs.py --tokens 600000 --epochs 8 --json epochs.json

Calibration read each training token about half a time at 2M tokens (one Adam step per 512 tokens, minibatches of 256,
spread over the stream), and the base forward that makes a token's states costs far more than a step over it. Here the
states of `--tokens` answer positions are made once (the stream, windows, vocabulary, loss and scoring are
`draft_scale.py`'s: ShareGPT conversations 0 to 16,670 through the chat template, KL to the full model over the 1,536
tokens it predicts most, first-draft top-1 on the base model's greedy answers to 8 held-out questions and to the first
user turns of 8 measurement-only conversations), held in memory in bfloat16, and the heads then sweep them `--epochs`
times in a shuffled order: Tide's `DraftHead` with an MLP of 256 at a constant learning rate (calibration's), the same
with the rate decayed to zero over all the passes (cosine), and an MLP of 1,024 with the decay. Scored after half a pass
(what calibration took at 2M tokens) and after each pass.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import draft_scale
import realmodel
import torch

from tide.calibration.chat import chat_texts, sharegpt_records
from tide.heads.draftvocab import ranked_vocabulary
from tide.heads.router import DraftHead


def stream_states(feat, tok, head_w, tokens: int, length: int, batch: int):
    """(layer-3 states, context, final normed states) [tokens, H] bfloat16 of the first `tokens` answer positions of
    the training conversations, and the full model's top-1 counts over them."""
    hidden = head_w.shape[1]
    out = {k: torch.empty(tokens, hidden, dtype=torch.bfloat16) for k in ("x", "context", "final")}
    predicted = torch.zeros(head_w.shape[0], dtype=torch.long)
    texts = chat_texts(tok, sharegpt_records(draft_scale.sharegpt_file(), 0, draft_scale.HELD_FROM))
    seen = 0
    for group in draft_scale.batched(draft_scale.windows(tok, texts, length), batch):
        ids, keep = draft_scale.padded(group)
        got = [t[keep] for t in draft_scale.features(feat, ids)]
        n = min(got[0].shape[0], tokens - seen)
        for key, value in zip(("x", "context", "final"), got):
            out[key][seen:seen + n] = value[:n].to(torch.bfloat16)
        predicted += torch.bincount((got[2][:n].float() @ head_w.T).argmax(-1), minlength=predicted.numel())
        seen += n
        if seen == tokens:
            break
    return {k: v[:seen] for k, v in out.items()}, predicted


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=600_000, help="training tokens (answer positions)")
    parser.add_argument("--epochs", type=int, default=8, help="passes over them")
    parser.add_argument("--length", type=int, default=512, help="window length in tokens")
    parser.add_argument("--batch", type=int, default=8, help="windows a forward")
    parser.add_argument("--minibatch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--extract-threads", type=int, default=2, help="threads making the states")
    parser.add_argument("--threads", type=int, default=1, help="threads of the heads' steps")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.extract_threads)
    torch.manual_seed(0)
    base, tok = realmodel.load()
    start = time.perf_counter()
    sets = draft_scale.held_sets(base, tok)
    head_w, norm, hidden = base.lm_head.weight.detach().float(), base.model.norm, base.config.hidden_size
    feat = copy.deepcopy(base).to(torch.bfloat16)
    t0 = time.perf_counter()
    states, predicted = stream_states(feat, tok, head_w, args.tokens, args.length, args.batch)
    extract_s = time.perf_counter() - t0
    del feat
    torch.set_num_threads(args.threads)
    n = states["x"].shape[0]
    vocab = ranked_vocabulary(predicted, draft_scale.VOCAB)
    rows_w = head_w[vocab]
    print(json.dumps({"tokens": n, "extract_s": round(extract_s, 1)}), flush=True)
    per_epoch = math.ceil(n / args.minibatch)
    total = per_epoch * args.epochs
    heads = {"mlp256": DraftHead(hidden, None, 256), "mlp256_cosine": DraftHead(hidden, None, 256),
             "mlp1024_cosine": DraftHead(hidden, None, 1024)}
    optims = {k: torch.optim.Adam(h.parameters(), lr=args.lr) for k, h in heads.items()}
    scheds = {k: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / total, 1))))
              for k, o in optims.items() if k.endswith("cosine")}
    generator = torch.Generator().manual_seed(0)
    rows, steps, train_s = [], 0, 0.0
    checkpoints = [per_epoch // 2] + [per_epoch * e for e in range(1, args.epochs + 1)]
    for _ in range(args.epochs):
        order = torch.randperm(n, generator=generator)
        for i in range(per_epoch):
            t0 = time.perf_counter()
            draft_scale.train_step(heads, optims, states, order[i * args.minibatch:(i + 1) * args.minibatch], norm,
                                   rows_w)
            for sched in scheds.values():
                sched.step()
            steps += 1
            train_s += time.perf_counter() - t0
            if steps in checkpoints:
                row = {"epochs": round(steps / per_epoch, 2), "steps": steps, "train_s": round(train_s, 1),
                       "seconds": round(time.perf_counter() - start, 1),
                       "top1": {k: draft_scale.score(h, sets, norm, rows_w, vocab, head_w) for k, h in heads.items()}}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tokens": n, "extract_s": round(extract_s, 1), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
