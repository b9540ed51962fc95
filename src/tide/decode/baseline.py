"""The baseline a speed-minded user runs: the base model's greedy decode on a static cache, compiled.

`compiled_static_decoder(base, cache_len)` returns `decode(ids, new_tokens)`: a plain loop over
`torch.compile(base.forward, fullgraph=True, dynamic=False)` single-token steps on a `StaticCache` of
`cache_len` positions (one shape for every prompt, so one graph), with end-of-sequence suppressed as
`generate`'s `min_new_tokens` does, so that its tokens compare with `generate`'s. `tide bench` and
`examples/bench_baselines` time Tide against it as well as against `generate`.
"""

from __future__ import annotations

import torch
from transformers import StaticCache

__all__ = ["compiled_static_decoder"]


def compiled_static_decoder(base, cache_len: int, compile_options: dict | None = None):
    """A greedy decode function `decode(ids [1, n], new_tokens) -> ids [1, n + new_tokens]` over `base`."""
    step = torch.compile(base.forward, **(compile_options or dict(fullgraph=True, dynamic=False)))
    eos = base.generation_config.eos_token_id
    eos = torch.tensor([eos] if isinstance(eos, int) else (eos or []), dtype=torch.long, device=base.device)

    def pick(logits):  # greedy with end-of-sequence suppressed, as generate's min_new_tokens does
        return logits.index_fill(-1, eos, float("-inf")).argmax(-1, keepdim=True)

    @torch.no_grad()
    def decode(ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        if ids.shape[1] + new_tokens > cache_len:
            raise ValueError(f"the static cache holds {cache_len} positions; {ids.shape[1]} + {new_tokens} do not fit")
        cache = StaticCache(config=base.config, max_cache_len=cache_len)
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
