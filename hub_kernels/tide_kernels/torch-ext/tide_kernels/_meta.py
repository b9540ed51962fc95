"""Fake (meta) implementation of router_exit, so torch.compile can trace through the op.

Registration is skipped when the compiled op library is not loaded (e.g. importing the sources on a
machine without the built extension); the op itself is then unavailable anyway.
"""

import torch

try:
    from ._ops import add_op_namespace_prefix
except ImportError:  # sources imported without a build
    add_op_namespace_prefix = None


def _router_exit_fake(hidden, norm_weight, norm_bias, norm_kind, eps, down_weight, down_bias, up_weight, up_bias,
                      threshold):
    torch._check(hidden.dim() == 2, lambda: f"router_exit: hidden must be [B, H], got {tuple(hidden.shape)}")
    batch = hidden.shape[0]
    return hidden.new_empty((batch,), dtype=torch.float32), hidden.new_empty((batch,), dtype=torch.bool)


if add_op_namespace_prefix is not None:
    try:
        torch.library.register_fake(add_op_namespace_prefix("router_exit"))(_router_exit_fake)
    except RuntimeError:  # the op library is not loaded in this process
        pass
