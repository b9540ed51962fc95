"""Train the tiny demo Llama that ships in ``src/tide/assets/tiny-llama``.

One-off script, CPU only.  The text is the running Python's own documentation
(see ``tide.tools.demo_corpus``), so nothing is downloaded.  Steps:

1. train a byte-level BPE tokenizer (``tokenizers``) on the train split;
2. build a 12-layer ``LlamaForCausalLM`` with tied embeddings;
3. train it with AdamW + linear warm-up + cosine decay on packed sequences for a
   fixed wall-clock budget (``--minutes``) or a fixed number of ``--steps``;
4. evaluate held-out perplexity and, for every layer k, how often
   ``lm_head(final_norm(h_k))`` has the same top-1 token as the full model;
5. save model (safetensors), tokenizer and ``training_report.json``.

Example::

    .venv/bin/python examples/tiny-model/train.py --minutes 35
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

from tide.tools.demo_corpus import split_corpus  # noqa: E402  (before torch: imports are quiet)

import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (AutoModelForCausalLM, GenerationConfig, GPT2Config, LlamaConfig, PreTrainedTokenizerFast,  # noqa: E402
                          Qwen3Config)

EOS, PAD = "<|endoftext|>", "<pad>"
DEFAULT_OUT = REPO / "src" / "tide" / "assets" / "tiny-llama"
PROMPTS = ["The list type", "A function is", "To open a file,"]
ARCHITECTURES = {"llama": LlamaConfig, "qwen3": Qwen3Config, "gpt2": GPT2Config}


def stack(model):
    """(decoder layers, final norm) of a model built here."""
    if model.config.model_type == "gpt2":
        return model.transformer.h, model.transformer.ln_f
    return model.model.layers, model.model.norm


def model_config(args, vocab_size: int, eos: int, pad: int):
    if args.arch == "gpt2":  # learned positions, LayerNorm, fused qkv; its own dropout stands in for the hooks
        return GPT2Config(vocab_size=vocab_size, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                          n_inner=args.intermediate, n_positions=args.max_positions, tie_word_embeddings=True,
                          resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=0.0,
                          bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, use_cache=True)
    return ARCHITECTURES[args.arch](
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, use_cache=True,
        **({"head_dim": args.hidden // args.heads} if args.arch == "qwen3" else {}))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train the tiny demo Llama (CPU, Python-documentation corpus) and save it "
                    "with its tokenizer and a training_report.json.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    p.add_argument("--minutes", type=float, default=35.0,
                   help="wall-clock training budget (ignored when --steps is given)")
    p.add_argument("--steps", type=int, default=None, help="train for exactly this many steps instead")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("model")
    g.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama",
                   help="model family (the demo model is llama; qwen3 adds q/k norms)")
    g.add_argument("--vocab-size", type=int, default=4096)
    g.add_argument("--layers", type=int, default=12)
    g.add_argument("--hidden", type=int, default=192)
    g.add_argument("--intermediate", type=int, default=512)
    g.add_argument("--heads", type=int, default=6)
    g.add_argument("--kv-heads", type=int, default=6)
    g.add_argument("--max-positions", type=int, default=512, help="config.max_position_embeddings")
    g = p.add_argument_group("optimisation")
    g.add_argument("--seq-len", type=int, default=256, help="packed sequence length")
    g.add_argument("--batch", type=int, default=8, help="sequences per step")
    g.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr = lr * this")
    g.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--dropout", type=float, default=0.1,
                   help="residual dropout on attention/MLP outputs while training (hooks; not saved)")
    g.add_argument("--log-every", type=int, default=25, help="steps between loss lines")
    g.add_argument("--eval-every", type=float, default=5.0, help="minutes between held-out evals")
    return p.parse_args(argv)


def train_tokenizer(texts, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    eos = tok.token_to_id(EOS)
    # Every document starts with <|endoftext|> in training, so prompts get it as BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B:1", special_tokens=[(EOS, eos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=None, add_bos_token=True, add_eos_token=False)


def encode_docs(tokenizer, texts):
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [torch.tensor([tokenizer.bos_token_id] + x, dtype=torch.long) for x in ids]


def pack(docs, seq_len, rng=None):
    """Concatenate <eos>doc<eos>doc... (shuffled when rng is given) and cut into rows."""
    order = list(range(len(docs)))
    if rng is not None:
        rng.shuffle(order)
    stream = torch.cat([docs[i] for i in order])
    n = len(stream) // seq_len
    rows = stream[: n * seq_len].view(n, seq_len)
    if rng is not None:
        rows = rows[torch.randperm(n, generator=torch.Generator().manual_seed(rng.randrange(2**31)))]
    return rows, stream[n * seq_len:]


def batches(docs, seq_len, batch, seed):
    rng, epoch = random.Random(seed), 0
    while True:
        rows, _ = pack(docs, seq_len, rng)
        for i in range(0, len(rows) - batch + 1, batch):
            yield epoch, rows[i: i + batch]
        epoch += 1


@torch.no_grad()
def evaluate(model, rows, tail, per_layer=False, batch=16):
    """Held-out NLL of the full model; optionally per-layer early-exit NLL and top-1 agreement."""
    model.eval()
    chunks = [rows[i: i + batch] for i in range(0, len(rows), batch)] + ([tail[None]] if len(tail) > 1 else [])
    (layers, norm), head = stack(model), model.lm_head
    captured = []
    hooks = [layer.register_forward_hook(lambda m, i, o: captured.append(o[0] if isinstance(o, tuple) else o))
             for layer in layers] if per_layer else []
    L = len(layers)
    nll, n, agree, layer_nll = 0.0, 0, torch.zeros(L), torch.zeros(L)
    try:
        for x in chunks:
            captured.clear()
            logits = model(input_ids=x).logits[:, :-1].float()
            target = x[:, 1:]
            nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum").item()
            n += target.numel()
            if per_layer:
                top = logits.argmax(-1)
                for k, h in enumerate(captured):
                    lk = head(norm(h))[:, :-1].float()
                    agree[k] += (lk.argmax(-1) == top).sum()
                    layer_nll[k] += torch.nn.functional.cross_entropy(
                        lk.flatten(0, 1), target.flatten(), reduction="sum")
    finally:
        for hk in hooks:
            hk.remove()
    model.train()
    out = {"nll": nll / n, "ppl": math.exp(nll / n), "tokens": n}
    if per_layer:
        out["layer_agreement"] = [round(a, 4) for a in (agree / n).tolist()]
        out["layer_ppl"] = [round(math.exp(v), 2) for v in (layer_nll / n).tolist()]
    return out


def add_train_dropout(model, p):
    """Dropout on each attention / MLP output, active only in train mode; the saved model is the plain family's."""
    def hook(module, inputs, output):
        if not module.training or p == 0:
            return None
        if isinstance(output, tuple):
            return (torch.nn.functional.dropout(output[0], p, True),) + output[1:]
        return torch.nn.functional.dropout(output, p, True)
    if model.config.model_type == "gpt2":
        return []
    return [m.register_forward_hook(hook) for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]


