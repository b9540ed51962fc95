"""Held-out scoring: the second pass streams the held-out texts and keeps only scalars per token and checkpoint
(router score as generation computes it, agreement with the full model, training label, and where the full
model's token ranks among the drafts, also restricted to the ranked vocabulary of `ranked_draft_vocabulary`);
`Heldout` accumulates them and gathers every process's. Threshold selection and the draft estimates read them.

Where the draft heads trained over the ranked vocabulary (the trainer's `draft_rows`: large vocabularies), every
checkpoint's drafts are scored within it alone, through the head's rows for those tokens (`rankedrows`), and an
exit's agreement runs the whole head only where no ranked token already beats the full model's: on a 262,144-token
vocabulary, 4,096 rows against 64 times as many for each draft and each exit."""

from __future__ import annotations

import torch

from ..config import MAX_DRAFT_TOPK, TideConfig
from ..heads.draftvocab import candidate_sizes, ranked_vocabulary, restricted_ranks
from ..modeling import TideForCausalLM
from .distributed import Processes
from .forward import Capture, capture, exit_labels, label_of
from .phases import Context
from .rankedrows import RankedRows
from .texts import batches

__all__ = ["Heldout", "score_heldout", "ranked_draft_vocabulary"]


def score_heldout(ctx: Context, held_texts: list[str], ranked: torch.Tensor | None, bar,
                  draft_vocab_only: bool = False) -> tuple["Heldout", tuple]:
    """Score this process's held-out texts (`bar` counts them); (every process's scores, (texts, tokens) of this
    process's). `draft_vocab_only`: the draft heads trained over `ranked` and are scored over it alone."""
    tide, phases = ctx.tide, ctx.phases
    held = Heldout()
    rows = RankedRows.of(tide.parts, ranked, tide.num_head_rows) if draft_vocab_only else None
    for batch in phases.counted("data", batches(held_texts, ctx.tokenizer, ctx.opts, tide.base.device)):
        with phases("held-out scoring"):
            held.add(_score(tide, capture(tide, batch), ctx.cfg, ranked, rows))
        bar.update(batch["texts"])
    local = (len(held_texts), held.num_tokens if held_texts else 0)
    with phases("held-out scoring"):
        return held.gathered(ctx.procs), local


class Heldout:
    def __init__(self):
        self._scores, self._agree, self._labels, self._ranks, self._chain_ranks = {}, {}, {}, {}, {}
        self._vocab_ranks, self._vocab_chain_ranks = {}, {}  # keyed (layer, draft vocabulary size)

    def _stores(self):
        return {"scores": self._scores, "agree": self._agree, "labels": self._labels, "ranks": self._ranks,
                "chain_ranks": self._chain_ranks, "vocab_ranks": self._vocab_ranks,
                "vocab_chain_ranks": self._vocab_chain_ranks}

    def add(self, scored: dict) -> None:
        for name, store in self._stores().items():
            for k, v in scored[name].items():
                store.setdefault(k, []).append(v.cpu())

    def _cat(self, store):
        return {k: torch.cat(v) for k, v in store.items()}

    def gathered(self, procs: Processes) -> "Heldout":
        """Every process's held-out scalars, in rank order, on every process."""
        if procs.world == 1:
            return self
        out = Heldout()
        for name, mine in self._stores().items():
            theirs = out._stores()[name]
            for k, parts in mine.items():
                theirs[k] = [procs.gather_cat(torch.cat(parts))]
        return out

    def scores(self):
        return self._cat(self._scores)

    def agree(self):
        return self._cat(self._agree)

    def labels(self):
        return self._cat(self._labels)

    def ranks(self):
        return self._cat(self._ranks)

    def chain_ranks(self):
        return self._cat(self._chain_ranks)

    def restricted(self) -> dict[int, tuple[dict, dict]]:
        """{draft vocabulary size n: ({layer: ranks}, {layer: chain ranks})} of drafts restricted to n tokens."""
        out: dict[int, tuple[dict, dict]] = {}
        chain = self._cat(self._vocab_chain_ranks)
        for (k, n), ranks in self._cat(self._vocab_ranks).items():
            first, later = out.setdefault(n, ({}, {}))
            first[k], later[k] = ranks, chain[(k, n)]
        return out

    @property
    def num_tokens(self) -> int:
        return sum(v.numel() for v in next(iter(self._scores.values())))


def _draft_ranks(logits: torch.Tensor, full_top1: torch.Tensor) -> torch.Tensor:
    """[N] uint8: where the full model's top-1 ranks among a lossless draft's logits [N, V] (0: the draft's top-1;
    capped at MAX_DRAFT_TOPK, for tree drafts)."""
    return (logits > logits.gather(-1, full_top1[:, None])).sum(-1).clamp(max=MAX_DRAFT_TOPK).to(torch.uint8)


