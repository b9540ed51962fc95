"""Do more of the full model's layers help a draft head? SmolLM2's layer-3 draft head reading, at the position before
the drafted token, the states of a few middle and high layers beside the final normed state (EAGLE-3's fused
features), against Tide's `DraftHead`, trained side by side on the same ShareGPT stream.

    python examples/bench_real/draft_layers.py --tokens 400000 --context-layers 9 19 26 --json layers.json

Training text, held-out sets, the draft vocabulary, the loss and the scoring are `draft_scale.py`'s (ShareGPT
conversations 0 to 16,670 through the chat template, teacher-forced; KL to the full model over the 1,536 tokens it
predicts most; first-draft top-1 on the base model's greedy answers to 8 held-out questions and to the first user
turns of 8 measurement-only ShareGPT conversations). The fused head is `DraftHead`'s terms plus a linear map of the
chosen layers' outputs (each RMS-normalised, the map initialised to zero) and the same MLP over all its inputs.
Verification computes those states at every position it checks, so a drafter could read them at no extra pass.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import draft_scale
import realmodel
import torch
from torch import nn

from tide.calibration.chat import chat_texts, sharegpt_records
from tide.calibration.headloss import head_kl
from tide.heads.draftvocab import ranked_vocabulary
from tide.heads.router import DraftHead


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class FusedContextHead(nn.Module):
    """(h, c, m) -> A h + B c + b + F [rms(m_1); ...] + W_2 silu(W_1 [h; c; rms(m_1); ...]); F and W_2 start at 0."""

    def __init__(self, hidden: int, layers: int, mlp: int):
        super().__init__()
        self.own = DraftHead(hidden, None, 0)
        self.fuse = nn.Parameter(torch.zeros(hidden, layers * hidden))
        self.mlp_in = nn.Linear((2 + layers) * hidden, mlp)
        self.mlp_out = nn.Parameter(torch.zeros(hidden, mlp))

    def forward(self, hidden, context, middle):
        # hidden, context: [N, H]; middle: [N, layers * H] (raw layer outputs, each RMS-normalised here)
        h = hidden.shape[-1]
        mids = torch.cat([_rms(m) for m in middle.split(h, -1)], -1)
        inner = nn.functional.silu(self.mlp_in(torch.cat([hidden, context, mids], -1)))
        return self.own(hidden, context) + mids @ self.fuse.T + inner @ self.mlp_out.T


@torch.no_grad()
def features(base, input_ids, layers):
    """(layer-3 states, context, final normed states, the chosen layers' outputs at the position before) [B, T, .]."""
    out = base.model(input_ids, output_hidden_states=True, use_cache=False)
    final = out.last_hidden_state

    def before(t):
        return torch.cat([torch.zeros_like(t[:, :1]), t[:, :-1]], 1)

    middle = torch.cat([before(out.hidden_states[k + 1]) for k in layers], -1)
    return out.hidden_states[draft_scale.LAYER + 1], before(final), final, middle


def run(head, key, x, context, middle):
    return head(x, context) if key == "draft_head" else head(x, context, middle)


def score(heads, sets, norm, rows_w, vocab, head_w) -> dict:
    out = {}
    with torch.no_grad():
        for name, rows in sets.items():
            hits, total = dict.fromkeys(heads, 0), 0
            for x, context, final, middle, scored in rows:
                truth = (final @ head_w.T).argmax(-1)
                for key, head in heads.items():
                    draft = vocab[(norm(run(head, key, x, context, middle)) @ rows_w.T).argmax(-1)]
                    hits[key] += (draft == truth)[scored].sum().item()
                total += scored.sum().item()
            out[name] = {key: round(h / total, 4) for key, h in hits.items()}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400_000, help="training tokens (answer positions) in all")
    parser.add_argument("--milestones", type=int, nargs="+", default=[50_000, 100_000, 200_000, 400_000, 800_000])
    parser.add_argument("--context-layers", type=int, nargs="+", default=[9, 19, 26])
    parser.add_argument("--mlp", type=int, default=256)
    parser.add_argument("--length", type=int, default=512, help="window length in tokens")
    parser.add_argument("--batch", type=int, default=8, help="windows a forward")
    parser.add_argument("--buffer", type=int, default=131072)
    parser.add_argument("--minibatch", type=int, default=512)
    parser.add_argument("--steps-per-token", type=float, default=1 / 512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base, tok = realmodel.load()
    layers = args.context_layers
    sets = draft_scale.held_sets(base, tok, lambda model, ids: features(model, ids, layers))
    feat = copy.deepcopy(base).to(torch.bfloat16)
    head_w, norm, hidden = base.lm_head.weight.detach().float(), base.model.norm, base.config.hidden_size
    heads = {"draft_head": DraftHead(hidden, None, args.mlp), "fused": FusedContextHead(hidden, len(layers), args.mlp)}
    optims = {k: torch.optim.Adam(h.parameters(), lr=args.lr) for k, h in heads.items()}
    widths = {"x": hidden, "context": hidden, "final": hidden, "middle": hidden * len(layers)}
    buf = {k: torch.empty(args.buffer, w, dtype=torch.bfloat16) for k, w in widths.items()}
    filled = cursor = seen = steps = 0
    predicted = torch.zeros(head_w.shape[0], dtype=torch.long)
    vocab = rows_w = None
    generator = torch.Generator().manual_seed(0)
    texts = chat_texts(tok, sharegpt_records(draft_scale.sharegpt_file(), 0, draft_scale.HELD_FROM))
    results, milestones, start = [], sorted(m for m in args.milestones if m <= args.tokens), time.perf_counter()
    extract = train_s = 0.0
    for group in draft_scale.batched(draft_scale.windows(tok, texts, args.length), args.batch):
        ids, keep = draft_scale.padded(group)
        t0 = time.perf_counter()
        got = dict(zip(("x", "context", "final", "middle"), (t[keep] for t in features(feat, ids, layers))))
        extract += time.perf_counter() - t0
        n = min(got["x"].shape[0], args.buffer)
        idx = (torch.arange(n) + cursor) % args.buffer
        for key, value in got.items():
            buf[key][idx] = value[-n:].to(torch.bfloat16)
        predicted += torch.bincount((got["final"].float() @ head_w.T).argmax(-1), minlength=predicted.numel())
        cursor, filled, seen = (cursor + n) % args.buffer, min(filled + n, args.buffer), seen + got["x"].shape[0]
        if vocab is None or steps % 200 == 0:
            vocab = ranked_vocabulary(predicted, draft_scale.VOCAB)
            rows_w = head_w[vocab]
        t0 = time.perf_counter()
        for _ in range(round(got["x"].shape[0] * args.steps_per_token)):
            pick = torch.randint(filled, (args.minibatch,), generator=generator)
            hx, hc, hf, hm = (buf[k][pick].float() for k in ("x", "context", "final", "middle"))
            teacher = hf @ rows_w.T
            for key, head in heads.items():
                loss = head_kl(norm(run(head, key, hx, hc, hm)) @ rows_w.T, teacher)
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


if __name__ == "__main__":
    main()
