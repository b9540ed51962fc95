"""Tide's own decode loops, run by `generate` as its decoding method (transformers' `custom_generate`).

`generate` still prepares the generation config, the logits processors, the stopping criteria, the cache and
the prompt's inputs; the loop then decodes: `exits.loop.exit_decode` (one token per step, by a walk with per-token exits
or, compiled, one graph a step) or `lossless.loop.lossless_decode` (draft, verify, accept per cycle, or, compiled, one
graph a cycle). `drafts.py` holds what passes between drafting, verification and the loop, `accept.py` the acceptance
rules, `emit.py` what the loops hand back.
"""

from __future__ import annotations

from contextlib import nullcontext

from ..models import compat
from .exits.loop import exit_decode
from .lossless.loop import lossless_decode

__all__ = ["attention_backends", "generate_with_loop", "exit_decode", "lossless_decode"]


def generate_with_loop(base, session, loop, args: tuple, kwargs: dict):
    """`base.generate(*args, **kwargs)` with `loop(session, ...)` as its decoding method."""
    streamer = kwargs.get("streamer")  # generate streams the prompt; the loop streams what it accepts
    kwargs = compat.stop_strings_as_criteria(base, kwargs)

    def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
               **model_kwargs):
        with attention_backends(model):
            return loop(session, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                        model_kwargs)

    return base.generate(*args, custom_generate=decode, **kwargs)


def attention_backends(base):
    """The SDPA backends Tide's passes run with: on CUDA, all but cuDNN's attention. On an H200 it failed in Tide's
    single-token passes with explicit masks (`mha_graph.execute(...).is_good()`, then misaligned addresses; the
    failure known from pytorch/pytorch#122695, whose workaround is this), while flash, memory-efficient and math
    attention compute the same. Elsewhere nothing changes."""
    if base.device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
