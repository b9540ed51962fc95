"""Exit mode's single-row compiled steps as one graph each (`decode/exitgraph.py`): `torch.cond` at every consulted
checkpoint, token for token as the compiled spans and the eager walk, one graph and one host read a step, no
recompilation across prompt lengths."""

import pytest
import torch
from transformers import CompileConfig

from generation_helpers import exits_by_sign
from tide.decode import exitgraph
from tiny_models import noisy_tide, prompt_ids

EAGER_BACKEND = CompileConfig(backend="eager")
EXIT = {"exit_threshold": 0.5, "compile": True}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


def _graph_keys(model) -> list:
    (runner,) = model.span_runners.values()
    return [key for key in runner._compiled if key[0] == "graph" and key[1][0] == "exit"]


# the cache by keyword, and by position (GPT-2's `layer_past`); exit tests on the sign of a state's dimension chosen so
# that tokens leave at both checkpoints and some run every layer
@pytest.mark.parametrize("family, dims", [("llama", {1: 0, 3: 3}), ("gpt2", {1: 4, 3: 1})])
def test_exit_steps_as_one_graph_equal_the_walk(family, dims, monkeypatch):
    """Tokens leaving at either checkpoint or running every layer: the graph's tokens and exits are the eager walk's
    and the compiled spans', and the steps ran the graph, not spans."""
    model, base = noisy_tide(family)
    model.exit_tests = exits_by_sign(dims)
    ids = prompt_ids()
    kwargs = dict(do_sample=False, max_new_tokens=20)
    eager = model.generate(ids, tide_config={"exit_threshold": 0.5}, **kwargs)
    exits = dict(model.last_stats.exits)
    assert len(set(exits) - {"full"}) == 2 and "full" in exits  # both checkpoints, and full passes
    out = model.generate(ids, tide_config=EXIT, compile_config=EAGER_BACKEND, **kwargs)
    assert torch.equal(out, eager) and dict(model.last_stats.exits) == exits
    assert _graph_keys(model)
    (runner,) = model.span_runners.values()
    assert not [key for key in runner._compiled if isinstance(key[0], int)]  # no run of layers was compiled alone
    monkeypatch.setattr(exitgraph.ExitGraph, "for_session", classmethod(lambda cls, session: None))
    assert torch.equal(model.generate(ids, tide_config=EXIT, compile_config=EAGER_BACKEND, **kwargs), eager)


def test_one_graph_launch_and_one_host_read_a_step(monkeypatch):
    """Counted: each decode step calls the compiled exit graph once and reads the device twice, however many
    checkpoints it passes: the exit layer, and the cache's length (for the layers' arguments, as every step)."""
    model, base = noisy_tide("llama")
    model.exit_tests = exits_by_sign({1: 0, 3: 3})
    ids = prompt_ids()
    model.generate(ids, tide_config=EXIT, compile_config=EAGER_BACKEND, do_sample=False, max_new_tokens=12)
    launches, reads = [0], [0]
    real_graph, real_int = exitgraph.ExitGraph.step, int

    def counted_step(self, steps, cache):
        launches[0] += 1
        return real_graph(self, steps, cache)

    monkeypatch.setattr(exitgraph.ExitGraph, "step", counted_step)
    monkeypatch.setattr(torch.Tensor, "__int__", lambda t: reads.__setitem__(0, reads[0] + 1) or real_int(t.item()))
    model.generate(ids, tide_config=EXIT, compile_config=EAGER_BACKEND, do_sample=False, max_new_tokens=12)
    monkeypatch.undo()
    steps = model.last_stats.decode_steps
    assert steps == 11 and launches[0] == steps and reads[0] == 2 * steps


def test_no_recompilation_across_prompt_lengths():
    model, base = noisy_tide("llama")
    model.exit_tests = exits_by_sign({1: 0, 3: 3})
    kwargs = dict(do_sample=False, max_new_tokens=10, compile_config=EAGER_BACKEND, tide_config=EXIT)
    model.generate(prompt_ids(24, seed=1), **kwargs)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for length in range(6, 16):
            model.generate(prompt_ids(length, seed=length), **kwargs)
    assert len(_graph_keys(model)) == 1


def test_the_routers_own_tests_run_in_the_graph():
    """The call's `CheckpointTest`s (made anew each call) in the graph: the eager walk's tokens, and a second call
    replays the graph."""
    model, base = noisy_tide("llama")
    ids = prompt_ids()
    kwargs = dict(do_sample=False, max_new_tokens=12)
    for threshold in (0.3, 0.5, 0.7):
        eager = model.generate(ids, tide_config={"exit_threshold": threshold}, **kwargs)
        if set(model.last_stats.exits) - {"full"}:
            break
    assert set(model.last_stats.exits) - {"full"}, "no token left at these thresholds"
    config = {"exit_threshold": threshold, "compile": True}
    assert torch.equal(model.generate(ids, tide_config=config, compile_config=EAGER_BACKEND, **kwargs), eager)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(ids, tide_config=config, compile_config=EAGER_BACKEND, **kwargs), eager)
    assert _graph_keys(model)
