"""What a skipped layer must compute: its K/V, and nothing more. Found from the layer itself, by a probe.

A K/V-only pass (`calls.write_kv_only`) runs a layer's own code up to its cache write. Every linear
module that runs before that write and whose output never reaches the written K/V is wasted work there: a
query projection above all (with 4-8 query heads per KV head, 2-4 times the size of K and V together), the
query rows of a fused qkv projection (GPT-2's `c_attn`, Falcon's and GPT-NeoX's `query_key_value`, Bloom,
Phi-3's `qkv_proj`), the query path of latent attention (`q_a_proj`, `q_b_proj`).

`kv_plan(parts)` finds them once per model, on the model's own layers and arguments:

1. Candidates are the linear modules (any leaf with a 2-D weight: `nn.Linear` and its subclasses, GPT-2's
   `Conv1D`) that run before the cache write, found by running each layer's K/V-only pass with hooks.
2. Which of their outputs reach the cache: every candidate's output gets a zero bias that requires grad, and
   the gradient of the written K and V (with random weights) with respect to those biases says, column by
   column, which outputs reach `update()`. A candidate none of whose outputs reach it is skipped (its output
   replaced by zeros); one whose outputs reach it only in part (a fused qkv projection) computes only those
   rows of its weight (columns, for `Conv1D`), the rest zeros; one whose outputs all reach it runs as is.
   The gradients of the keys and of the values are taken apart, so the plan also says which outputs become
   keys and which values (`key_rows`, `value_rows`, ascending: the written head order for separate and fused
   projections alike), which module's output those linears read (`kv_input`: the input norm, or "" for the
   layer's input itself), and the written (heads, head_dim). `kvfill` stacks the K/V weights from this.
3. Confirmed: the K/V-only pass with that plan must write what the layer's own code writes, on a second input;
   otherwise nothing is skipped beyond the table's `query_proj`, and the report says why. What the layer's
   own code wrote there is kept (`LayerPlan.sample`): `kvfill` checks its stacked weights against it without
   calling the layer again (unless the layer's parameters changed in place since: then it is taken again).

A part computed in part must be an `nn.Linear` or a `Conv1D` (whose forward Tide knows); any other class is
computed in full and the report says so. Skipping a whole module works for any class. Non-contiguous rows
(GPT-NeoX and Bloom interleave q, k and v per head) are gathered into a copy of the K/V rows, made once per
weight (its storage and version) and kept with the plan: the size of that projection's K/V part.

`kv_plan(parts).report()` lists, per layer, what a K/V-only pass computes and skips, and why anything is not
skipped. Nothing here decides about exits; the probe's forward runs on its own inputs and a cache it
discards, outside any inference mode of the caller.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ..models.architectures import ModelParts
from .calls import LayerCall, PartialRows, capture_layer_calls, run_to_cache_write, write_kv_only

__all__ = ["KVPlan", "LayerPlan", "kv_plan", "write_kv", "KVSample", "is_linear", "clear_plans"]

_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layers ModuleList -> KVPlan
_LOCK = threading.Lock()
_PROBE_LENGTH = 3  # positions of the probe's inputs


def is_linear(module: nn.Module) -> bool:
    """A leaf module that multiplies by a 2-D weight (nn.Linear and subclasses, Conv1D), not an embedding."""
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and not isinstance(module, nn.Embedding)
            and not list(module.children()))


@dataclass
class KVSample:
    """What a layer's own code writes (every linear computed) for a random `hidden`, with the probe's `call`."""

    hidden: torch.Tensor  # [1, T, H]
    keys: torch.Tensor  # as passed to the cache's update(), [1, heads, T, head_dim]
    values: torch.Tensor
    call: LayerCall
    versions: tuple = ()  # the layer's parameters' version counters when the sample was taken

    @staticmethod
    def take(parts: ModelParts, index: int, call: LayerCall, hidden: torch.Tensor) -> KVSample:
        with torch.no_grad():
            keys, values = _run_to_write(parts, index, call, hidden)
        return KVSample(hidden, keys, values, call, _versions(parts.layers[index]))

    def current(self, parts: ModelParts, index: int) -> KVSample:
        """This sample, or one taken again on the same input if the layer's parameters changed in place since."""
        if self.versions == _versions(parts.layers[index]):
            return self
        return KVSample.take(parts, index, self.call, self.hidden)


def _versions(layer: nn.Module) -> tuple:
    return tuple(p._version for p in layer.parameters())


@dataclass
class LayerPlan:
    """One layer's K/V-only pass: modules skipped (zeros) or computed in part, and what was found."""

    skips: dict = field(default_factory=dict)  # module -> None (zeros) or PartialRows
    kv: list[str] = field(default_factory=list)  # linears whose outputs all reach the cache (run as they are)
    skipped: list[str] = field(default_factory=list)  # linears replaced by zeros
    partial: dict[str, str] = field(default_factory=dict)  # name -> "rows a of b"
    kept: dict[str, str] = field(default_factory=dict)  # name -> why it still runs (in full)
    # where the written K/V come from, for the batched fill (`kvfill`): per linear, the indices of its outputs that
    # reach the written keys / values (ascending; empty unless every such linear is one `PartialRows` supports);
    # the module whose output every such linear takes as its input ("" for the layer's input itself, None when
    # they differ or it was not found); the written keys' and values' (heads, head_dim)
    key_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    value_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_input: str | None = None
    key_shape: tuple[int, int] | None = None
    value_shape: tuple[int, int] | None = None
    sample: KVSample | None = None  # to check another way of computing the K/V against (kvfill's stack)


