"""The package's shape: every module imports alone, no import cycles, and the transformers internals Tide uses exist."""

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import tide
from tide import _hf_compat

PACKAGE_DIR = Path(tide.__file__).parent
MODULES = sorted(m.name for m in pkgutil.iter_modules([str(PACKAGE_DIR)]))


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone(module):
    code = f"import importlib; importlib.import_module('tide.{module}')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_transformers_internals_tide_relies_on_are_there():
    _hf_compat.check()


def test_every_public_name_resolves():
    for name in tide.__all__:
        assert getattr(tide, name) is not None
    for module in MODULES:
        mod = importlib.import_module(f"tide.{module}")
        for name in getattr(mod, "__all__", []):
            assert hasattr(mod, name), f"tide.{module}.__all__ names {name}, which it does not define"
