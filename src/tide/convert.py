"""Converting routers trained by TIDE (`tide-inference`): its `router.pt` into a `TideForCausalLM`.

TIDE saves one bias-free MLP router per layer it consults, trained on un-normalised hidden states, in a
PyTorch pickle of plain tensors and numbers. `convert_tide_routers` reads it with `weights_only=True`, keeps
the routers at layers that can be exits, and sets TIDE's operating point (threshold 0.85, routers consulted
from layer 8). Scores shift under Tide's final-norm view, so recalibrate before relying on them.
"""

from __future__ import annotations

import warnings

import torch

from .architectures import resolve
from .config import TideConfig
from .modeling import TideForCausalLM

__all__ = ["convert_tide_routers", "import_tide_checkpoint"]


def convert_tide_routers(path, base_model, config: TideConfig | None = None):
    """Read a TIDE `router.pt` (tensors only, `weights_only=True`) into a `TideForCausalLM`.

    TIDE routers have no biases and were trained on un-normalised states; Tide scores the final-norm view,
    so their scores shift: recalibrate (`tide.calibrate`) before relying on the imported thresholds.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    try:
        hidden, bottleneck, layers = state["hidden_dim"], state["bottleneck_dim"], state["router_layers"]
    except (TypeError, KeyError) as err:
        raise ValueError(f"{path} is not a TIDE router checkpoint (expected hidden_dim, bottleneck_dim, router_layers).") from err
    num_layers = len(resolve(base_model).layers)
    checkpoints = sorted(int(k) for k in layers)
    dropped = [k for k in checkpoints if k >= num_layers - 1]
    if dropped:
        warnings.warn(f"Dropping TIDE routers at layers {dropped}: the last layer is not an exit.", stacklevel=2)
    checkpoints = [k for k in checkpoints if k < num_layers - 1]
    config = config or TideConfig()
    config.checkpoint_layers = checkpoints
    config.router_hidden_size = int(bottleneck)
    config.exit_head = "lens"  # TIDE reads exits through the final norm and head alone
    # TIDE's default operating point: threshold 0.85, routers consulted at layer indices >= 8 (Tide consults k
    # when k + 1 >= min_layers).
    config.set_generation_defaults(exit_threshold=0.85, min_layers=min(8 + 1, checkpoints[-1] + 1))
    model = TideForCausalLM.from_base(base_model, config)
    if int(hidden) != model.config.base_hidden_size:
        raise ValueError(f"TIDE routers have hidden_dim {hidden}, the base model has {model.config.base_hidden_size}.")
    for k in checkpoints:
        router, src = model.routers[k], layers[k] if k in layers else layers[str(k)]
        param = next(router.parameters())
        with torch.no_grad():
            router.down.weight.copy_(src["down.weight"].to(param))
            router.up.weight.copy_(src["up.weight"].to(param))
            router.down.bias.zero_()
            router.up.bias.zero_()
    warnings.warn(
        "Imported TIDE routers were trained on un-normalised states; Tide scores the final-norm view. "
        "Run tide.calibrate for calibrated thresholds.",
        stacklevel=2,
    )
    return model


def import_tide_checkpoint(path, base_model, config: TideConfig | None = None):
    """Deprecated name of `convert_tide_routers`."""
    warnings.warn("tide.import_tide_checkpoint is renamed tide.convert_tide_routers.", FutureWarning, stacklevel=2)
    return convert_tide_routers(path, base_model, config)
