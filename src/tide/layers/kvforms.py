"""What a layer does between its input and its cache write, recognised by what it computes.

`kvfill` stacks every skipped layer's K/V weights (`LayerKV`: the rows the probe found, with the input norm's affine
folded in) and must then do to the keys what each layer's own code does: its input norm and k-norm (`Norm`: RMS or
LayerNorm, with the affine folded or applied per layer) and its rotary (`Rotary`). Both come in a few conventions;
which one a model uses is not read from its class or its name but from what it computes: a norm on one random input
(`Norm.of`), a rotary by trying the conventions in `ROTARY_FORMS` (most common first) against what each layer's own
code wrote in the probe (`kvfill._Stack.choose`). `LayerKV.of` raises `Unfit` with the reason a layer cannot be
stacked; `kvfill.fill_path` reports it.

Rotary conventions, on the first d dims of each head (d: the width of the calls' cos/sin; the rest pass through):
pairs (i, i + d/2) as in Llama, or adjacent pairs (2i, 2i + 1) as in GPT-J, Cohere and ERNIE 4.5; cos/sin used as
given, or their first half with each entry repeated for a pair (ERNIE 4.5, GLM), or of half the width, used for
both halves (GPT-OSS); sin's sign flipped (NanoChat).
Where the calls carry no `position_embeddings`, a table of sin and cos per position kept by the attention module
(GPT-J's `embed_positions`, [positions, d]) gives them, read at the calls' `position_ids` (`table_rotary`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Norm", "Rotary", "ROTARY_FORMS", "LayerKV", "Unfit", "position_table", "table_rotary"]

_K_NORM_NAMES = ("k_norm", "k_layernorm", "key_norm")


@dataclass(frozen=True)
class Norm:
    """What a norm computes: `kind` ("rms", "layer") without affine, then * scale (+ shift); fp32 [width]."""

    kind: str
    eps: float
    scale: torch.Tensor | None
    shift: torch.Tensor | None

    @classmethod
    def of(cls, module: nn.Module, width: int) -> Norm | None:
        """The norm `module` computes over its last `width` features, recognised on one random input; None when
        it is none of RMS and LayerNorm (each with weight w, with Gemma's and Nemotron's 1 + w, or without)."""
        eps = next((getattr(module, n) for n in ("variance_epsilon", "eps", "epsilon") if hasattr(module, n)), None)
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if any(isinstance(p, torch.Tensor) and p.device.type == "meta" for p in (weight, bias)):
            return None
        # a norm that keeps no eps (OLMo's parameter-free LayerNorm hard-codes 1e-5): the usual values are tried
        epsilons = [float(eps)] if isinstance(eps, (int, float)) else [1e-5, 1e-6]
        weight = weight.detach().float() if isinstance(weight, torch.Tensor) else None
        bias = bias.detach().float() if isinstance(bias, torch.Tensor) else None
        if weight is not None and weight.shape != (width,) or bias is not None and bias.shape != (width,):
            return None  # e.g. a k-norm over all heads at once, tried on one head (OLMo 2)
        candidates = []
        for eps in epsilons:
            candidates += [cls("layer", eps, weight, bias)]
            if weight is not None:
                candidates += [cls("layer", eps, 1.0 + weight, bias)]
            if bias is None:
                candidates += [cls("rms", eps, weight, None)]
                if weight is not None:
                    candidates += [cls("rms", eps, 1.0 + weight, None)]
        probe = next(module.parameters(), None)
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(0))
        x = x.to(probe.device, probe.dtype) if probe is not None else x
        try:
            own = module(x)
        except (RuntimeError, ValueError, TypeError):
            return None
        if not isinstance(own, torch.Tensor) or own.shape != x.shape:
            return None
        tol = dict(atol=1e-5, rtol=1e-4) if x.dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        return next((c for c in candidates if torch.allclose(c(x.float()), own.float(), **tol)), None)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """The norm without its affine, over the last dimension (fp32 in, fp32 out)."""
        if self.kind == "rms":
            return F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return F.layer_norm(x, (x.shape[-1],), eps=self.eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self.normalise(x)
        x = x if self.scale is None else x * self.scale.to(x.device)
        return x if self.shift is None else x + self.shift.to(x.device)

    def kind_key(self) -> tuple:
        return self.kind, self.eps, self.scale is None, self.shift is None


@dataclass(frozen=True)
class Rotary:
    """One rotary convention: `adjacent` pairs (2i, 2i + 1), else (i, i + d/2); `halved`: cos/sin's first half,
    each entry repeated for its pair; `doubled`: cos/sin of half a head's rotated width, used for both halves
    (GPT-OSS); `sign` of sin."""

    adjacent: bool = False
    halved: bool = False
    doubled: bool = False
    sign: float = 1.0

    @property
    def name(self) -> str:
        pairs = "adjacent pairs" if self.adjacent else "pairs (i, i + d/2)"
        widths = ", cos/sin halved" if self.halved else ", cos/sin doubled" if self.doubled else ""
        return pairs + widths + (", sin negated" if self.sign < 0 else "")

    def __call__(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`keys` [m, B, h, T, D] rotated on their first d dims by cos/sin [B, T, d] (fp32)."""
        cos, sin = (t.float()[None, :, None] for t in (cos, sin))  # [1, B, 1, T, d]
        if self.halved:
            cos, sin = (t[..., : t.shape[-1] // 2].repeat_interleave(2, dim=-1) for t in (cos, sin))
        if self.doubled:
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        sin = sin if self.sign > 0 else -sin
        dims = cos.shape[-1]
        if dims > keys.shape[-1] or dims % 2:
            raise ValueError(f"a rotary of {dims} dims does not fit heads of {keys.shape[-1]}")
        part = keys if dims == keys.shape[-1] else keys[..., :dims]
        if self.adjacent:
            turned = torch.stack([-part[..., 1::2], part[..., 0::2]], dim=-1).flatten(-2)
        else:
            turned = torch.cat([-part[..., dims // 2:], part[..., : dims // 2]], dim=-1)
        rotated = part * cos + turned * sin
        return rotated if dims == keys.shape[-1] else torch.cat([rotated, keys[..., dims:]], dim=-1)


# tried in this order against the probe's samples: the first every layer matches is used
ROTARY_FORMS = (Rotary(), Rotary(adjacent=True), Rotary(adjacent=True, halved=True), Rotary(doubled=True),
                Rotary(sign=-1.0), Rotary(adjacent=True, sign=-1.0))


def position_table(attention: nn.Module | None, head_dim: int) -> torch.Tensor | None:
    """A buffer of the attention module that holds sin and cos per position, [positions, d] (d even, at most the
    head size), as GPT-J's `embed_positions`; None when it keeps none or more than one."""
    if attention is None:
        return None
    tables = [b for _, b in attention.named_buffers(recurse=False)
              if b is not None and b.dim() == 2 and b.is_floating_point() and b.shape[-1] % 2 == 0
              and b.shape[-1] <= head_dim and b.shape[0] > 1]
    return tables[0] if len(tables) == 1 else None


def table_rotary(table: torch.Tensor, position_ids: torch.Tensor, sin_first: bool) -> tuple:
    """(cos, sin) [B, T, d] as Llama's rotary passes them (each frequency twice, halves repeated), from a table of
    [sin | cos] (`sin_first`) or [cos | sin] per position, at `position_ids` [B, T]."""
    rows = table.to(position_ids.device)[position_ids].float()  # [B, T, d]
    first, second = rows.chunk(2, dim=-1)
    sin, cos = (first, second) if sin_first else (second, first)
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


class Unfit(Exception):
    """Why a layer's K/V cannot be stacked."""


@dataclass
class LayerKV:
    """One layer's K/V weights as the probe found them: keys = k_norm(weight[:n] @ norm(h) + bias[:n]) in
    heads of `head_dim` (each repeated `repeat` times), values likewise from weight[n:]."""

    weight: torch.Tensor  # [2n, H] fp32, the input norm's affine folded in
    bias: torch.Tensor  # [2n] fp32
    norm: Norm | None  # the input norm, without affine (None: the layer's input is read as is)
    k_norm: Norm | None
    k_norm_all: bool  # the k-norm spans all n key features at once (OLMo 2), not one head
    head_dim: int
    repeat: int
    table: torch.Tensor | None  # a table of sin and cos per position kept by the attention (GPT-J)
    params: list  # the parameters folded in

    @classmethod
    def of(cls, parts, index: int, plan) -> LayerKV:
        """Layer `index`'s K/V weights from its probe plan (`kvprobe.LayerPlan`); raises `Unfit` saying why not."""
        layer = parts.layers[index]
        if plan.key_shape is None or plan.key_shape != plan.value_shape:
            raise Unfit(f"its keys {plan.key_shape} and values {plan.value_shape} (heads, head size) differ in shape")
        if not plan.key_rows or not plan.value_rows:
            raise Unfit("the probe found no nn.Linear or Conv1D outputs that become its keys and values as they are")
        if plan.kv_input is None:
            raise Unfit("its K/V linears do not all read one module's output")
        heads, head_dim = plan.key_shape
        pieces = [_rows_of(layer.get_submodule(name), rows) for name, rows in plan.key_rows.items()]
        pieces += [_rows_of(layer.get_submodule(name), rows) for name, rows in plan.value_rows.items()]
        if any(p is None for p in pieces):
            raise Unfit("its K/V weights are not loaded")
        n_keys = len(plan.key_rows)
        key_w, value_w = torch.cat([w for w, _ in pieces[:n_keys]]), torch.cat([w for w, _ in pieces[n_keys:]])
        key_b, value_b = torch.cat([b for _, b in pieces[:n_keys]]), torch.cat([b for _, b in pieces[n_keys:]])
        n, width = key_w.shape
        if value_w.shape != key_w.shape or n % head_dim or (heads * head_dim) % n:
            raise Unfit("its key and value rows do not split into whole heads")
        weight, bias = torch.cat([key_w, value_w]), torch.cat([key_b, value_b])
        params = [p for name in {**plan.key_rows, **plan.value_rows} for p in layer.get_submodule(name).parameters()]
        norm = None
        if plan.kv_input:
            module = layer.get_submodule(plan.kv_input)
            norm = Norm.of(module, width)
            if norm is None:
                raise Unfit(f"its input norm ({type(module).__name__}) computes neither RMS nor LayerNorm")
            params += list(module.parameters(recurse=False))
            if norm.shift is not None:
                bias = bias + weight @ norm.shift
            if norm.scale is not None:
                weight = weight * norm.scale
        key_linear = next(iter(plan.key_rows))
        attention = _submodule(layer, key_linear.rpartition(".")[0]) if "." in key_linear else layer
        k_norm, k_norm_all, k_norm_module = None, False, _k_norm_module(parts, layer, attention)
        if k_norm_module is not None:
            k_norm = Norm.of(k_norm_module, head_dim)
            if k_norm is None:
                k_norm, k_norm_all = Norm.of(k_norm_module, n), True
            if k_norm is None:
                raise Unfit(f"its k-norm ({type(k_norm_module).__name__}) computes neither RMS nor LayerNorm, "
                             "over one head or over all")
            params += list(k_norm_module.parameters(recurse=False))
        return cls(weight, bias, norm, k_norm, k_norm_all, head_dim, heads * head_dim // n,
                   position_table(attention, head_dim), params)


def _rows_of(module: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight [n, in], bias [n]) fp32 of the outputs `rows` of a linear module (one the probe found `nn.Linear`-like
    or `Conv1D`), or None if its weight is not loaded."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if weight is None or weight.device.type == "meta":
        return None
    weight = weight.detach().float()
    weight = weight.T if type(module).__name__ == "Conv1D" else weight
    rows = rows.to(weight.device)
    bias = torch.zeros(weight.shape[0], device=weight.device) if bias is None else bias.detach().float()
    return weight.index_select(0, rows), bias.index_select(0, rows)


def _k_norm_module(parts, layer: nn.Module, attention: nn.Module | None) -> nn.Module | None:
    """The table's k-norm, else a child of the key projection's parent named like one."""
    named = parts.spec.kv_projections.k_norm if parts.spec.kv_projections is not None else None
    if named:
        return _submodule(layer, named)
    return next((getattr(attention, n) for n in _K_NORM_NAMES if isinstance(getattr(attention, n, None), nn.Module)),
                None)


def _submodule(layer: nn.Module, path: str) -> nn.Module | None:
    try:
        return layer.get_submodule(path)
    except AttributeError:
        return None
