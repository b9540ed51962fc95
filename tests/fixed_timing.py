"""Fixed timings for the tests that do not test timing (installed for the whole suite by conftest.py).

Calibration and `tide bench` time things on the machine: `measure_costs` (a decode step's pieces and
`generate`'s own work, hundreds of timed runs), `measured_speedup` (a mode against the base model's
`generate`) and `measure_cycle` (the machine check's price of a drafting cycle in base steps: a compiled one
compiles the base model's step). Most tests calibrate or decode to check something else, and there the
measurements took most of the suite's time and made its outcome depend on the machine's load. The suite replaces
them with fixed, deterministic values:

- `fixed_costs(model)`: a fixed cost table (`FIXED_COSTS`, seconds: a layer 1 ms, a consulted checkpoint 0.2
  layer, a skipped layer's K/V 0.1 layer, ...), on the model's device;
- `fixed_speedup(...)`: every timed mode runs `FIXED_SPEEDUP` (1.0) times the base model's speed, as the tiny
  test models do: no mode is kept, exit mode's calibrated thresholds go to 1.0 and no draft is chosen;
- `fixed_cycle_steps(...)`: a drafting cycle costs `FIXED_CYCLE_STEPS` (1.0) base steps, so the machine check lets
  a repo's scheme run wherever its record expects it to accept a draft in 50 cycles or more (`machinecheck.MARGIN`).

Everything else in calibration runs for real (training, held-out scoring, threshold selection, pruning by
the costs, the check through the decode step, the order of the trials). Tests that set their own timings
(monkeypatching `tide.calibration.trials.measured_speedup` or `timed`) still do, on top of these. A test that needs
the real measurements is marked `@pytest.mark.real_timing`.

Run as a script, it installs the same cost table and runs another script (the examples tests):
`python tests/fixed_timing.py examples/quickstart/quickstart.py --tiny`. There every timed mode runs
`SCRIPT_SPEEDUP` (1.5) times the base model's speed, so calibration keeps its exits and a drafting scheme: the
examples' damped tiny models (examples/_tiny.py) time their exits faster, and the examples read exit mode's stats.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings

import tide

# The functions that time things on this machine, by name; every module-level binding of them in `tide` is
# replaced (calibration's modules and bench.py import them by name, so patching their home module alone would miss
# them).
TIMED_FUNCTIONS = ("measure_costs", "measured_speedup", "measure_cycle")
FIXED_SPEEDUP = 1.0
FIXED_CYCLE_STEPS = 1.0
SCRIPT_SPEEDUP = 1.5
LAYER_S = 1e-3
FIXED_COSTS = dict(layer_s=LAYER_S, checkpoint_s=0.2 * LAYER_S, skipped_layer_s=0.1 * LAYER_S, head_s=1.0 * LAYER_S,
                   capture_s=0.5 * LAYER_S, step_extra_s=1.0 * LAYER_S, cycle_extra_s=2.0 * LAYER_S, windowed=True,
                   verify_extra_s={2: 0.1 * LAYER_S, 3: 0.2 * LAYER_S, 4: 0.4 * LAYER_S, 6: 0.8 * LAYER_S,
                                   8: 1.2 * LAYER_S})


def _tide_modules() -> list:
    """Every module of the `tide` package, imported (the command line, bench and demo are not imported by
    `import tide`)."""
    for info in pkgutil.walk_packages(tide.__path__, "tide."):
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - a module that does not import fails its own tests, not every test
            pass
    return [m for name, m in sorted(sys.modules.items()) if (name == "tide" or name.startswith("tide.")) and m]


def _find(name: str, modules: list):
    """The one object named `name` at module level in `tide` (it may move between modules); None, with a
    warning, where there is not exactly one (the suite then times for real: slower, not wrong)."""
    found = {id(obj): obj for m in modules if callable(obj := vars(m).get(name))}
    if len(found) != 1:
        warnings.warn(f"tests/fixed_timing.py: expected one `{name}` in the tide package, found {len(found)}; the "
                      "tests run real timing trials until TIMED_FUNCTIONS names the functions that time them.")
        return None
    return next(iter(found.values()))


def fixed_costs(model, prompt_length: int = 32, repeats: int = 30):
    """`measure_costs`' fixed stand-in: FIXED_COSTS on the model's device."""
    return _STEP_COSTS(**FIXED_COSTS, device=str(model.base.device))


def fixed_speedup(*args, **kwargs) -> float:
    """`measured_speedup`'s fixed stand-in: as fast as the base model."""
    return FIXED_SPEEDUP


def fixed_cycle_steps(*args, **kwargs) -> float:
    """`measure_cycle`'s fixed stand-in: a cycle costs one base step."""
    return FIXED_CYCLE_STEPS


_FAKES = {"measure_costs": fixed_costs, "measured_speedup": fixed_speedup, "measure_cycle": fixed_cycle_steps}
_STEP_COSTS = None


def bindings() -> list[tuple[object, str, object, object]]:
    """[(module, attribute, real function, fixed stand-in)] for every binding of a timed function in `tide`."""
    global _STEP_COSTS
    modules = _tide_modules()
    _STEP_COSTS = _find("StepCosts", modules)
    out = []
    for name in TIMED_FUNCTIONS:
        real = _find(name, modules)
        if real is None or (name == "measure_costs" and _STEP_COSTS is None):
            continue
        out += [(m, attr, real, _FAKES[name]) for m in modules for attr, obj in vars(m).items() if obj is real]
    return out


def install() -> None:
    """Replace the timed functions for the rest of this process (the script entry point)."""
    for module, attr, _real, fake in bindings():
        setattr(module, attr, fake)


if __name__ == "__main__":
    import os
    import runpy

    FIXED_SPEEDUP = SCRIPT_SPEEDUP
    install()
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as if the script had been run itself
    runpy.run_path(sys.argv[0], run_name="__main__")
