# Set-up and entry points. Every target creates the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned to the CPU build; GPU users: install a CUDA build of torch into $(VENV) first
# (e.g. `$(BIN)/pip install torch --index-url https://download.pytorch.org/whl/cu128`), then run make.
TORCH ?= torch==2.13.0

.PHONY: setup test demo

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test,bench]"
	touch $@

setup: $(BIN)/.installed

test: setup
	$(BIN)/python -m pytest

demo: setup
	$(BIN)/tide demo
