"""Routers and exit heads: per checkpoint, a small MLP that scores whether a token may leave the stack, and
the map that turns the state it leaves with into logits.

A checkpoint's `Router` holds an optional `translator` (the exit head: an affine map into the last layer's
space, initialised to the identity, the "tuned lens") and the scoring MLP. The exit state of a token is
`translator(h)`; its logits are the model's own final norm and head on that state; the router reads the
final-norm view of the same state and returns a logit whose sigmoid is the score. Without a translator the
exit is the "logit lens" (final norm and head on the raw state). This module holds the modules and pure
scoring math; it knows nothing about data, thresholds or generation.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CheckpointTest", "DraftHead", "Router", "RouterBank", "Translator", "checkpoint_test",
           "checkpoint_test_reference", "exit_decision"]


def exit_decision(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """The exit rule, everywhere: a token exits when its score is strictly above the threshold.
    -> bool, scores' shape."""
    return scores > threshold


class Translator(nn.Module):
    """h -> W h + b (W initialised to the identity), or with `rank`: h -> h + U (V h) + b (U initialised to 0)."""

    def __init__(self, hidden_size: int, rank: int | None = None):
        super().__init__()
        self.rank = rank
        if rank is None:
            self.weight = nn.Parameter(torch.eye(hidden_size))
        else:
            self.down = nn.Parameter(torch.randn(rank, hidden_size) / hidden_size**0.5)
            self.up = nn.Parameter(torch.zeros(hidden_size, rank))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., H] -> [..., H]
        if self.rank is None:
            return nn.functional.linear(hidden, self.weight, self.bias)
        return hidden + nn.functional.linear(nn.functional.linear(hidden, self.down), self.up, self.bias)


