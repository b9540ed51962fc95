"""Compiled greedy trees as one graph and one host read a cycle (`decode/fusedtree.py`): the shape's ancestry and
paths, and the K/V moved to the path. Token for token as the base model, one launch and one read a cycle, and no
recompilation across prompt lengths: `test_fused_cycles.py`, on its warm model."""

import torch
from transformers.cache_utils import StaticCache

from tide.decode.fusedtree import TreeShape, _compact
from tiny_models import noisy_tide


def test_the_shape_orders_nodes_as_the_passes_write_them():
    """x, 2 siblings, an n-gram branch of 3: parents, depths, ancestry and each node's path by depth."""
    shape = TreeShape(siblings=2, ngram=3)
    assert shape.parents == [-1, 0, 0, 0, 3, 4] and shape.depths == [0, 1, 1, 1, 2, 3]
    assert shape.size == 6 and shape.max_depth == 3
    assert [u for u in range(6) if shape.ancestry[5][u]] == [0, 3, 4, 5]
    assert not shape.ancestry[2][1] and not shape.ancestry[3][1]  # siblings and the branch do not see each other
    assert shape.path[5] == [0, 3, 4, 5] and shape.path[2] == [0, 2, 2, 2] and shape.path[0] == [0, 0, 0, 0]
    assert TreeShape(siblings=3, ngram=0).depths == [0, 1, 1, 1]


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
