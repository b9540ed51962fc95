"""The pieces Tide's one-graph loops share (`lossless/graph.py`, `lossless/graphtree.py`, `exits/graph.py`): what runs
inside a cycle's or a step's graph, and what the loops around those graphs need.

- `causal_mask`: the additive causal mask of queries at some positions over a static cache's slots, made in the
  graph.
- `GraphProcessors`: the call's logits processors that run in the graph (a minimum length, one repetition penalty,
  `seen_at` and `penalised` its maths; sampling, the warpers that read the scores alone, as one `Warp`).
- `Stops`: the call's stopping criteria over emitted tokens, one at a time, on the host's list of tokens.
- Views of a backbone over some of its layers (`backbone_view`, `views_of`): the backbone's own forward on a
  shallow copy holding only those layers, so positions, rotary tables and masks are made inside the graph as the
  model makes them; what the backbone adds to input embeddings it is given (learned positions, `input_offset`),
  measured once, so a view that starts past layer 0 can take it off; and what such loops need of the model, the
  cache and the prompt (`one_graph_fits`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from ..models.compat import is_static_layer

__all__ = ["GraphProcessors", "Stops", "Warp", "backbone_view", "causal_mask", "input_offset", "one_graph_fits",
           "penalised", "seen_at", "views_of"]


def causal_mask(positions: torch.Tensor, keys: int, dtype) -> torch.Tensor:
    """The additive causal mask [1, 1, q, keys] for queries at `positions` [q] over a static cache of `keys` slots."""
    sees = torch.arange(keys, device=positions.device)[None, :] <= positions[:, None]
    return torch.zeros((), dtype=dtype, device=positions.device).masked_fill(~sees, torch.finfo(dtype).min)[None, None]


def seen_at(seen: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The tokens a repetition penalty counts at each position of [x, d1..dk]: those `seen` [V] up to x, and the
    drafts before the position (`drafts` [k]) -> [k + 1, V] bool."""
    before = torch.nn.functional.one_hot(drafts, seen.shape[0]).cumsum(0) > 0  # [k, V]: row j holds d1..d(j+1)
    return seen | torch.cat([torch.zeros_like(seen)[None], before])


def penalised(logits: torch.Tensor, strength: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """transformers' repetition penalty on fp32 `logits` [..., V]: where `seen` [..., V], a positive score divided
    by `strength` [], any other multiplied by it."""
    return torch.where(seen, torch.where(logits < 0, logits * strength, logits / strength), logits)


class GraphProcessors:
    """The call's logits processors that run inside a cycle's or a step's graph: generate's minimum length
    (`min_length`, `min_new_tokens`: the end-of-sequence tokens' scores set to -inf until the sequence is long
    enough), one repetition penalty (`penalty` [], after the prompt's first `ignore` tokens; it and the minimum
    commute) and, when sampling, the warpers that are functions of the scores alone (temperature, top-k, top-p,
    min-p), in the call's order."""

    WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)

    def __init__(self, length: int, eos: torch.Tensor, warpers: tuple, sample: bool,
                 penalty: float | None = None, ignore: int = 0):
        self.length, self.eos = length, eos  # eos: [V] bool
        self.penalty = None if penalty is None else torch.tensor(penalty, device=eos.device)
        self.ignore = ignore
        self.warp = Warp(warpers, eos.shape[0]) if sample else None
        self._past_minimum: dict[int, tuple] = {}  # width -> what `suppress` gives once no position is under it

    @classmethod
    def of(cls, logits_processor, vocab: int, device, sample: bool) -> GraphProcessors | None:
        """The processors of `logits_processor`; None where it holds any other (or a minimum or a penalty after a
        warper, a second penalty, or one that ignores a prompt length per row)."""
        length, eos, warpers, penalty, ignore = 0, set(), [], None, 0
        for processor in logits_processor:
            if isinstance(processor, (MinNewTokensLengthLogitsProcessor, MinLengthLogitsProcessor)) and not warpers:
                length = max(length, processor.prompt_length_to_skip + processor.min_new_tokens
                             if isinstance(processor, MinNewTokensLengthLogitsProcessor) else processor.min_length)
                eos |= set(processor.eos_token_id.view(-1).tolist())
            elif (isinstance(processor, RepetitionPenaltyLogitsProcessor) and not warpers and penalty is None
                  and isinstance(processor.prompt_ignore_length, (int, type(None)))):
                penalty, ignore = processor.penalty, processor.prompt_ignore_length or 0
            elif sample and isinstance(processor, cls.WARPERS):
                warpers.append(processor)
            else:
                return None
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        mask[[token for token in eos if 0 <= token < vocab]] = True
        return cls(length, mask, tuple(warpers), sample, penalty, ignore)

    def seen(self, tokens: list[int], device) -> torch.Tensor | None:
        """[V] bool: the tokens of `tokens` the repetition penalty counts (after the first `ignore`), for the loop to
        keep on the device and mark each emitted token in; None without a penalty."""
        if self.penalty is None:
            return None
        seen = torch.zeros(self.eos.shape[0], dtype=torch.bool, device=device)
        seen[[t for t in tokens[self.ignore:] if 0 <= t < seen.shape[0]]] = True
        return seen

    def suppress(self, length: int, width: int):
        """For a cycle whose first position follows a sequence of `length` tokens: ([width + 1] bool, the tokens):
        where the tokens' scores are -inf (all False once no position is under the minimum: one graph either way;
        made once per width then, not every cycle)."""
        if length >= self.length and width in self._past_minimum:
            return self._past_minimum[width]
        where = torch.tensor([length + i < self.length for i in range(width + 1)], device=self.eos.device)
        if length >= self.length:
            self._past_minimum[width] = where, self.eos
        return where, self.eos


