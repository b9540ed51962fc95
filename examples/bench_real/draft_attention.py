"""Does attention over the context help a draft head? SmolLM2's layer-3 draft head with one causal attention block
(EAGLE's shape) against Tide's `DraftHead`, trained side by side on the same ShareGPT windows.

    python examples/bench_real/draft_attention.py --tokens 100000 --json attention.json

Training text, features, held-out sets and scoring are `draft_scale.py`'s (ShareGPT conversations 0 to 16,670,
teacher-forced through the chat template; KL to the full model over the 1,536 tokens it predicts most; top-1 on the
base model's greedy answers to 8 held-out questions and 8 measurement-only ShareGPT first turns). The attention head
reads whole windows: at each position the token's layer-3 state and the full model's final normed state before it
(as `DraftHead`), fused by a linear map, then one pre-norm block (causal multi-head attention over the window's
earlier positions, and an MLP), into a state for the model's final norm and head. Scored teacher-forced: each
position's first draft, with the true context. Both heads take the same Adam steps on the same windows.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import draft_scale
import realmodel
import torch
import torch.nn.functional as F
from torch import nn

from tide.calibration.chat import chat_texts, sharegpt_records
from tide.calibration.headloss import head_kl
from tide.heads.draftvocab import ranked_vocabulary
from tide.heads.router import DraftHead


class RMSNorm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class AttentionDraftHead(nn.Module):
    """(h, c) over a window [B, T, H] each -> states [B, T, H]: A h + B c + b, then attention and MLP blocks."""

    def __init__(self, hidden: int, heads: int = 9, mlp: int = 1024):
        super().__init__()
        self.fuse = DraftHead(hidden)  # A h + B c + b, A = I and B = 0 at the start
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, mlp)
        self.down = nn.Linear(mlp, hidden, bias=False)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.down.weight)

    def forward(self, hidden, context):
        z = self.fuse(hidden, context)
        b, t, h = z.shape
        q, k, v = self.qkv(self.attn_norm(z)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        z = z + self.out(a)
        return z + self.down(F.silu(self.up(self.mlp_norm(z))))


def score(heads, sets, norm, rows_w, vocab, head_w) -> dict:
    out = {}
    with torch.no_grad():
        for name, rows in sets.items():
            hits, total = dict.fromkeys(heads, 0), 0
            for x, context, final, scored in rows:
                truth = (final @ head_w.T).argmax(-1)
                for key, head in heads.items():
                    state = head(x[None], context[None])[0] if key == "attention" else head(x, context)
                    hits[key] += (vocab[(norm(state) @ rows_w.T).argmax(-1)] == truth)[scored].sum().item()
                total += scored.sum().item()
            out[name] = {key: round(h / total, 4) for key, h in hits.items()}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000, help="training tokens (answer positions) in all")
    parser.add_argument("--milestones", type=int, nargs="+", default=[25_000, 50_000, 100_000, 200_000, 400_000])
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="windows a forward and a step")
    parser.add_argument("--buffer", type=int, default=256, help="windows kept")
    parser.add_argument("--steps-per-window", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--mlp", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base, tok = realmodel.load()
    sets = draft_scale.held_sets(base, tok)
    feat = copy.deepcopy(base).to(torch.bfloat16)
    head_w, norm, hidden = base.lm_head.weight.detach().float(), base.model.norm, base.config.hidden_size
    heads = {"mlp": DraftHead(hidden, None, 256), "attention": AttentionDraftHead(hidden, mlp=args.mlp)}
    optims = {k: torch.optim.Adam(h.parameters(), lr=args.lr) for k, h in heads.items()}
    shape = (args.buffer, args.length, hidden)
    buf = {k: torch.zeros(shape, dtype=torch.bfloat16) for k in ("x", "context", "final")}
    keep_buf = torch.zeros(args.buffer, args.length, dtype=torch.bool)
    filled = cursor = seen = steps = 0
    predicted = torch.zeros(head_w.shape[0], dtype=torch.long)
    vocab = rows_w = None
    generator = torch.Generator().manual_seed(0)
    texts = chat_texts(tok, sharegpt_records(draft_scale.sharegpt_file(), 0, draft_scale.HELD_FROM))
    results, milestones, start = [], sorted(m for m in args.milestones if m <= args.tokens), time.perf_counter()
    extract = train_s = 0.0
    credit = 0.0
    for group in draft_scale.batched(draft_scale.windows(tok, texts, args.length), args.batch):
        ids, keep = draft_scale.padded(group, args.length)
        t0 = time.perf_counter()
        x, context, final = draft_scale.features(feat, ids)
        extract += time.perf_counter() - t0
        for i in range(len(group)):
            slot = cursor
            buf["x"][slot], buf["context"][slot], buf["final"][slot] = x[i], context[i], final[i]
            keep_buf[slot] = keep[i]
            cursor, filled = (cursor + 1) % args.buffer, min(filled + 1, args.buffer)
        predicted += torch.bincount((final[keep].float() @ head_w.T).argmax(-1), minlength=predicted.numel())
        seen += int(keep.sum())
        if vocab is None or steps % 50 == 0:
            vocab = ranked_vocabulary(predicted, draft_scale.VOCAB)
            rows_w = head_w[vocab]
        t0 = time.perf_counter()
        credit += len(group) * args.steps_per_window / args.batch
        while credit >= 1:
            credit -= 1
            pick = torch.randint(filled, (args.batch,), generator=generator)
            hx, hc, hf = (buf[k][pick].float() for k in ("x", "context", "final"))
            mask = keep_buf[pick]
            teacher = hf[mask] @ rows_w.T
            for key, head in heads.items():
                state = head(hx, hc)[mask] if key == "attention" else head(hx[mask], hc[mask])
                loss = head_kl(norm(state) @ rows_w.T, teacher)
                optims[key].zero_grad()
                loss.backward()
                optims[key].step()
            steps += 1
        train_s += time.perf_counter() - t0
        while milestones and seen >= milestones[0]:
            row = {"tokens": seen, "steps": steps, "seconds": round(time.perf_counter() - start, 1),
                   "extract_s": round(extract, 1), "train_s": round(train_s, 1),
                   "top1": score(heads, sets, norm, rows_w, vocab, head_w)}
            print(json.dumps(row), flush=True)
            results.append(row)
            milestones.pop(0)
        if seen >= args.tokens:
            break
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": results}, f, indent=1)
        torch.save({k: h.state_dict() for k, h in heads.items()}, f"{args.json}.heads.pt")


if __name__ == "__main__":
    main()
