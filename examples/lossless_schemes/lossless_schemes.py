"""Lossless drafting schemes timed against the base model, and one tree cycle timed piece by piece.

    python examples/lossless_schemes/lossless_schemes.py --routers DIR [--model DIR] [--schemes 0:1:1,0:1:3]

A scheme is `draft_layer:max_draft:draft_topk[:exit][:vN]` (topk 1: a chain of up to max_draft drafts; k > 1: a
tree of k candidates; `:exit` drafts from the exit head even where the layer has a draft head; `:vN` drafts over
the N most predicted tokens of the router repo's draft vocabulary). Each repeat runs the base model and every
scheme once, on one of the demo prompts in turn (interleaved, so that the machine's drift hits them alike); the
ratio is the median of the per-repeat ratios, with the interquartile range. `--pieces` also times the parts of one
tree cycle after a 40-token context.
Without `--model`, the shipped demo model; `--routers` is a router repo calibrated for that model
(e.g. the one `tide demo` saves).
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from tide import TideForCausalLM
from tide.models.compat import LengthView, keep_one_of_tail
from tide.tools.demo import DEMO_MODEL_DIR, DEMO_PROMPTS
from tide.layers.fewrows import few_row_linears
from tide.layers.calls import capture_layer_calls
from tide.layers.calltransforms import tree_mask_calls, without_first_position


def parse_schemes(text: str) -> list[tuple]:
    """'0:1:3,0:1:3:exit,1:1:2:v1024' -> [(0, 1, 3, 'draft', 0), (0, 1, 3, 'exit', 0), (1, 1, 2, 'draft', 1024)]."""
    schemes = []
    for item in text.split(","):
        fields = item.split(":")
        extra = fields[3:]
        vocab = next((int(f[1:]) for f in extra if f.startswith("v")), 0)
        schemes.append((*(int(v) for v in fields[:3]), "exit" if "exit" in extra else "draft", vocab))
    return schemes


class exit_head_drafts:
    """Within the block, the model drafts from its exit heads (its draft heads set aside)."""

    def __init__(self, model, active: bool):
        self.model, self.active, self.heads = model, active, {}

    def __enter__(self):
        if self.active:
            self.heads = {k: self.model.routers[k].draft for k in self.model.checkpoints}
            for k in self.heads:
                self.model.routers[k].draft = None

    def __exit__(self, *exc):
        for k, head in self.heads.items():
            self.model.routers[k].draft = head


def compare(model, tokenizer, schemes, repeats: int, new_tokens: int) -> None:
    prompts = [tokenizer(p, return_tensors="pt")["input_ids"] for p in DEMO_PROMPTS]
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def seconds(scheme, ids):
        start = time.perf_counter()
        if scheme is None:
            model.base.generate(ids, **kwargs)
        else:
            layer, length, topk, head, vocab = scheme
            with exit_head_drafts(model, head == "exit"):
                model.generate(ids, tide_config={"mode": "lossless", "draft_layer": layer, "max_draft": length,
                                                 "draft_topk": topk, "draft_vocab_size": vocab}, **kwargs)
        return time.perf_counter() - start

    runs = [None, *schemes]
    for scheme in runs:  # warm-up
        seconds(scheme, prompts[0])
    times = {scheme: [] for scheme in runs}
    for repeat in range(repeats):
        for scheme in runs:
            times[scheme].append(seconds(scheme, prompts[repeat % len(prompts)]))
    print(f"base: {statistics.median(times[None]) * 1000 / new_tokens:.2f} ms per token")
    print("draft layer | max draft | topk | drafts from | draft vocabulary | vs base [IQR] | accepted / drafted | "
          "layer passes per token")
    for scheme in schemes:
        ratios = sorted(b / t for b, t in zip(times[None], times[scheme]))
        accepted = drafted = passes = tokens = 0
        for ids in prompts:
            seconds(scheme, ids)
            s = model.last_stats
            accepted, drafted, passes, tokens = (accepted + s.accepted, drafted + s.drafted,
                                                 passes + s.layer_passes, tokens + s.decode_tokens)
        quart = len(ratios) // 4
        print(f"{scheme[0]} | {scheme[1]} | {scheme[2]} | {scheme[3]} head | {scheme[4] or 'all'} | "
              f"x{statistics.median(ratios):.3f} "
              f"[{ratios[quart]:.2f}-{ratios[-1 - quart]:.2f}] | {accepted} / {drafted} | {passes / tokens:.2f}")


@torch.no_grad()
def pieces(model, layer: int, topk: int, repeats: int = 60) -> None:
    """One tree cycle's parts, as `tide.decode.lossless.tree` runs them, against one base decode step."""
    parts, num_layers = model.parts, model.parts.num_layers
    ids = torch.randint(5, model.base.config.vocab_size - 1, (1, 41))
    blocked = torch.zeros(topk + 1, topk + 1, dtype=torch.bool)
    blocked[1:, 1:] = ~torch.eye(topk, dtype=torch.bool)
    cache = DynamicCache(config=model.base.config)
    model.base(ids[:, :40], past_key_values=cache, use_cache=True)
    times: dict = {}
    for repeat in range(repeats):
        marks = [("start", time.perf_counter())]

        def mark(name):
            marks.append((name, time.perf_counter()))

        model.base(ids[:, 40:], past_key_values=cache, use_cache=True)
        cache.crop(-1)
        mark("one base decode step (whole forward)")
        calls = capture_layer_calls(parts, input_ids=ids[:, 40:], past_key_values=cache, use_cache=True,
                                    position_ids=torch.tensor([[40]]))
        mark("x: capture")
        state = calls[0].hidden
        for i in range(layer + 1):
            state = calls[i].run(parts, i, state)
        mark(f"x: layers 0..{layer}")
        candidates = model.draft_logits(layer, state[:, -1], state[:, -1])[0].topk(topk, -1).indices
        mark("draft head + top-k")
        deep = capture_layer_calls(parts, input_ids=torch.cat([ids[:, 40:], candidates], 1),
                                   past_key_values=LengthView(cache, 40), use_cache=True,
                                   position_ids=torch.tensor([[40] + [41] * topk]))
        mark(f"capture of the {topk + 1}-position chunk")
        deep = tree_mask_calls(deep, blocked)
        shallow = without_first_position(deep[: layer + 1], topk + 1)
        mark("tree mask + slicing the candidates' calls")
        with few_row_linears(parts):
            states = shallow[0].hidden
            for i in range(layer + 1):
                states = shallow[i].run(parts, i, states)
            mark(f"candidates: layers 0..{layer}")
            states = torch.cat([state, states], 1)
            for i in range(layer + 1, num_layers):
                states = deep[i].run(parts, i, states)
            mark(f"layers {layer + 1}..{num_layers - 1} over {topk + 1} positions")
            parts.logits_from_normed(parts.final_norm(states))
            mark(f"final norm + head over {topk + 1} positions")
        for i in range(num_layers):
            keep_one_of_tail(cache, i, topk, 1)
        mark("keeping the accepted candidate's K/V")
        for i in range(num_layers):
            cache.layers[i].crop(-2)
        if repeat >= 10:
            for (_, before), (name, after) in zip(marks, marks[1:]):
                times.setdefault(name, []).append((after - before) * 1000)
    medians = {name: statistics.median(values) for name, values in times.items()}
    step = medians.pop("one base decode step (whole forward)")
    print(f"one base decode step: {step:.2f} ms")
    for name, ms in medians.items():
        print(f"{name:45s} {ms:6.2f} ms")
    print(f"{'cycle':45s} {sum(medians.values()):6.2f} ms ({sum(medians.values()) / step:.2f} steps)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_MODEL_DIR))
    parser.add_argument("--routers", required=True)
    parser.add_argument("--schemes", default="0:1:1,1:1:1,0:1:2,0:1:3,0:1:4,1:1:3,1:1:4")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pieces", action="store_true", help="also time one tree cycle piece by piece")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = AutoModelForCausalLM.from_pretrained(args.model).eval()
    model = TideForCausalLM.from_pretrained(args.routers, base_model=base)
    compare(model, AutoTokenizer.from_pretrained(args.model), parse_schemes(args.schemes), args.repeats,
            args.new_tokens)
    if args.pieces:
        pieces(model, layer=0, topk=3)


if __name__ == "__main__":
    main()
