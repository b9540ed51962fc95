"""`tide warmup REPO`: compile a router repo's `compile=True` calls once and persist the compiled work.

Runs the repo's default compiled call greedy (and, with `sampled`, sampling) on a prompt whose text repeats (so that
n-gram drafts, where the repo drafts them, find continuations) and on a varied one, long enough for a chain's cap to
take every width; then writes what torch compiled to Tide's cache folder (`decode/compilecache.py`), where the first
compiled call of a later process finds it. The calls run inside `decode.precompiled.precompiling()`, so each one-graph
cycle or step is also saved whole, trace included, and a later process loads it without tracing the model again. It
does not time or compare anything (`tide bench` does).
"""

from __future__ import annotations

import time

import torch

__all__ = ["warmup"]


def warmup(model, tokenizer=None, sampled: bool = False, new_tokens: int = 48, compile_config=None) -> dict:
    """Run `model`'s (a TideForCausalLM) compiled calls and save the compiled work -> a report: the file written
    (None where torch had nothing to save), seconds, and per call its graphs compiled and compile seconds."""
    from ..decode import compilecache
    from ..decode.precompiled import precompiling
    from ..layers.spans import compile_options

    device = model.base.device
    prompts = _prompts(model, tokenizer, device)
    runs, start = [], time.perf_counter()
    for do_sample in (False, True) if sampled else (False,):
        for ids in prompts:
            kwargs = dict(max_new_tokens=new_tokens, do_sample=do_sample, tide_config={"compile": True})
            if compile_config is not None:
                kwargs["compile_config"] = compile_config
            with precompiling():
                model.generate(ids, **kwargs)
            stats = model.last_stats
            runs.append({"prompt_tokens": ids.shape[1], "sampled": do_sample, "plan": stats.plan,
                         "graphs_compiled": stats.graphs_compiled, "recompiles": stats.recompiles,
                         "compile_s": round(stats.compile_s, 2)})
    options = compile_options(compile_config or getattr(model.base.generation_config, "compile_config", None),
                              model.base.device.type)
    path = compilecache.save(model, options, device)
    return {"file": None if path is None else str(path), "seconds": round(time.perf_counter() - start, 1),
            "calls": runs}


def _prompts(model, tokenizer, device) -> list[torch.Tensor]:
    """Two prompts: a text that repeats itself, and a varied one (token ids where there is no tokenizer)."""
    if tokenizer is not None:
        texts = ["The cat sat on the mat. The cat sat on the mat. The cat sat on the",
                 "Write a short note about rivers, mountains and the weather in spring."]
        return [tokenizer(text, return_tensors="pt").input_ids.to(device) for text in texts]
    vocab = model.base.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    varied = torch.randint(4, max(vocab, 5), (1, 24), generator=generator)
    return [torch.cat([varied[:, :6]] * 4, 1).to(device), varied.to(device)]
