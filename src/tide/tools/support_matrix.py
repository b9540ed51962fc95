"""The support matrix: every causal-LM model type in transformers, checked on a tiny random-init model.

For each model type in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` whose tiny config (`tide.models.tiny`) builds offline, and
each named variant of a family whose config switches take other code paths (`tiny.VARIANTS`, e.g.
`falcon[mha-sequential,rotary,sdpa]`), `check_model_type` wraps it with `TideForCausalLM.from_base` and runs four
checks:

- `exact`: `exit_threshold=1.0` gives the base model's greedy tokens;
- `forced_exit`: every decode token forced out after layer 1 gives the tokens of an independent reference
  (the base model's own forward with hooks that feed layers > 1 the layer-1 state), runs exactly 2 layers
  per decode token, never runs a skipped layer's work after its cache write (attention core, MLP), and in
  decode steps a skipped layer computes only its K/V (`only_kv_linears`): forward hooks on every linear module
  of every skipped layer see only modules whose outputs reach that layer's `cache.update()` in the base model's
  own decode step (found by differentiating the written K/V with respect to each linear's outputs), at most
  once per step, and the outputs of a fused projection that do not reach the K/V (its query rows) are zeros,
  i.e. not computed;
- `lossless`: lossless mode (drafts from layer 1) gives the base model's greedy tokens;
- `batch`: a left-padded batch whose rows exit at different checkpoints gives each row's tokens alone.

Status: `full` (all four pass), `exit only` (lossless refused with a clear error), `refused` (`from_base`
refuses with a clear reason), `untested` (the tiny config does not build offline), `fails` (a check failed
or crashed: a bug). `python -m tide.tools.support_matrix --markdown docs/support.md` writes docs/support.md.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..config import TideConfig
from ..layers.kvfill import fill_path
from ..layers.kvprobe import is_linear, kv_plan
from ..modeling import TideForCausalLM
from ..models.architectures import refusal_reason, resolve
from ..models.tiny import HIDDEN, NUM_LAYERS, VARIANTS, VOCAB, tiny_config, tiny_model
from .references import AfterPrefill, kv_reach, only_kv_linears, reference_forced_exit, work_after_cache_write

__all__ = ["CHECKS", "MatrixResult", "check_model_type", "model_types", "run_matrix", "markdown_table",
           "reference_forced_exit", "work_after_cache_write", "kv_reach", "only_kv_linears", "kv_fill_note"]

CHECKS = ("exact", "forced_exit", "lossless", "batch")
MAX_PARAMETERS = 3_000_000  # tiny configs above this (multimodal towers, fixed-size blocks) are not built
NEW_TOKENS = 6
EXIT_LAYER = 1


@dataclass
class MatrixResult:
    model_type: str
    status: str  # full | exit only | refused | untested | fails
    reason: str = ""  # why not full; for a full row, a note (the K/V of skipped layers filled layer by layer)
    checks: dict[str, str] = field(default_factory=dict)  # check -> "pass" | "refused: ..." | "FAIL: ..."
    seconds: float = 0.0


def model_types() -> list[str]:
    """Every causal-LM model type in transformers, and the named variants (each after its family)."""
    return sorted([*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *VARIANTS])


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _build(model_type: str):
    """The tiny model of `model_type` (or a variant's name), or a refusal read from its structure alone (built on
    the meta device, so models too large to build here are still judged)."""
    config = tiny_config(model_type)
    with torch.device("meta"):
        shape = AutoModelForCausalLM.from_config(config)
    reason = refusal_reason(shape)
    if reason:
        raise _Refused(f"Tide cannot run early exit on model type {model_type!r}: {reason}.")
    size = sum(p.numel() for p in shape.parameters())
    if size > MAX_PARAMETERS:
        raise RuntimeError(f"the shrunk config still has {size:,} parameters")
    return tiny_model(model_type)


class _Refused(Exception):
    pass


def _prompt(rows: int = 1, length: int = 7, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB - 4, (rows, length), generator=generator)


GREEDY = dict(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)


def _greedy(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, pad_token_id=0, **GREEDY, **kwargs)


def check_exact(model, base) -> None:
    ids = _prompt()
    ref, out = _greedy(base, ids), _greedy(model, ids, tide_config={"exit_threshold": 1.0})
    if not torch.equal(out, ref):
        raise AssertionError(f"exit_threshold=1.0 gave {out[0, -NEW_TOKENS:].tolist()}, "
                             f"the base model {ref[0, -NEW_TOKENS:].tolist()}")


def kv_fill_note(parts) -> str:
    """Empty where the batched K/V fill (`kvfill`) writes the skipped layers' cache; else why it cannot, and what the
    layer-by-layer fill costs instead."""
    path = fill_path(parts)
    if not path.startswith("layer by layer"):
        return ""
    return (f"K/V of skipped layers filled layer by layer ({path.removeprefix('layer by layer: ')}): each skipped "
            "layer's own code runs to its cache write, one partial layer call per skipped layer and token (the "
            "query projection called, returning zeros, not computed), where the batched fill runs one matmul for all")


def check_forced_exit(model, base) -> str:
    parts, ids = model.parts, _prompt()
    eos = base.generation_config.eos_token_id  # generate suppresses it (min_new_tokens); so does the reference
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    expected = reference_forced_exit(base, parts, ids, EXIT_LAYER, NEW_TOKENS, suppress=eos)
    skipped = EXIT_LAYER + 1
    after_write = work_after_cache_write(base, parts, skipped, ids)
    deep = list(range(skipped, parts.num_layers))
    reach = kv_reach(base, parts, deep, ids)
    kv_plan(parts)  # the probe (once per model, on its own inputs) runs before the first decode step is counted
    decoding, ran, linears = [], set(), {}

    def note(name):
        if decoding:
            ran.add(name)

    def linear_called(key, out):
        if not decoding:
            return
        kv, beyond = reach.get(key), 0.0
        if isinstance(out, torch.Tensor) and out.numel():
            if kv is None or out.shape[-1] != kv.numel():
                beyond = float(out.abs().max())  # nothing of it reaches the K/V
            elif not bool(kv.all()):
                beyond = float(out[..., ~kv.to(out.device)].abs().max())
        count, worst = linears.get(key, (0, 0.0))
        linears[key] = (count + 1, max(worst, beyond))

    hooks = [m.register_forward_hook(lambda *_a, name=name: note(name))
             for name, m in parts.layers[skipped].named_modules() if not list(m.children())]
    hooks += [m.register_forward_hook(lambda _m, _a, out, key=(j, name): linear_called(key, out))
              for j in deep for name, m in parts.layers[j].named_modules() if is_linear(m)]
    try:
        out = _greedy(model, ids, tide_config={"exit_threshold": -1.0},
                      logits_processor=LogitsProcessorList([AfterPrefill(decoding)]))
    finally:
        for h in hooks:
            h.remove()
    if not torch.equal(out, expected):
        raise AssertionError(f"forced exit gave {out[0, -NEW_TOKENS:].tolist()}, "
                             f"the reference {expected[0, -NEW_TOKENS:].tolist()}")
    stats, steps = model.last_stats, NEW_TOKENS - 1
    if stats.exits != {str(EXIT_LAYER): steps} or stats.layer_passes != skipped * steps:
        raise AssertionError(f"expected {skipped} layer passes per decode token and every exit at layer "
                             f"{EXIT_LAYER}; got {stats.layer_passes} passes, exits {stats.exits}")
    if ran & after_write:
        raise AssertionError(f"a skipped layer ran {sorted(ran & after_write)} for decode tokens")
    problems = only_kv_linears(linears, reach, steps)
    if problems:
        raise AssertionError("a skipped layer computed more than its K/V: " + "; ".join(problems[:4]))
    return kv_fill_note(parts)


def check_lossless(model, base) -> None:
    ids = _prompt()
    ref = _greedy(base, ids)
    out = _greedy(model, ids, tide_config={"mode": "lossless", "draft_layer": EXIT_LAYER, "max_draft": 2})
    if not torch.equal(out, ref):
        raise AssertionError(f"lossless gave {out[0, -NEW_TOKENS:].tolist()}, "
                             f"the base model {ref[0, -NEW_TOKENS:].tolist()}")


def check_batch(model, base) -> None:
    with torch.no_grad():  # decisive routers: rows leave at different checkpoints
        for layer in model.checkpoints:
            model.routers[layer].up.weight.mul_(40.0)
    cfg = {"exit_threshold": 0.5}
    prompts = [_prompt(length=n, seed=n) for n in (7, 3, 5)]
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:], mask[i, width - p.shape[1]:] = p[0], 1
    together = _greedy(model, ids, attention_mask=mask, tide_config=cfg)
    for i, p in enumerate(prompts):
        alone = _greedy(model, p, tide_config=cfg)
        if not torch.equal(together[i, -NEW_TOKENS:], alone[0, -NEW_TOKENS:]):
            raise AssertionError(f"row {i} in a left-padded batch gave {together[i, -NEW_TOKENS:].tolist()}, "
                                 f"alone {alone[0, -NEW_TOKENS:].tolist()}")


_RUNNERS = {"exact": check_exact, "forced_exit": check_forced_exit, "lossless": check_lossless, "batch": check_batch}


def _config_for(check: str, num_layers: int) -> TideConfig:
    if check == "batch":
        return TideConfig(checkpoint_layers=[0, min(2, num_layers - 2)])
    return TideConfig(checkpoint_layers=[EXIT_LAYER])


def check_model_type(model_type: str) -> MatrixResult:
    """Build a tiny `model_type`, wrap it, and run the four checks (see the module docstring)."""
    start = time.perf_counter()
    result, notes = MatrixResult(model_type, "full"), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            base = _build(model_type)
        except _Refused as err:
            result.status, result.reason = "refused", str(err)
            return result
        except Exception as err:  # noqa: BLE001 - any failure to build is reported, not raised
            result.status, result.reason = "untested", f"tiny config does not build offline ({_first_line(err)})"
            return result
        try:
            num_layers = resolve(base).num_layers
        except ValueError as err:
            result.status, result.reason = "refused", _first_line(err)
            return result
        except Exception as err:  # noqa: BLE001
            result.status, result.reason = "fails", f"from_base crashed: {_first_line(err)}"
            return result
        for check in CHECKS:
            try:
                model = TideForCausalLM.from_base(base, _config_for(check, num_layers))
            except ValueError as err:
                result.status, result.reason = "refused", _first_line(err)
                break
            except Exception as err:  # noqa: BLE001
                result.status, result.reason = "fails", f"from_base crashed: {_first_line(err)}"
                break
            try:
                notes.append(_RUNNERS[check](model, base))
                result.checks[check] = "pass"
            except (ValueError, NotImplementedError) as err:
                result.checks[check] = f"refused: {_first_line(err)}"
            except Exception as err:  # noqa: BLE001
                result.checks[check] = f"FAIL: {_first_line(err)}"
    result.seconds = time.perf_counter() - start
    if result.status in ("full", "exit only") and result.checks:
        failed = [c for c, v in result.checks.items() if v != "pass"]
        if any(result.checks[c].startswith("FAIL") for c in failed) or any(c != "lossless" for c in failed):
            result.status = "fails"
        elif failed:
            result.status = "exit only"
        result.reason = "; ".join(f"{c}: {result.checks[c]}" for c in failed)
        if result.status == "full":
            result.reason = "; ".join(n for n in notes if n)
    return result


def run_matrix(types: list[str] | None = None, verbose: bool = False) -> list[MatrixResult]:
    results = []
    for model_type in types or model_types():
        result = check_model_type(model_type)
        if verbose:
            print(f"{model_type:28s} {result.status:10s} {result.seconds:5.1f}s {result.reason[:150]}", flush=True)
        results.append(result)
    return results


_HEADER = """# Supported model types

