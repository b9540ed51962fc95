"""Tide's decode loop on a CUDA device: exit and lossless modes token for token the base model, eagerly and compiled
with CUDA graphs, and the exit tests on the fused kernel where a build is loaded (LOCAL_KERNELS). Skipped without
CUDA (tests/conftest.py)."""

import pytest
import torch

import tide.heads.kernels as tk
from tide.heads.router import checkpoint_test_reference
from tiny_models import noisy_tide, prompt_ids

pytestmark = pytest.mark.gpu


def _on_cuda(family: str, dtype=torch.float32, **config):
    model, base = noisy_tide(family, **config)
    model.to("cuda", dtype)
    model.align_routers()
    return model, base


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exit_and_lossless_equal_the_base_model_on_cuda(family, dtype):
    model, base = _on_cuda(family, dtype)
    ids = prompt_ids().cuda()
    ref = base.generate(ids, do_sample=False, max_new_tokens=20)
    for scheme in ({"max_draft": 1}, {"max_draft": 4}):
        out = model.generate(ids, do_sample=False, max_new_tokens=20, tide_config={"mode": "lossless", **scheme})
        assert torch.equal(out, ref), scheme
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=20, tide_config={"exit_threshold": 1.0}),
                       ref)
    out = model.generate(ids, do_sample=False, max_new_tokens=20, tide_config={"exit_threshold": 0.5})
    assert out.shape == ref.shape and out.is_cuda


def test_exit_steps_use_the_fused_checkpoint_test_where_it_is_loaded():
    model, _ = _on_cuda("llama")
    tests = model.exit_tests({k: 0.5 for k in model.checkpoints})
    hidden = torch.randn(3, model.base.config.hidden_size, device="cuda")
    loaded = tk.load_checkpoint_kernel() is not checkpoint_test_reference
    for test in tests.values():
        scores, exits, state = test(hidden)
        assert scores.is_cuda and exits.dtype == torch.bool and state.shape == hidden.shape
    if tk._local_build() is not None:  # LOCAL_KERNELS names a build: it must be what ran
        assert loaded
    elif not loaded:
        pytest.skip("no build of the fused kernel for this torch/CUDA: the reference ran")


CUDA_GRAPH_CONFIGS = {
    "lossless": {"mode": "lossless", "max_draft": 3},
    # trees verified by the backbone's compiled forward, the tree as a 4-D mask; n-gram branches padded to one width
    "tree": {"mode": "lossless", "max_draft": 3, "draft_topk": 3, "draft_ngram": 3},
    "exit": {"exit_threshold": 1.0},
}


@pytest.mark.parametrize("mode", sorted(CUDA_GRAPH_CONFIGS))
def test_cuda_graphs_equal_the_base_model(mode):
    """compile=True with transformers' default CompileConfig (mode="reduce-overhead": CUDA graphs), on the static
    cache the model lends its compiled calls (the same one both times)."""
    model, base = _on_cuda("llama")
    ids = torch.cat([prompt_ids(), prompt_ids()], 1).cuda()  # a prompt that repeats itself: n-gram branches
    ref = base.generate(ids, do_sample=False, max_new_tokens=24)
    for _ in range(2):  # the second call replays the captured graphs
        out = model.generate(ids, do_sample=False, max_new_tokens=24,
                             tide_config={**CUDA_GRAPH_CONFIGS[mode], "compile": True})
        assert torch.equal(out, ref)
    if mode == "tree":
        assert model.last_stats.tree_cycles > 0


def test_lossless_with_sdpa_in_bfloat16_equals_the_base_model():
    model, base = noisy_tide("llama", attention="sdpa")
    model.to("cuda", torch.bfloat16)
    model.align_routers()
    ids = prompt_ids().cuda()
    ref = base.generate(ids, do_sample=False, max_new_tokens=20)
    for scheme in ({"max_draft": 3}, {"max_draft": 1, "draft_topk": 3}):
        assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=20,
                                          tide_config={"mode": "lossless", **scheme}), ref), scheme

