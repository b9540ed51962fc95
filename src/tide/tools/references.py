"""What the support matrix compares with (`support_matrix.check_forced_exit`), computed from the base model alone:
the greedy tokens of a forced exit through plain hooks on the base model's own forward (`reference_forced_exit`),
what a layer runs after its cache write (`work_after_cache_write`), which outputs of each linear reach the K/V a
layer writes (`kv_reach`), and the verdict on what skipped layers computed (`only_kv_linears`). Nothing here runs
Tide's engine."""

from __future__ import annotations

import torch
from transformers import DynamicCache, LogitsProcessor

from ..layers.kvprobe import is_linear

__all__ = ["AfterPrefill", "reference_forced_exit", "work_after_cache_write", "kv_reach", "only_kv_linears"]


class AfterPrefill(LogitsProcessor):
    """Sets a flag once the prompt's forward is done (logits processors run after each forward)."""

    def __init__(self, flag: list):
        self.flag = flag

    def __call__(self, input_ids, scores):
        self.flag.append(True)
        return scores


def reference_forced_exit(base, parts, ids, k: int, steps: int, suppress=()) -> torch.Tensor:
    """Greedy decode of `steps` tokens where every generated token leaves after layer k and layers > k see its
    layer-k state, with plain hooks on the base model's own forward. Tokens in `suppress` are never chosen."""
    cache = DynamicCache(config=base.config)
    state = {}

    def greedy(logits):
        logits = logits.clone()
        logits[:, list(suppress)] = -float("inf")
        return logits.argmax(-1, keepdim=True)

    def feed_exit_state(_m, args, kwargs):
        if args:
            return (state["h"],) + tuple(args[1:]), kwargs
        return args, dict(kwargs, hidden_states=state["h"])

    with torch.no_grad():
        logits = base(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        hooks = [parts.layers[k].register_forward_hook(lambda _m, _a, out: state.update(h=parts.layer_output(out)))]
        hooks += [parts.layers[j].register_forward_pre_hook(feed_exit_state, with_kwargs=True)
                  for j in range(k + 1, parts.num_layers)]
        out = [greedy(logits)]
        try:
            for _ in range(steps - 1):
                base(out[-1], past_key_values=cache, use_cache=True)
                out.append(greedy(parts.logits_from_normed(parts.final_norm(state["h"]))[:, -1]))
        finally:
            for h in hooks:
                h.remove()
    return torch.cat([ids] + out, dim=1)


def work_after_cache_write(base, parts, layer: int, ids) -> set[str]:
    """Leaf modules of `layer` that run after its K/V cache write in a normal decode step after prompt `ids`: what a
    skipped layer must never run."""
    cache = DynamicCache(config=base.config)
    with torch.no_grad():
        base(ids, past_key_values=cache, use_cache=True)
    order, original = [], cache.update

    def update(*args, **kwargs):
        if (len(args) > 2 and args[2] == layer) or kwargs.get("layer_idx") == layer:
            order.append(None)
        return original(*args, **kwargs)

    cache.update = update
    hooks = [m.register_forward_hook(lambda *_a, name=name: order.append(name))
             for name, m in parts.layers[layer].named_modules() if not list(m.children())]
    try:
        with torch.no_grad():
            base(ids[:, -1:], past_key_values=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return set(order[order.index(None) + 1:]) if None in order else set()


def kv_reach(base, parts, layers: list[int], ids) -> dict[tuple[int, str], torch.Tensor]:
    """{(layer, linear module name): bool [outputs]}: which outputs of each linear module of `layers` reach that
    layer's K/V write in a normal decode step after prompt `ids` (the gradient of the written K and V, with
    random weights, with respect to a zero bias on each linear's output). Modules that do not run before the
    write are absent."""
    gates, written = {}, {}
    with torch.inference_mode(False), torch.enable_grad():
        cache = DynamicCache(config=base.config)
        with torch.no_grad():
            base(ids, past_key_values=cache, use_cache=True)
        original = cache.update

        def update(key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx in layers and layer_idx not in written:
                written[layer_idx] = (key_states, value_states)
            return original(key_states.detach(), value_states.detach(), layer_idx, *args, **kwargs)

        def gate(j, name):
            def hook(_m, _a, out):
                if (j, name) in gates or j in written or not isinstance(out, torch.Tensor):
                    return None
                gates[(j, name)] = out.new_zeros(out.shape[-1], requires_grad=True)
                return out + gates[(j, name)]
            return hook

        cache.update = update
        hooks = [m.register_forward_hook(gate(j, name)) for j in layers
                 for name, m in parts.layers[j].named_modules() if is_linear(m)]
        try:  # (the gates require grad: what depends on them does)
            base(ids[:, -1:], past_key_values=cache, use_cache=True)
        finally:
            for h in hooks:
                h.remove()
        generator = torch.Generator().manual_seed(0)
        reach = {}
        for j in layers:
            mine = [key for key in gates if key[0] == j]
            if j not in written or not mine:
                continue
            k, v = written[j]
            weights = (torch.randn(k.shape, generator=generator).to(k), torch.randn(v.shape, generator=generator).to(v))
            grads = torch.autograd.grad((k, v), [gates[key] for key in mine], weights, allow_unused=True)
            for key, grad in zip(mine, grads):
                reach[key] = (torch.zeros(gates[key].shape, dtype=torch.bool) if grad is None else grad != 0).cpu()
    return reach


def only_kv_linears(calls: dict, reach: dict, steps: int) -> list[str]:
    """What a skipped layer computed beyond its K/V in `steps` decode steps: `calls` {(layer, name): [number of
    calls, largest |output| among the outputs that do not reach the K/V]} from forward hooks, `reach` from
    `kv_reach`. A module Tide skips is still called by the layer's code, and returns zeros there: outputs that do
    not reach the K/V must be zeros (not computed), and no linear runs more than once a step."""
    problems = []
    for (j, name), (count, beyond) in sorted(calls.items()):
        kv = reach.get((j, name))
        if count > steps:
            problems.append(f"layer {j} ran {name} {count} times in {steps} decode steps")
        elif beyond > 0 and (kv is None or not bool(kv.any())):
            problems.append(f"layer {j} computed {name}, which does not reach its K/V")
        elif beyond > 0:
            problems.append(f"layer {j} computed {name}'s outputs that do not reach its K/V ({int((~kv).sum())} of "
                            f"{kv.numel()})")
    return problems