def generate_samples(model, tokenizer, prompts, seed):
    model.eval()
    out = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        greedy = model.generate(**enc, max_new_tokens=48, do_sample=False, repetition_penalty=1.2)
        torch.manual_seed(seed)
        sampled = model.generate(**enc, max_new_tokens=48, do_sample=True, temperature=0.8, top_p=0.9)
        out.append({"prompt": prompt,
                    "greedy (repetition_penalty=1.2)": tokenizer.decode(greedy[0], skip_special_tokens=True),
                    "sampled (T=0.8, top_p=0.9, seed)": tokenizer.decode(sampled[0], skip_special_tokens=True)})
    return out


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()

    train_texts, held_texts = split_corpus(seed=args.seed)
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    train_docs, held_docs = encode_docs(tokenizer, train_texts), encode_docs(tokenizer, held_texts)
    held_rows, held_tail = pack(held_docs, args.seq_len)
    n_train_tok = sum(len(d) for d in train_docs)
    print(f"corpus: {len(train_texts)} train / {len(held_texts)} held-out texts, "
          f"{n_train_tok} / {sum(len(d) for d in held_docs)} tokens (vocab {len(tokenizer)}), "
          f"prepared in {time.time() - t_start:.0f}s", flush=True)

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = model_config(args, len(tokenizer), eos, pad)
    model = AutoModelForCausalLM.from_config(config)
    dropout_hooks = add_train_dropout(model, args.dropout)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"heads {args.heads}/{args.kv_heads}, {n_params / 1e6:.2f}M params", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    budget_s = args.minutes * 60

    def lr_at(step, progress):
        warm = min(1.0, (step + 1) / args.warmup)
        cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return args.lr * warm * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)

    model.train()
    t0 = time.time()
    step, epoch, run_loss, run_n = 0, 0, 0.0, 0
    curve, evals, next_eval = [], [], args.eval_every * 60
    for epoch, x in batches(train_docs, args.seq_len, args.batch, args.seed):
        elapsed = time.time() - t0
        progress = step / args.steps if args.steps else elapsed / budget_s
        if progress >= 1.0:
            break
        lr = lr_at(step, progress)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        run_loss, run_n = run_loss + loss.item(), run_n + 1
        if step % args.log_every == 0:
            el = time.time() - t0
            curve.append([step, round(el / 60, 2), round(run_loss / run_n, 4)])
            print(f"step {step:5d}  epoch {epoch}  loss {run_loss / run_n:.4f}  lr {lr:.2e}  "
                  f"{step * x.numel() / el:.0f} tok/s  {el / 60:.1f} min", flush=True)
            run_loss, run_n = 0.0, 0
        if time.time() - t0 >= next_eval:
            ev = evaluate(model, held_rows, held_tail)
            evals.append([step, round((time.time() - t0) / 60, 2), round(ev["ppl"], 2)])
            print(f"  held-out ppl {ev['ppl']:.2f} at step {step}", flush=True)
            next_eval += args.eval_every * 60
    train_minutes = (time.time() - t0) / 60
    for hk in dropout_hooks:
        hk.remove()
    tokens_seen = step * args.batch * args.seq_len

    final = evaluate(model, held_rows, held_tail, per_layer=True)
    print(f"final held-out ppl {final['ppl']:.2f} over {final['tokens']} tokens", flush=True)
    for k, (a, p) in enumerate(zip(final["layer_agreement"], final["layer_ppl"]), 1):
        print(f"  layer {k:2d}: top-1 agreement {a:.4f}  early-exit ppl {p:.2f}", flush=True)

    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    samples = generate_samples(model, tokenizer, PROMPTS, args.seed)
    for s in samples:
        print(json.dumps(s, ensure_ascii=False, indent=1), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.config._name_or_path = ""
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.model_max_length = args.max_positions
    tokenizer.save_pretrained(args.out)
    weights = args.out / "model.safetensors"
    for f in args.out.iterdir():
        f.chmod(0o644)  # save_pretrained writes the weights 0600; package data should be readable
    report = {
        "model": {"architecture": type(model).__name__, "layers": args.layers, "hidden_size": args.hidden,
                  "intermediate_size": args.intermediate, "heads": args.heads, "kv_heads": args.kv_heads,
                  "vocab_size": len(tokenizer), "tied_embeddings": True, "params": n_params,
                  "dtype": str(model.dtype).replace("torch.", ""),
                  "safetensors_bytes": weights.stat().st_size, "trained_context": args.seq_len},
        "corpus": {"source": "pydoc_data.topics + stdlib docstrings (tide.tools.demo_corpus)",
                   "python": platform.python_version(), "train_texts": len(train_texts),
                   "heldout_texts": len(held_texts), "train_tokens_per_epoch": n_train_tok},
        "training": {"steps": step, "batch": args.batch, "seq_len": args.seq_len, "tokens_seen": tokens_seen,
                     "epochs": round(tokens_seen / n_train_tok, 2), "minutes": round(train_minutes, 2),
                     "threads": args.threads, "peak_lr": args.lr, "warmup": args.warmup,
                     "weight_decay": args.weight_decay,
                     "dropout": args.dropout, "seed": args.seed,
                     "command": " ".join(["python", "examples/tiny-model/train.py"] + sys.argv[1:]),
                     "torch": torch.__version__, "transformers": transformers.__version__},
        "heldout": {"tokens": final["tokens"], "nll": round(final["nll"], 4), "ppl": round(final["ppl"], 2),
                    "layer_top1_agreement": final["layer_agreement"],
                    "layer_early_exit_ppl": final["layer_ppl"]},
        "loss_curve": curve,
        "heldout_ppl_curve": evals,
        "samples": samples,
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(f"saved to {args.out} ({weights.stat().st_size / 2**20:.1f} MiB weights)", flush=True)


if __name__ == "__main__":
    main()
