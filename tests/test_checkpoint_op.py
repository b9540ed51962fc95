"""The checkpoint test as a `torch.library` custom op (`tide::checkpoint_test`): checked with opcheck, callable from
compiled code, and the same as the eager test."""

import pytest
import torch

import tide
from tide.heads.router import checkpoint_test
from tiny_models import tiny_model


def _inputs(translate: bool, rows: int = 3, hidden: int = 16, rank: int = 4, dtype=torch.float32):
    torch.manual_seed(0)
    weight = torch.randn(hidden, hidden) if translate else None
    bias = torch.randn(hidden) if translate else None
    return (torch.randn(rows, hidden, dtype=dtype), weight, bias, torch.randn(rank), torch.randn(hidden, rank),
            torch.randn(1), torch.randn(rank, 1))


@pytest.mark.parametrize("layer_norm", [False, True])
@pytest.mark.parametrize("translate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(translate, layer_norm, dtype):
    torch.library.opcheck(checkpoint_test, (*_inputs(translate, dtype=dtype), layer_norm, 1e-6, 0.3))


@pytest.mark.parametrize("exit_head", ["tuned", "lens"])
def test_compiled_checkpoint_test_equals_the_eager_one(exit_head):
    model = tide.TideForCausalLM.from_base(tiny_model("llama"),
                                           tide.TideConfig(checkpoint_interval=2, exit_head=exit_head))
    tests = model.exit_tests({k: 0.5 for k in model.checkpoints})
    hidden = torch.randn(5, model.base.config.hidden_size)
    for _, test in tests.items():
        compiled = torch.compile(lambda h, test=test: test(h), fullgraph=True, backend="eager")
        with torch.no_grad():
            for got, want in zip(compiled(hidden), test(hidden)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
