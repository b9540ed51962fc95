"""The decoder layers' arguments for the next positions of a decode, made once per window of positions.

Tide drives decoder layers one at a time, and each wants the arguments the backbone would pass it: masks per
layer type, rotary embeddings, positions, the cache. `calls.capture_layer_calls` gets them by running the
backbone's prelude, about a layer's worth of host work, which a decode step or a drafted token cannot afford.
`LayerArgs` captures them once for a window of the next `width` positions and hands every request (T tokens
at positions past..past+T-1) a slice of them: axes of the window's length cut to the request's rows, a mask's
key axis cut to the request's key length. A one-query mask row that sees every key becomes None, as most
backbones pass it; one whose check finds the mask passed anyway (Falcon's eager attention adds it unconditionally)
keeps it. The layer-0 input is the model's input embedding of the tokens, plus the positional
part the backbone adds to it (learned positions), read from a capture on zero embeddings.

Every shortcut is checked against the backbone, never assumed: the embedding form once per model, and the first
slice of each request length (per cache type) against a fresh capture; what the checks found is kept per model.
Where something does not hold (sliding-window layers at positions that reach their window, a backbone that
transforms its embeddings, an argument whose axes cannot be told apart, a slice that differs), requests get a
fresh capture each, as before. Nothing here decides anything. Which axes are positions, the cut and the checks of
a slice: `argplans.py`.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field

import torch

from ..models.architectures import ModelParts
from ..models.compat import LengthView, has_sliding_layers, is_static_layer, sliding_window_of
from .argplans import (AMBIGUOUS, Cut, apply_plan, call_arguments, mask_arguments, passes_full_masks, same_call,
                       slicing_plan, visible_counts)
from .calls import LayerCall, capture_layer_calls
from .calltransforms import additive_masks, map_calls

__all__ = ["LayerArgs", "grown_mask", "new_positions"]

_KNOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backbone -> what its checks found

DEFAULT_WIDTH = 31  # odd, so that it is unlikely to match a batch, head or hidden size (checked anyway)


@dataclass
class _Window:
    cache: object  # a weak reference to the cache the window was captured on (ids are reused once it is freed)
    start: int
    width: int
    batch: int
    masked: bool  # an attention mask was given
    calls: list[LayerCall]
    plans: dict  # id(call) -> the slicing plan of its (args, kwargs)
    key_length: int  # the cache's key length for the whole window (kv length of its masks)
    positional: torch.Tensor | None  # [B, W, H] what the backbone adds to the embeddings (None: nothing)
    visible: dict = field(default_factory=dict)  # id(mask) -> (fewest, most) keys each query row sees


class LayerArgs:
    """Layer calls for the requests of one decode (one `generate` call), one backbone capture per window."""

    def __init__(self, parts: ModelParts, width: int = DEFAULT_WIDTH):
        self.parts, self.width = parts, width
        self.window: _Window | None = None
        # what was checked against the backbone holds for the model, not one call: kept per backbone
        known = _KNOWN.setdefault(parts.backbone, {"checked": set(), "form": None, "keeps_full_masks": False})
        self._known = known
        self.checked: set = known["checked"]  # (cache type, masked, request length) whose slice matched a capture
        self.off_reason: str | None = None  # why requests get fresh captures (None: windows serve them, or nothing
        #   was asked yet); with `captures`, what the call's stats report (`GenerationStats.arg_windows_off`)
        self.captures = 0  # backbone captures run so far (windows, checks and fresh requests)

    # ------------------------------------------------------------------ the request
    @torch.no_grad()
    def calls(self, input_ids: torch.Tensor, cache, attention_mask=None, position_ids=None,
              past: int | None = None) -> tuple[torch.Tensor, list[LayerCall]]:
        """(layer-0 input [B, T, H], every layer's call) for `input_ids` [B, T] at positions past..past+T-1.

        `past` defaults to the cache's length; a chunk behind shallower layers names its own. `attention_mask`
        [B, past + T] and `position_ids` [B, T] are what the backbone would be given; 4-D masks come additive
        where attention is SDPA (`calls.additive_masks`)."""
        past = _length(cache) if past is None else int(past)
        batch, length = input_ids.shape
        if self.off_reason is None and not self._fits(cache, past, length, batch, attention_mask):
            if past == 0:  # from position 0, SDPA's masks may be None (its is_causal shortcut), which holds for a
                return self._fresh(input_ids, cache, attention_mask, position_ids, past)  # chunk at 0 only: no window
            self._open(input_ids, cache, attention_mask, position_ids, past, length)
        if self.off_reason is not None:
            return self._fresh(input_ids, cache, attention_mask, position_ids, past)
        hidden, calls = self._slice(input_ids, cache, past, length)
        if calls is None:
            return self._fresh(input_ids, cache, attention_mask, position_ids, past)
        key = (type(cache).__name__, attention_mask is not None, length)
        if key not in self.checked:
            fresh_hidden, fresh = self._fresh(input_ids, cache, attention_mask, position_ids, past,
                                              every_layer_at_past=True)
            if not self._known["keeps_full_masks"] and passes_full_masks(calls, fresh):
                self._known["keeps_full_masks"] = True  # the backbone passes a mask where the slice had None
                hidden, calls = self._slice(input_ids, cache, past, length)
            if not (torch.equal(hidden, fresh_hidden) and all(map(same_call, calls, fresh))):
                self.off_reason = (f"a slice of the window's layer arguments differed from the backbone's "
                                   f"({length} tokens)")
                return fresh_hidden, fresh
            self.checked.add(key)
        return hidden, calls

    def _fresh(self, input_ids, cache, attention_mask, position_ids, past, every_layer_at_past=False):
        """The backbone's own (layer-0 input, calls). `every_layer_at_past`: as if every layer held `past` positions,
        as a window's slice assumes (where deeper layers are behind, a request at `past` does not run them, and
        their masks' key lengths would differ)."""
        as_is = past == _length(cache) and not (every_layer_at_past and _behind(cache, past))
        view = cache if as_is else LengthView(cache, past)
        calls = self._captured(view, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return calls[0].hidden, calls

    def _captured(self, view, **inputs) -> list[LayerCall]:
        """Every layer's call in one backbone pass over `inputs` (those not None) on the cache `view`."""
        self.captures += 1
        return additive_masks(self.parts, capture_layer_calls(
            self.parts, past_key_values=view, use_cache=True, **{k: v for k, v in inputs.items() if v is not None}))

    def positional(self, past: int, length: int) -> torch.Tensor | None:
        """What the backbone adds to the input embeddings of positions past..past+length-1 ([B, length, H]), read from
        the window a `calls` request for them opened; None where it adds nothing or no window holds them."""
        w = self.window
        if w is None or w.positional is None or not (w.start <= past and past + length <= w.start + w.width):
            return None
        return w.positional[:, past - w.start:past - w.start + length]

    @property
    def embedding_form(self) -> str | None:
        """"exact", "positional" or "other" once read (per backbone)."""
        return self._known["form"]

    # ------------------------------------------------------------------ windows
    def _fits(self, cache, past, length, batch, attention_mask) -> bool:
        w = self.window
        return (w is not None and w.cache() is cache and w.batch == batch and w.masked == (attention_mask is not None)
                and w.start <= past and past + length <= w.start + w.width)

    def _open(self, input_ids, cache, attention_mask, position_ids, past, length) -> None:
        """Capture the layer arguments for positions past..past+W-1 (W: the width, or the request's length)."""
        self.window = None
        width = max(self.width, length | 1)
        limit = _sliding_limit(cache)
        if limit is not None:  # a window ends below the sliding window (its axes are read from W + 1 positions)
            width = min(width, (limit - past - 1) - (limit - past) % 2)  # (odd, as above)
            if width < length:
                self.off_reason = (f"sliding-window cache layers, at positions that reach their window ({limit}): "
                                   "there their masks are relative to the kept keys")
                return
        if self.embedding_form is None:
            self._known["form"] = self._read_embedding_form(input_ids, cache, attention_mask, position_ids, past)
        if self.embedding_form == "other":
            self.off_reason = "the backbone transforms its input embeddings"
            return
        batch = input_ids.shape[0]
        view = LengthView(cache, past)
        # Two captures, W and W + 1 positions wide: the axes that grow by one are the positions' (a query axis of
        # the window's width, or a mask's key axis), whatever sizes other axes happen to have
        calls, wider = (self._capture(input_ids, view, attention_mask, position_ids, past, w)
                        for w in (width, width + 1))
        key_length = view.get_mask_sizes(width, 0)[0]
        plans = {}
        for call, other in {id(c): (c, o) for c, o in zip(calls, wider)}.values():
            plan = slicing_plan(call_arguments(call), call_arguments(other), width)
            if plan is AMBIGUOUS:
                self.off_reason = "a layer argument's position axes cannot be told apart"
                return
            plans[id(call)] = plan
        hidden = calls[0].hidden
        positional = None if self.embedding_form == "exact" else hidden
        self.window = _Window(_reference(cache), past, width, batch, attention_mask is not None, calls, plans,
                              key_length, positional)
        for call in calls:
            for mask, plan in mask_arguments(call, plans[id(call)]):
                if id(mask) not in self.window.visible:
                    self.window.visible[id(mask)] = visible_counts(mask, plan)

    def _capture(self, input_ids, view, attention_mask, position_ids, past, width) -> list[LayerCall]:
        """The layer calls for `width` positions from `past`, on zero embeddings."""
        positions = (None if position_ids is None
                     else position_ids[:, :1] + torch.arange(width, device=position_ids.device))
        weight = self.parts.backbone.get_input_embeddings().weight
        embeds = torch.zeros(input_ids.shape[0], width, weight.shape[1], dtype=weight.dtype, device=input_ids.device)
        return self._captured(view, inputs_embeds=embeds, position_ids=positions,
                              attention_mask=None if attention_mask is None
                              else grown_mask(attention_mask, past + width))

    def _read_embedding_form(self, input_ids, cache, attention_mask, position_ids, past) -> str:
        """"exact": the layer-0 input is the input embedding; "positional": the embedding plus a part the backbone
        adds per position (read from a capture on zero embeddings); "other": neither reproduces the backbone."""
        backbone = self.parts.backbone
        try:
            embedding = backbone.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            return "other"
        if embedding is None or "inputs_embeds" not in inspect.signature(backbone.forward).parameters:
            return "other"
        hidden, _ = self._fresh(input_ids, cache, attention_mask, position_ids, past)
        embedded = embedding(input_ids.to(embedding.weight.device))
        if embedded.shape != hidden.shape or embedded.dtype != hidden.dtype:  # e.g. OPT's project_in
            return "other"
        if torch.equal(embedded, hidden):
            return "exact"
        inputs = {"attention_mask": attention_mask, "position_ids": position_ids}
        self.captures += 1
        zero = capture_layer_calls(self.parts, inputs_embeds=torch.zeros_like(embedded), use_cache=True,
                                   past_key_values=LengthView(cache, past),
                                   **{k: v for k, v in inputs.items() if v is not None})[0].hidden
        return "positional" if torch.equal(embedded + zero, hidden) else "other"

    # ------------------------------------------------------------------ slicing
    def _slice(self, input_ids, cache, past, length):
        w = self.window
        first = past - w.start
        key_length = LengthView(cache, past).get_mask_sizes(length, 0)[0]  # a static cache's stays the whole cache
        embedding = self.parts.backbone.get_input_embeddings()
        hidden = embedding(input_ids.to(embedding.weight.device))
        if w.positional is not None:
            hidden = hidden + w.positional[:, first:first + length]

        def one(call: LayerCall) -> LayerCall:
            args, kwargs = apply_plan(call_arguments(call),
                                  w.plans[id(call)],
                                  Cut(first, length, None if key_length == w.key_length else key_length, cache,
                                       w.visible,
                                       not getattr(cache, "is_compileable", False)
                                       and not self._known["keeps_full_masks"]))
            if call.args:
                return LayerCall((hidden, *args), kwargs)
            return LayerCall((), {**kwargs, "hidden_states": hidden})

        return hidden, map_calls(w.calls, one)


def _reference(cache):
    try:
        return weakref.ref(cache)
    except TypeError:  # an object without weak references: held until the next window
        return lambda: cache


def _length(cache) -> int:
    return int(cache.get_seq_length())


def _behind(cache, past: int) -> bool:
    """Some dynamic layer of `cache` holds fewer than `past` positions (deep layers behind a lossless draft)."""
    return any(layer.get_seq_length() < past for layer in getattr(cache, "layers", ()) if not is_static_layer(layer))


def _sliding_limit(cache) -> int | None:
    """The smallest sliding window among `cache`'s layers (None: none slides). Below it a sliding layer's keys and
    mask are a full-attention layer's (every earlier position is kept and seen), so a window's slices hold there.
    Sliding layers that are not dynamic (a static cache's) count as reached at once."""
    if not has_sliding_layers(cache):
        return None
    windows = []
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            if type(layer).__name__ != "DynamicSlidingWindowLayer" or sliding_window_of(cache, i) is None:
                return 0
            windows.append(sliding_window_of(cache, i))
    return min(windows)


def grown_mask(mask, length: int):
    """The attention mask for the first `length` positions: cut, or extended with ones for new tokens."""
    if mask is None:
        return None
    if mask.shape[1] >= length:
        return mask[:, :length]
    return torch.cat([mask, mask.new_ones(mask.shape[0], length - mask.shape[1])], dim=1)


def new_positions(mask, past: int, length: int, device=None) -> dict:
    """attention_mask / position_ids for `length` new positions after `past` cached ones (batch 1), on the mask's
    device, or on `device` where there is no mask."""
    if mask is None:
        return {"position_ids": torch.arange(past, past + length, device=device).unsqueeze(0)}
    mask = grown_mask(mask, past + length)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]
    return {"attention_mask": mask, "position_ids": positions}
