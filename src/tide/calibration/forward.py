"""One base forward over a batch of calibration text (`capture`): the checkpoint layers' outputs, the last
layer's, the full model's top-1 (and best tokens), and the draft heads' context; and the training label of an
exit (`exit_labels`). Both the training stream and held-out scoring read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import TideConfig
from ..layers.calls import capture_outputs
from ..modeling import TideForCausalLM
from .headloss import TEACHER_TOP

__all__ = ["Capture", "capture", "exit_labels"]


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
    with capture_outputs(parts, tide.checkpoints + [last]) as states:
        logits = tide.base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    # the positions trained and scored on: real tokens (a conversation's answer positions only)
    keep = batch["trained"] if "trained" in batch else batch["attention_mask"].bool()
    context = first = None
    if any(tide.routers[k].draft is not None for k in tide.checkpoints):
        normed = parts.final_norm(states[last])
        context = torch.cat([torch.zeros_like(normed[:, :1]), normed[:, :-1]], 1)[keep]
        first = (keep.cumsum(1) == 1)[keep]
    logits = logits[keep]
    return Capture({k: states[k][keep] for k in tide.checkpoints}, states[last][keep], logits.argmax(-1),
                   context, first, logits.topk(TEACHER_TOP, -1).indices if top else None)


def exit_labels(exit_logits: torch.Tensor, states: torch.Tensor, final: torch.Tensor, full_top1: torch.Tensor,
                cfg: TideConfig):
    """(agree, label) [N]: the exit's top-1 (from its logits [N, V]) equals the full model's, and the training label."""
    agree = exit_logits.argmax(-1) == full_top1
    if cfg.label == "top1":
        return agree, agree
    return agree, F.cosine_similarity(states.float(), final.float(), dim=-1) > cfg.cosine_threshold
