"""The `tide` command line: calibrate, generate, bench, import-tide, demo, warmup, check.

Each subcommand is a thin layer over the library; errors are printed as one line that says what to do.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from safetensors import SafetensorError
from tide_cli import build_parser
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TextStreamer

from ..calibration.data import check_local_dataset
from ..calibration.distributed import Processes, join_as_rank_zero, processes_asked_of_accelerate
from ..calibration.run import calibrate
from ..config import TideConfig
from ..hub.card import calibration_table
from ..hub.repos import check_save_directory
from ..modeling import TideForCausalLM
from .bench import plot_bench, run_bench, save_results
from .convert import convert_tide_routers
from .demo import demo_model_and_texts, run_demo

__all__ = ["main", "run", "build_parser"]


def _load(name_or_path: str, dtype: str = "auto"):
    """(TideForCausalLM or base model, tokenizer) for a router repo or a plain model."""
    if name_or_path.startswith(("/", ".", "~")) and not Path(name_or_path).expanduser().exists():
        raise FileNotFoundError(f"{name_or_path}: no such directory "
                                "(pass a router repo or model directory, or a Hub id)")
    config = AutoConfig.from_pretrained(name_or_path)
    if isinstance(config, TideConfig):
        model = TideForCausalLM.from_pretrained(name_or_path, dtype=dtype)
        return model, AutoTokenizer.from_pretrained(name_or_path)  # the base model's, named in the repo
    return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype), AutoTokenizer.from_pretrained(name_or_path)


def _prompt_lines(path: str) -> list[str]:
    """The prompts of a text file: one a line, blank lines and lines starting with '#' skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read the prompts file {path}: {error}") from error
    prompts = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    if len(prompts) < 2:
        raise ValueError(f"{path} holds {len(prompts)} prompt(s); at least 2 are needed (one held out), one a line.")
    return prompts


def cmd_calibrate(args) -> None:
    check_save_directory(Path(args.out))  # before calibrating: --out must not hold another model
    if args.dataset is None and args.prompts is None:
        raise ValueError("pass --dataset (text to read) and/or --prompts (a file of prompts, one a line, for the "
                         "model to answer).")
    if args.dataset is not None:
        check_local_dataset(args.dataset)
    prompts = _prompt_lines(args.prompts) if args.prompts else None
    config = TideConfig(
        checkpoint_layers=args.checkpoint_layers,
        checkpoint_interval=args.checkpoint_interval,
        target_agreement=args.target_agreement,
        label=args.label,
    )
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = calibrate(base, tokenizer, dataset=args.dataset, prompts=prompts, config=config,
                           dataset_config=args.dataset_config, split=args.split, text_column=args.text_column,
                           num_samples=args.num_samples, max_length=args.max_length, batch_size=args.batch_size,
                           timing_budget_s=args.timing_budget_s, compiled_trials=args.compiled_trials,
                           decode_threads=args.decode_threads, pin_cores=not args.no_pin_cores)
    if not Processes.current(base.device).is_main:  # under `accelerate launch`: the main process writes
        return
    model.save_pretrained(args.out)
    print(f"Router repo written to {args.out}")
    print(calibration_table(model.config))
    if args.push_to_hub:
        model.push_to_hub(args.push_to_hub)
        print(f"Pushed to https://huggingface.co/{args.push_to_hub}")


def _tide_overrides(args) -> dict:
    overrides = {"mode": args.mode} if args.mode else {}
    if args.threshold is not None:
        overrides["exit_threshold"] = args.threshold
    if args.kv_strategy:
        overrides["kv_strategy"] = args.kv_strategy
    if args.draft_layer is not None:
        overrides["draft_layer"] = args.draft_layer
    if args.max_draft is not None:
        overrides["max_draft"] = args.max_draft
    if args.draft_topk is not None:
        overrides["draft_topk"] = args.draft_topk
    if args.draft_vocab_size is not None:
        overrides["draft_vocab_size"] = args.draft_vocab_size
    return overrides


def cmd_generate(args) -> None:
    model, tokenizer = _load(args.model)
    inputs = tokenizer(args.prompt, return_tensors="pt").to(model.device)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample)
    if args.stream:
        kwargs["streamer"] = TextStreamer(tokenizer, skip_prompt=False, skip_special_tokens=True)
    if isinstance(model, TideForCausalLM):
        kwargs["tide_config"] = _tide_overrides(args)
    else:
        print("(no routers: this is the plain base model; make a router repo with `tide calibrate`)", file=sys.stderr)
    out = model.generate(**inputs, **kwargs)
    if not args.stream:
        print(tokenizer.decode(out[0], skip_special_tokens=True))
    stats = getattr(model, "last_stats", None)  # (its plan says why, where the base model ran unchanged)
    if stats is not None:
        print("\n" + stats.summary())


def _read_heldout(path: str) -> list[str]:
    """The non-blank paragraphs of a held-out text file."""
    heldout = [p for p in Path(path).read_text().split("\n\n") if p.strip()]
    if not heldout:
        raise ValueError(f"--heldout {path} holds no text; pass a file of text paragraphs separated by blank lines.")
    return heldout


