"""Fake (meta) implementations of router_exit and checkpoint_test, so torch.compile can trace through the op.

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


def _checkpoint_test_fake(hidden, translate_weight, translate_bias, down_bias, down_weight, up_bias, up_weight,
                          layer_norm, eps, threshold):
    torch._check(hidden.dim() == 2, lambda: f"checkpoint_test: hidden must be [N, H], got {tuple(hidden.shape)}")
    rows = hidden.shape[0]
    return (hidden.new_empty((rows,), dtype=torch.float32), hidden.new_empty((rows,), dtype=torch.bool),
            hidden.new_empty(hidden.shape))


if add_op_namespace_prefix is not None:
    for _name, _fake in (("router_exit", _router_exit_fake), ("checkpoint_test", _checkpoint_test_fake)):
        try:
            torch.library.register_fake(add_op_namespace_prefix(_name))(_fake)
        except RuntimeError:  # the op library is not loaded in this process
            pass
