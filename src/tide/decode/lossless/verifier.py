"""Lossless verification: the full model's passes of a call, and the drafted state that waits for them.

Drafted tokens run through the shallow layers 0..E (E = the draft layer) as they are drafted (`shallow.py`);
their layer-E states wait here (`Verifier.keep`) until verification runs the deep layers E+1..L-1 over all of them
at once, which makes the cache even again and gives the full model's logits and final normed states for each
position (a `drafts.Verified`, one per verification). A chain's last drafted token runs the shallow layers at
verification (its draft needs no head after it), unless it already ran (an n-gram chunk). A tree's nodes run all
the layers in its verification pass (`verify_tree`; `tree.py` tells how), and the cache then keeps the K/V of
the path its walk kept (`keep_path`). The state at the accepted position is the next draft's context
(`accepted`); the first context comes from the prefill, the prompt's pass through the base model's own forward.

Compiled passes see one width: a pass narrower than the widest a draft makes is padded to it on a static cache
(positions past a layer's length are free to overwrite), and the padding's K/V are dropped after it; where the
cache has no room left for the widest, the pass runs eagerly.
"""

from __future__ import annotations

import inspect

import torch

from ...layers.args import new_positions
from ...layers.calls import capture_layer_calls, capture_outputs
from ...layers.calltransforms import additive_mask, additive_masks, tree_mask_calls, without_first_position
from ...layers.fewrows import few_row_linears
from ...models.compat import (
    LengthView,
    crop_cache,
    crop_layer,
    grouped_query_attention_in_place,
    is_static_layer,
    keep_path,
    layer_length,
    unrecoverable_sliding_layers,
)
from .drafts import Verified

__all__ = ["LosslessUnavailable", "Verifier", "check_rollback", "room_for"]


class LosslessUnavailable(ValueError):
    """Lossless mode cannot run this call or model (the message says what to do instead)."""


def check_rollback(cache) -> None:
    """Sliding-window layers must keep evicted positions until a draft is accepted or cropped: the decode loop
    turns that on (`activate_past_recording`); a cache where it is off cannot be used."""
    layers = unrecoverable_sliding_layers(cache)
    if layers:
        raise LosslessUnavailable(
            f"mode='lossless' needs sliding-window cache layers that can roll back rejected drafts, and layers "
            f"{layers} of this cache drop evicted positions at once. Pass a DynamicCache (or none) and let "
            "generate create it, or use mode='exit'."
        )


def room_for(cache, positions: int) -> bool:
    """Whether every layer of a static cache has `positions` free slots past its length (a tree writes x and all
    its nodes before it keeps a path); always on a dynamic cache."""
    return all(not is_static_layer(layer) or layer.max_cache_len - int(layer.get_seq_length()) >= positions
               for layer in cache.layers)


