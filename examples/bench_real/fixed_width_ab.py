"""SmolLM2 chat: Tide's compiled default (fused chains whose width follows acceptance, `fused.next_cap`)
against the same chains at one fixed width (the scheme's `max_draft`: one graph, as fast GPU decoders run), both
baselines in the same process.

    python examples/bench_real/fixed_width_ab.py ROUTERS [PROMPTS] [OUT.json]
"""

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "bench_baselines")]

import bench_real  # noqa: E402
import realmodel  # noqa: E402
from bench_baselines import bench_rows  # noqa: E402

import tide  # noqa: E402
import tide.decode.lossless.graph as fused  # noqa: E402


def main(routers: str, prompts: int = 8, out: str | None = None) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base, tok = realmodel.load()
    model = tide.TideForCausalLM.from_pretrained(routers, base_model=base)
    greedy = dict(do_sample=False, max_new_tokens=64, min_new_tokens=64)
    adaptive = fused.next_cap

    def fixed_width(ids):
        fused.next_cap = lambda cap, width, accepted, max_draft: max_draft
        try:
            return model.generate(ids, **greedy, tide_config={"compile": True})
        finally:
            fused.next_cap = adaptive

    result = bench_rows(base, model, bench_real.prompts_for("chat", tok, prompts), 64, {"tide default": None},
                        repeats=2, compile=True, extra_rows={"fixed width compiled": fixed_width})
    if out:
        Path(out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]), *sys.argv[3:4])
