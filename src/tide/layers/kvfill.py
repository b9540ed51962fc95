"""K/V for the layers a token skips, all of them in one batched computation.

With `propagate`, every layer after a token's exit sees the same exit state, so their K/V can be computed
together: normalise the state once (RMS or LayerNorm, without affine), one matmul against a stack of every
layer's K/V weights with that layer's input-norm affine folded in (RMS: W * g, Gemma's 1 + g; LayerNorm:
W * g and bias W @ beta + b), the k-norm where the layers have one (per head, or over all heads before the head
split as in OLMo 2; batched over layers), rotary on all layers' keys at once, then each layer's own
`cache.update(k, v, layer)`, so sliding-window cache layers keep their own behaviour.

What is stacked comes from the probe (`kvprobe.kv_plan`), not from names: per layer, which linear outputs
reach the written keys and which the written values (separate k_proj/v_proj, or only the K/V rows of a fused
qkv projection such as GPT-2's `c_attn`, GPT-NeoX's and Falcon's `query_key_value`, Phi-3's `qkv_proj`, in
the written head order; heads repeated as Falcon's new decoder architecture broadcasts them), the module whose
output those linears read (the input norm, or the layer's input itself), and the written heads and head
size. The k-norm is the attention module's `k_norm`/`k_layernorm` (or the table's `KVProjections.k_norm`).
Norms and rotary are recognised by what they compute (`kvforms`): the rotary from the calls'
`position_embeddings` (or the attention's table of sin and cos per position, at the calls' `position_ids`:
GPT-J), none with alibi or learned positions; its convention (pairs (i, i + d/2) or adjacent pairs, partial,
either sign), the k-norm's place before or after it, and which layers rotate at all (SmolLM3's NoPE layers,
Cohere 2's and EXAONE 4's full layers) are those under which the stack reproduces every layer's sample.

Which layers take this path: every model whose `ArchSpec.kv_projections` is not None (the default, for the
table's families and the types `probe_spec` describes), when every layer's K/V linears are `nn.Linear`-like
or `Conv1D` and read one module's output, the layers' input norms (and k-norms) are of one kind with one eps,
all their parameters are on one device, and the stack reproduces what each layer's own code wrote in the probe
(`LayerPlan.sample`); otherwise the model fills layer by layer, and `fill_path(parts)` says why. A fill is
batched per group of one attention type (`parts.layer_types`; sliding and full layers apart, each stacked
contiguously) whose calls share one rotary or carry none. Everything else is filled by `kvprobe.write_kv` per
layer, which runs each layer's own code up to its cache write, computing only the linear outputs that reach the
K/V (the query projection is called but returns zeros: its norm and rotary run on them). `fill_kv(...,
layerwise=True)` forces that path (a generate call's `kv_fill="layerwise"`).

A batched fill calls no module of the skipped layers: only the stacked weights, the calls' rotary and
`cache.update`. Building the stack (once per model, device and dtype) calls each input norm and k-norm once on a
random input, to recognise it, and retakes a layer's sample only if its parameters changed since the probe.

Memory: the stack is a copy of every layer's K/V weights (and biases), i.e. the size of all k/v projections,
e.g. 2 * L * H * H_kv * D elements. It is folded in fp32, stored in the states' dtype on their device, built
lazily once per (layers, device, dtype), freed with the model (weak keys) and rebuilt when a folded parameter
is modified in place (its version counter). After replacing parameters in another way (e.g. a dtype round
trip), call `clear_stacks()`.

This module decides nothing about exits and never runs attention or MLPs; it only writes the cache.
"""

from __future__ import annotations

import weakref
from itertools import product

import torch
import torch.nn.functional as F

from .calls import LayerCall
from .kvforms import ROTARY_FORMS, LayerKV, Rotary, Unfit, table_rotary
from .kvprobe import kv_plan, write_kv

__all__ = ["fill_kv", "fused_available", "fill_path", "clear_stacks", "stack_for"]

