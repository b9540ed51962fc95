"""Compiled trees as one graph and one host read a cycle (`decode/lossless/graphtree.py`): the shape's ancestry and
paths, the K/V moved to the path, and the sampled rule's distributions. Token for token as the base model, one
launch and one read a cycle, and no recompilation across prompt lengths: `test_fused_cycles.py`, on its warm
model."""

from collections import Counter

import pytest
import torch
from transformers.cache_utils import StaticCache

from generation_helpers import chi_square, chi_square_limit
from tide.decode.lossless.accept import sampling_tree_verdict_on_device as sampled_path
from tide.decode.lossless.graphtree import TreeShape, _compact
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


@pytest.mark.parametrize("ids, counts", [([5, 1, 2, 3, 4], [1, 1, 1, 1, 1]),   # every node distinct
                                         ([5, 1, 2, 1, 4], [1, 1, 1, 1, 1]),   # the n-gram branch repeats a sibling
                                         ([5, 1, 2, 3, 4], [1, 1, 1, 1, 0])],  # its second token is padding
                         ids=["distinct", "repeat", "padding"])
def test_a_sampled_tree_emits_what_the_full_model_samples(ids, counts):
    """The sampled rule as the graph runs it (`accept.sampling_tree_verdict_on_device`), against fixed distributions
    at every node of a tree of 2 siblings and an n-gram branch of 2: the first emitted token is distributed as the
    full model's distribution after x, and the next as the distribution after the node the first one went through
    (chi-square, 6,000 runs)."""
    torch.manual_seed(0)
    shape, vocab, runs = TreeShape(siblings=2, ngram=2), 6, 6000
    p = torch.rand(shape.size, vocab) ** 2
    p[0] = torch.tensor([0.1, 0.25, 0.2, 0.3, 0.1, 0.05])  # after x: the drafted tokens 1, 2, 3 likely
    p = p / p.sum(-1, keepdim=True)
    ids, counts = torch.tensor(ids), torch.tensor(counts, dtype=torch.bool)
    first, after = Counter(), {}
    for _ in range(runs):
        end, token = sampled_path(p, ids, shape, counts)
        path = [v for v in shape.path[int(end)][1:shape.depths[int(end)] + 1]]
        emitted = [int(ids[v]) for v in path] + [int(token)]
        first[emitted[0]] += 1
        if len(emitted) > 1:  # the second token, after the node of the first
            after.setdefault(path[0], Counter())[emitted[1]] += 1
    checks = [(first, p[0])] + [(c, p[v]) for v, c in after.items() if sum(c.values()) >= 200]
    for seen, row in checks:
        chi2, df = chi_square(seen, dict(enumerate(row.tolist())), sum(seen.values()))
        assert chi2 < chi_square_limit(df), (chi2, df, seen)
    assert len(checks) >= 3  # paths through siblings and the n-gram branch were taken and tested
    if not counts[4]:
        assert all(int(sampled_path(p, ids, shape, counts)[0]) != 4 for _ in range(200))  # padding is never accepted
