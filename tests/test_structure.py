"""The package's shape: every module imports alone, no import cycles, and the transformers internals Tide uses exist."""

import ast
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import tide
from tide import _hf_compat

PACKAGE_DIR = Path(tide.__file__).parent
MODULES = sorted(m.name for m in pkgutil.iter_modules([str(PACKAGE_DIR)]))


def test_each_module_imports_alone():
    """Every module imports first in a fresh interpreter (one process per module, a few at a time)."""
    from concurrent.futures import ThreadPoolExecutor

    def run(module):
        code = f"import importlib; importlib.import_module('tide.{module}')"
        return module, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        failed = {module: result.stderr[-2000:] for module, result in pool.map(run, MODULES) if result.returncode}
    assert not failed, failed


def _sources(module: str) -> list[Path]:
    """The files of a module, or of every module in a subpackage."""
    path = PACKAGE_DIR / module
    return sorted(path.glob("*.py")) if path.is_dir() else [PACKAGE_DIR / f"{module}.py"]


def _imports(module: str) -> set[str]:
    """The tide modules `module` imports at module level (function-level imports included: a cycle is a cycle);
    for a subpackage, what its modules import from outside it."""
    out = set()
    level = 2 if (PACKAGE_DIR / module).is_dir() else 1  # the import level that reaches tide's own modules
    for source in _sources(module):
        out |= _imports_in(ast.parse(source.read_text()), level)
    return out & set(MODULES)


def _imports_in(tree, level: int) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == level:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tide."):
            out.add(node.module.split(".")[1])
    return out


def test_the_import_graph_has_no_cycle():
    graph = {m: _imports(m) for m in MODULES if m != "__init__"}
    state = {}

    def visit(node, path):
        if state.get(node) == "done":
            return
        if state.get(node) == "open":
            cycle = path[path.index(node):] + [node]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        state[node] = "done"

    for m in graph:
        visit(m, [])


def test_transformers_internals_tide_relies_on_are_there():
    _hf_compat.check()


def test_every_public_name_resolves():
    for name in tide.__all__:
        assert getattr(tide, name) is not None
    for module in MODULES:
        mod = importlib.import_module(f"tide.{module}")
        for name in getattr(mod, "__all__", []):
            assert hasattr(mod, name), f"tide.{module}.__all__ names {name}, which it does not define"
