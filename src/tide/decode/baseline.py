"""The baseline a speed-minded user runs: the base model's decode on a static cache, its forward compiled.

Two forms of it:
- `BaseSession`: what a Tide call with `tide_config={"compile": True}` runs when Tide's modes do not pay there
  (no operating point, or calibration timed them no faster than this): the base model's own forward, one token
  a step, through one compiled graph of its forward (the model's compiled `SpanRunner.graph`, which `tide warmup`
  precompiles) on the static cache that the call asks generate for;
  generate's processors, stopping criteria and streamer are served by the exit-mode loop (`exits.loop.exit_decode`).
  The prompt, and steps that carry a padding mask (a growing mask is a new shape each step), run eagerly.
- `compiled_static_decoder(base, cache_len)`: the same decode as a bare greedy loop, outside `generate`, which
  `tide bench` and `examples/bench_baselines` time Tide against as well as against `generate`.
"""

from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..models.compat import mask_sizes_from_tensors
from .cachepool import dynamic_length
from .stats import GenerationStats

__all__ = ["BaseSession", "compiled_static_decoder"]


def _base_step(base, inputs: dict):
    """The compiled step (`SpanRunner.graph`: loaded precompiled where `tide warmup` saved it): the base model's forward
    on `inputs` -> its logits. The model is an argument and the output a tensor, so that a saved graph names neither
    (`precompiled.py`); the static cache is updated in place."""
    return base.forward(**inputs).logits


class BaseSession:
    """The base model's decode with compiled steps, in the shape of an exit-mode session (`forward`, `stats`)."""

    def __init__(self, model, spans):
        self.base, self.spans = model.base, spans  # (spans: the model's compiled `SpanRunner` for the call's options)
        self.stats = GenerationStats(num_layers=model.parts.num_layers, checkpoints=[], mode="base (compiled)")
        self._sized = None  # the cache whose length the step reads from its tensors

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, **kwargs):
        cache_empty = past_key_values is None or past_key_values.get_seq_length() == 0
        if cache_empty or input_ids.shape[1] != 1 or attention_mask is not None:
            self.stats.record_passes(0, input_ids.numel() if cache_empty else 0)
            return self.base(input_ids=input_ids, past_key_values=past_key_values, attention_mask=attention_mask,
                             **kwargs)
        self.stats.record_base_step(input_ids.shape[0])
        if past_key_values is not self._sized:  # (once a cache: its length a dynamic dimension of the step's graph)
            mask_sizes_from_tensors(past_key_values)
            dynamic_length(past_key_values)
            self._sized = past_key_values
        inputs = dict(kwargs, input_ids=input_ids, past_key_values=past_key_values)
        logits = self.spans.graph(("base step",), _base_step, "tide_base_step", self.base, inputs)
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)


def compiled_static_decoder(base, cache_len: int, compile_options: dict | None = None, warp=None,
                            lowered: bool = False):
    """A greedy decode function `decode(ids [1, n], new_tokens) -> ids [1, n + new_tokens]` over `base` (`warp`, a
    function of the scores, e.g. temperature and top-p: it samples from their softmax instead): single-token
    steps of `torch.compile(base.forward, fullgraph=True, dynamic=False)` (on CUDA with `mode="reduce-overhead"`:
    CUDA graphs, as transformers' own compiled generate uses) on one `StaticCache` of `cache_len` positions, reset
    per call (one shape and one set of cache addresses for every prompt, so one graph), with end-of-sequence
    suppressed as `generate`'s `min_new_tokens` does, so that its tokens compare with `generate`'s. `lowered` (with
    the default options, for a model on a CPU): inductor takes the options Tide's CPU graphs take
    (`layers/rowproducts.py`: products of a few rows lowered to inductor's own reductions)."""
    if compile_options is None:
        compile_options = dict(fullgraph=True, dynamic=False)
        if lowered:
            from ..layers.rowproducts import CPU_INDUCTOR_OPTIONS

            compile_options["options"] = CPU_INDUCTOR_OPTIONS
        elif base.device.type == "cuda":
            compile_options["mode"] = "reduce-overhead"
    step = torch.compile(base.forward, **compile_options)
    eos = base.generation_config.eos_token_id
    eos = torch.tensor([eos] if isinstance(eos, int) else (eos or []), dtype=torch.long, device=base.device)
    cache = StaticCache(config=base.config, max_cache_len=cache_len)

    def pick(logits):  # end-of-sequence suppressed, as generate's min_new_tokens does
        logits = logits.index_fill(-1, eos, float("-inf"))
        if warp is None:
            return logits.argmax(-1, keepdim=True)
        return torch.multinomial(warp(logits.float()).softmax(-1), 1)

    @torch.no_grad()
    def decode(ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        if ids.shape[1] + new_tokens > cache_len:
            raise ValueError(f"the static cache holds {cache_len} positions; {ids.shape[1]} + {new_tokens} do not fit")
        cache.reset()
        n = ids.shape[1]
        logits = base(input_ids=ids, past_key_values=cache, use_cache=True,
                      position_ids=torch.arange(n, device=ids.device)[None]).logits[:, -1]
        out = [pick(logits)]
        for i in range(new_tokens - 1):
            logits = step(input_ids=out[-1], past_key_values=cache, use_cache=True,
                          position_ids=torch.tensor([[n + i]], device=ids.device)).logits[:, -1]
            out.append(pick(logits))
        return torch.cat([ids, *out], 1)

    return decode
