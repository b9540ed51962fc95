"""The cost model: what a configuration costs per token, in decoder layers, by the measured costs.

`layer_cost_of_cascade` prices exit mode's cascade; `prune_checkpoints` turns that and calibration's held-out
cascade into the set of checkpoints worth consulting; `draft_candidates` ranks lossless mode's drafting schemes
(draft layer, chain length or tree width, draft vocabulary, with or without n-gram branches in the tree) by their
estimated speed-up, walking held-out text
with generation's own chain rule (`chain_cycles`). The costs come from `measure.measure_costs` (`StepCosts`);
calibration then times the best estimates (`trials.py`). Nothing here times, trains or saves anything.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch

from ..config import MAX_DRAFT_TOPK
from ..decode.lossless.chain import next_cap

__all__ = ["DraftScheme", "MERGED_TOPK", "draft_candidates", "layer_cost_of_cascade", "prune_checkpoints",
           "chain_cycles", "chain_cost"]

# The `costs` arguments below are `measure.StepCosts` (not imported, nor annotated: measure.py imports this module).


def layer_cost_of_cascade(rows, total: int, num_layers: int, costs) -> float:
    """Mean cost per token, in decoder layers, of the cascade `rows` (CheckpointCalibration list, exit order).

    A token that reaches a checkpoint with a threshold < 1 pays for consulting it; one that exits after layer
    k runs k + 1 layers and fills the other layers' K/V.
    """
    running, cost = total, 0.0
    for row in rows:
        if row.threshold < 1.0:
            cost += running * costs.checkpoint
        cost += row.exits * ((row.layer + 1) + (num_layers - row.layer - 1) * costs.skipped_layer)
        running -= row.exits
    return (cost + running * num_layers) / max(total, 1)


def prune_checkpoints(select, layers: list[int], total: int, num_layers: int, costs):
    """Drop consulted checkpoints that cost more than they save; returns (selection, dropped {layer: reason}).

    `select(layers)` runs threshold selection on a subset of checkpoints (a `CascadeSelection`). A checkpoint
    is dropped when removing it lowers the cascade's expected cost per token; the worst is dropped first and
    the thresholds are selected again each time.
    """
    active, dropped = list(layers), {}
    selection = select(active)
    while True:
        cost = layer_cost_of_cascade(selection.checkpoints, total, num_layers, costs)
        trials = []
        for row in selection.checkpoints:
            if row.threshold >= 1.0:
                continue
            rest = [k for k in active if k != row.layer]
            trial = select(rest)  # may be empty: no checkpoint at all, every token runs the whole stack
            trials.append((layer_cost_of_cascade(trial.checkpoints, total, num_layers, costs), row.layer, rest, trial))
        if not trials:
            return selection, dropped
        best_cost, layer, rest, trial = min(trials, key=lambda t: t[0])
        if best_cost >= cost:
            return selection, dropped
        exits = next(r.exits for r in selection.checkpoints if r.layer == layer)
        dropped[layer] = (f"{exits / max(total, 1):.1%} of tokens exit there; consulting it costs "
                          f"{costs.checkpoint:.2f} layer per token that reaches it")
        active, selection = rest, trial


class DraftScheme(NamedTuple):
    draft_layer: int
    max_draft: int  # chain drafts: most per verification; a tree with n-gram branches: their deepest (else 1)
    draft_topk: int  # > 1: one verification tree of this many head candidates for the next position
    estimate: float  # estimated speed-up over the base model
    draft_vocab_size: int = 0  # > 0: drafts rank only that many most-predicted tokens (draftvocab.py)
    draft_ngram: int = 0  # > 0 (trees): the n-gram continuation, where there is one, is a branch of the tree


# Trees with n-gram branches are candidates up to this many head candidates: the branch makes the verification
# wider still, and on CPU a wide pass can cost a jump (trials.timed_schemes).
MERGED_TOPK = 4


def draft_candidates(ranks: dict[int, torch.Tensor], num_layers: int, costs, max_draft: int = 8,
                     max_topk: int = MAX_DRAFT_TOPK, chain_ranks: dict[int, torch.Tensor] | None = None,
                     restricted: dict[int, tuple[dict, dict]] | None = None, head_rows: int = 0,
                     ngram: int = 0, ngram_depth: int = 0) -> list[DraftScheme]:
    """Lossless mode's drafting schemes with their estimated speed-up, best first, from held-out exit heads.

    ranks: {layer: [N]} in text order, where the full model's next token ranks among the draft's logits
    (0: its top-1), for a draft that reads a verified context (a chain's first draft, a tree's).
    chain_ranks: the same for a chain's later drafts, whose draft head reads the previous draft's own state
    (default: `ranks`; equal where there is no draft head). A draft step from layer E costs E + 1 layers and the
    head; a verification costs the whole stack and the head (each plus a capture where layer arguments are not
    windowed, `costs.pass_capture`), plus what a pass over p positions costs more than a pass over one
    (`costs.verify_extra_at(p)`, measured at `VERIFY_POINTS`; speculative decoding assumes it small, and on a
    CPU it can be a third of a step). A chain cycle emits the run of drafts that agree with
    the full model, plus one, and drafts as many as generation's adaptive cap allows (`chain_cycles` walks the
    held-out text with it); a tree cycle (k candidates for one position, run through the shallow layers
    together and verified with the token before them in one pass: about a chain cycle of one draft) emits
    two tokens when the full model's token is among the k, else one. A cycle also pays `generate`'s own work
    per cycle, and the base model's per token (`costs.cycle_extra`, `costs.step_extra`, measured in `generate`).
    An estimate: calibration then measures the best.

    restricted: {n: (ranks, chain_ranks)} for drafts that rank only the n most-predicted tokens (a token outside
    them ranks last), whose head costs n / `head_rows` of the whole head.

    ngram, ngram_depth (> 0): each tree of up to `MERGED_TOPK` candidates is also a candidate with n-gram branches
    (`draft_ngram=ngram`, continuations up to `ngram_depth` tokens deep), listed right after the same tree without
    them and estimated as it is: an n-gram branch is a free draft (no head, no per-token shallow step) whose
    benefit depends on how much the text repeats itself, which held-out ranks do not say; the timing decides.
    """
    passes = num_layers + costs.head + costs.pass_capture

    def verify(positions: int) -> float:  # a verification, and the cycle's work beyond its pieces
        return passes + costs.verify_extra_at(positions) + costs.cycle_extra

    variants = [(0, ranks, chain_ranks or ranks)]
    variants += [(n, r, c) for n, (r, c) in sorted((restricted or {}).items()) if head_rows and n < head_rows]
    out = []
    for vocab, layer_ranks, layer_chain_ranks in variants:
        head = costs.head * (vocab / head_rows if vocab else 1.0)
        schemes = _schemes(layer_ranks, layer_chain_ranks, head + costs.pass_capture, verify,
                           num_layers + costs.step_fixed, max_draft, max_topk, vocab,
                           tree_extra=2 * (costs.capture - costs.pass_capture))
        for scheme in schemes:
            out.append(scheme)
            if ngram and ngram_depth and 1 < scheme.draft_topk <= MERGED_TOPK:
                out.append(scheme._replace(max_draft=ngram_depth, draft_ngram=ngram))
    return sorted(out, key=lambda c: -c.estimate)  # stable: a tree with n-gram branches after the same without


def _schemes(ranks, chain_ranks, draft_overhead: float, verify, base: float, max_draft: int, max_topk: int,
             vocab: int, tree_extra: float = 0.0) -> list:
    """`draft_candidates`' schemes for one draft vocabulary (a draft step costs E + 1 layers + `draft_overhead`;
    a cycle's verification `verify(positions)`; a base token `base`; a tree cycle also `tree_extra`: its tree
    masks' two captures, where the chain's passes take windowed arguments)."""
    out = []
    for layer, rank in ranks.items():
        later = chain_ranks[layer]
        first_flags, later_flags, runs, current = (rank == 0).tolist(), (later == 0).tolist(), [], 0
        for first, flag in zip(reversed(first_flags), reversed(later_flags)):
            runs.append(current + 1 if first else 0)  # runs[t]: a chain drafted from t, agreeing drafts in a row
            current = current + 1 if flag else 0  # the same for drafts that follow a draft
        runs.reverse()
        draft = layer + 1 + draft_overhead
        for length in range(1, max_draft + 1):
            tokens, drafted = chain_cycles(runs, length)
            out.append(DraftScheme(layer, length, 1, tokens / chain_cost(drafted, draft, verify) * base, vocab))
        if max_draft:
            for k in range(2, max_topk + 1):
                hit = float((rank.long() < k).double().mean())
                out.append(DraftScheme(layer, 1, k, (1 + hit) / (draft + verify(k + 1) + tree_extra) * base, vocab))
    return out


def chain_cost(drafted: Counter, draft: float, verify) -> float:
    """What chain cycles cost, in layers: {drafts in a cycle: cycles}, a draft step `draft`, and a verification
    over p positions `verify(p)` (the drafts and the token before them)."""
    return sum(count * (d * draft + verify(d + 1)) for d, count in drafted.items())


def chain_cycles(runs: list[int], max_draft: int) -> tuple[int, Counter]:
    """Lossless mode's chain drafting walked over held-out text: (tokens emitted, {drafts in a cycle: cycles}).

    runs[t]: how many drafts in a row from position t agree with the full model. A cycle at t drafts `cap`
    tokens, emits the agreeing ones and one more, and the cap follows generation's rule (`next_cap`). So a
    chain of up to 4 whose drafts often fail early mostly verifies 2-3 positions, not 5."""
    tokens, drafted, cap, t = 0, Counter(), max_draft, 0
    while t < len(runs):
        accepted = min(runs[t], cap)
        drafted[cap] += 1
        tokens += accepted + 1
        t += accepted + 1
        cap = next_cap(cap, cap, accepted, max_draft)
    return tokens, drafted
