"""The checkpoint test's cost: the fused kernel against its PyTorch reference, per call, on the shapes of 1B-8B models.

    python examples/gpu/time_checkpoint_test.py [--device cuda] [--repeats 200] [--json OUT]

Times `tide::checkpoint_test` with a full (tuned) exit head in bf16 on CUDA (fp32 on CPU) for a few row counts,
hidden sizes and router widths: the fused kernel (where one is loaded: `LOCAL_KERNELS`, see
hub_kernels/tide_kernels/README.md), the PyTorch reference's ops, and, for scale, one decoder layer of a Llama of
that width on one row. Medians of `--repeats` calls, each synchronised on CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tide.heads.kernels import load_checkpoint_kernel
from tide.heads.router import CheckpointTest, Router, Translator, checkpoint_test_reference

SHAPES = [(1, 2048, 64), (4, 2048, 64), (1, 4096, 128), (8, 4096, 128)]  # rows, hidden size, router width


def _args(rows: int, hidden: int, bottleneck: int, device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    router = Router(hidden, bottleneck, Translator(hidden)).to(device)
    test = CheckpointTest(router, torch.ones(hidden, device=device), None, 0, 1e-6, 0.5)
    tensors = [t.detach() for t in (torch.randn(rows, hidden, device=device, dtype=dtype), *test.translate,
                                    *test.down, *test.up)]
    return (*tensors, False, 1e-6, 0.5)


def _median_us(fn, repeats: int, cuda: bool) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _layer(hidden: int, device: str, dtype: torch.dtype):
    """One Llama decoder layer of this width (intermediate 4x, 32 heads, 8 K/V heads) and its rotary embedding."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    return LlamaDecoderLayer(config, 0).to(device, dtype).eval(), LlamaRotaryEmbedding(config).to(device)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--shapes", type=int, nargs=3, action="append", metavar=("ROWS", "HIDDEN", "R"))
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    fused = load_checkpoint_kernel() if cuda else checkpoint_test_reference
    has_kernel = fused is not checkpoint_test_reference
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"{device_name}, {dtype}, fused kernel: "
          f"{'loaded' if has_kernel else 'not loaded (reference only)'}")
    print(f"{'rows':>5}{'hidden':>8}{'R':>5}{'fused (us)':>12}{'reference (us)':>16}{'layer, 1 row (us)':>19}")
    rows_out = []
    with torch.inference_mode():
        for rows, hidden, bottleneck in args.shapes or SHAPES:
            call = _args(rows, hidden, bottleneck, args.device, dtype)
            reference = _median_us(lambda: checkpoint_test_reference(*call), args.repeats, cuda)
            kernel = _median_us(lambda: fused(*call), args.repeats, cuda) if has_kernel else None
            layer, rotary = _layer(hidden, args.device, dtype)
            x = torch.randn(1, 1, hidden, device=args.device, dtype=dtype)
            position = torch.zeros(1, 1, dtype=torch.long, device=args.device)
            embeddings = rotary(x, position)
            layer_us = _median_us(lambda: layer(x, position_embeddings=embeddings, position_ids=position),
                                  args.repeats, cuda)
            rows_out.append({"rows": rows, "hidden": hidden, "bottleneck": bottleneck, "fused_us": kernel,
                             "reference_us": reference, "layer_us": layer_us})
            fused_text = "-" if kernel is None else f"{kernel:.1f}"
            print(f"{rows:>5}{hidden:>8}{bottleneck:>5}{fused_text:>12}{reference:>16.1f}{layer_us:>19.1f}")
    result = {"device": device_name, "dtype": str(dtype),
              "torch": torch.__version__, "repeats": args.repeats, "rows": rows_out}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
