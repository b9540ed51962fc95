"""Add to a SmolLM2 router repo's calibration record what a cycle of its kept schemes costs in base steps
(`cycle_steps`), measured as `tide.calibrate` now does after its timing trials: for a repo calibrated before
calibration recorded it. Run it on the machine, and the threads, that timed the schemes (the record's
`timing_machine`); another machine's pay check then scales the recorded timings by its own measurement.

    python examples/bench_real/record_cycle_steps.py examples/bench_real/routers-smollm2
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realmodel  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("routers")
    args = parser.parse_args(argv)
    import tide
    from tide.decode import machinecheck

    config_path = Path(args.routers) / "config.json"
    config = json.loads(config_path.read_text())
    timed_on = (config.get("calibration") or {}).get("timing_machine")
    threads = re.search(r":(\d+) threads$", timed_on or "")
    if not threads:
        raise SystemExit(f"{config_path}: the record names no machine its trials ran on (timing_machine {timed_on!r})")
    torch.set_num_threads(int(threads.group(1)))
    base, _ = realmodel.load()
    model = tide.TideForCausalLM.from_pretrained(args.routers, base_model=base)
    if machinecheck.machine_name(model) != timed_on:
        raise SystemExit(f"the trials ran on {timed_on}; this is {machinecheck.machine_name(model)}")
    record = machinecheck.record_cycle_steps(model)
    config["calibration"] = record
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    chosen = (record.get("draft_selection") or {}).get("chosen") or {}
    compiled = [c.get("cycle_steps") for c in record.get("compiled_chains") or []]
    print(f"eager scheme: {chosen.get('cycle_steps')} base steps a cycle; compiled chains: {compiled}")


if __name__ == "__main__":
    main()
