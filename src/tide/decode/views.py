"""Views of a backbone over some of its layers, for loops that run a step as one compiled graph (`fused.py`,
`fusedtree.py`, `fusedexit.py`): the backbone's own forward on a shallow copy holding only those layers, so
positions, rotary tables and masks are made inside the graph as the model makes them; what the backbone adds to
input embeddings it is given (learned positions), measured once, so a view that starts past layer 0 can take it off;
and what such loops need of the model, the cache and the prompt."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..models.compat import is_static_layer

__all__ = ["backbone_view", "input_offset", "one_graph_fits", "views_of"]


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