@dataclass
class KVPlan:
    """The K/V-only pass of every layer of one model, and the probe's verdict."""

    layers: list[LayerPlan]
    reason: str | None = None  # why the probe's plan is not used (then only the table's query_proj is skipped)

    def skips(self, index: int) -> dict:
        return self.layers[index].skips if index < len(self.layers) else {}

    def report(self) -> str:
        lines = [f"probe not used: {self.reason}"] if self.reason else []
        for i, layer in enumerate(self.layers):
            parts = [f"K/V from {', '.join(layer.kv) or '-'}"]
            if layer.partial:
                parts.append("in part: " + ", ".join(f"{n} ({r})" for n, r in layer.partial.items()))
            if layer.skipped:
                parts.append(f"skipped: {', '.join(layer.skipped)}")
            if layer.kept:
                parts.append("computed in full: " + "; ".join(f"{n} ({why})" for n, why in layer.kept.items()))
            lines.append(f"layer {i}: " + "; ".join(parts))
        return "\n".join(lines)

    @property
    def complete(self) -> bool:
        """Every layer's K/V-only pass runs only linears whose outputs reach its K/V (fused ones in part)."""
        return self.reason is None and not any(layer.kept for layer in self.layers)

    def why_incomplete(self) -> str:
        if self.reason:
            return self.reason
        kept = {f"{n}: {why}" for layer in self.layers for n, why in layer.kept.items()}
        return "; ".join(sorted(kept))


def kv_plan(parts: ModelParts) -> KVPlan:
    """The probe's plan for `parts` (probed once per model; kept while its layers live)."""
    plan = _PLANS.get(parts.layers)
    if plan is None:
        with _LOCK:
            plan = _PLANS.get(parts.layers)
            if plan is None:
                plan = _probe(parts)
                _PLANS[parts.layers] = plan
    return plan


def clear_plans() -> None:
    _PLANS.clear()


@torch.no_grad()
def write_kv(call: LayerCall, parts: ModelParts, index: int, hidden: torch.Tensor, cache) -> None:
    """`calls.write_kv_only` with the probe's plan: only the K/V of layer `index` is computed."""
    write_kv_only(call, parts, index, hidden, cache, skips=kv_plan(parts).skips(index))


class _Stop(Exception):
    pass


class _Catch:
    """Cache proxy for the probe: `update()` keeps the K/V (nothing is written) and stops the layer."""

    def __init__(self, cache):
        self._cache, self.kv = cache, None

    def update(self, key_states, value_states, *args, **kwargs):
        self.kv = (key_states, value_states)
        raise _Stop

    def __getattr__(self, name):
        return getattr(self._cache, name)


def _probe(parts: ModelParts) -> KVPlan:
    try:
        with torch.inference_mode(False), torch.enable_grad():
            calls = _probe_calls(parts)
            return KVPlan([_probe_layer(parts, i, calls[i]) for i in range(parts.num_layers)])
    except Exception as err:  # noqa: BLE001 - any failure: the table's query_proj only, and the report says why
        text = str(err).strip().splitlines()
        return KVPlan([LayerPlan() for _ in parts.layers],
                      reason=f"the probe failed ({type(err).__name__}: {text[0] if text else ''})"[:300])


def _probe_calls(parts: ModelParts) -> list[LayerCall]:
    from transformers import DynamicCache

    embed = parts.backbone.get_input_embeddings() if hasattr(parts.backbone, "get_input_embeddings") else None
    device = embed.weight.device if embed is not None and hasattr(embed, "weight") else next(
        parts.layers.parameters()).device
    ids = torch.arange(3, 3 + _PROBE_LENGTH, device=device)[None]
    cache = DynamicCache(config=parts.backbone.config)
    return capture_layer_calls(parts, input_ids=ids, past_key_values=cache, use_cache=True)


