"""Decode speed of Tide's early-exit engine against the base model, side by side in one process.

Random-init Llama large enough that compute dominates (default 16 layers, hidden 1536), batch 1,
greedy, CPU. Measures decode tokens/s (generate time for N+1 new tokens minus generate time for 1),
median of `--repeats` interleaved runs, for:
  - the base model's generate;
  - Tide with exit_threshold=1.0 (layer-wise engine, never exits): the engine's overhead;
  - Tide forced to exit after layer `--exit-layer` (threshold -1) with each KV strategy;
and the ideal speedup implied by what ran (weights touched per decode token: full layers, K/V-only
passes, head), so the measured speedup can be read as a fraction of it.

With `--batch-sizes 1,4,16`, it measures batches instead: the first half of the rows (at least one) is forced
out after `--exit-layer` at every step, the rest runs every layer; rows that exit leave the running batch.
The ideal there counts the row-layers that ran (a row that exits runs `exit_layer + 1` layers and K/V-only
passes for the rest).

    python examples/bench_generate/bench_generate.py --json docs/results/bench_generate_cpu.json
    python examples/bench_generate/bench_generate.py --batch-sizes 1,4,16 --json docs/results/bench_batch_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tide


def build(layers: int, hidden: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3 // 256 * 256),
                         num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=hidden // 512,
                         max_position_embeddings=2048)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # random weights: decode the full length every time
    model.generation_config.pad_token_id = 0
    return model


def decode_seconds(generate, ids, new_tokens: int) -> float:
    start = time.perf_counter()
    generate(ids, max_new_tokens=1)
    one = time.perf_counter() - start
    start = time.perf_counter()
    generate(ids, max_new_tokens=new_tokens + 1)
    return (time.perf_counter() - start) - one


def params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def ideal_speedup(model: tide.TideForCausalLM, stats) -> float:
    """Weights a decode token touches, full stack vs what ran (full layers, K/V-only passes, routers)."""
    layer = model.parts.layers[0]
    c_layer, c_head = params(layer), params(model.parts.lm_head)
    c_kv = params(layer.input_layernorm) + params(layer.self_attn.k_proj) + params(layer.self_attn.v_proj)
    c_router = params(model.routers[model.checkpoints[0]])
    steps = stats.decode_steps
    ran = (stats.layer_passes * c_layer + stats.kv_only_passes * c_kv) / steps + c_head
    ran += c_router * len(stats.checkpoints)
    return (model.parts.num_layers * c_layer + c_head) / ran


def ideal_batch_speedup(model: tide.TideForCausalLM, stats, batch: int) -> float:
    """Weights x rows per decode step, full stack vs what ran: each row's own layers, K/V-only layers, head."""
    layer = model.parts.layers[0]
    c_layer, c_head = params(layer), params(model.parts.lm_head)
    c_kv = params(layer.input_layernorm) + params(layer.self_attn.k_proj) + params(layer.self_attn.v_proj)
    c_router = params(model.routers[model.checkpoints[0]])
    num_layers, tokens = model.parts.num_layers, stats.decode_tokens
    ran = ((stats.token_layers * c_layer + (tokens * num_layers - stats.token_layers) * c_kv) / tokens
           + c_head + c_router)
    return (num_layers * c_layer + c_head) / ran


