"""The `tide` command line: calibrate, generate, bench, import-tide, demo, warmup.

Each subcommand is a thin layer over the library; errors are printed as one line that says what to do.
"""

from __future__ import annotations

import argparse
import math
import pickle
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TextStreamer

from ..calibration.data import check_local_dataset
from ..calibration.distributed import Processes, join_as_rank_zero, processes_asked_of_accelerate
from ..calibration.run import calibrate
from ..config import MAX_DRAFT_TOPK, TideConfig
from ..hub.card import calibration_table
from ..hub.repos import check_save_directory
from ..modeling import TideForCausalLM
from .bench import plot_bench, run_bench, save_results
from .convert import convert_tide_routers
from .demo import demo_model_and_texts, run_demo

__all__ = ["main"]


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
                           pin_cores=not args.no_pin_cores)
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


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line, `tide <command>: error: ...` (exit code 2), like the commands' own errors."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _integer(minimum: int, maximum: int | None = None, allowed: tuple[int, ...] = ()):
    """argparse type: an integer in [minimum, maximum] (or one of `allowed`)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or (value not in allowed and (value < minimum or (maximum is not None and value > maximum))):
            bounds = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}"
                                             + "".join(f" or {a}" for a in allowed) + f", got {text!r}")
        return value
    return parse


def _number(high: float, low: float | None = None, low_included: bool = False):
    """argparse type: a finite number <= high (and > low where given; >= low with `low_included`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if (not math.isfinite(value) or value > high
                or (low is not None and (value < low if low_included else value <= low))):
            bounds = (f"in {'[' if low_included else '('}{low:g}, {high:g}]" if low is not None else f"<= {high:g}")
            raise argparse.ArgumentTypeError(f"must be a finite number {bounds}, got {text!r}")
        return value
    return parse


def _budget(text: str) -> float | str | None:
    """argparse type for --timing-budget-s: 'auto', 'none' (no cap) or seconds in [0, 86400]."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    return _number(86400.0, low=0.0, low_included=True)(text)


def _dtype(text: str) -> str:
    """argparse type: 'auto' or the name of a torch floating-point dtype."""
    if text != "auto" and not (isinstance(getattr(torch, text, None), torch.dtype)
                               and getattr(torch, text).is_floating_point):
        raise argparse.ArgumentTypeError(f"must be 'auto' or a torch floating-point dtype such as float32, bfloat16 or "
                                         f"float16, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tide", description="Per-token early exit for HuggingFace causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("calibrate", help="train routers and calibrate thresholds; write a router repo")
    p.add_argument("model", help="base model: Hub id or local directory")
    p.add_argument("--dataset", help="Hub dataset name, local .txt/.jsonl/.csv file or directory")
    p.add_argument("--prompts", metavar="FILE", help="a text file of prompts, one a line: the model's own answers "
                   "(through its chat template where it has one) become calibration text, alone or beside --dataset")
    p.add_argument("--dataset-config", help="dataset configuration name (e.g. wikitext-2-raw-v1)")
    p.add_argument("--split", default="train")
    p.add_argument("--text-column")
    p.add_argument("--out", required=True, help="directory for the router repo")
    p.add_argument("--push-to-hub", metavar="REPO", help="also upload the router repo to this Hub repo id")
    p.add_argument("--num-samples", type=_integer(2), default=512)
    p.add_argument("--max-length", type=_integer(2), default=256)
    p.add_argument("--batch-size", type=_integer(1), default=8)
    p.add_argument("--checkpoint-interval", type=_integer(1), default=4)
    p.add_argument("--checkpoint-layers", type=_integer(0), nargs="+", help="explicit 0-based checkpoint layers")
    p.add_argument("--target-agreement", type=_number(1.0, low=0.0), default=0.99)
    p.add_argument("--label", choices=["top1", "cosine"], default="top1")
    p.add_argument("--dtype", type=_dtype, default="auto", help="auto, or a torch dtype: float32, bfloat16, float16")
    p.add_argument("--timing-budget-s", type=_budget, default="auto", metavar="SECONDS",
                   help="cap the timing trials (exit mode, drafting schemes by estimate, the compiled default): a "
                        "trial starts only while they have taken less; the card lists those cut (default: auto, a "
                        "third of the other phases' time, at least 30 s; 'none': no cap)")
    p.add_argument("--compiled-trials", action="store_true",
                   help="also time the kept mode compiled (torch.compile) against the base model's compiled decode")
    p.add_argument("--no-pin-cores", action="store_true",
                   help="under `accelerate launch --cpu`, leave the processes' cores as launched (by default each "
                        "process of one machine takes its own share of the cores)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("generate", help="generate text with early exit (or losslessly)")
    p.add_argument("model", help="router repo (or a plain model, run without exits)")
    p.add_argument("prompt")
    p.add_argument("--mode", choices=["exit", "lossless", "auto"],
                   help="default: the router repo's (calibration picks the faster of exit and lossless)")
    p.add_argument("--threshold", type=_number(1.0), help="exit mode: override the calibrated thresholds")
    p.add_argument("--draft-layer", type=_integer(0),
                   help="lossless mode: the checkpoint whose draft head (or exit head) drafts")
    p.add_argument("--max-draft", type=_integer(0), help="lossless mode: most drafts per verification (0: no drafting)")
    p.add_argument("--draft-topk", type=_integer(1, MAX_DRAFT_TOPK),
                   help="lossless mode, greedy: verify the draft head's k best tokens together "
                        "(a one-level draft tree; 1: chain drafts)")
    p.add_argument("--draft-vocab-size", type=_integer(MAX_DRAFT_TOPK, allowed=(0,)),
                   help="lossless mode: drafts rank only this many most-predicted "
                        "tokens (0: the whole vocabulary)")
    p.add_argument("--kv-strategy", choices=["propagate", "recompute"])
    p.add_argument("--max-new-tokens", type=_integer(1), default=64)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="speed/quality side by side; JSON + PNG plot")
    p.add_argument("model", nargs="?", help="router repo (default: the shipped demo model, calibrated on the fly)")
    p.add_argument("--routers", help="router repo for the demo model (skips calibration)")
    p.add_argument("--heldout", help="held-out text file (paragraphs separated by blank lines)")
    p.add_argument("--heldout-texts", type=_integer(1), default=24)
    p.add_argument("--prompt", action="append", help="prompt to time (repeatable)")
    p.add_argument("--new-tokens", type=_integer(1), default=48)
    p.add_argument("--repeats", type=_integer(1), default=3)
    p.add_argument("--no-compiled-baseline", action="store_true",
                   help="skip the second baseline: the base model's compiled static-cache decode "
                        "(compiling takes seconds)")
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write the quality/speed plot here (PNG)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("import-tide", help="convert a TIDE router.pt into a Tide router repo")
    p.add_argument("router", help="path to TIDE's router.pt")
    p.add_argument("--base", required=True, help="the base model the routers were trained on")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_import_tide)

    p = sub.add_parser("demo", help="the whole job on the shipped model: calibrate, save, load, generate, measure")
    p.add_argument("--out", default="tide-demo-routers", help="where to write the router repo")
    p.add_argument("--quick", action="store_true", help="fewer calibration samples (for smoke tests)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("warmup", help="compile a router repo's compile=True calls once; save the compiled work "
                                      "for later processes")
    p.add_argument("model", help="router repo (local directory or Hub id)")
    p.add_argument("--sample", action="store_true", help="also compile the sampled calls' graphs")
    p.add_argument("--new-tokens", type=_integer(1), default=48)
    p.set_defaults(func=cmd_warmup)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "calibrate" and (asked := processes_asked_of_accelerate()) > 1:
        return _launch(asked, sys.argv[1:] if argv is None else argv)
    try:
        args.func(args)
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
