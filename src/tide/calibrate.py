"""Streaming router calibration: `tide.calibrate(model, tokenizer, dataset=..., config=...)`.

Pass 1 streams training batches: one base forward per batch (hooks capture the checkpoint layers'
outputs), labels computed on the fly, a bounded buffer per checkpoint, a few minibatch steps per batch.
Pass 2 streams held-out batches and keeps only (score, agree, label) scalars per token, then
`thresholds.calibrate_cascade` picks the thresholds. Memory is bounded by the batch and the buffer,
whatever the number of samples. This module does not generate text.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .config import TideConfig
from .data import load_texts
from .layercalls import capture_outputs
from .modeling import TideForCausalLM
from .thresholds import calibrate_cascade, oracle_depth

__all__ = ["calibrate", "CalibrationOptions"]


@dataclass
class CalibrationOptions:
    num_samples: int = 512
    max_length: int = 256
    batch_size: int = 8
    heldout_fraction: float = 0.2
    buffer_size: int = 16384  # states kept per checkpoint for minibatch training
    minibatch: int = 256
    passes: int = 2  # minibatch sweeps over the new tokens after each base forward
    lr: float = 1e-3
    seed: int = 0
    progress: bool = True


def calibrate(
    model,
    tokenizer,
    dataset,
    config: TideConfig | None = None,
    *,
    dataset_config: str | None = None,
    split: str = "train",
    text_column: str | None = None,
    **options,
) -> TideForCausalLM:
    """Train routers on `dataset` and calibrate per-checkpoint thresholds; returns a `TideForCausalLM`.

    `model` is a base causal LM (fresh routers are created from `config`) or a `TideForCausalLM` (its
    routers are retrained). Extra keyword arguments set `CalibrationOptions` fields.
    """
    opts = CalibrationOptions(**options)
    tide = model if isinstance(model, TideForCausalLM) else TideForCausalLM.from_base(model, config or TideConfig(), seed=opts.seed)
    cfg = tide.config
    texts = load_texts(dataset, dataset_config=dataset_config, split=split, text_column=text_column)
    random.Random(opts.seed).shuffle(texts)
    texts = texts[: opts.num_samples]
    if len(texts) < 2:
        raise ValueError(f"Calibration needs at least 2 texts (one held out); the dataset gave {len(texts)}.")
    n_held = min(len(texts) - 1, max(1, round(len(texts) * opts.heldout_fraction)))
    train_texts, held_texts = texts[n_held:], texts[:n_held]
    layers = [k for k in tide.checkpoints if k + 1 >= cfg.min_layers]

    was_training = tide.base.training
    tide.base.eval()
    bar = tqdm(total=len(texts), desc="Tide calibration", unit="text", disable=not opts.progress)
    try:
        trainers = {k: _RouterTrainer(tide.routers[k], opts) for k in tide.checkpoints}
        train_tokens = 0
        for batch in _batches(train_texts, tokenizer, opts, tide.base.device):
            probe = _probe(tide, batch, cfg)
            for k, trainer in trainers.items():
                trainer.add(probe.normed[k], probe.labels[k])
            train_tokens += probe.num_tokens
            bar.update(batch["input_ids"].shape[0])
            bar.set_postfix(loss=f"{sum(t.last_loss for t in trainers.values()) / len(trainers):.3f}")
        for trainer in trainers.values():
            trainer.finish()
        held = _Heldout()
        for batch in _batches(held_texts, tokenizer, opts, tide.base.device):
            held.add(_probe(tide, batch, cfg, score=True))
            bar.update(batch["input_ids"].shape[0])
    finally:
        bar.close()
        tide.base.train(was_training)

    results = calibrate_cascade(layers, held.scores(), held.agree(), held.labels(), cfg.target_agreement, cfg.confidence)
    cfg.thresholds = {str(r.layer): r.threshold for r in results}
    cfg.calibration = _summary(results, held, cfg, tide.parts.num_layers, dataset, len(texts), train_tokens)
    return tide


# ---------------------------------------------------------------------- batches
def _batches(texts, tokenizer, opts: CalibrationOptions, device):
    """Right-padded token batches; works for tokenizers without a pad token."""
    for start in range(0, len(texts), opts.batch_size):
        encoded = tokenizer(texts[start : start + opts.batch_size], truncation=True, max_length=opts.max_length)
        rows = [ids for ids in encoded["input_ids"] if len(ids) > 1] or encoded["input_ids"]
        width = max(len(ids) for ids in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        yield {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}


# ---------------------------------------------------------------------- one base forward
@dataclass
class _Probe:
    normed: dict[int, torch.Tensor]  # [N, H] final-norm view at each checkpoint (real tokens only)
    labels: dict[int, torch.Tensor]  # [N] bool training label
    agree: dict[int, torch.Tensor]  # [N] bool checkpoint top-1 == full top-1
    scores: dict[int, torch.Tensor]  # [N] router scores (held-out only)
    num_tokens: int


@torch.no_grad()
def _probe(tide: TideForCausalLM, batch, cfg: TideConfig, score: bool = False) -> _Probe:
    parts, last = tide.parts, tide.parts.num_layers - 1
    with capture_outputs(parts, tide.checkpoints + [last]) as states:
        logits = tide.base(**batch, use_cache=False).logits
    keep = batch["attention_mask"].bool()
    full_top1 = logits[keep].argmax(-1)
    final_raw = states[last][keep].float()
    out = _Probe({}, {}, {}, {}, int(keep.sum()))
    for k in tide.checkpoints:
        normed = parts.final_norm(states[k][keep])
        agree = parts.logits_from_normed(normed).argmax(-1) == full_top1
        if cfg.label == "top1":
            label = agree
        else:
            label = F.cosine_similarity(states[k][keep].float(), final_raw, dim=-1) > cfg.cosine_threshold
        out.normed[k], out.labels[k], out.agree[k] = normed, label, agree
        if score:
            out.scores[k] = tide.route(k, states[k][keep], 1.0)[0].cpu()  # as generation scores them
    return out


# ---------------------------------------------------------------------- router training
class _RouterTrainer:
    """Bounded ring buffer of (state, label) plus minibatch Adam steps on an fp32 copy of one router."""

    def __init__(self, router, opts: CalibrationOptions):
        self.target = router
        param = next(router.parameters())
        self.router = copy.deepcopy(router).float()
        self.optim = torch.optim.Adam(self.router.parameters(), lr=opts.lr)
        self.opts = opts
        self.states = torch.empty(opts.buffer_size, param.shape[-1], device=param.device)
        self.labels = torch.empty(opts.buffer_size, device=param.device)
        self.filled = self.cursor = 0
        self.last_loss = float("nan")
        self.generator = torch.Generator(device="cpu").manual_seed(opts.seed)

    def add(self, normed: torch.Tensor, labels: torch.Tensor) -> None:
        n = min(normed.shape[0], self.opts.buffer_size)
        idx = (torch.arange(n) + self.cursor) % self.opts.buffer_size
        self.states[idx.to(self.states.device)] = normed[-n:].float().to(self.states.device)
        self.labels[idx.to(self.labels.device)] = labels[-n:].float().to(self.labels.device)
        self.cursor = (self.cursor + n) % self.opts.buffer_size
        self.filled = min(self.filled + n, self.opts.buffer_size)
        self._train(steps=self.opts.passes * math.ceil(n / self.opts.minibatch))

    def _train(self, steps: int) -> None:
        with torch.enable_grad():
            for _ in range(steps):
                pick = torch.randint(self.filled, (min(self.opts.minibatch, self.filled),), generator=self.generator)
                pick = pick.to(self.states.device)
                loss = F.binary_cross_entropy_with_logits(self.router(self.states[pick]), self.labels[pick])
                self.optim.zero_grad(set_to_none=True)
                loss.backward()
                self.optim.step()
                self.last_loss = loss.item()

    def finish(self) -> None:
        """Copy the trained fp32 weights back into the model's router (its own device and dtype)."""
        with torch.no_grad():
            for dst, src in zip(self.target.parameters(), self.router.parameters()):
                dst.copy_(src.to(dst.dtype))


