"""`tide --help` answers from the arguments alone: no torch, transformers or Tide module is imported for it."""

import subprocess
import sys
import time

import pytest

import tide_cli

CODE = ("import sys\n"
        "from tide_cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit as stop:\n"
        "    heavy = sorted(m for m in ('torch', 'transformers', 'tide') if m in sys.modules)\n"
        "    print('imported:', heavy, 'exit:', stop.code)\n")


@pytest.mark.parametrize("argv", [["--help"], ["calibrate", "--help"], ["generate", "m", "p", "--max-draft", "x"]])
def test_help_and_argument_errors_import_nothing_heavy(argv):
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CODE, *argv], capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - start
    assert "imported: [] exit:" in out.stdout, out.stdout + out.stderr
    assert seconds < 2.0, f"{argv}: {seconds:.2f} s"
    assert ("usage: tide" in out.stdout) if "--help" in argv else ("must be an integer" in out.stderr)


def test_the_entry_point_is_the_light_module():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # (Python 3.11 and later)

    project = tomllib.loads((Path(tide_cli.__file__).parents[1] / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["tide"] == "tide_cli:main"


def test_bounds_from_tides_modules_are_read_when_the_option_is_given():
    from tide.config import MAX_DRAFT_TOPK

    parser = tide_cli.build_parser()
    assert parser.parse_args(["generate", "m", "p", "--draft-topk", str(MAX_DRAFT_TOPK)]).draft_topk == MAX_DRAFT_TOPK
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "m", "p", "--draft-topk", str(MAX_DRAFT_TOPK + 1)])
