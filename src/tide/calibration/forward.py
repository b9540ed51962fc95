"""One base forward over a batch of calibration text (`capture`): the checkpoint layers' outputs, the last
layer's, the full model's top-1 (and best tokens), and the draft heads' context; and the training label of an
exit (`exit_labels`). Both the training stream and held-out scoring read it.

The full model's head is the costliest part of that forward on a large vocabulary (a 262,144 x 640 head costs
about as much as 17 decoder layers of a 270M model), so where the head is a plain linear layer and the model's
forward takes `logits_to_keep`, the head runs only at the positions kept (real tokens, or a conversation's answer
positions: never the padding), a chunk of rows at a time, keeping each row's top-1 and best tokens rather than a
[batch, length, vocabulary] tensor of logits."""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import TideConfig
from ..layers.calls import capture_outputs
from ..modeling import TideForCausalLM
from .headloss import TEACHER_TOP
from .measure import seconds_of

__all__ = ["Capture", "capture", "exit_labels", "label_of", "head_top", "head_chunk", "WeightsIn", "stream_dtype"]


@dataclass
class Capture:
    states: dict[int, torch.Tensor]  # [N, H] raw output of each checkpoint layer (real tokens only)
    final: torch.Tensor  # [N, H] raw output of the last layer
    full_top1: torch.Tensor  # [N] the full model's top-1
    context: torch.Tensor | None  # [N, H] the final normed state at the position before (zeros at a text's first
    # token); None when the model has no draft heads
    first: torch.Tensor | None = None  # [N] bool: a text's first token (with `context`)
    top: torch.Tensor | None = None  # [N, TEACHER_TOP] the full model's best tokens (with `top=True`)


@torch.no_grad()
def capture(tide: TideForCausalLM, batch, top: bool = False) -> Capture:
    parts, last = tide.parts, tide.parts.num_layers - 1
    own_head = _head_at_kept_positions(tide)
    with capture_outputs(parts, tide.checkpoints + [last]) as states:
        out = tide.base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                        **({"logits_to_keep": 1} if own_head else {}))
    # the positions trained and scored on: real tokens (a conversation's answer positions only)
    keep = batch["trained"] if "trained" in batch else batch["attention_mask"].bool()
    context = first = None
    if any(tide.routers[k].draft is not None for k in tide.checkpoints):
        normed = parts.final_norm(states[last])
        context = torch.cat([torch.zeros_like(normed[:, :1]), normed[:, :-1]], 1)[keep]
        first = (keep.cumsum(1) == 1)[keep]
    final = states[last][keep]
    if own_head:
        full_top1, best = head_top(parts, final, TEACHER_TOP if top else 0)
    else:
        logits = out.logits[keep]
        full_top1, best = logits.argmax(-1), logits.topk(TEACHER_TOP, -1).indices if top else None
    return Capture({k: states[k][keep] for k in tide.checkpoints}, final, full_top1, context, first, best)


class WeightsIn:
    """A module's floating-point parameters in another dtype for a while: `with weights(): ...` runs the module on
    copies in `dtype` (made once, here), and puts its own tensors back after, whatever happens inside; buffers
    (rotary frequencies) stay as they are. A dtype of None, or the parameters' own, changes nothing."""

    def __init__(self, module: torch.nn.Module, dtype: str | torch.dtype | None):
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        params = [p for p in module.parameters() if p.is_floating_point()]  # a tied head and embedding: one
        self._swaps = [] if dtype is None else [(p, p.data, p.data.to(dtype)) for p in params if p.dtype != dtype]

    @contextmanager
    def __call__(self):
        for param, _, copy in self._swaps:
            param.data = copy
        try:
            yield
        finally:
            for param, own, _ in self._swaps:
                param.data = own


