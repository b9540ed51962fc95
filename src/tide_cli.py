"""The `tide` command: its arguments, parsed before anything heavy is imported.

This module stands outside the `tide` package on purpose: importing `tide` imports torch and transformers (and
registers Tide with transformers' auto classes), which takes seconds. `tide --help`, a subcommand's `--help` and
argument errors are answered here alone; a command that runs imports `tide.tools.cli`, which does the work.
"""

from __future__ import annotations

import argparse
import math
import sys

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """The `tide` command: parse the arguments, then run the command (`tide.tools.cli.run`)."""
    args = build_parser().parse_args(argv)
    from tide.tools import cli

    return cli.run(args, argv)


def _max_draft_topk() -> int:
    from tide.config import MAX_DRAFT_TOPK

    return MAX_DRAFT_TOPK


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line, `tide <command>: error: ...` (exit code 2), like the commands' own errors."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _integer(minimum, maximum=None, allowed: tuple[int, ...] = ()):
    """argparse type: an integer in [minimum, maximum] (or one of `allowed`); a bound may be a function, called when
    the option is given (bounds that live in Tide's modules, imported only then)."""
    def parse(text: str) -> int:
        low, high = (bound() if callable(bound) else bound for bound in (minimum, maximum))
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or (value not in allowed and (value < low or (high is not None and value > high))):
            bounds = f"from {low} to {high}" if high is not None else f">= {low}"
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
    if text == "auto":
        return text
    import torch  # (only for a --dtype given: `tide --help` imports no torch)

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
    p.add_argument("--decode-threads", type=_integer(1), metavar="N",
                   help="time costs and trials on N CPU threads, the threads decoding will use (default: the "
                        "process's own)")
    p.add_argument("--no-pin-cores", action="store_true",
                   help="under `accelerate launch --cpu`, leave the processes' cores as launched (by default each "
                        "process of one machine takes its own share of the cores)")

    p = sub.add_parser("generate", help="generate text with early exit (or losslessly)")
    p.add_argument("model", help="router repo (or a plain model, run without exits)")
    p.add_argument("prompt")
    p.add_argument("--mode", choices=["exit", "lossless", "auto"],
                   help="default: the router repo's (calibration picks the faster of exit and lossless)")
    p.add_argument("--threshold", type=_number(1.0), help="exit mode: override the calibrated thresholds")
    p.add_argument("--draft-layer", type=_integer(0),
                   help="lossless mode: the checkpoint whose draft head (or exit head) drafts")
    p.add_argument("--max-draft", type=_integer(0), help="lossless mode: most drafts per verification (0: no drafting)")
    p.add_argument("--draft-topk", type=_integer(1, _max_draft_topk),
                   help="lossless mode, greedy: verify the draft head's k best tokens together "
                        "(a one-level draft tree; 1: chain drafts)")
    p.add_argument("--draft-vocab-size", type=_integer(_max_draft_topk, allowed=(0,)),
                   help="lossless mode: drafts rank only this many most-predicted "
                        "tokens (0: the whole vocabulary)")
    p.add_argument("--kv-strategy", choices=["propagate", "recompute"])
    p.add_argument("--max-new-tokens", type=_integer(1), default=64)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")

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

    p = sub.add_parser("import-tide", help="convert a TIDE router.pt into a Tide router repo")
    p.add_argument("router", help="path to TIDE's router.pt")
    p.add_argument("--base", required=True, help="the base model the routers were trained on")
    p.add_argument("--out", required=True)

    p = sub.add_parser("demo", help="the whole job on the shipped model: calibrate, save, load, generate, measure")
    p.add_argument("--out", default="tide-demo-routers", help="where to write the router repo")
    p.add_argument("--quick", action="store_true", help="fewer calibration samples (for smoke tests)")

    p = sub.add_parser("check", help="measure whether a router repo's drafting scheme pays on this machine (what "
                                     "a lossless call at the repo's defaults checks once and caches)")
    p.add_argument("model", help="router repo (local directory or Hub id)")
    p.add_argument("--dtype", type=_dtype, default="auto", help="auto, or a torch dtype: float32, bfloat16, float16")
    p.add_argument("--remeasure", action="store_true", help="measure again and replace the cached measurement")

    p = sub.add_parser("warmup", help="compile a router repo's compile=True calls once; save the compiled work "
                                      "for later processes")
    p.add_argument("model", help="router repo (local directory or Hub id)")
    p.add_argument("--sample", action="store_true", help="also compile the sampled calls' graphs")
    p.add_argument("--new-tokens", type=_integer(1), default=48)
    return parser


if __name__ == "__main__":
    sys.exit(main())