# layers ModuleList -> {(device, dtype): _Stack, or why its layers cannot be stacked (str)}
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_DIFFER = object()  # a group's calls pass different rotary (each layer has its own), or one Tide cannot apply


@torch.no_grad()
def fill_kv(parts, calls: list[LayerCall], layers: list[int], hidden: torch.Tensor, cache,
            layerwise: bool = False) -> None:
    """Write K/V computed from `hidden` [B, T, H] into the cache of each layer in `layers` (ascending).

    `calls[i]` is layer i's `LayerCall`; `layerwise=True` forces the per-layer path.
    """
    if not layers:
        return
    stack = None if layerwise else _stack(parts, hidden.device, hidden.dtype)
    for group in _by_attention_type(parts, layers):
        rotary = _DIFFER if stack is None else stack.rotary(calls, group)
        if rotary is _DIFFER:
            for i in group:
                write_kv(calls[i], parts, i, hidden, cache)
            continue
        keys, values = stack.kv(group, hidden, rotary)  # [m, B, H_kv, T, D] each
        for i, k, v in zip(group, keys.unbind(0), values.unbind(0)):
            cache.update(k, v, i)


@torch.no_grad()
def fused_available(parts, calls: list[LayerCall], layers: list[int], hidden: torch.Tensor) -> bool:
    """True when every layer in `layers` would be filled by the batched path for states like `hidden`."""
    stack = _stack(parts, hidden.device, hidden.dtype)
    return stack is not None and all(stack.rotary(calls, group) is not _DIFFER
                                     for group in _by_attention_type(parts, layers))


def stack_for(parts, hidden: torch.Tensor) -> _Stack | None:
    """The stacked K/V projections for states like `hidden` (None where the layers fill one by one): what a compiled
    graph calls `kv(layers, hidden, rotary)` and `rotary(calls, layers)` on (`decode/exits/walkgraph.py`)."""
    return _stack(parts, hidden.device, hidden.dtype)


@torch.no_grad()
def fill_path(parts, device: torch.device | None = None, dtype: torch.dtype | None = None) -> str:
    """How skipped layers' K/V are filled for states on `device` in `dtype` (default: the layers' own): "batched
    (...)" with the rotary convention found, or "layer by layer: <why the stack does not reproduce the layers>"."""
    param = next(parts.layers.parameters())
    built = _built(parts, device or param.device, dtype or param.dtype)
    return built.describe() if isinstance(built, _Stack) else f"layer by layer: {built}"


def clear_stacks() -> None:
    """Forget every stacked weight (they are rebuilt on the next fill)."""
    _STACKS.clear()


def _by_attention_type(parts, layers: list[int]) -> list[list[int]]:
    """`layers` split by attention type, each group ascending."""
    types = parts.layer_types
    if not types or len({types[i] for i in layers}) == 1:
        return [layers]
    groups: dict[str, list[int]] = {}
    for i in layers:
        groups.setdefault(types[i], []).append(i)
    return list(groups.values())


def _built(parts, device: torch.device, dtype: torch.dtype) -> _Stack | str:
    if parts.spec.kv_projections is None:
        return "the architecture table turns the batched fill off (kv_projections=None)"
    per_model = _STACKS.setdefault(parts.layers, {})
    key = (device, dtype)
    if key not in per_model or (isinstance(per_model[key], _Stack) and per_model[key].stale()):
        per_model[key] = _Stack.build(parts, device, dtype)
    return per_model[key]


def _stack(parts, device: torch.device, dtype: torch.dtype) -> _Stack | None:
    built = _built(parts, device, dtype)
    return built if isinstance(built, _Stack) else None


