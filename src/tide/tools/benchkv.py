"""The cost of a skipped layer's K/V, by each way Tide can fill it (`tide bench` reports it; `python -m
tide.tools.bench TYPE ...` prints it for random-init models of some model types)."""

from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from ..layers.calls import capture_layer_calls, write_kv_only
from ..layers.kvfill import fill_kv, fused_available
from ..layers.kvprobe import kv_plan

__all__ = ["kv_fill_costs", "kv_fill_costs_text", "kv_cost_main", "device_name"]


def device_name(device) -> str:
    """The accelerator's or the CPU's own name, as the machine reports it."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({torch.get_num_threads()} threads)"


@torch.no_grad()
def kv_fill_costs(model, prompt_length: int = 32, repeats: int = 15) -> dict:
    """A skipped layer's K/V for one decode token, as a fraction of a decoder layer's time (medians over
    interleaved repeats, so every piece reads its weights from memory as in a real step), by each way Tide can
    fill it: `batched` (`kvfill`'s one matmul over every layer's stacked K/V projections; None where the family
    does not take it), `per_layer` (each layer's own code up to its cache write, computing only the outputs the
    probe found to reach the K/V: `kvprobe`), and `per_layer_everything` (the same pass computing every linear
    output before the cache write: the query projection, a fused projection's query rows; what that pass cost
    before the probe). Each is the time to fill every layer, divided by the number of layers. Also the probe's
    report (`kv_plan(...).report()`, its first layer)."""
    parts, base = model.parts, model.base
    device = next(parts.layers.parameters()).device
    vocab = base.config.get_text_config().vocab_size
    ids = torch.arange(3, prompt_length + 4, device=device).remainder(vocab)[None]
    cache = DynamicCache(config=base.config)
    base(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
    calls = capture_layer_calls(parts, input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    hidden, layers = calls[0].hidden, list(range(parts.num_layers))
    plan = kv_plan(parts)

    def run_layers():
        h = hidden
        for i in layers:
            h = calls[i].run(parts, i, h)
        cache.crop(-1)

    def fill(layerwise: bool):
        fill_kv(parts, calls, layers, hidden, cache, layerwise=layerwise)
        cache.crop(-1)

    def everything():
        for i in layers:
            write_kv_only(calls[i], parts, i, hidden, cache, skips={})
        cache.crop(-1)

    pieces = {"layer": run_layers, "per_layer": lambda: fill(True), "per_layer_everything": everything}
    if fused_available(parts, calls, layers, hidden):
        pieces["batched"] = lambda: fill(False)
    seconds = {name: [] for name in pieces}
    for fn in pieces.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in pieces.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[name].append(time.perf_counter() - start)
    layer_s = statistics.median(seconds["layer"]) / len(layers)
    out = {"layer_ms": layer_s * 1e3, "batched": None, "probe": plan.report().splitlines()[0] if plan.layers else "",
           "probe_complete": plan.complete}
    for name in pieces:
        if name != "layer":
            out[name] = statistics.median(seconds[name]) / len(layers) / layer_s
    return out


def kv_fill_costs_text(costs: dict) -> str:
    batched = "" if costs["batched"] is None else f"batched {costs['batched']:.3f}, "
    return (f"a skipped layer's K/V, as a fraction of a layer ({costs['layer_ms']:.2f} ms): {batched}"
            f"per-layer K/V-only pass {costs['per_layer']:.3f} (computing every linear output before the cache "
            f"write: {costs['per_layer_everything']:.3f}); probe: {costs['probe']}")


def kv_cost_main(argv: list[str] | None = None) -> int:
    """`python -m tide.tools.bench TYPE [TYPE ...] --hidden 2048 --heads 32 --kv-heads 4`: the K/V cost of a skipped
    layer on random-init models of these model types and shape (no download), one table row each."""
    import argparse

    from transformers import AutoConfig, AutoModelForCausalLM

    from ..config import TideConfig
    from ..modeling import TideForCausalLM

    parser = argparse.ArgumentParser(description=kv_cost_main.__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="+")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print("| model type | shape | layer (ms) | batched fill | per-layer K/V-only pass | that pass computing "
          "everything before the cache write |\n|---|---|---|---|---|---|")
    for model_type in args.model_types:
        torch.manual_seed(0)
        config = AutoConfig.for_model(
            model_type, hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            intermediate_size=args.intermediate, num_hidden_layers=args.layers, vocab_size=args.vocab,
            head_dim=args.hidden // args.heads,
            max_position_embeddings=512, pad_token_id=0)
        base = AutoModelForCausalLM.from_config(config).eval()
        model = TideForCausalLM.from_base(base, TideConfig(checkpoint_layers=[0]))
        costs = kv_fill_costs(model, repeats=args.repeats)
        kv = args.kv_heads if "num_key_value_heads" in type(config)().to_dict() else args.heads  # else MHA
        batched = "-" if costs["batched"] is None else f"{costs['batched']:.3f}"
        print(f"| `{model_type}` | hidden {args.hidden}, {args.heads} heads / {kv} KV heads, intermediate "
              f"{args.intermediate}, {args.layers} layers | {costs['layer_ms']:.2f} | {batched} | "
              f"{costs['per_layer']:.3f} | {costs['per_layer_everything']:.3f} |", flush=True)
        del model, base
    print(f"({device_name('cpu')}, torch {torch.__version__})")
    return 0
