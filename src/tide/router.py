"""Routers: one small MLP per checkpoint that scores whether a token's state has converged.

A router reads the state exactly as the model's own final norm would hand it to the head
(`ModelParts.final_norm(h)`), at calibration and at inference alike, and returns a logit; the score is
its sigmoid. This module holds the modules and pure scoring math; it knows nothing about data,
thresholds or generation.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Router", "RouterBank", "exit_decision"]


class Router(nn.Module):
    """hidden -> r -> 1 with SiLU, returning a logit per token."""

    def __init__(self, hidden_size: int, bottleneck: int):
        super().__init__()
        self.down = nn.Linear(hidden_size, bottleneck)
        self.act = nn.SiLU()
        self.up = nn.Linear(bottleneck, 1)

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        # normed: [..., H] -> logits [...]
        return self.up(self.act(self.down(normed))).squeeze(-1)


class RouterBank(nn.Module):
    """The routers of one model, keyed by checkpoint layer index."""

    def __init__(self, hidden_size: int, checkpoints: list[int], bottleneck: int):
        super().__init__()
        self.checkpoints = list(checkpoints)
        self.routers = nn.ModuleDict({str(k): Router(hidden_size, bottleneck) for k in checkpoints})

    def __getitem__(self, layer: int) -> Router:
        return self.routers[str(layer)]

    def check_placement(self, layer: int, states: torch.Tensor) -> None:
        """Raise unless the router at `layer` is on the device and dtype of its layer's states."""
        weight = self[layer].down.weight
        if states.device != weight.device or states.dtype != weight.dtype:
            raise RuntimeError(
                f"The router at layer {layer} is on {weight.device}/{weight.dtype} but its layer's states are "
                f"on {states.device}/{states.dtype}; call model.align_routers() after moving the base model."
            )

    def score(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        """Exit probability in [0, 1] at checkpoint `layer`. normed: [..., H] -> [...]."""
        self.check_placement(layer, normed)
        return torch.sigmoid(self[layer](normed).float())


def exit_decision(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """A token exits when its score is strictly above the threshold. scores: [B] -> bool [B]."""
    return scores > threshold