class DraftHead(nn.Module):
    """Lossless drafts with context: (h, c) -> A h + B c + b + W_2 silu(W_1 [h; c]), a state for the model's
    final norm and head.

    h is the token's layer-E state; c is the full model's final normed state at the position before it (what
    verification computed there), so the draft reads the whole stack's view of the context as well as the
    shallow view of the token. A starts as the identity, B and W_2 at zero; with `rank`, A = I + U_h V_h and
    B = U_c V_c; `mlp` is the width of the two-layer term (0: none). Trained in calibration like the exit heads.
    """

    def __init__(self, hidden_size: int, rank: int | None = None, mlp: int = 0):
        super().__init__()
        self.own = Translator(hidden_size, rank)  # A h + b
        if rank is None:
            self.context = nn.Parameter(torch.zeros(hidden_size, hidden_size))  # B
        else:
            self.context_down = nn.Parameter(torch.randn(rank, hidden_size) / hidden_size**0.5)  # V_c
            self.context_up = nn.Parameter(torch.zeros(hidden_size, rank))  # U_c
        self.mlp_in = nn.Linear(2 * hidden_size, mlp) if mlp else None  # W_1 (with a bias)
        self.mlp_out = nn.Parameter(torch.zeros(hidden_size, mlp)) if mlp else None  # W_2

    def forward(self, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        # hidden, context: [..., H] -> [..., H]
        if self.own.rank is None:
            state = self.own(hidden) + nn.functional.linear(context, self.context)
        else:
            state = self.own(hidden) + nn.functional.linear(nn.functional.linear(context, self.context_down),
                                                            self.context_up)
        if self.mlp_in is not None:
            inner = nn.functional.silu(self.mlp_in(torch.cat([hidden, context], -1)))
            state = state + nn.functional.linear(inner, self.mlp_out)
        return state


class Router(nn.Module):
    """hidden -> r -> 1 with SiLU, returning a logit per token; optionally with the checkpoint's exit head and
    its lossless draft head."""

    def __init__(self, hidden_size: int, bottleneck: int, translator: Translator | None = None,
                 draft: DraftHead | None = None):
        super().__init__()
        self.down = nn.Linear(hidden_size, bottleneck)
        self.act = nn.SiLU()
        self.up = nn.Linear(bottleneck, 1)
        self.translator = translator
        self.draft = draft

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        # normed: [..., H] -> logits [...]
        return self.up(self.act(self.down(normed))).squeeze(-1)

    def exit_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """The state the exit head hands to the final norm. hidden: [..., H] -> [..., H]."""
        return hidden if self.translator is None else self.translator(hidden)


class RouterBank(nn.Module):
    """The routers of one model, keyed by checkpoint layer index."""

    def __init__(self, hidden_size: int, checkpoints: list[int], bottleneck: int, exit_head: str = "lens",
                 rank: int | None = None, draft_layers: list[int] = (), draft_mlp: int = 0):
        super().__init__()
        self.checkpoints = list(checkpoints)

        def make(k):
            return Router(hidden_size, bottleneck, Translator(hidden_size, rank) if exit_head == "tuned" else None,
                          DraftHead(hidden_size, rank, draft_mlp) if k in draft_layers else None)

        self.routers = nn.ModuleDict({str(k): make(k) for k in checkpoints})

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


class CheckpointTest:
    """One checkpoint's exit test with its weights laid out for few, small ops (the decode step's hot path).

    Computes the same as `TideForCausalLM.route` (exit head, final norm, router, sigmoid, threshold) in fp32,
    with the norm's weight (and bias) folded into the router's first projection: 6-8 tensor ops and no
    module calls. Built per generate call for the checkpoints it consults, from `norm_params`' description
    of the final norm (RMS, Gemma RMS or LayerNorm); other norms use `route`.
    """

    def __init__(self, router: Router, weight, bias, kind: int, eps: float, threshold: float):
        with torch.no_grad():
            translator = router.translator
            self.translate = None
            if translator is not None and translator.rank is None:
                self.translate = (translator.weight.float().t().contiguous(), translator.bias.float())
            elif translator is not None:
                self.translate = translator  # low rank: two small projections, kept as a module
            scale = weight.float() + 1.0 if kind == GEMMA_RMS_NORM else weight.float()
            down_w, down_b = router.down.weight.float(), router.down.bias.float()
            if bias is not None:
                down_b = down_b + down_w @ bias.float()
            self.down = (down_b, (down_w * scale).t().contiguous())  # [R], [H, R]
            self.up = (router.up.bias.float(), router.up.weight.float().t().contiguous())  # [1], [R, 1]
        self.layer_norm, self.eps, self.threshold = kind == LAYER_NORM, eps, float(threshold)

    def __call__(self, hidden: torch.Tensor):
        """hidden [N, H] -> (scores fp32 [N], exits bool [N], exit states [N, H] in hidden's dtype).

        On CUDA the computation runs as the custom op `tide::checkpoint_test`: the fused kernel where one is loaded
        (`tide.heads.kernels`), one node in compiled graphs. On CPU the same arithmetic runs without the op, eagerly
        and compiled (inductor fuses it into the graph; as the op, a call inside a compiled graph cost about 0.2 ms
        of dispatch in Python on one core)."""
        if isinstance(self.translate, nn.Module):  # a low-rank exit head: two small projections, as a module
            translate = (self.translate(hidden.float()), None)
        else:
            translate = self.translate or (None, None)
        test = checkpoint_test if hidden.is_cuda else _checkpoint_test
        return test(hidden, *translate, *self.down, *self.up, self.layer_norm, self.eps, self.threshold)


def _checkpoint_test(hidden, translate_weight, translate_bias, down_bias, down_weight, up_bias, up_weight,
                     layer_norm: bool, eps: float, threshold: float):
    """The exit test's arithmetic (`CheckpointTest`): hidden [N, H]; translate_weight [H, H] (transposed) and bias
    [H], or a translated fp32 state [N, H] in `translate_weight`'s place with no bias, or None; the router's first
    projection with the norm folded in, down_bias [R] and down_weight [H, R]; up_bias [1], up_weight [R, 1]."""
    x = hidden.float()
    if translate_bias is not None:
        x = torch.addmm(translate_bias, x, translate_weight)
    elif translate_weight is not None:
        x = translate_weight
    state = x.to(hidden.dtype)
    if layer_norm:
        x = x - x.mean(-1, keepdim=True)
    inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [N, 1]
    z = torch.nn.functional.silu(torch.addcmul(down_bias, x @ down_weight, inv_rms))  # [N, R]
    scores = torch.sigmoid(torch.addmm(up_bias, z, up_weight)).squeeze(-1)  # [N]
    return scores, exit_decision(scores, threshold), state


@torch.library.custom_op("tide::checkpoint_test", mutates_args=())
def checkpoint_test(hidden: torch.Tensor, translate_weight: torch.Tensor | None, translate_bias: torch.Tensor | None,
                    down_bias: torch.Tensor, down_weight: torch.Tensor, up_bias: torch.Tensor, up_weight: torch.Tensor,
                    layer_norm: bool, eps: float, threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`CheckpointTest` as one op: (scores fp32 [N], exits bool [N], exit states [N, H]); see `_checkpoint_test`.
    On CUDA, `tide.heads.kernels` registers the fused kernel in front of this reference."""
    return checkpoint_test_reference(hidden, translate_weight, translate_bias, down_bias, down_weight, up_bias,
                                     up_weight, layer_norm, eps, threshold)


def checkpoint_test_reference(hidden, translate_weight, translate_bias, down_bias, down_weight, up_bias, up_weight,
                              layer_norm, eps, threshold):
    """The op's PyTorch implementation: `_checkpoint_test`, with an exit state that aliases no input (hidden, or a
    low-rank head's translated state)."""
    scores, exits, state = _checkpoint_test(hidden, translate_weight, translate_bias, down_bias, down_weight, up_bias,
                                            up_weight, layer_norm, eps, threshold)
    inputs = (hidden, translate_weight)
    aliased = any(t is not None and t.data_ptr() == state.data_ptr() for t in inputs)
    return scores, exits, state.clone() if aliased else state


@checkpoint_test.register_fake
def _(hidden, translate_weight, translate_bias, down_bias, down_weight, up_bias, up_weight, layer_norm, eps, threshold):
    rows = hidden.shape[0]
    return (hidden.new_empty(rows, dtype=torch.float32), hidden.new_empty(rows, dtype=torch.bool),
            hidden.new_empty(hidden.shape))


# the fused op's norm kinds (kernels.py re-exports them)
RMS_NORM, GEMMA_RMS_NORM, LAYER_NORM = 0, 1, 2
