"""Which router input pays: the normed exit state alone, or with the exit's own confidence?

On the shipped model (or any model + texts you adapt it to), this trains per-checkpoint routers on four inputs
and reports, on held-out tokens, their AUC per checkpoint and the speed-up each reaches at a target agreement,
estimated from measured costs (the same per-exit budget scan as calibration, over every subset of
checkpoints reachable by dropping one at a time while the estimate improves):

- state: the normed exit state (what Tide's routers read);
- trunc: + max prob, margin and entropy of the exit's logits over the 256 most frequent tokens (1/16 of the head);
- full: + the same from the full head (one head per consulted checkpoint);
- confonly: the full head's three numbers alone.

The estimate charges every layer run 1, a consulted checkpoint `--checkpoint-cost`, a skipped layer
`--skip-cost`, the head `--head-cost` (plus one more head per consulted checkpoint where the token stays, for
"full"/"confonly"; 1/16 of it for "trunc"), and the step set-up `--setup-cost`, all in layers
(defaults: `tide.calibration.measure.measure_costs` on a 2-core CPU, docs/benchmarks.md).

    python examples/router_signals/router_signals.py
"""

import argparse
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tide  # noqa: E402
from tide.calibration.forward import capture  # noqa: E402
from tide.calibration.options import CalibrationOptions  # noqa: E402
from tide.calibration.texts import batches  # noqa: E402
from tide.tools.demo import _load_base  # noqa: E402
from tide.tools.demo_corpus import split_corpus  # noqa: E402
from tide.calibration.thresholds import auc, calibrate_cascade  # noqa: E402

KINDS = ("state", "trunc", "full", "confonly")


def collect(model, tokenizer, texts):
    opts = CalibrationOptions(batch_size=16, max_length=128)
    normed, logprobs, agree = ({k: [] for k in model.checkpoints} for _ in range(3))
    top1 = []
    with torch.no_grad():
        for batch in batches(texts, tokenizer, opts, model.base.device):
            cap = capture(model, batch)
            top1.append(cap.full_top1)
            for k in model.checkpoints:
                n = model.parts.final_norm(model.routers[k].exit_state(cap.states[k]))
                lp = model.parts.logits_from_normed(n).float().log_softmax(-1)
                normed[k].append(n.float())
                logprobs[k].append(lp)
                agree[k].append(lp.argmax(-1) == cap.full_top1)
    cat = lambda d: {k: torch.cat(v) for k, v in d.items()}  # noqa: E731
    return cat(normed), cat(logprobs), cat(agree), torch.cat(top1)


def confidence(logprobs):
    p = logprobs.exp()
    top2 = p.topk(2, -1).values
    return torch.stack([top2[:, 0], top2[:, 0] - top2[:, 1], -(p * logprobs).sum(-1)], -1)


def features(kind, normed, logprobs, frequent):
    if kind == "state":
        return normed
    if kind == "trunc":
        return torch.cat([normed, confidence(logprobs[:, frequent].log_softmax(-1))], -1)
    if kind == "full":
        return torch.cat([normed, confidence(logprobs)], -1)
    return confidence(logprobs)


def fit(x, y, steps=1500):
    mean, std = x.mean(0), x.std(0) + 1e-6
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 16), torch.nn.SiLU(), torch.nn.Linear(16, 1))
    optim = torch.optim.Adam(net.parameters(), 1e-2 if x.shape[1] < 10 else 1e-3)
    generator = torch.Generator().manual_seed(0)
    xn = (x - mean) / std
    for _ in range(steps):
        pick = torch.randint(x.shape[0], (256,), generator=generator)
        loss = F.binary_cross_entropy_with_logits(net(xn[pick]).squeeze(-1), y[pick].float())
        optim.zero_grad()
        loss.backward()
        optim.step()
    return lambda z: torch.sigmoid(net((z - mean) / std).squeeze(-1)).detach()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-samples", type=int, default=768)
    parser.add_argument("--checkpoint-cost", type=float, default=0.18)
    parser.add_argument("--skip-cost", type=float, default=0.04)
    parser.add_argument("--head-cost", type=float, default=1.08)
    parser.add_argument("--setup-cost", type=float, default=0.28)
    args = parser.parse_args()
    torch.manual_seed(0)
    base, tokenizer = _load_base()
    train, held = split_corpus()
    config = tide.TideConfig(checkpoint_interval=1, target_agreement=0.9)
    model = tide.calibrate(base, tokenizer, dataset=train, config=config, num_samples=args.num_samples, max_length=128,
                           batch_size=16, measure_costs=False, validation_tokens=0, draft_trials=0, progress=False)
    random.Random(1).shuffle(train)
    layers, num_layers = model.checkpoints, model.parts.num_layers
    tr_normed, tr_lp, tr_agree, tr_top1 = collect(model, tokenizer, train[:400])
    ho_normed, ho_lp, ho_agree, _ = collect(model, tokenizer, held[:200])
    frequent = torch.bincount(tr_top1, minlength=tr_lp[layers[0]].shape[-1]).argsort(descending=True)[:256]
    base_cost = num_layers + args.head_cost + args.setup_cost
    print(f"training tokens {tr_top1.numel()}, held-out tokens {ho_agree[layers[0]].numel()}")

    def speedup(exit_layer, active, kind):
        cost = (exit_layer + 1).double() + (num_layers - 1 - exit_layer).double() * args.skip_cost
        cost += args.head_cost + args.setup_cost
        per_checkpoint = args.checkpoint_cost + (args.head_cost / 16 if kind == "trunc" else 0.0)
        for k in active:
            consulted = exit_layer >= k
            cost += consulted.double() * per_checkpoint
            if kind in ("full", "confonly"):
                cost += (consulted & (exit_layer != k)).double() * args.head_cost
        return base_cost / float(cost.mean())

    for kind in KINDS:
        scores = {}
        for k in layers:
            router = fit(features(kind, tr_normed[k], tr_lp[k], frequent), tr_agree[k])
            scores[k] = router(features(kind, ho_normed[k], ho_lp[k], frequent))
        print(kind, "AUC per checkpoint:", " ".join(f"{auc(scores[k], ho_agree[k]):.2f}" for k in layers))
        for target in (0.85, 0.9, 0.95):
            def evaluate(active):
                selection = calibrate_cascade(active, scores, ho_agree, ho_agree, target, 0.95)
                n = ho_agree[layers[0]].numel()
                exit_layer, running = torch.full((n,), num_layers - 1), torch.ones(n, dtype=torch.bool)
                for row in selection.checkpoints:
                    leaving = running & (scores[row.layer] > row.threshold)
                    exit_layer[leaving], running = row.layer, running & ~leaving
                agree = torch.ones(n, dtype=torch.bool)
                for k in active:
                    agree[exit_layer == k] = ho_agree[k][exit_layer == k]
                return (speedup(exit_layer, active, kind), float((exit_layer + 1).double().mean()),
                        float(agree.float().mean()))

            active, best = list(layers), evaluate(layers)
            improved = True
            while improved and len(active) > 1:
                improved = False
                for k in list(active):
                    trial = [a for a in active if a != k]
                    result = evaluate(trial)
                    if result[0] > best[0] + 1e-4:
                        active, best, improved = trial, result, True
                        break
            print(f"  target {target}: estimated x{best[0]:.3f}, mean layers {best[1]:.2f}, "
                  f"held-out agreement {best[2]:.3f}, checkpoints {active}")


if __name__ == "__main__":
    main()
