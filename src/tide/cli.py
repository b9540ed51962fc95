"""The `tide` command line: calibrate, generate, bench, import-tide, demo.

Each subcommand is a thin layer over the library; errors are printed as one line that says what to do.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TextStreamer

from .bench import plot_bench, run_bench, save_results
from .calibrate import calibrate, calibration_table
from .config import TideConfig
from .convert import convert_tide_routers
from .demo import demo_model_and_texts, run_demo
from .distributed import Processes
from .modeling import TideForCausalLM

__all__ = ["main"]


def _load(name_or_path: str, dtype: str = "auto"):
    """(TideForCausalLM or base model, tokenizer) for a router repo or a plain model."""
    if name_or_path.startswith(("/", ".", "~")) and not Path(name_or_path).expanduser().exists():
        raise FileNotFoundError(f"{name_or_path}: no such directory (pass a router repo or model directory, or a Hub id)")
    config = AutoConfig.from_pretrained(name_or_path)
    if isinstance(config, TideConfig):
        model = TideForCausalLM.from_pretrained(name_or_path, dtype=dtype)
        return model, AutoTokenizer.from_pretrained(name_or_path)  # the base model's, named in the repo
    return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype), AutoTokenizer.from_pretrained(name_or_path)


def cmd_calibrate(args) -> None:
    config = TideConfig(
        checkpoint_layers=args.checkpoint_layers,
        checkpoint_interval=args.checkpoint_interval,
        target_agreement=args.target_agreement,
        label=args.label,
    )
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = calibrate(base, tokenizer, dataset=args.dataset, config=config, dataset_config=args.dataset_config,
                           split=args.split, text_column=args.text_column, num_samples=args.num_samples,
                           max_length=args.max_length, batch_size=args.batch_size)
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
        kwargs["streamer"] = TextStreamer(tokenizer, skip_prompt=False)
    if isinstance(model, TideForCausalLM):
        kwargs["tide_config"] = _tide_overrides(args)
    else:
        print("(no routers: this is the plain base model; make a router repo with `tide calibrate`)", file=sys.stderr)
    out = model.generate(**inputs, **kwargs)
    if not args.stream:
        print(tokenizer.decode(out[0], skip_special_tokens=True))
    stats = getattr(model, "last_stats", None)
    if stats is not None:
        print("\n" + stats.summary())
    elif isinstance(model, TideForCausalLM):
        print("\n(the base model ran unchanged: no exits or drafts pay here, or none were configured)")


def cmd_bench(args) -> None:
    if args.model:
        model, tokenizer = _load(args.model)
        heldout = Path(args.heldout).read_text().split("\n\n") if args.heldout else None
        if heldout is None:
            raise SystemExit("tide bench MODEL needs --heldout FILE (text paragraphs separated by blank lines).")
        prompts = args.prompt or [p[:80] for p in heldout[:3]]
    else:
        model, tokenizer, prompts, heldout = demo_model_and_texts(args.routers)
        prompts = args.prompt or prompts
    results = run_bench(model, tokenizer, prompts, heldout[: args.heldout_texts], new_tokens=args.new_tokens,
                        repeats=args.repeats)
    if args.json:
        save_results(results, args.json)
        print(f"results: {args.json}")
    if args.plot:
        plot_bench(results, args.plot)
        print(f"plot: {args.plot}")


def cmd_import_tide(args) -> None:
    base = AutoModelForCausalLM.from_pretrained(args.base)
    model = convert_tide_routers(args.router, base)
    model.save_pretrained(args.out)
    print(f"Imported {len(model.checkpoints)} routers (checkpoints {model.checkpoints}) into {args.out}")


def cmd_demo(args) -> None:
    run_demo(out_dir=args.out, quick=args.quick)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tide", description="Per-token early exit for HuggingFace causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("calibrate", help="train routers and calibrate thresholds; write a router repo")
    p.add_argument("model", help="base model: Hub id or local directory")
    p.add_argument("--dataset", required=True, help="Hub dataset name, local .txt/.jsonl/.csv file or directory")
    p.add_argument("--dataset-config", help="dataset configuration name (e.g. wikitext-2-raw-v1)")
    p.add_argument("--split", default="train")
    p.add_argument("--text-column")
    p.add_argument("--out", required=True, help="directory for the router repo")
    p.add_argument("--push-to-hub", metavar="REPO", help="also upload the router repo to this Hub repo id")
    p.add_argument("--num-samples", type=int, default=512)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--checkpoint-interval", type=int, default=4)
    p.add_argument("--checkpoint-layers", type=int, nargs="+", help="explicit 0-based checkpoint layers")
    p.add_argument("--target-agreement", type=float, default=0.99)
    p.add_argument("--label", choices=["top1", "cosine"], default="top1")
    p.add_argument("--dtype", default="auto")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("generate", help="generate text with early exit (or losslessly)")
    p.add_argument("model", help="router repo (or a plain model, run without exits)")
    p.add_argument("prompt")
    p.add_argument("--mode", choices=["exit", "lossless", "auto"],
                   help="default: the router repo's (calibration picks the faster of exit and lossless)")
    p.add_argument("--threshold", type=float, help="exit mode: override the calibrated thresholds")
    p.add_argument("--draft-layer", type=int, help="lossless mode: the checkpoint whose draft head (or exit head) drafts")
    p.add_argument("--max-draft", type=int, help="lossless mode: most drafts per verification (0: no drafting)")
    p.add_argument("--draft-topk", type=int, help="lossless mode, greedy: verify the draft head's k best tokens together "
                                                  "(a one-level draft tree; 1: chain drafts)")
    p.add_argument("--draft-vocab-size", type=int, help="lossless mode: drafts rank only this many most-predicted "
                                                        "tokens (0: the whole vocabulary)")
    p.add_argument("--kv-strategy", choices=["propagate", "recompute"])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="speed/quality side by side; JSON + PNG plot")
    p.add_argument("model", nargs="?", help="router repo (default: the shipped demo model, calibrated on the fly)")
    p.add_argument("--routers", help="router repo for the demo model (skips calibration)")
    p.add_argument("--heldout", help="held-out text file (paragraphs separated by blank lines)")
    p.add_argument("--heldout-texts", type=int, default=24)
    p.add_argument("--prompt", action="append", help="prompt to time (repeatable)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, OSError, RuntimeError, pickle.UnpicklingError, SafetensorError) as err:
        message = " ".join(str(err).split())  # one line, whatever the underlying error printed
        print(f"tide {args.command}: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