def cmd_bench(args) -> None:
    heldout = _read_heldout(args.heldout) if args.heldout else None  # before any work
    if args.model:
        if heldout is None:
            raise ValueError("tide bench MODEL needs --heldout FILE (text paragraphs separated by blank lines).")
        model, tokenizer = _load(args.model)
        prompts = args.prompt or [p[:80] for p in heldout[:3]]
    else:
        model, tokenizer, prompts, demo_heldout = demo_model_and_texts(args.routers)
        prompts = args.prompt or prompts
        heldout = heldout or demo_heldout
    results = run_bench(model, tokenizer, prompts, heldout[: args.heldout_texts], new_tokens=args.new_tokens,
                        repeats=args.repeats, compiled_baseline=not args.no_compiled_baseline)
    if args.json:
        save_results(results, args.json)
        print(f"results: {args.json}")
    if args.plot:
        plot_bench(results, args.plot)
        print(f"plot: {args.plot}")


def cmd_import_tide(args) -> None:
    check_save_directory(Path(args.out))
    base = AutoModelForCausalLM.from_pretrained(args.base)
    model = convert_tide_routers(args.router, base)
    model.save_pretrained(args.out)
    print(f"Imported {len(model.checkpoints)} routers (checkpoints {model.checkpoints}) into {args.out}")


def cmd_demo(args) -> None:
    run_demo(out_dir=args.out, quick=args.quick)


def cmd_warmup(args) -> None:
    from .warmup import warmup  # (imported here: `tide --help` stays fast)

    model, tokenizer = _load(args.model)
    if not isinstance(model, TideForCausalLM):
        raise ValueError(f"{args.model} is not a router repo; tide warmup compiles a router repo's compiled calls.")
    report = warmup(model, tokenizer, sampled=args.sample, new_tokens=args.new_tokens)
    for run in report["calls"]:
        print(f"{run['prompt_tokens']:>4} prompt tokens{' (sampled)' * run['sampled']}: {run['compile_s']:.1f} s "
              f"compiling, {run['graphs_compiled']} graphs, {run['recompiles']} recompiles ({run['plan']})")
    print(f"compiled work saved: {report['file'] or 'nothing to save'} ({report['seconds']:.1f} s in all)")


def cmd_check(args) -> None:
    from ..decode import machinecheck  # (imported here: `tide --help` stays fast)

    model, _ = _load(args.model, args.dtype)
    if not isinstance(model, TideForCausalLM):
        raise ValueError(f"{args.model} is not a router repo; tide check weighs a router repo's drafting scheme.")
    print(f"{args.model} on {machinecheck.machine_name(model)}:")
    for compiled in (False, True):
        why, verdict = machinecheck.check_defaults(model, compiled, remeasure=args.remeasure)
        call = "compile=True" if compiled else "eager"
        if verdict is None:
            print(f"  {call}: not checked: {why}")
            continue
        if verdict.get("timed") is not None:
            how = "from the repo's calibration record"
        elif verdict["cached"]:
            how = f"read from {machinecheck.cache_path(verdict['key'])}"
        else:
            how = f"measured in {verdict['measured_s']:.1f} s, kept in {machinecheck.cache_path(verdict['key'])}"
        print(f"  {call}: {machinecheck.decision_text(verdict)} (it pays from x{machinecheck.MARGIN:.2f}; {how})")


def main(argv: list[str] | None = None) -> int:
    """The `tide` command (`tide_cli.main` is its entry point, which parses before importing this module)."""
    return run(build_parser().parse_args(argv), argv)


def run(args, argv: list[str] | None = None) -> int:
    """Run the parsed command `args`; an expected failure is one line on stderr and exit code 2."""
    if args.command == "calibrate" and (asked := processes_asked_of_accelerate()) > 1:
        return _launch(asked, sys.argv[1:] if argv is None else argv)
    try:
        globals()["cmd_" + args.command.replace("-", "_")](args)  # (looked up now: `cmd_calibrate` etc.)
    except (ValueError, OSError, RuntimeError, pickle.UnpicklingError, SafetensorError) as err:
        message = " ".join(str(err).split())  # one line, whatever the underlying error printed
        print(f"tide {args.command}: error: {message}", file=sys.stderr)
        return 2
    return 0


def _launch(processes: int, argv: list[str]) -> int:
    """Run as the first of the `processes` a plain `accelerate launch --cpu --num_processes N` asked for (it started
    this one alone), starting the others on this machine (`join_as_rank_zero`); each then takes its own cores
    (`pin_cores`)."""
    print(f"tide calibrate: `accelerate launch --cpu` started 1 process of the {processes} asked for; starting the "
          f"other {processes - 1} (as `torchrun --nproc_per_node {processes}` would)", file=sys.stderr)
    others = join_as_rank_zero(processes, lambda: main(argv), [sys.executable, "-m", "tide.tools.cli", *argv])
    try:
        status = main(argv)
    except BaseException:
        for other in others:
            other.kill()
        raise
    return max([status] + [other.wait() for other in others])


if __name__ == "__main__":
    sys.exit(main())