# ---------------------------------------------------------------------- held-out statistics
class _Heldout:
    def __init__(self):
        self._scores, self._agree, self._labels = {}, {}, {}

    def add(self, probe: _Probe) -> None:
        for store, values in ((self._scores, probe.scores), (self._agree, probe.agree), (self._labels, probe.labels)):
            for k, v in values.items():
                store.setdefault(k, []).append(v.cpu())

    def _cat(self, store):
        return {k: torch.cat(v) for k, v in store.items()}

    def scores(self):
        return self._cat(self._scores)

    def agree(self):
        return self._cat(self._agree)

    def labels(self):
        return self._cat(self._labels)

    @property
    def num_tokens(self) -> int:
        return sum(v.numel() for v in next(iter(self._scores.values())))


def _summary(results, held: _Heldout, cfg, num_layers, dataset, num_samples, train_tokens) -> dict:
    agree = held.agree()
    exits = sum(r.exits for r in results)
    disagreements = sum(r.errors for r in results)
    total = held.num_tokens
    mean_layers = (sum(r.exits * (r.layer + 1) for r in results) + (total - exits) * num_layers) / max(total, 1)
    return {
        "dataset": dataset if isinstance(dataset, str) else f"<{type(dataset).__name__}>",
        "num_samples": num_samples,
        "train_tokens": train_tokens,
        "heldout_tokens": total,
        "expected_agreement": 1.0 - disagreements / max(total, 1),
        "expected_mean_layers": mean_layers,
        "oracle_mean_layers": _oracle_mean_layers(agree, cfg.resolve_checkpoints(num_layers), num_layers),
        "checkpoints": {str(r.layer): r.as_dict() for r in results},
    }


def _oracle_mean_layers(agree: dict[int, torch.Tensor], layers: list[int], num_layers: int) -> float:
    """Mean depth if every token left at the first checkpoint whose top-1 already matches the full model."""
    return float(oracle_depth(agree, layers, num_layers).mean())