# `feature_dtype="auto"` reads the training stream in bfloat16 only on models at least this wide (a narrower one's
# stream costs little either way, and its products are too small to time the dtypes apart) and where their
# products time at least BF16_MIN_GAIN times faster in bfloat16 than in float32 on the model's device: CPUs with
# bfloat16 matrix instructions (an AMD EPYC with AVX-512 bf16 read SmolLM2-135M's stream 2.4x faster), GPUs. Where
# bfloat16 is emulated (AVX2) it is slower, and the stream stays in float32.
AUTO_MIN_HIDDEN = 512
BF16_MIN_GAIN = 1.5


def stream_dtype(tide: TideForCausalLM, requested: str | None) -> str | None:
    """The dtype the training stream's forward runs in for `feature_dtype=requested` (None: the model's own)."""
    if requested != "auto":
        return requested
    hidden = tide.config.base_hidden_size or tide.parts.norm.weight.shape[-1]
    if next(tide.base.parameters()).dtype != torch.float32 or hidden < AUTO_MIN_HIDDEN:
        return None
    return "bfloat16" if _bf16_gain(hidden, tide.base.device) >= BF16_MIN_GAIN else None


def _bf16_gain(hidden: int, device) -> float:
    """float32 seconds over bfloat16 seconds of an MLP-sized product over a batch of rows, the best of a few each."""
    rows = torch.randn(1024, hidden, device=device)
    weight = torch.randn(4 * hidden, hidden, device=device)

    def best(dtype):
        x, w = rows.to(dtype), weight.to(dtype)
        F.linear(x, w)  # (warm-up)
        return min(seconds_of(lambda: F.linear(x, w)) for _ in range(5))

    return best(torch.float32) / best(torch.bfloat16)


def head_chunk(vocab_size: int) -> int:
    """Rows of whole-vocabulary logits computed at a time: about 512 MiB of fp32 logits (64 to 4,096 rows; on a
    262,144-token head, 512 rows took x0.85 of the time of 128-row chunks, one thread)."""
    return max(64, min(4096, (1 << 27) // max(vocab_size, 1)))


def head_top(parts, final: torch.Tensor, k: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full model's top-1 [N] (and with `k`, its k best tokens [N, k], best first) from the last layer's raw
    outputs [N, H], through the model's final norm and head, `head_chunk` rows at a time."""
    top1, best = [], []
    for chunk in final.split(head_chunk(parts.lm_head.weight.shape[0])):
        logits = parts.logits_from_normed(parts.final_norm(chunk))
        top1.append(logits.argmax(-1))
        if k:
            best.append(logits.topk(k, -1).indices)
    empty = torch.zeros(0, dtype=torch.long, device=final.device)
    return (torch.cat(top1) if top1 else empty,
            (torch.cat(best) if best else empty.view(0, k)) if k else None)


def _head_at_kept_positions(tide: TideForCausalLM) -> bool:
    """The head can run apart from the model's forward: a plain linear layer (`ModelParts.head_rows_readable`) and
    a forward that takes `logits_to_keep` (it then computes the last position's logits only)."""
    if not tide.parts.head_rows_readable:
        return False
    try:
        return "logits_to_keep" in inspect.signature(tide.base.forward).parameters
    except (TypeError, ValueError):
        return False


def exit_labels(exit_logits: torch.Tensor, states: torch.Tensor, final: torch.Tensor, full_top1: torch.Tensor,
                cfg: TideConfig):
    """(agree, label) [N]: the exit's top-1 (from its logits [N, V]) equals the full model's, and the training label."""
    agree = exit_logits.argmax(-1) == full_top1
    return agree, label_of(agree, states, final, cfg)


def label_of(agree: torch.Tensor, states: torch.Tensor, final: torch.Tensor, cfg: TideConfig) -> torch.Tensor:
    """[N] bool: the training label of exits whose top-1 agreement with the full model is `agree` [N]: that
    agreement (`label="top1"`), or the cosine of the checkpoint's states [N, H] and the last layer's above
    `cosine_threshold`."""
    if cfg.label == "top1":
        return agree
    return F.cosine_similarity(states.float(), final.float(), dim=-1) > cfg.cosine_threshold
