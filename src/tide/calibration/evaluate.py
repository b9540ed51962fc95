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


# Texts decoded side by side in `teacher_forced`: on SmolLM2-135M (2 threads, exit mode) a step of 4 rows cost 17.9 ms
# a token and one of 8 rows 9.4 ms, against 39.7 ms for one row
BATCH_ROWS = 8


@torch.no_grad()
def teacher_forced(model, token_lists: list[list[int]], tide_config=None, prefix: int = 1,
                   stop_after_errors: int | None = None, rows: int = BATCH_ROWS) -> QualityReport:
    """Per-token agreement and perplexity of Tide's decode step against the full model. Up to `rows` texts decode
    side by side, longest first; a text that ends leaves the batch (its rows of the cache go), so every step decodes
    real tokens only, each row exiting on its own as in a batched `generate` (with `kv_strategy="recompute"`, one
    text at a time). `stop_after_errors`: stop as soon as more tokens than that disagreed (the report then covers the
    tokens decoded, and says `stopped`)."""
    config = model.config.resolve_generation(tide_config)
    session = ExitSession(model, config)
    limit = math.inf if stop_after_errors is None else stop_after_errors  # disagreements allowed before stopping
    rows = 1 if config.kv_strategy == "recompute" else max(1, rows)
    texts = sorted((ids for ids in token_lists if len(ids) > prefix + 1), key=len, reverse=True)
    tally = _Tally()
    for first in range(0, len(texts), rows):
        if tally.errors > limit:
            break
        _decode_together(session, texts[first : first + rows], prefix, limit, tally)
    return QualityReport(
        tokens=tally.tokens,
        agreement=tally.agree / max(tally.tokens, 1),
        ppl_tide=math.exp(tally.nll_tide / max(tally.tokens, 1)),
        ppl_base=math.exp(tally.nll_base / max(tally.tokens, 1)),
        mean_layers=session.stats.mean_layers,
        stopped=tally.errors > limit,
    )


@dataclass
class _Tally:
    tokens: int = 0
    agree: int = 0
    nll_tide: float = 0.0
    nll_base: float = 0.0

    @property
    def errors(self) -> int:
        return self.tokens - self.agree


def _decode_together(session: ExitSession, texts: list[list[int]], prefix: int, limit: float, tally: _Tally) -> None:
    """Teacher-force `texts` (longest first) through the session's decode step as one batch, into `tally`."""
    device = session.model.base.device
    lengths = [len(ids) for ids in texts]
    ids = torch.tensor([t + [t[-1]] * (lengths[0] - len(t)) for t in texts], device=device)  # [B, T], right-padded
    full_top1, base_nll = ids.clone(), torch.zeros(ids.shape, device=device)  # the full model's, per position
    for row, length in enumerate(lengths):  # a text at a time: [T, V] logits, not [B, T, V]
        full = session.original_forward(input_ids=ids[row : row + 1, :length], use_cache=False).logits[0].float()
        full_top1[row, :length] = full.argmax(-1)
        base_nll[row, : length - 1] = F.cross_entropy(full[:-1], ids[row, 1:length], reduction="none")
    cache = DynamicCache(config=session.model.base.config)
    session.forward(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True)
    live = len(texts)
    for t in range(prefix, lengths[0] - 1):
        ending = sum(length - 1 <= t for length in lengths[:live])  # texts with no next token at t
        if ending:
            live -= ending
            cache.batch_select_indices(torch.arange(live, device=device))
        logits = session.forward(input_ids=ids[:live, t : t + 1], past_key_values=cache,
                                 use_cache=True).logits[:, -1].float()  # [live, V]
        target = ids[:live, t + 1]
        tally.tokens += live
        tally.agree += int((logits.argmax(-1) == full_top1[:live, t]).sum())
        tally.nll_tide += float(F.cross_entropy(logits, target, reduction="sum"))
        tally.nll_base += float(base_nll[:live, t].sum())
        if tally.errors > limit:
            return


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