class Verifier:
    """One lossless call's verification (`session`: a `session.LosslessSession`; `shallow`: its
    `shallow.ShallowPasses`): the pending tokens (run through layers 0..E only) and their layer-E states, the
    latest verification until the loop says what it accepted, the next draft's context."""

    def __init__(self, session, cache, shallow):
        self.session, self.cache, self.shallow = session, cache, shallow
        self.layer_calls = 0  # decoder-layer calls its verification passes ran (the loop counts them into the stats)
        self.prefilled = 0  # prompt tokens its prefill ran (likewise)
        self.ids = None  # [1, P] the pending tokens: through the shallow layers only
        self.states = None  # [1, P, H] their layer-E outputs
        self.complete = False  # the pending tokens include the last drafted one (n-gram drafts)
        self.last: Verified | None = None  # the latest verification, until `accepted`
        self.context = None  # [1, H] the full model's final normed state before the next drafted token
        self.trees_through_backbone = None  # known at the first tree (`_through_backbone`)

    @property
    def pending(self) -> int:
        return 0 if self.ids is None else self.ids.shape[1]

    def keep(self, tokens: torch.Tensor, states: torch.Tensor, complete: bool = False) -> None:
        """Tokens [1, T] that ran through layers 0..E, with their layer-E states [1, T, H], wait for verification;
        `complete`: they end with the last drafted token (nothing runs the shallow layers at verification)."""
        if self.ids is None:
            self.ids, self.states = tokens, states
        else:
            self.ids = torch.cat([self.ids, tokens], 1)
            self.states = torch.cat([self.states, states], 1)
        self.complete = complete

    def drop(self, count: int) -> None:
        """Forget the last `count` pending tokens: their states, and their K/V in layers 0..E."""
        for layer in range(self.session.draft_layer + 1):
            crop_layer(self.cache, layer, -count)
        self.ids, self.states = self.ids[:, :-count], self.states[:, :-count]

    def accepted(self, accepted: int) -> None:
        """After the loop accepted `accepted` drafts: the next draft's context is the state at that position."""
        if self.last is not None:
            self.context = self.last.states[:, int(accepted)]
            self.last = None

    def prefill(self, input_ids: torch.Tensor) -> None:
        """Make the cache hold the exact K/V of everything but the last token (the first call only), and take the
        full model's state at the last of them as the context."""
        session, cache = self.session, self.cache
        have = layer_length(cache, 0)
        if have == 0:
            check_rollback(cache)
        if have >= input_ids.shape[1] - 1:
            return
        parts = session.parts
        mask = session.grown_mask(input_ids.shape[1] - 1)
        # positions as generate gives them (from the mask: a left-padded prompt's start at 0), not the cache's
        positions = {}
        if mask is not None and "position_ids" in inspect.signature(type(session.base).forward).parameters:
            positions["position_ids"] = new_positions(mask, have, input_ids.shape[1] - 1 - have)["position_ids"]
        with torch.no_grad(), capture_outputs(parts, [parts.num_layers - 1]) as last:
            session.original_forward(input_ids=input_ids[:, have:-1], past_key_values=cache, attention_mask=mask,
                                     use_cache=True, **positions)
            self.context = parts.final_norm(last[parts.num_layers - 1][:, -1])
        check_rollback(cache)
        self.prefilled += input_ids.shape[1] - 1 - have

    # ------------------------------------------------------------------ chains
    @torch.no_grad()
    def verify(self, input_ids: torch.Tensor) -> Verified:
        """The full model at the drafted positions and the last token of `input_ids` (the sequence with the drafts
        appended): the pending tokens, the last drafted one run through layers 0..E where it has not, then layers
        E+1..L-1 over them all."""
        session, cache, pending = self.session, self.cache, self.pending
        if input_ids.shape[1] < pending + 1:
            raise RuntimeError("Tide lossless mode: unexpected verification call.")
        drafted = input_ids[:, input_ids.shape[1] - pending:] if self.complete else input_ids[:, -pending - 1: -1]
        if pending and not torch.equal(drafted.to(self.ids.device), self.ids):
            raise RuntimeError("Tide lossless mode: the verified tokens are not the drafted ones.")
        mask = session.grown_mask(input_ids.shape[1])
        if not self.complete:  # the last drafted token has not run through the shallow layers yet
            self.keep(input_ids[:, -1:], self.shallow.run(input_ids[:, -1:], mask))
        self.complete = False
        ids, states = self.ids, self.states  # [1, P + 1], [1, P + 1, H]
        positions = ids.shape[1]
        deep_length = layer_length(cache, session.parts.num_layers - 1)  # deep layers: every position before these
        pad = self._padding(positions, session.options.max_draft + 1, lambda widest: min(
            getattr(layer, "max_cache_len", 0) for layer in cache.layers) - deep_length >= widest)
        eager, pad = pad is None, pad or 0  # (None: no room left to pad; the last few verifications run eagerly)
        if pad:
            ids = torch.cat([ids, ids.new_zeros(1, pad)], 1)
            states = torch.cat([states, states.new_zeros(1, pad, states.shape[-1])], 1)
        inputs = new_positions(mask, deep_length, ids.shape[1], ids.device)
        _, calls = session.layer_args.calls(ids, cache, inputs.get("attention_mask"), inputs["position_ids"],
                                            past=deep_length)
        deep = range(session.draft_layer + 1, session.parts.num_layers)
        layout = session.options.few_row_layout  # (the CPU linears' layout for P + 1 rows)
        with few_row_linears(session.parts, layout), grouped_query_attention_in_place():
            states = session.spans.run(deep.start, deep.stop, states, calls, eager=eager)
            states = self._unpadded(states, positions, pad, deep)
            normed = session.parts.final_norm(states)
            return self._verified(normed, session.parts.logits_from_normed(normed), len(deep))

    # ------------------------------------------------------------------ trees
    def verify_tree(self, tree, length: int) -> Verified | None:
        """The full model at the pending token x and at each node of `tree` (a `drafts.DraftTree` under x, the
        last of a sequence of `length` tokens); None if no tree mask reached the layers (nothing has changed)."""
        session, parts, cache, n = self.session, self.session.parts, self.cache, len(tree)
        mask = session.grown_mask(length)
        widest = 1 + session.draft_topk + session.options.max_draft  # x, k candidates and the longest continuation
        pad = self._padding(n, widest, lambda widest: room_for(cache, widest)) if tree.has_ngram else 0
        if self.trees_through_backbone is None:  # (known at the first tree: the call's cache and compile options stay)
            self.trees_through_backbone = self._through_backbone()
        if pad is not None and self.trees_through_backbone:
            return self._tree_through_backbone(tree, mask, pad)
        # compiled graphs serve the head's k-wide trees and, padded to one width, trees with n-gram branches; where
        # a static cache has no room left for that width, an n-gram tree runs eagerly
        eager, pad = pad is None, pad or 0
        q = n + pad  # the chunk's width: the tree, and padding after it to the compiled width of n-gram trees
        have = layer_length(cache, 0)  # shallow layers hold x; deep layers do not yet
        ids, inputs, blocked = self._chunk(tree, pad, mask, have - 1)
        deep = capture_layer_calls(parts, input_ids=ids, past_key_values=LengthView(cache, have - 1), use_cache=True,
                                   **inputs)
        deep = tree_mask_calls(deep, blocked, start=have - 1)
        if deep is None:
            return None
        deep = additive_masks(parts, deep)
        # The nodes' chunk for the shallow layers is the same chunk without x: same keys (x is cached there),
        # same positions. Sliced from the deep calls where every per-position argument is recognised, else captured.
        shallow = without_first_position(deep[: session.draft_layer + 1], q)
        if shallow is None:
            inputs["position_ids"] = inputs["position_ids"][:, 1:]
            shallow = tree_mask_calls(capture_layer_calls(parts, input_ids=ids[:, 1:], use_cache=True, **inputs,
                                                          past_key_values=LengthView(cache, have)), blocked[1:, 1:],
                                      start=have)
            shallow = additive_masks(parts, shallow)
        layout = session.options.few_row_layout  # (the CPU linears' layout for N - 1 and N rows)
        with few_row_linears(parts, layout), grouped_query_attention_in_place():
            states = session.spans.run(0, session.draft_layer + 1, shallow[0].hidden, shallow, eager=eager)
            states = session.spans.run(session.draft_layer + 1, parts.num_layers, torch.cat([self.states, states], 1),
                                       deep, eager=eager)
            states = self._unpadded(states, n, pad)
            normed = parts.final_norm(states)
            return self._verified(normed, parts.logits_from_normed(normed), parts.num_layers)

    def keep_path(self, path: list[int]) -> Verified:
        """After a tree's verification, the path its walk kept (node indices, x first): the cache keeps the path's
        K/V, moved right after x in order, and drops the other nodes'. -> the verification along the path."""
        nodes = self.last.logits.shape[1] - 1
        keep_path(self.cache, self.session.parts.num_layers, nodes, [node - 1 for node in path[1:]])
        self.last = Verified(self.last.logits[:, path], self.last.states[:, path])
        return self.last

    def _chunk(self, tree, pad: int, mask, past: int):
        """The verification chunk [x, nodes, padding] after `past` cached positions: its ids [1, Q]; the backbone's
        inputs for it (the mask grown over it, positions x's + each node's depth, the padding's depth 1); and the
        tree's blocked entries [Q, Q] (the padding sees what causal attention lets it see, and no node sees it)."""
        x_ids = self.ids  # [1, 1]
        nodes = torch.tensor([tree.tokens[1:] + [0] * pad], dtype=x_ids.dtype, device=x_ids.device)
        inputs = new_positions(mask, past, len(tree) + pad, x_ids.device)
        depths = torch.tensor([tree.depths + [1] * pad], device=inputs["position_ids"].device)
        inputs["position_ids"] = inputs["position_ids"][:, :1] + depths
        blocked = tree.blocked()
        if pad:
            blocked = torch.nn.functional.pad(blocked, (0, pad, 0, pad), value=False)
        return torch.cat([x_ids, nodes], 1), inputs, blocked

    def _through_backbone(self) -> bool:
        """Whether a compiled call verifies its trees in one pass of the backbone's own compiled forward, with the
        tree as a custom 4-D mask (which transformers passes to every layer as given): every layer takes the same
        arguments (one mask serves all), attention adds the mask (SDPA, eager), the backbone's output is its final
        norm's (no projection after it, e.g. OPT's project_out), and the cache is a full-attention static one (one
        shape, one graph)."""
        session, parts = self.session, self.session.parts
        return (session.spans.compiled and parts.uniform_layers and parts.post_norm is None
                and parts.spec.norm.startswith(parts.spec.backbone + ".")
                and getattr(parts.backbone.config, "_attn_implementation", None) in ("sdpa", "eager")
                and all(is_static_layer(layer) for layer in self.cache.layers))

    def _tree_through_backbone(self, tree, mask, pad: int) -> Verified:
        """`verify_tree` as one compiled pass of the backbone over the chunk [x, nodes, padding] (positions x's + the
        nodes' depths, the tree mask), from x's position in every layer: the draft layers drop x first, and the
        pass writes it again with the rest. The backbone's output is the full model's final normed state."""
        session, cache, n = self.session, self.cache, len(tree)
        q = n + pad
        for layer in range(session.draft_layer + 1):
            crop_layer(cache, layer, -1)
        past = layer_length(cache, 0)  # every layer holds the context before x
        ids, inputs, blocked = self._chunk(tree, pad, mask, past)
        keys = cache.layers[0].get_mask_sizes(q)[0]  # a static layer's masks span the whole cache
        sees = torch.zeros(1, 1, q, keys, dtype=torch.bool, device=ids.device)
        context = inputs.get("attention_mask")
        sees[..., :past] = True if context is None else context[:, None, None, :past].bool()
        tree_part = torch.ones(q, q, dtype=torch.bool).tril().logical_and_(blocked.logical_not())  # ancestors, itself
        sees[0, 0, :, past:past + q] = tree_part.to(sees.device)
        states = session.spans.backbone(input_ids=ids, position_ids=inputs["position_ids"],
                                        attention_mask=additive_mask(sees, self.states.dtype),
                                        past_key_values=cache, use_cache=True)
        states = self._unpadded(states, n, pad)
        return self._verified(states, session.parts.logits_from_normed(states), session.parts.num_layers)

    # ------------------------------------------------------------------ both
    def _padding(self, width: int, widest: int, room) -> int | None:
        """Positions to add to a pass of `width` positions so that compiled passes see one width, `widest`; 0 where
        nothing is compiled; None where `room(widest)` says the cache has no room left for it."""
        if not self.session.spans.compiled:
            return 0
        return widest - width if room(widest) else None

    def _unpadded(self, states: torch.Tensor, width: int, pad: int, layers: range | None = None) -> torch.Tensor:
        """A pass's states without its padding; the padding's K/V, in the `layers` the pass ran (None: all), lie
        past the layers' length afterwards, where the next pass overwrites them."""
        if not pad:
            return states
        if layers is None:
            crop_cache(self.cache, pad)
        else:
            for i in layers:
                crop_layer(self.cache, i, -pad)
        return states[:, :width]

    def _verified(self, normed: torch.Tensor, logits: torch.Tensor, layers: int) -> Verified:
        """After a verification pass that ran `layers` layer calls: its record, kept until the loop says what it
        accepted; nothing is pending any more."""
        self.last = Verified(logits, normed)
        self.ids = self.states = None
        self.layer_calls += layers
        return self.last
