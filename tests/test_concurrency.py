"""Concurrent generate calls on one model: each runs its own configuration, and the base model is left as it was."""

import threading
import time

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import tide
from tiny_models import tiny_model

GREEDY = dict(do_sample=False, max_new_tokens=12)
CONFIGS = {
    "exit": {"exit_threshold": -1},
    "exit_recompute": {"exit_threshold": 0.5, "kv_strategy": "recompute"},
    "lossless": {"mode": "lossless", "draft_layer": 1, "max_draft": 3},
    "plain": None,
}


class _Slow(StoppingCriteria):
    """Sleeps at every step, so that the other thread's call runs while this one is mid-generation."""

    def __call__(self, input_ids, scores, **kwargs):
        time.sleep(0.01)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _model():
    base = tiny_model("llama")
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_layers=[1, 3]))
    with torch.no_grad():  # routers that let some tokens out and keep others
        for k in model.checkpoints:
            model.routers[k].up.bias.fill_(0.0)
            model.routers[k].up.weight.normal_(0, 3.0)
    return model, base


def _ids(seed):
    torch.manual_seed(seed)
    return torch.randint(4, 100, (1, 8))


def _run(model, name, seed, slow=False):
    criteria = StoppingCriteriaList([_Slow()]) if slow else None
    out = model.generate(_ids(seed), tide_config=CONFIGS[name], stopping_criteria=criteria,
                         return_dict_in_generate=True, **GREEDY)
    return out.sequences, out.get("tide_stats")


@pytest.mark.parametrize("first, second", [("exit", "lossless"), ("exit", "plain"), ("lossless", "exit_recompute"),
                                           ("exit_recompute", "exit")])
def test_concurrent_calls_equal_their_sequential_results(first, second):
    model, base = _model()
    expected = {name: _run(model, name, seed)[0] for name, seed in ((first, 0), (second, 1))}
    plain_before = base.generate(_ids(2), **GREEDY)
    results, errors = {}, []

    def call(name, seed, slow):
        try:
            results[name] = _run(model, name, seed, slow)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    a = threading.Thread(target=call, args=(first, 0, True))
    b = threading.Thread(target=call, args=(second, 1, False))
    a.start()
    time.sleep(0.05)
    b.start()
    a.join()
    b.join()
    assert not errors, errors
    for name in (first, second):
        assert torch.equal(results[name][0], expected[name]), name
    # each call's stats are its own
    for name in (first, second):
        stats = results[name][1]
        if CONFIGS[name] is None:
            assert stats.mode == "base"
        else:
            assert stats.mode == CONFIGS[name].get("mode", "exit")
    assert torch.equal(base.generate(_ids(2), **GREEDY), plain_before)


def test_plain_forward_on_another_thread_is_unaffected_by_a_running_call():
    model, base = _model()
    ids = _ids(3)
    with torch.no_grad():
        expected = base(ids).logits
    seen, errors = [], []

    def plain_forwards():
        try:
            for _ in range(20):
                with torch.no_grad():
                    seen.append(torch.equal(base(ids).logits, expected))
                time.sleep(0.005)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    t = threading.Thread(target=plain_forwards)
    t.start()
    for _ in range(3):
        _run(model, "exit", 0, slow=True)
    t.join()
    assert not errors, errors
    assert seen and all(seen)


def test_a_deep_copy_dispatches_for_itself():
    import copy

    model, base = _model()
    _run(model, "exit", 0)  # installs the dispatching hooks
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.base.parameters():
            p.mul_(0.5)
    ids = _ids(4)
    assert not torch.equal(twin.base(ids).logits, base(ids).logits)
    assert torch.equal(twin.generate(ids, tide_config={"exit_threshold": 1.0}, **GREEDY),
                       twin.base.generate(ids, **GREEDY))
