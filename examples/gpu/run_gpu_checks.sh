#!/usr/bin/env bash
# Tide's checks for a machine with one CUDA GPU, in one command (about 10 minutes on an H100):
#   bash examples/gpu/run_gpu_checks.sh [OUT_DIR]
# 1. the GPU tests: the fused router kernel against the PyTorch reference, compiled passes and lossless = base;
# 2. examples/bench_baselines on the shipped model (CUDA, with compiled rows: CUDA graphs);
# 3. the same on a random-weight Llama of a 1B shape, for the cost table and per-cycle overheads.
# Results land in OUT_DIR (default docs/results/gpu); docs/gpu.md says how to read them into docs/benchmarks.md.
set -euo pipefail
out="${1:-docs/results/gpu}"
mkdir -p "$out"
python - <<'PY' | tee "$out/device.txt"
import torch, transformers
print(torch.cuda.get_device_name(0), "| torch", torch.__version__, "| transformers", transformers.__version__)
PY
python -m pytest -q -m gpu tests/ 2>&1 | tee "$out/gpu_tests.txt"
python -m pytest -q tests/test_compile.py tests/test_static_cache.py 2>&1 | tee "$out/compile_tests.txt"
python examples/bench_baselines/bench_baselines.py --device cuda --compile --tokens 64 --prompts 8 \
    --schemes 0:1 0:2 0:4 0:1:k3 --exit 0.5 --json "$out/bench_shipped.json" 2>&1 | tee "$out/bench_shipped.txt"
python examples/bench_baselines/bench_baselines.py --device cuda --compile --random-shape 1b --tokens 64 --prompts 4 \
    --costs --schemes 3:1 3:4 --exit -1 --json "$out/bench_1b.json" 2>&1 | tee "$out/bench_1b.txt"
