"""The package's shape: every module imports alone, no import cycles, each package imports only the packages
below it, and the transformers internals Tide uses exist."""

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import tide
from tide.models import compat

PACKAGE_DIR = Path(tide.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages([str(PACKAGE_DIR)], prefix="tide."))
# The layers of the package, bottom first: each imports only those before it (and itself).
LAYERS = ["config", "records", "models", "heads", "layers", "decode", "generation", "hub", "modeling", "calibration",
          "tools"]


def test_each_module_imports_alone():
    """Every module imports first in a fresh interpreter. One process imports torch and transformers, then forks
    a child per module, which imports that module and nothing of Tide before it (as many at once as it has cores)."""
    code = (
        "import os, sys, traceback\n"
        "import torch, torch._dynamo, transformers, transformers.modeling_utils, transformers.generation.utils\n"
        "import transformers.integrations.sdpa_attention, accelerate, safetensors.torch, huggingface_hub\n"
        "failed, running = [], {}\n"
        "cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else 1\n"
        "def reap():\n"
        "    pid, status = os.wait()\n"
        "    if status:\n"
        "        failed.append(running[pid])\n"
        "    del running[pid]\n"
        "for m in sys.argv[1:]:\n"
        "    if len(running) >= cores:\n"
        "        reap()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            __import__(m)\n"
        "        except BaseException:\n"
        "            traceback.print_exc()\n"
        "            os._exit(1)\n"
        "        os._exit(0)\n"
        "    running[pid] = m\n"
        "while running:\n"
        "    reap()\n"
        "print(' '.join(failed))\n"
    )
    result = subprocess.run([sys.executable, "-c", code, *MODULES], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr[-4000:]


def _file(module: str) -> Path:
    path = PACKAGE_DIR.joinpath(*module.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imports(module: str) -> set[str]:
    """The tide modules `module` imports (function-level imports included: a cycle is a cycle)."""
    package = module if _file(module).name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(_file(module).read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from . import fewrows` imports a module
                if f"{target}.{alias.name}" in MODULES:
                    out.add(f"{target}.{alias.name}")
            if target in MODULES:
                out.add(target)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in MODULES)
    out.discard("tide")  # `from .. import __version__`
    return out - {module}


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def test_the_import_graph_has_no_cycle():
    graph = {m: _imports(m) for m in MODULES if m != "tide"}
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


def test_each_package_imports_only_packages_below_it():
    assert {m.split(".")[1] for m in MODULES if m != "tide"} == set(LAYERS), "a new package needs a place in LAYERS"
    upward = [f"{m} imports {t}" for m in MODULES if m != "tide" for t in _imports(m) if _layer(t) > _layer(m)]
    assert not upward, upward


def test_transformers_internals_tide_relies_on_are_there():
    compat.check()


def test_every_public_name_resolves():
    for name in tide.__all__:
        assert getattr(tide, name) is not None
    for module in MODULES:
        mod = importlib.import_module(module)
        for name in getattr(mod, "__all__", []):
            assert hasattr(mod, name), f"{module}.__all__ names {name}, which it does not define"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# The one module that reaches into private pieces (transformers'): what it exports is Tide's to use.
PRIVATE_HOME = "tide.models.compat"


def test_no_private_name_is_imported_across_modules():
    """No module imports another Tide module's private name (`from .fused import _mask`)."""
    found = []
    for module in MODULES:
        package = module if _file(module).name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(_file(module).read_text())):
            if not isinstance(node, ast.ImportFrom) or module == PRIVATE_HOME:
                continue
            if node.level:
                target = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                  + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "tide" and target != PRIVATE_HOME:
                found += [f"{module}:{node.lineno} imports {target}.{a.name}" for a in node.names if _private(a.name)]
    assert not found, found


def test_no_private_attribute_of_another_module_is_read():
    """No module reads a private attribute that only another Tide module defines (`spans._shared_call(...)`,
    `fused._mask`): a private name (a function, class or attribute starting with one underscore) is read where it
    is defined, or through `self`/`cls`."""
    trees = {m: ast.parse(_file(m).read_text()) for m in MODULES}
    defined: dict[str, set] = {}
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names = [node.attr]
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names = [node.id]
            else:
                continue
            for name in filter(_private, names):
                defined.setdefault(name, set()).add(module)
    found = [f"{module}:{node.lineno} reads {ast.unparse(node)}" for module, tree in trees.items()
             if module != PRIVATE_HOME for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in defined
             and module not in defined[node.attr] and ast.unparse(node.value) not in ("self", "cls")]
    assert not found, found


def _stats_object(node) -> bool:
    """Whether `node` is a call's stats (`stats`, `self.stats`, `session.stats`, ...)."""
    return (isinstance(node, ast.Name) and node.id == "stats") or (isinstance(node, ast.Attribute)
                                                                     and node.attr == "stats")


def _assigned(node) -> list:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    out = []
    for target in targets:
        out += target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
    return out


def _stats_writers() -> tuple[set, set]:
    """(the modules that assign a field of a call's `GenerationStats`, those that call its `record_*` methods);
    `decode/stats.py`, whose methods write its fields, is the first's by definition."""
    assigning, recording = {"tide.decode.stats"}, set()
    for module in MODULES:
        for node in ast.walk(ast.parse(_file(module).read_text())):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                if any(isinstance(t, ast.Attribute) and _stats_object(t.value) for t in _assigned(node)):
                    assigning.add(module)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr.startswith("record_") and _stats_object(node.func.value)):
                recording.add(module)
    return assigning, recording


# The loops, which record what each cycle or step ran and what their passes counted, through `GenerationStats`'
# `record_*` methods; the passes they run (drafting, verification, layer arguments) count and hand back.
STATS_RECORDERS = {"tide.decode.lossless.loop", "tide.decode.exits.loop", "tide.decode.exits.session",
                   "tide.decode.baseline", "tide.decode.stats"}


def test_generation_stats_is_written_from_few_modules():
    """`GenerationStats`' fields are assigned in at most three modules (`decode/stats.py`'s `record_*` methods and
    `generation.py`: the call's plan, wall time, compiling and layer-argument captures), and only the loops call
    the `record_*` methods: no pass writes the stats."""
    assigning, recording = _stats_writers()
    assert len(assigning) <= 3, sorted(assigning)
    assert recording <= STATS_RECORDERS, sorted(recording - STATS_RECORDERS)