def _run_to_write(parts, index, call, hidden, skips=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V layer `index` writes for `hidden`, computing everything before the write but `skips`."""
    skips = {} if skips is None else skips  # (None would skip the table's query_proj)
    catch = _Catch(_call_cache(parts, call))
    try:
        run_to_cache_write(call, parts, index, hidden, catch, skips)
    except _Stop:
        pass
    if catch.kv is None:
        raise RuntimeError(f"decoder layer {index} did not write its KV cache")
    return catch.kv


def _call_cache(parts: ModelParts, call: LayerCall):
    where = parts.spec.cache_arg
    if isinstance(where, int):
        return call.args[where] if where < len(call.args) else call.kwargs.get("past_key_values")
    return call.kwargs.get(where)


def _probe_layer(parts: ModelParts, index: int, call: LayerCall) -> LayerPlan:
    layer = parts.layers[index]
    names = {module: name for name, module in layer.named_modules() if is_linear(module)}
    gates: dict[nn.Module, torch.Tensor] = {}
    order: list[nn.Module] = []
    inputs: dict[nn.Module, int] = {}  # linear -> id of the tensor it took
    outputs: dict[int, str] = {}  # id of a module's output -> that module's name
    alive: list[torch.Tensor] = []  # keeps those outputs (and their ids) alive during the run

    def gate(module, args, out):
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or module in gates:
            return None
        order.append(module)
        inputs[module] = id(args[0]) if args else None
        gates[module] = out.new_zeros(out.shape[-1], requires_grad=True)
        return out + gates[module]

    def source(name, _module, _args, out):
        if isinstance(out, torch.Tensor):
            outputs.setdefault(id(out), name)
            alive.append(out)

    generator = torch.Generator().manual_seed(index)
    shape, ref = call.hidden.shape, call.hidden
    hidden = torch.randn(shape, generator=generator).to(ref.device, ref.dtype)  # the gates require grad
    outputs[id(hidden)] = ""
    hooks = [module.register_forward_hook(functools.partial(source, name))
             for name, module in layer.named_modules() if name and module not in names]
    hooks += [module.register_forward_hook(gate) for module in names]
    try:
        keys, values = _run_to_write(parts, index, call, hidden)
    finally:
        for h in hooks:
            h.remove()
    plan = LayerPlan()
    if not order:
        return plan
    to_keys = _reach(keys, [gates[m] for m in order], generator)
    to_values = _reach(values, [gates[m] for m in order], generator)
    for module, key_reach, value_reach in zip(order, to_keys, to_values):
        name = names[module]
        reach = key_reach | value_reach
        if bool(reach.all()):
            plan.kv.append(name)
        elif not bool(reach.any()):
            plan.skips[module] = None
            plan.skipped.append(name)
        elif PartialRows.supports(module):
            plan.skips[module] = PartialRows(module, reach.nonzero().squeeze(1))
            plan.partial[name] = f"K/V rows {int(reach.sum())} of {reach.numel()}"
        else:
            plan.kept[name] = (f"its outputs reach the K/V in part, and {type(module).__name__} "
                               "cannot compute rows alone")
        if bool(key_reach.any()):
            plan.key_rows[name] = key_reach.nonzero().squeeze(1)
        if bool(value_reach.any()):
            plan.value_rows[name] = value_reach.nonzero().squeeze(1)
    if not all(PartialRows.supports(layer.get_submodule(n)) for n in {**plan.key_rows, **plan.value_rows}):
        plan.key_rows, plan.value_rows = {}, {}  # only linears whose forward Tide knows can be stacked
    sources = {outputs.get(inputs[m]) for m in order if names[m] in plan.key_rows or names[m] in plan.value_rows}
    plan.kv_input = sources.pop() if len(sources) == 1 else None
    if keys.dim() == 4 and values.dim() == 4:  # [B, heads, T, head_dim]
        plan.key_shape, plan.value_shape = (keys.shape[1], keys.shape[-1]), (values.shape[1], values.shape[-1])
    _confirm(parts, index, call, plan)
    return plan


def _reach(written: torch.Tensor, gates: list[torch.Tensor], generator) -> list[torch.Tensor]:
    """Per gate, which of its columns reach `written` (bool, on the CPU): the gradient of `written` against
    random weights is nonzero there."""
    if not written.requires_grad:
        return [torch.zeros(g.shape[0], dtype=torch.bool) for g in gates]
    weights = torch.randn(written.shape, generator=generator).to(written)
    grads = torch.autograd.grad(written, gates, weights, retain_graph=True, allow_unused=True)
    return [torch.zeros(g.shape[0], dtype=torch.bool) if d is None else (d != 0).cpu() for g, d in zip(gates, grads)]


def _confirm(parts: ModelParts, index: int, call: LayerCall, plan: LayerPlan) -> None:
    """Keep a sample of what the layer's own code writes (on a second input); the plan must write the same, else
    skip nothing more, and say so."""
    generator = torch.Generator().manual_seed(1000 + index)
    ref = call.hidden
    hidden = torch.randn(ref.shape, generator=generator).to(ref.device, ref.dtype)
    plan.sample = KVSample.take(parts, index, call, hidden)
    if not plan.skips:
        return
    full = plan.sample.keys, plan.sample.values
    with torch.no_grad():
        lean = _run_to_write(parts, index, call, hidden, skips=plan.skips)
    tol = dict(atol=1e-5, rtol=1e-4) if ref.dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    if all(torch.allclose(a.float(), b.float(), **tol) for a, b in zip(full, lean)):
        return
    for module in plan.skips:
        name = next(n for n, m in parts.layers[index].named_modules() if m is module)
        plan.kept[name] = "skipping it changed the K/V the layer writes"
    plan.skips, plan.skipped, plan.partial = {}, [], {}
    plan.key_rows, plan.value_rows, plan.kv_input = {}, {}, None  # the batched fill does not rely on it either