class _Stack:
    """Every layer's folded K/V weights, stacked; `kv` computes a group of layers' K/V from one state."""

    def __init__(self, layers: list[LayerKV], device: torch.device, dtype: torch.dtype, types: list | None):
        # stacked by attention type, then layer: the layers a token skips (the last ones of each type) are then a
        # contiguous range of the stack, read as a view
        order = sorted(range(len(layers)), key=lambda i: (types.index(types[i]) if types else 0, i))
        self.position = {layer: row for row, layer in enumerate(order)}
        layers = [layers[i] for i in order]
        first = layers[0]
        self.weight = torch.stack([s.weight for s in layers]).to(device=device, dtype=dtype)  # [L, 2n, H]
        self.bias = torch.stack([s.bias for s in layers]).to(device=device, dtype=dtype)  # [L, 2n]
        self.norm, self.head_dim, self.repeat = first.norm, first.head_dim, first.repeat
        self.k_norm, self.k_norm_all, self.k_scale, self.k_shift = first.k_norm, first.k_norm_all, None, None
        if self.k_norm is not None:  # per layer [L, D] (or [L, n] over all heads) fp32
            self.k_scale = _stacked([s.k_norm.scale for s in layers], device)
            self.k_shift = _stacked([s.k_norm.shift for s in layers], device)
        self.table = first.table if all(s.table is not None for s in layers) else None
        # how the keys are rotated (found by `choose`): the convention, the k-norm before or after it, [sin | cos] or
        # [cos | sin] in the table, and which layers (by row) rotate their keys at all
        self.form, self.k_after, self.sin_first = ROTARY_FORMS[0], False, True
        self.rotated = (True,) * len(layers)
        self._rotated_mask = torch.ones(len(layers), dtype=torch.bool, device=device)
        self._params = [p for s in layers for p in s.params]  # the folded parameters, to notice in-place changes
        self._versions = self._current_versions()

    def _current_versions(self) -> tuple:
        return tuple(p._version for p in self._params)

    def stale(self) -> bool:
        return self._versions != self._current_versions()

    def describe(self) -> str:
        if not any(self.rotated):
            return "batched (keys not rotated)"
        found = [self.form.name]
        if self.table is not None:
            found.append("sin and cos from the attention's position table")
        if self.k_norm is not None:
            found.append(f"k-norm over {'all heads' if self.k_norm_all else 'each head'}"
                         + (", after rotary" if self.k_after else ""))
        if not all(self.rotated):
            found.append(f"{self.rotated.count(False)} of {len(self.rotated)} layers without rotary")
        return f"batched (rotary on {'; '.join(found)})"

    def _source(self, call: LayerCall):
        """What a call rotates its keys with: its (cos, sin); its position ids, for a position table; None (alibi,
        learned positions)."""
        if call.kwargs.get("alibi") is not None:  # alibi biases the scores; Falcon passes rotary anyway
            return None
        rotary = call.kwargs.get("position_embeddings")
        if rotary is None and self.table is not None:
            ids = call.kwargs.get("position_ids")
            return _DIFFER if ids is None else ids
        return rotary

    def _rotary(self, source, sin_first: bool):
        if source is None or source is _DIFFER:
            return source
        if isinstance(source, torch.Tensor) and not (source.is_floating_point() or source.is_complex()):
            return table_rotary(self.table, source, sin_first)  # position ids, for the table
        return tuple(source) if isinstance(source, tuple) and len(source) == 2 else _DIFFER  # Llama 4: complex

    def rotary(self, calls: list[LayerCall], group: list[int]):
        """The (cos, sin) every call of `group` rotates its keys with; None: none; `_DIFFER`: they differ."""
        source = self._source(calls[group[0]])
        if any(self._source(calls[i]) is not source for i in group[1:]):
            return _DIFFER
        return self._rotary(source, self.sin_first)

    def kv(self, group: list[int], hidden: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [m, B, heads, T, D] in `hidden`'s dtype for the m layers of `group`, from `hidden`."""
        rows = [self.position[i] for i in group]
        index = _rows(rows)
        keys, values = self._project(index, hidden)
        keys = self._keys(index, keys, rotary, self.form, self.k_after, [self.rotated[r] for r in rows])
        if self.repeat > 1:  # Falcon's new decoder architecture broadcasts each K/V head to its query heads
            keys, values = keys.repeat_interleave(self.repeat, 2), values.repeat_interleave(self.repeat, 2)
        return keys.to(hidden.dtype), values.to(hidden.dtype)

    def _project(self, rows, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys and values [m, B, heads, T, D] fp32 from the stacked matmul, the keys k-normed only where the k-norm
        spans all heads."""
        weight, bias = self.weight[rows], self.bias[rows]  # [m, 2n, H], [m, 2n]
        (batch, length, _), m = hidden.shape, weight.shape[0]
        x = hidden.float() if self.norm is None else self.norm.normalise(hidden.float())
        out = F.linear(x.to(weight.dtype), weight.flatten(0, 1), bias.flatten()).float()  # [B, T, m * 2n]
        out = out.view(batch, length, m, 2, -1)
        keys, values = out[:, :, :, 0], out[:, :, :, 1]  # [B, T, m, n]
        if self.k_norm is not None and self.k_norm_all:
            keys = self._k_affine(self.k_norm.normalise(keys), rows, (-1, keys.shape[-1]))
        keys, values = (t.reshape(batch, length, m, -1, self.head_dim).permute(2, 0, 3, 1, 4) for t in (keys, values))
        return keys, values

    def _keys(self, rows, keys: torch.Tensor, rotary, form: Rotary, k_after: bool, rotated: list) -> torch.Tensor:
        """`keys` [m, B, h, T, D] through the per-head k-norm and rotary (on the layers `rotated` marks)."""
        per_head = self.k_norm is not None and not self.k_norm_all
        if per_head and not k_after:
            keys = self._k_affine(self.k_norm.normalise(keys), rows, (-1, 1, 1, 1, self.head_dim))
        if rotary is not None and any(rotated):
            turned = form(keys, *rotary)
            mask = self._rotated_mask[rows].view(-1, 1, 1, 1, 1) if len(rotated) > 1 else None
            keys = turned if all(rotated) else keys if mask is None else torch.where(mask, turned, keys)
        if per_head and k_after:
            keys = self._k_affine(self.k_norm.normalise(keys), rows, (-1, 1, 1, 1, self.head_dim))
        return keys

    def _k_affine(self, keys: torch.Tensor, rows, shape: tuple) -> torch.Tensor:
        if self.k_scale is not None:
            keys = keys * self.k_scale[rows].view(shape)
        return keys if self.k_shift is None else keys + self.k_shift[rows].view(shape)

    def choose(self, samples: list) -> str | None:
        """Find how the keys are rotated: the first of `ROTARY_FORMS` (with the per-head k-norm before or after it,
        the table's sin or cos first, rotary on or off per layer) under which every layer's batched K/V equal what
        its own code wrote in the probe (`kvprobe.KVSample`). None when found, else why not."""
        projected = []
        for i, sample in enumerate(samples):
            if sample is None:
                return f"layer {i}: the probe kept no sample of what it writes"
            row = self.position[i]
            hidden = sample.hidden.to(self.weight.device, self.weight.dtype)
            keys, values = self._project(slice(row, row + 1), hidden)
            if not self._close(values, sample.values):
                return f"layer {i}: the stacked values differ from what its own code writes"
            projected.append((i, row, keys, sample))
        k_orders = (False, True) if self.k_norm is not None and not self.k_norm_all else (False,)
        tables = (True, False) if self.table is not None else (True,)
        furthest, unrotated = 0, all(self._source(sample.call) is None for _, _, _, sample in projected)
        for form, k_after, sin_first in product(ROTARY_FORMS, k_orders, tables):
            rotated = {}
            for i, row, keys, sample in projected:
                rotary = self._rotary(self._source(sample.call), sin_first)  # recorded where the probe ran
                if rotary is _DIFFER:
                    return f"layer {i}: its calls' rotary is not a (cos, sin) pair (e.g. complex frequencies)"
                rotary = None if rotary is None else tuple(t.to(self.weight.device) for t in rotary)
                flag = next((f for f in ((True, False) if rotary is not None else (False,))
                             if self._reproduces(row, keys, rotary, form, k_after, f, sample.keys)), None)
                if flag is None:
                    furthest = max(furthest, i)
                    break
                rotated[row] = flag
            else:
                self.form, self.k_after, self.sin_first = form, k_after, sin_first
                self.rotated = tuple(rotated[r] for r in range(len(rotated)))
                self._rotated_mask = torch.tensor(self.rotated, device=self.weight.device)
                self.table = self.table if any(self.rotated) else None
                return None
        if unrotated:
            return (f"layer {furthest}: its calls carry no rotary (position_embeddings), and the stack does not "
                    "reproduce its keys: they are rotated or transformed inside the attention")
        return (f"layer {furthest}: no rotary convention Tide knows reproduces its keys (pairs (i, i + d/2) or "
                "adjacent pairs, either sign, cos/sin as given, halved or doubled; the k-norm before or after it; "
                "rotary on or off per layer)")

    def _reproduces(self, row: int, keys: torch.Tensor, rotary, form: Rotary, k_after: bool, rotated: bool,
                    own: torch.Tensor) -> bool:
        try:
            return self._close(self._keys(slice(row, row + 1), keys, rotary, form, k_after, [rotated]), own)
        except ValueError:  # a convention that does not fit these heads
            return False

    def _close(self, mine: torch.Tensor, own: torch.Tensor) -> bool:
        mine = mine.repeat_interleave(self.repeat, 2) if self.repeat > 1 else mine
        mine, own = mine[0].to(self.weight.dtype), own.to(mine.device)
        low = self.weight.dtype != torch.float32 or own.dtype != torch.float32
        tol = dict(atol=5e-2, rtol=5e-2) if low else dict(atol=1e-4, rtol=1e-3)
        return mine.shape == own.shape and torch.allclose(mine.float(), own.float(), **tol)

    @classmethod
    def build(cls, parts, device: torch.device, dtype: torch.dtype) -> _Stack | str:
        """Fold and stack every layer's K/V weights, or say why the layers do not fit the batched path."""
        plan = kv_plan(parts)
        if plan.reason is not None:
            return f"the probe's plan is not used ({plan.reason})"
        if len(plan.layers) != parts.num_layers:
            return "the probe did not plan every layer"
        try:
            layers = []
            for i, layer in enumerate(plan.layers):
                layers.append(LayerKV.of(parts, i, layer))
        except Unfit as why:
            return f"layer {i}: {why}"
        if not _alike(layers):
            return "the layers' K/V weights, input norms or k-norms differ in kind, or are on several devices"
        stack = cls(layers, device, dtype, parts.layer_types)
        why = stack.choose([layer.sample and layer.sample.current(parts, i) for i, layer in enumerate(plan.layers)])
        return stack if why is None else why


def _alike(layers: list[LayerKV]) -> bool:
    """One weight shape, one kind of input norm and of k-norm (with one eps), every parameter on one device."""
    def kind(norm):
        return None if norm is None else norm.kind_key()

    return (len({(s.weight.shape, s.head_dim, s.repeat, kind(s.norm), kind(s.k_norm), s.k_norm_all)
                 for s in layers}) == 1
            and len({p.device for s in layers for p in s.params}) == 1)


def _stacked(tensors: list, device) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.stack(tensors).to(device)


def _rows(rows: list[int]):
    """Index of `rows` into the stack: a slice (a view) when they are contiguous and ascending, else the list."""
    first, last = rows[0], rows[-1] + 1
    return slice(first, last) if last - first == len(rows) and rows == sorted(rows) else rows
