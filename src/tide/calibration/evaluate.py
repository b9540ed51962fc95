"""Quality of early exit on held-out text, measured the way generation runs.

`teacher_forced` feeds held-out text through Tide's own decode step one token at a time (so the KV
strategy's effect on later tokens counts) and compares each step's prediction with the full model's
on the same prefix: top-1 agreement, and perplexity of both. `oracle_depths` gives, per held-out token,
the first checkpoint whose top-1 (through the model's own final norm and head) already equals the
full model's: a perfect router would exit there. Nothing here trains or saves anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..decode.exits.session import ExitSession
from ..layers.calls import capture_outputs
from .thresholds import oracle_depth

__all__ = ["teacher_forced", "oracle_depths", "QualityReport"]


@dataclass
class QualityReport:
    tokens: int
    agreement: float  # Tide top-1 == full top-1
    ppl_tide: float
    ppl_base: float
    mean_layers: float
    stopped: bool = False  # decoding stopped early: more disagreements than `stop_after_errors`

    @property
    def ppl_delta(self) -> float:
        return self.ppl_tide - self.ppl_base


@torch.no_grad()
def teacher_forced(model, token_lists: list[list[int]], tide_config=None, prefix: int = 1,
                   stop_after_errors: int | None = None) -> QualityReport:
    """Per-token agreement and perplexity of Tide's decode step against the full model. `stop_after_errors`: stop
    as soon as more tokens than that disagreed (the report then covers the tokens decoded, and says `stopped`)."""
    config = model.config.resolve_generation(tide_config)
    session = ExitSession(model, config)
    agree = total = 0
    limit = math.inf if stop_after_errors is None else stop_after_errors  # disagreements allowed before stopping
    nll_tide = nll_base = 0.0
    device = model.base.device
    for ids in token_lists:
        if len(ids) <= prefix + 1:
            continue
        if total - agree > limit:
            break
        ids_t = torch.tensor([ids], device=device)
        full = session.original_forward(input_ids=ids_t, use_cache=False).logits[0].float()  # [T, V]
        cache = DynamicCache(config=model.base.config)
        session.forward(input_ids=ids_t[:, :prefix], past_key_values=cache, use_cache=True)
        for t in range(prefix, len(ids) - 1):
            if total - agree > limit:
                break
            logits = session.forward(input_ids=ids_t[:, t : t + 1], past_key_values=cache, use_cache=True).logits
            logits = logits[0, -1].float()
            agree += int(logits.argmax() == full[t].argmax())
            target = ids_t[0, t + 1]
            nll_tide += float(F.cross_entropy(logits[None], target[None]))
            nll_base += float(F.cross_entropy(full[t][None], target[None]))
            total += 1
    stats = session.stats
    return QualityReport(
        tokens=total,
        agreement=agree / max(total, 1),
        ppl_tide=math.exp(nll_tide / max(total, 1)),
        ppl_base=math.exp(nll_base / max(total, 1)),
        mean_layers=stats.mean_layers,
        stopped=total - agree > limit,
    )


@torch.no_grad()
def oracle_depths(model, token_lists: list[list[int]], layers: list[int] | None = None,
                  lens: bool = False) -> torch.Tensor:
    """Per token, the number of layers a perfect router would run with exits at `layers`.

    Exits are read through the checkpoints' exit heads, or through the final norm and head alone with
    `lens=True` (and at layers that are not checkpoints).
    """
    parts = model.parts
    layers = list(model.checkpoints if layers is None else layers)

    def exit_logits(k, states):
        if lens or k not in model.checkpoints:
            return parts.logits_from_normed(parts.final_norm(states))
        return model.exit_logits(k, states)

    depths = []
    for ids in token_lists:
        ids_t = torch.tensor([ids], device=model.base.device)
        with capture_outputs(parts, layers) as states:
            full_top1 = model.base(input_ids=ids_t, use_cache=False).logits[0].argmax(-1)
        agree = {k: exit_logits(k, states[k][0]).argmax(-1) == full_top1 for k in layers}
        depths.append(oracle_depth(agree, layers, parts.num_layers).cpu())
    return torch.cat(depths)


def oracle_speedup(model, token_lists, layers=None) -> float:
    """L / mean(oracle depth): the most any router can save with these checkpoints (in layers)."""
    return model.parts.num_layers / float(oracle_depths(model, token_lists, layers).float().mean())