@torch.no_grad()
def _score(tide: TideForCausalLM, cap: Capture, cfg: TideConfig, vocab: torch.Tensor | None = None,
           rows: RankedRows | None = None) -> dict:
    """Held-out scalars per checkpoint: router scores (as generation computes them), agreement, label, and where
    the full model's token ranks among drafts (also restricted to the first ids of `vocab`, the ranked
    vocabulary, at each candidate size). With `rows` (`vocab`'s head rows), drafts are ranked within the ranked
    vocabulary only (no "ranks" or "chain_ranks") and agreement reads the rows first (`RankedRows.agreement`)."""
    out = {"scores": {}, "agree": {}, "labels": {}, "ranks": {}, "chain_ranks": {}, "vocab_ranks": {},
           "vocab_chain_ranks": {}}
    tests = tide.exit_tests({k: 1.0 for k in cap.states})  # the decode step's own checkpoint test
    sizes = [n for n in candidate_sizes(tide.num_head_rows) if vocab is not None and n <= vocab.numel()]
    if rows is not None and sizes:
        _score_within(tide, cap, cfg, rows, sizes, tests, out)
        return out
    for k, states in cap.states.items():
        exit_logits = tide.exit_logits(k, states)
        agree, label = exit_labels(exit_logits, states, cap.final, cap.full_top1, cfg)
        out["scores"][k] = tests[k](states)[0].cpu()
        out["agree"][k], out["labels"][k] = agree.cpu(), label.cpu()
        if cap.context is None or tide.routers[k].draft is None:  # drafts from the exit head: the logits above
            first = chained = exit_logits
        else:
            first, normed = tide.draft_logits(k, states, cap.context.to(states.dtype))
            # A chain's second and later drafts read the previous draft's own normed state, not a verified one.
            context = torch.cat([torch.zeros_like(normed[:1]), normed[:-1]]).masked_fill(cap.first[:, None], 0.0)
            chained = tide.draft_logits(k, states, context)[0]
        out["ranks"][k] = _draft_ranks(first, cap.full_top1).cpu()
        out["chain_ranks"][k] = out["ranks"][k] if chained is first else _draft_ranks(chained, cap.full_top1).cpu()
        for n in sizes:  # the same drafts ranking only the n most-predicted tokens
            ranks = out["vocab_ranks"][(k, n)] = restricted_ranks(first, cap.full_top1, vocab[:n], MAX_DRAFT_TOPK).cpu()
            out["vocab_chain_ranks"][(k, n)] = ranks if chained is first else \
                restricted_ranks(chained, cap.full_top1, vocab[:n], MAX_DRAFT_TOPK).cpu()
    return out


def _score_within(tide: TideForCausalLM, cap: Capture, cfg: TideConfig, rows: RankedRows, sizes: list[int], tests,
                  out: dict) -> None:
    """`_score` where every draft is ranked within the ranked vocabulary (`rows`), into `out`."""
    parts = tide.parts
    for k, states in cap.states.items():
        router = tide.routers[k]
        exit_normed = parts.final_norm(router.exit_state(states))
        agree = rows.agreement(parts, exit_normed, cap.full_top1)
        out["scores"][k] = tests[k](states)[0].cpu()
        out["agree"][k], out["labels"][k] = agree.cpu(), label_of(agree, states, cap.final, cfg).cpu()
        if cap.context is None or router.draft is None:  # drafts from the exit head
            firsts = chains = rows.ranks(parts, exit_normed, cap.full_top1, sizes)
        else:
            normed = parts.final_norm(router.draft(states, cap.context.to(states.dtype)))
            # A chain's second and later drafts read the previous draft's own normed state, not a verified one.
            context = torch.cat([torch.zeros_like(normed[:1]), normed[:-1]]).masked_fill(cap.first[:, None], 0.0)
            chained = parts.final_norm(router.draft(states, context))
            firsts, chains = (rows.ranks(parts, n, cap.full_top1, sizes) for n in (normed, chained))
        for n in sizes:
            out["vocab_ranks"][(k, n)], out["vocab_chain_ranks"][(k, n)] = firsts[n].cpu(), chains[n].cpu()


def ranked_draft_vocabulary(tide: TideForCausalLM, trainer, procs: Processes) -> torch.Tensor | None:
    """The tokens the full model predicted most on the training texts (all processes: `trainer.predicted`, its
    counts), as many as the largest draft vocabulary held-out scoring ranks drafts within; None where the head is too
    small for one, or where generation could not read its rows alone (`ModelParts.head_rows_readable`), as for an
    offloaded head."""
    sizes = candidate_sizes(tide.num_head_rows)
    if not sizes or not tide.parts.head_rows_readable:  # the drafts would read the whole head: no cheaper
        return None
    counts = torch.tensor(procs.sum(trainer.predicted.tolist())) if procs.world > 1 else trainer.predicted
    return ranked_vocabulary(counts, max(sizes))
