"""Compiled greedy trees as one graph and one host read a cycle (`decode/fusedtree.py`): the shape's ancestry and
paths, the K/V moved to the path, token for token as the base model (siblings, a chain from the best, an n-gram
branch). One launch and one read a cycle, and no recompilation across prompt lengths: `test_fused_cycles.py`."""

import pytest
import torch
from transformers import CompileConfig
from transformers.cache_utils import StaticCache

from tide.decode.fusedtree import TreeShape, _compact
from tiny_models import noisy_tide, prompt_ids

EAGER_BACKEND = CompileConfig(backend="eager")
TREE = {"mode": "lossless", "compile": True, "draft_topk": 3, "max_draft": 2}


@pytest.fixture(scope="module", autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def warm():
    """(Tide model, base), the graphs of both depths the cap takes made once, the longest call first."""
    model, base = noisy_tide("llama")
    for depth in (TREE["max_draft"], 1):
        generate(model, prompt_ids(20, seed=9), {**TREE, "max_draft": depth}, max_new_tokens=24)
    return model, base


def generate(model, ids, config=None, **kwargs):
    return model.generate(ids, do_sample=False, compile_config=EAGER_BACKEND, tide_config=config or TREE, **kwargs)


def test_the_shape_orders_nodes_as_the_passes_write_them():
    """x, 2 siblings, an n-gram branch of 2, a chain of 2 more from the best sibling: parents, depths, ancestry and
    each node's path by depth."""
    shape = TreeShape(siblings=2, depth=3, ngram=2)
    assert shape.parents == [-1, 0, 0, 0, 3, 1, 5] and shape.depths == [0, 1, 1, 1, 2, 2, 3]
    assert shape.size == 7 and shape.max_depth == 3 and shape.drafted == 4
    assert [u for u in range(7) if shape.ancestry[6][u]] == [0, 1, 5, 6]
    assert not shape.ancestry[2][1] and not shape.ancestry[4][1]  # siblings and branches do not see each other
    assert shape.path[6] == [0, 1, 5, 6] and shape.path[4] == [0, 3, 4, 4] and shape.path[0] == [0, 0, 0, 0]


def test_the_path_moves_to_the_slots_after_x():
    cache = StaticCache(config=noisy_tide("llama")[1].config, max_cache_len=16)
    layer = cache.layers[0]
    states = torch.arange(16, dtype=torch.float32).view(1, 1, 16, 1).expand(1, 2, 16, 4).contiguous()
    layer.lazy_initialization(states, states)
    layer.keys.copy_(states)
    layer.values.copy_(states)
    cache.layers = cache.layers[:1]
    _compact(cache, torch.tensor(5), torch.tensor([3, 6]))  # x at slot 5; the path's nodes at 8 and 11
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 8, 11, 8, 9, 10, 11, 12, 13, 14, 15]
    assert torch.equal(layer.values, layer.keys)


def test_gpt2_trees_take_their_learned_positions_off():
    """(First: a model of another family registers its classes with transformers, which the warm graphs' guards
    read.)"""
    model, base = noisy_tide("gpt2", model_overrides=dict(n_layer=4))
    ids = prompt_ids()
    out = generate(model, ids, max_new_tokens=20)
    assert torch.equal(out, base.generate(ids, do_sample=False, max_new_tokens=20))
    assert model.last_stats.fused_cycles and model.last_stats.accepted


@pytest.mark.parametrize("config", [TREE, {**TREE, "max_draft": 1, "draft_topk": 4}])
def test_fused_trees_equal_the_base_model(warm, config):
    model, base = warm
    ids = prompt_ids()
    out = generate(model, ids, config, max_new_tokens=24)
    stats = model.last_stats
    assert torch.equal(out, base.generate(ids, do_sample=False, max_new_tokens=24))
    assert stats.fused_cycles == stats.verify_passes > 0 and stats.draft_topk == config["draft_topk"]
    assert 0 < stats.accepted < stats.drafted


def test_a_tree_with_an_ngram_branch_equals_the_base_model(warm):
    """Where the text repeats, the n-gram continuation is a branch of the tree: accepted there, and the tokens are
    the base model's; a minimum length and EOS inside a cycle too."""
    model, base = warm
    ids = torch.cat([prompt_ids(6, seed=3)] * 3, 1)
    ref = base.generate(ids, do_sample=False, max_new_tokens=16)
    out = generate(model, ids, {**TREE, "draft_ngram": 3}, max_new_tokens=16)
    assert torch.equal(out, ref)
    assert model.last_stats.fused_cycles and model.last_stats.ngram_drafted
    stop = int(ref[0, ids.shape[1] + 5])
    kwargs = dict(max_new_tokens=16, min_new_tokens=3, eos_token_id=stop, pad_token_id=stop)
    assert torch.equal(generate(model, ids, {**TREE, "draft_ngram": 3}, **kwargs),
                       base.generate(ids, do_sample=False, **kwargs))


def test_sampled_trees_take_the_general_loop(warm):
    model, base = warm
    torch.manual_seed(0)
    model.generate(prompt_ids(), do_sample=True, top_k=2, max_new_tokens=8, compile_config=EAGER_BACKEND,
                   tide_config=TREE)
    assert not model.last_stats.fused_cycles and model.last_stats.tree_cycles
