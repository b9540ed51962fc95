"""Converting routers trained by TIDE (`tide-inference`): its `router.pt` into a `TideForCausalLM`.

TIDE saves one bias-free MLP router per layer it consults, trained on un-normalised hidden states, in a
PyTorch pickle of plain tensors and numbers. `convert_tide_routers` reads it with `weights_only=True`, keeps
the routers at layers that can be exits, and sets TIDE's operating point (threshold 0.85, routers consulted
from layer 8). Scores shift under Tide's final-norm view, so recalibrate before relying on them.
"""

from __future__ import annotations

import copy
import warnings

import torch

from ..config import TideConfig
from ..modeling import TideForCausalLM
from ..models.architectures import resolve

__all__ = ["convert_tide_routers"]


def convert_tide_routers(path, base_model, config: TideConfig | None = None):
    """Read a TIDE `router.pt` (tensors only, `weights_only=True`) into a `TideForCausalLM`.

    TIDE routers have no biases and were trained on un-normalised states; Tide scores the final-norm view,
    so their scores shift: recalibrate (`tide.calibrate`) before relying on the imported thresholds.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - unpickling errors of every kind, named with the file
        first = str(err).strip().split(". ")[0]
        raise ValueError(f"{path} could not be read as a TIDE router.pt of tensors "
                         f"({type(err).__name__}: {first}).") from err
    try:
        hidden, bottleneck, layers = state["hidden_dim"], state["bottleneck_dim"], state["router_layers"]
    except (TypeError, KeyError) as err:
        raise ValueError(f"{path} is not a TIDE router checkpoint "
                         "(expected hidden_dim, bottleneck_dim, router_layers).") from err
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{path}: router_layers is empty; a TIDE router.pt holds one router per consulted layer.")
    num_layers = len(resolve(base_model).layers)
    checkpoints = sorted(int(k) for k in layers)
    dropped = [k for k in checkpoints if k >= num_layers - 1]
    if dropped:
        warnings.warn(f"Dropping TIDE routers at layers {dropped}: the last layer is not an exit.", stacklevel=2)
    checkpoints = [k for k in checkpoints if k < num_layers - 1]
    if not checkpoints:
        raise ValueError(f"{path}: every router sits at or after the last layer of this {num_layers}-layer model.")
    expected = {"down.weight": (int(bottleneck), int(hidden)), "up.weight": (1, int(bottleneck))}
    tensors = {k: _router_tensors(path, k, layers[k] if k in layers else layers[str(k)], expected) for k in checkpoints}
    config = TideConfig() if config is None else copy.deepcopy(config)
    config.checkpoint_layers = checkpoints
    config.router_hidden_size = int(bottleneck)
    config.exit_head = "lens"  # TIDE reads exits through the final norm and head alone
    config.draft_head = "exit"  # and has no draft heads
    # TIDE's default operating point: threshold 0.85, routers consulted at layer indices >= 8 (Tide consults k
    # when k + 1 >= min_layers).
    config.set_generation_defaults(exit_threshold=0.85, min_layers=min(8 + 1, checkpoints[-1] + 1))
    model = TideForCausalLM.from_base(base_model, config)
    if int(hidden) != model.config.base_hidden_size:
        raise ValueError(f"TIDE routers have hidden_dim {hidden}, the base model has {model.config.base_hidden_size}.")
    for k in checkpoints:
        router = model.routers[k]
        param = next(router.parameters())
        with torch.no_grad():
            router.down.weight.copy_(tensors[k]["down.weight"].to(param))
            router.up.weight.copy_(tensors[k]["up.weight"].to(param))
            router.down.bias.zero_()
            router.up.bias.zero_()
    warnings.warn(
        "Imported TIDE routers were trained on un-normalised states; Tide scores the final-norm view. "
        "Run tide.calibrate for calibrated thresholds.",
        stacklevel=2,
    )
    return model


def _router_tensors(path, layer: int, router, expected: dict) -> dict:
    """The checked tensors of one TIDE router: present, of the expected shape, finite."""
    out = {}
    for key, shape in expected.items():
        tensor = router.get(key) if isinstance(router, dict) else None
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{path}: the router at layer {layer} has no {key} tensor.")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{path}: router layer {layer} {key} has shape {list(tensor.shape)}, "
                             f"expected {list(shape)} (from hidden_dim and bottleneck_dim).")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{path}: router layer {layer} {key} holds values that are not finite (NaN or inf).")
        out[key] = tensor
    return out