class Warp:
    """The call's warpers as one function of the scores (they read the scores alone: no sequence is given)."""

    def __init__(self, warpers: tuple, vocab: int):
        self.warpers, self.vocab = warpers, vocab

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(None, scores)
        return scores


class Stops:
    """The call's stopping criteria over emitted tokens, one at a time. EOS and the length limit are checked on the
    host's list of tokens (no device read); any other criterion is called on the sequence after each token."""

    def __init__(self, stopping_criteria, generation_config, device):
        self.criteria, self.device = stopping_criteria, device
        self.eos, self.max_length, self.other = set(), generation_config.max_length, False
        for criterion in stopping_criteria:
            if isinstance(criterion, EosTokenCriteria):
                self.eos |= set(criterion.eos_token_id.view(-1).tolist())
            elif isinstance(criterion, MaxLengthCriteria):
                self.max_length = min(self.max_length, criterion.max_length)
            else:
                self.other = True

    def emitted(self, tokens: list[int], new: list[int]) -> tuple[int, bool]:
        """(how many of `new` to keep, whether generation ends after them), `tokens` being the sequence before."""
        for i, token in enumerate(new):
            if token in self.eos or len(tokens) + i + 1 >= self.max_length:
                return i + 1, True
            if self.other:
                sequence = torch.tensor([tokens + new[: i + 1]], device=self.device)
                if bool(self.criteria(sequence, None).any()):
                    return i + 1, True
        return len(new), False


def backbone_view(parts, start: int, stop: int, final_norm: bool) -> nn.Module | None:
    """The backbone running only decoder layers start..stop-1 (its final norm where `final_norm`, else none): a
    shallow copy sharing every parameter, whose forward is the backbone's own. None where the layers or the norm
    are not the backbone's direct children."""
    backbone, spec = parts.backbone, parts.spec
    prefix = spec.backbone + "."
    layers_name, norm_name = spec.layers.removeprefix(prefix), spec.norm.removeprefix(prefix)
    if not (spec.layers.startswith(prefix) and spec.norm.startswith(prefix)) or "." in layers_name + norm_name:
        return None
    view = copy.copy(backbone)
    view._modules = dict(backbone._modules)  # (copy.copy shares the dict: the backbone itself must not change)
    view._modules[layers_name] = nn.ModuleList(list(parts.layers)[start:stop])
    if not final_norm:
        view._modules[norm_name] = nn.Identity()
    return view


def input_offset(view: nn.Module, hidden: int, like: torch.Tensor) -> bool | None:
    """What the backbone view `view` (no layers) adds to the input embeddings it is given, measured on random
    states: False, nothing (they pass as they are); True, a term that does not depend on them (learned positions),
    which the verification graph computes and takes off; None, it transforms them otherwise (e.g. scales them),
    and cannot be given states."""
    states = torch.randn(1, 3, hidden, dtype=like.dtype, device=like.device)
    positions = torch.arange(3, device=like.device)[None]
    with torch.no_grad():
        out = view(inputs_embeds=states, position_ids=positions, use_cache=False).last_hidden_state
        zero = view(inputs_embeds=torch.zeros_like(states), position_ids=positions, use_cache=False).last_hidden_state
    if torch.equal(out, states):
        return False
    return True if torch.allclose(out - zero, states, atol=1e-5, rtol=1e-4) else None


def one_graph_fits(parts, cache, mask) -> bool:
    """What a loop of one graph a step needs of the model, the cache and the prompt: a backbone that takes a 4-D mask
    with positions in `position_ids` (`spec.tree_drafts`), no projection after the final norm, attention that adds
    a mask (SDPA or eager), a full-attention static cache, and no padding."""
    return (parts.spec.tree_drafts and parts.post_norm is None
            and getattr(parts.backbone.config, "_attn_implementation", None) in ("sdpa", "eager")
            and bool(cache.layers) and all(is_static_layer(layer) for layer in cache.layers)
            and (mask is None or bool(mask.all())))


def views_of(model, parts, bounds: tuple, final_norms: tuple):
    """Views of the backbone over layers bounds[i]..bounds[i + 1] - 1 (with the final norm where `final_norms[i]`),
    and what the views add to the input embeddings they are given (a view that computes it, or None: nothing), made
    once per model; None where the backbone does not fit views or transforms its input embeddings otherwise."""
    made = model.__dict__.setdefault("_fused_views", {})
    key = (bounds, final_norms)
    if key not in made:
        views = tuple(backbone_view(parts, a, b, final_norm=norm)
                      for a, b, norm in zip(bounds, bounds[1:], final_norms))
        offset_view = backbone_view(parts, 0, 0, final_norm=False)
        needed = None
        if all(v is not None for v in views) and offset_view is not None:
            weight = next(parts.layers[0].parameters())
            needed = input_offset(offset_view, parts.backbone.config.get_text_config().hidden_size, weight)
        made[key] = None if needed is None else (views, offset_view if needed else None)
    return made[key]