def half_forced_out(exit_layer: int, batch: int):
    """Exit tests (for `TideForCausalLM.exit_tests`) that let the first half of the rows out at `exit_layer`."""
    out_rows = max(1, batch // 2)

    def test(hidden):
        exits = torch.zeros(hidden.shape[0], dtype=torch.bool)
        exits[:out_rows] = True
        return exits.float(), exits, hidden

    return lambda thresholds: {exit_layer: test}


def layer_seconds_by_rows(model, base, batches, prompt_tokens: int, repeats: int = 5) -> dict:
    """Median time of one decoder layer call on a decode token, by the number of rows it runs."""
    from transformers import DynamicCache

    from tide.layers.calls import capture_layer_calls

    parts, out = model.parts, {}
    for rows in batches:
        ids = torch.randint(10, 32000, (rows, prompt_tokens))
        cache = DynamicCache(config=base.config)
        with torch.inference_mode():
            base(ids, past_key_values=cache, use_cache=True)
            calls = capture_layer_calls(parts, input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                for i in range(parts.num_layers):
                    calls[i].run(parts, i, calls[0].hidden)
                    cache.layers[i].crop(-1)
                times.append((time.perf_counter() - start) / parts.num_layers)
        out[str(rows)] = round(statistics.median(times) * 1e3, 3)
    return out


def run_batches(args, base, model) -> dict:
    rows = {}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        ids = torch.randint(10, 32000, (batch, args.prompt_tokens))
        model.exit_tests = half_forced_out(args.exit_layer, batch)
        runs = {
            "base": lambda i, **kw: base.generate(i, do_sample=False, **kw),
            "tide_half_forced_out": lambda i, **kw: model.generate(
                i, do_sample=False, tide_config={"exit_threshold": 0.5}, **kw),
            "tide_half_forced_out_rows_kept": lambda i, **kw: model.generate(
                i, do_sample=False, tide_config={"exit_threshold": 0.5, "row_skipping": False}, **kw),
        }
        for fn in runs.values():
            fn(ids, max_new_tokens=2)
        times = {name: [] for name in runs}
        with torch.inference_mode():
            for _ in range(args.repeats):
                for name, fn in runs.items():
                    times[name].append(decode_seconds(fn, ids, args.new_tokens))
        kept_tps = batch * args.new_tokens / statistics.median(times["tide_half_forced_out_rows_kept"])
        model.generate(ids, do_sample=False, tide_config={"exit_threshold": 0.5}, max_new_tokens=args.new_tokens + 1)
        stats = model.last_stats
        base_tps = batch * args.new_tokens / statistics.median(times["base"])
        tps = batch * args.new_tokens / statistics.median(times["tide_half_forced_out"])
        ratios = [b / t for b, t in zip(times["base"], times["tide_half_forced_out"])]
        ideal = ideal_batch_speedup(model, stats, batch)
        rows[str(batch)] = {"base_tokens_per_s": round(base_tps, 3), "tide_tokens_per_s": round(tps, 3),
                            "ratio_to_base": round(tps / base_tps, 4), "paired_ratios": [round(r, 4) for r in ratios],
                            "rows_kept_ratio_to_base": round(kept_tps / base_tps, 4), "mean_layers": stats.mean_layers,
                            "exits": stats.exits, "ideal_speedup": round(ideal, 3),
                            "fraction_of_ideal": round(tps / base_tps / ideal, 4)}
        print(f"batch {batch:3d}: base {base_tps:8.2f} tok/s  tide {tps:8.2f} tok/s  x{tps / base_tps:.3f} "
              f"(exited rows kept in the batch: x{kept_tps / base_tps:.3f})  "
              f"ideal x{ideal:.3f} ({tps / base_tps / ideal:.1%} of ideal), mean layers {stats.mean_layers:.2f}")
    del model.exit_tests
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--exit-layer", type=int, default=3, help="0-based layer after which tokens are forced out")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch-sizes", help="e.g. 1,4,16: measure batches with half the rows forced out instead")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    base = build(args.layers, args.hidden)
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_layers=[args.exit_layer]))
    machine = f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}"
    if args.batch_sizes:
        results = {"machine": machine, "model": f"random-init Llama, {args.layers} layers, hidden {args.hidden}, fp32",
                   "exit_layer": args.exit_layer, "new_tokens": args.new_tokens, "repeats": args.repeats,
                   "batches": run_batches(args, base, model)}
        sizes = sorted({max(1, int(b) // 2) for b in args.batch_sizes.split(",")}
                       | {int(b) for b in args.batch_sizes.split(",")})
        results["layer_ms_by_rows"] = layer_seconds_by_rows(model, base, sizes, args.prompt_tokens)
        print("one decoder layer call (ms) by rows:", results["layer_ms_by_rows"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return
    ids = torch.randint(10, 32000, (1, args.prompt_tokens))
    runs = {
        "base": lambda i, **kw: base.generate(i, do_sample=False, **kw),
        "tide_threshold_1.0": lambda i, **kw: model.generate(
            i, do_sample=False, tide_config={"exit_threshold": 1.0}, **kw),
        "tide_forced_exit_propagate": lambda i, **kw: model.generate(
            i, do_sample=False, tide_config={"exit_threshold": -1, "kv_strategy": "propagate"}, **kw),
        "tide_forced_exit_recompute": lambda i, **kw: model.generate(
            i, do_sample=False, tide_config={"exit_threshold": -1, "kv_strategy": "recompute"}, **kw),
    }
    for fn in runs.values():  # warm-up
        fn(ids, max_new_tokens=2)
    times = {name: [] for name in runs}
    stats = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, fn in runs.items():
                times[name].append(decode_seconds(fn, ids, args.new_tokens))
                if name != "base":
                    stats[name] = model.last_stats
    results = {"machine": machine,
               "model": f"random-init Llama, {args.layers} layers, hidden {args.hidden}, fp32",
               "new_tokens": args.new_tokens, "repeats": args.repeats, "runs": {}}
    base_tps = args.new_tokens / statistics.median(times["base"])
    for name, ts in times.items():
        tps = args.new_tokens / statistics.median(ts)
        row = {"decode_tokens_per_s": round(tps, 3), "ratio_to_base": round(tps / base_tps, 4),
               "seconds": [round(t, 3) for t in ts]}
        if name in stats:
            s = stats[name]
            ideal = ideal_speedup(model, s)
            row.update(mean_layers=s.mean_layers, layer_passes_per_step=s.layer_passes / s.decode_steps,
                       kv_only_passes_per_step=s.kv_only_passes / s.decode_steps, ideal_speedup=round(ideal, 3),
                       fraction_of_ideal=round(tps / base_tps / ideal, 4))
        results["runs"][name] = row
        print(f"{name:28s} {tps:8.3f} tok/s  x{tps / base_tps:.3f}" +
              (f"  ideal x{row['ideal_speedup']:.3f}  ({row['fraction_of_ideal']:.1%} of ideal)"
               if "ideal_speedup" in row else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
