"""Offline study of SmolLM2's draft heads: which data, loss and head shape put the full model's next token first.

    python examples/bench_real/draft_study.py --samples 6 --loss draft --steps 3000          # the context MLP head
    python examples/bench_real/draft_study.py --samples 0 --loss candidates --steps 3000
    python examples/bench_real/draft_study.py --head attention --input layer --steps 600    # EAGLE-style

Training text: the model's own answers to the calibration questions (greedy, plus `--samples` sampled answers to
each, temperature 1.0, top-p 0.95), the questions of the last `--held` calibration questions left out. Score: how
often the head's top-1 over the 1,536 most predicted tokens is the full model's top-1, teacher-forced on the
greedy answers to the first 8 held-out questions (answer positions only; the same 448 positions `bench_real.py
bench --prompts 8 --tokens 64` decodes). Heads (not Tide's calibration; a study of what it could train):
- `mlp`: Tide's `DraftHead` (the token's layer-3 state and the full model's final normed state at the position
  before, with the 256-wide two-layer term), Adam 1e-3, 256-token minibatches;
- `attention`: [the token's layer-3 state or its embedding; the full model's final normed state before it] through
  a linear map and one decoder layer copied from the model's last (causal attention over the text), AdamW 3e-4,
  8 texts a step: EAGLE's draft model, on this model's features.
Losses: `draft`, KL to the full model over the 1,536 ranked tokens (what calibration now trains draft heads on);
`candidates`, calibration's earlier candidate loss (the full model's 32 best tokens a row and 256 shared
negatives). 1 thread unless `--threads`.
"""

from __future__ import annotations

import argparse
import copy
import time

import realmodel
import torch
import torch.nn.functional as F

from tide.calibration.headloss import TEACHER_TOP, Candidates, draw_negatives, head_kl
from tide.calibration.selftext import SelfText, generated_texts, prompt_texts
from tide.heads.draftvocab import ranked_vocabulary
from tide.heads.router import DraftHead
from tide.models.architectures import resolve as model_parts

LAYER, VOCAB = 3, 1536


@torch.no_grad()
def features(base, ids: list[int], start: int, embedding: bool) -> tuple:
    """(token input [T, H], context [T, H], final normed state [T, H], scored positions [T] bool) of one text."""
    out = base(torch.tensor([ids]), output_hidden_states=True)
    final = out.hidden_states[-1][0]
    x = base.model.embed_tokens(torch.tensor(ids)) if embedding else out.hidden_states[LAYER + 1][0]
    context = torch.cat([torch.zeros_like(final[:1]), final[:-1]])
    scored = torch.zeros(len(ids), dtype=torch.bool)
    scored[start:len(ids) - 1] = True
    return x, context, final, scored


class AttentionHead(torch.nn.Module):
    """[x; context] -> linear -> one decoder layer (a copy of the model's last) -> a state for the final norm."""

    def __init__(self, base):
        super().__init__()
        hidden = base.config.hidden_size
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden].copy_(torch.eye(hidden))
        self.layer = copy.deepcopy(base.model.layers[-1])
        self.layer.self_attn.layer_idx = 0
        self.rotary = base.model.rotary_emb

    def forward(self, x, context):  # [B, T, H] x 2 -> [B, T, H]
        h = self.fc(torch.cat([x, context], -1))
        positions = torch.arange(h.shape[1])[None].expand(h.shape[0], -1)
        out = self.layer(h, attention_mask=None, position_ids=positions,
                         position_embeddings=self.rotary(h, positions))
        return out[0] if isinstance(out, tuple) else out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--held", type=int, default=10, help="calibration questions left out of training")
    parser.add_argument("--loss", choices=["draft", "candidates"], default="draft")
    parser.add_argument("--head", choices=["mlp", "attention"], default="mlp")
    parser.add_argument("--input", choices=["layer", "embedding"], default="layer")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base, tok = realmodel.load()
    calibration, held_out = realmodel.questions()
    start = time.perf_counter()
    texts = generated_texts(base, tok, prompt_texts(tok, calibration[:len(calibration) - args.held]),
                            SelfText(128, samples=args.samples, temperature=1.0, batch_size=24))
    embedding = args.input == "embedding"
    train = [features(base, tok(t).input_ids[:256], 0, embedding) for t in texts]
    scored = []
    for q in held_out[:8]:
        prompt = tok(realmodel.chat_prompt(tok, q), return_tensors="pt").input_ids
        answer = base.generate(prompt, max_new_tokens=64, do_sample=False)[0].tolist()
        scored.append(features(base, answer, prompt.shape[1], embedding))
    print(f"{len(texts)} texts, {sum(t[0].shape[0] for t in train)} tokens ({time.perf_counter() - start:.0f} s)")
    head_w = base.lm_head.weight.detach()
    finals = torch.cat([t[2] for t in train])
    predicted = torch.bincount((finals @ head_w.T).argmax(-1), minlength=head_w.shape[0])
    vocab = ranked_vocabulary(predicted, VOCAB)
    norm, parts = base.model.norm, model_parts(base)

    def score(head) -> float:
        hits = total = 0
        with torch.no_grad():
            for x, context, final, mask in scored:
                state = head(x[None], context[None])[0] if args.head == "attention" else head(x, context)
                draft = vocab[(norm(state) @ head_w[vocab].T).argmax(-1)]
                hits += (draft == (final @ head_w.T).argmax(-1))[mask].sum().item()
                total += mask.sum().item()
        return hits / total

    hidden = base.config.hidden_size
    head = AttentionHead(base) if args.head == "attention" else DraftHead(hidden, None, 256)
    optim = (torch.optim.AdamW(head.parameters(), lr=3e-4, weight_decay=0.01) if args.head == "attention"
             else torch.optim.Adam(head.parameters(), lr=1e-3))
    flat = [torch.cat([t[i] for t in train]) for i in range(3)]
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(args.steps):
        if args.head == "attention":
            pick = torch.randint(len(train), (8,), generator=generator).tolist()
            width = max(train[i][0].shape[0] for i in pick)
            x, context, final = (torch.stack([F.pad(train[i][k], (0, 0, 0, width - train[i][k].shape[0]))
                                              for i in pick]) for k in range(3))
            valid = torch.stack([torch.arange(width) < train[i][0].shape[0] for i in pick])
            state, final = head(x, context)[valid], final[valid]
        else:
            pick = torch.randint(flat[0].shape[0], (256,), generator=generator)
            state, final = head(flat[0][pick], flat[1][pick]), flat[2][pick]
        if args.loss == "draft":
            rows = head_w[vocab]
            loss = head_kl(norm(state) @ rows.T, final @ rows.T)
        else:  # calibration's own candidate loss (`tide.calibration.headloss`)
            top = (final @ head_w.T).topk(TEACHER_TOP, -1).indices
            candidates = Candidates(top, draw_negatives(predicted, generator))
            loss = head_kl(candidates.logits(parts, norm(state)), candidates.logits(parts, final).detach())
        optim.zero_grad()
        loss.backward()
        optim.step()
        if (step + 1) % max(args.steps // 4, 1) == 0:
            print(f"step {step + 1}: kl {loss.item():.3f}, held-out top-1 {score(head):.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