Generated by `python -m tide.tools.support_matrix --markdown docs/support.md` (transformers {version}); do not edit by
hand. Every causal-LM model type in transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` gets a tiny random-init
model from its config class (`tide.models.tiny`: {layers} layers, hidden {hidden}, vocabulary {vocab}) and four checks;
so does each configuration of a family whose switches take other code paths in its modeling file (a row such as
`falcon[mha-sequential,rotary,sdpa]`: layout, positions, attention implementation; `tide.models.tiny.VARIANTS`):

- **exact**: `exit_threshold=1.0` gives the base model's greedy tokens;
- **forced exit**: every decode token forced out after layer {exit_layer} gives the tokens of an independent
  reference (the base model's own forward, hooked), with exactly {passes} layer passes per token, no skipped
  layer running its attention or MLP, and in decode steps no skipped layer computing anything but its K/V:
  forward hooks on every linear module of every skipped layer find only the modules whose outputs reach that
  layer's `cache.update()` in the base model's own decode step (read from the gradient of the written K/V),
  at most once a step, and zeros (nothing computed) in every output that does not reach it: no query
  projection, only the K/V rows of a fused qkv projection;
- **lossless**: lossless mode (drafts from layer {exit_layer}) gives the base model's greedy tokens;
- **batch**: a left-padded batch whose rows exit at different checkpoints gives each row's tokens alone.

Status: **full** = all four pass; **refused** = `TideForCausalLM.from_base` raises a `ValueError` with the reason
(encoder-decoder models, recurrent or linear-attention state, sparse-attention indexer caches, models without a
`DynamicCache`, or a structure the probe cannot find); **untested** = its tiny config does not build offline here
(too large after shrinking, or the config class needs values the generic shrink cannot guess), so nothing is
claimed; **fails** = a check failed (none at the time of writing: the test suite runs this matrix). A full row's
reason, where it has one, says that its skipped layers' K/V are filled layer by layer, and why the batched fill
(one matmul with every skipped layer's K/V weights stacked, calling no module of those layers) does not reproduce
them (`tide.layers.kvfill.fill_path`).

"""


def markdown_table(results: list[MatrixResult]) -> str:
    import transformers

    counts = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    header = _HEADER.format(version=transformers.__version__, layers=NUM_LAYERS, hidden=HIDDEN, vocab=VOCAB,
                            exit_layer=EXIT_LAYER, passes=EXIT_LAYER + 1)
    summary = ", ".join(f"{counts.get(s, 0)} {s}" for s in ("full", "refused", "untested", "fails"))
    lines = ["| model type | status | reason |", "|---|---|---|"] + [
        f"| `{r.model_type}` | {r.status} | {r.reason.replace('|', '/')} |" for r in results]
    variants = sum(r.model_type in VARIANTS for r in results)
    return (header + f"{len(results) - variants} model types and {variants} variants: {summary}.\n\n"
            + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="default: every causal-LM model type in transformers")
    parser.add_argument("--markdown", help="write the table to this file")
    args = parser.parse_args(argv)
    results = run_matrix(args.model_types or None, verbose=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(results))
    return 0 if not any(r.status == "fails" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
