"""Exit mode's single-row compiled steps as one graph each: the loop's graph backend (`decode/exits/graph.py`: token to
next token, one read a step) and, where the call's processors do not run in a graph, the session's walk as one graph
(`decode/exits/walkgraph.py`); both `torch.cond` at every consulted checkpoint, token for token as the eager walk and
the compiled spans, no recompilation across prompt lengths."""

import pytest
import torch
from transformers import CompileConfig

import tide.decode.exits.loop
from generation_helpers import count_fused_work, exits_by_sign
from tide.decode.cachepool import bucket
from tiny_models import noisy_tide, prompt_ids

EAGER_BACKEND = CompileConfig(backend="eager")
EXIT = {"exit_threshold": 0.5, "compile": True}
# exit tests on the sign of a state's dimension, chosen so that tokens leave at both checkpoints and some run every
# layer
DIMS = {"llama": {1: 0, 3: 3}, "gpt2": {1: 4, 3: 1}}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


def _graphs(model) -> set:
    (runner,) = model.span_runners.values()
    return {key[1][0] for key in runner._compiled if key[0] == "graph"}


def _model(family="llama"):
    model, base = noisy_tide(family)
    model.exit_tests = exits_by_sign(DIMS[family])
    return model


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # (GPT-2: learned positions, the cache by position)
def test_exit_steps_as_one_graph_equal_the_walk(family):
    """Tokens leaving at either checkpoint or running every layer: the graph backend's tokens and exits are the eager
    walk's, with a repetition penalty too (in the graph, on the tokens seen so far), and so are the session's
    one-graph walk's (a processor that reads the sequence, no repeated bigram, keeps the call on the walk backend); no
    run of layers was compiled alone."""
    model = _model(family)
    ids = prompt_ids()
    kwargs = dict(do_sample=False, max_new_tokens=20)
    eager = model.generate(ids, tide_config={"exit_threshold": 0.5}, **kwargs)
    exits = dict(model.last_stats.exits)
    assert len(set(exits) - {"full"}) == 2 and "full" in exits  # both checkpoints, and full passes
    out = model.generate(ids, tide_config=EXIT, compile_config=EAGER_BACKEND, **kwargs)
    assert torch.equal(out, eager) and dict(model.last_stats.exits) == exits
    assert _graphs(model) == {"fused exit"}
    for extra, graphs in (({"repetition_penalty": 1.3}, {"fused exit"}),
                          ({"no_repeat_ngram_size": 2}, {"fused exit", "exit"})):
        eager = model.generate(ids, tide_config={"exit_threshold": 0.5}, **kwargs, **extra)
        assert not torch.equal(eager, out), extra  # (the processor changes the tokens)
        assert torch.equal(model.generate(ids, tide_config=EXIT, compile_config=EAGER_BACKEND, **kwargs, **extra),
                           eager), extra
        assert _graphs(model) == graphs
    (runner,) = model.span_runners.values()
    assert not [key for key in runner._compiled if isinstance(key[0], int)]  # (compiled spans: tests/test_compile.py)


def test_a_minimum_length_a_stop_and_sampling_in_the_graph_backend():
    """A minimum length and an end-of-sequence token inside the loop as the walk serves them; sampling with top-k 1
    (after a temperature) gives the greedy tokens."""
    model = _model()
    ids = prompt_ids()
    ref = model.generate(ids, tide_config={"exit_threshold": 0.5}, do_sample=False, max_new_tokens=16)
    stop = int(ref[0, ids.shape[1] + 6])
    kwargs = dict(do_sample=False, max_new_tokens=16, min_new_tokens=4, eos_token_id=stop, pad_token_id=stop)
    eager = model.generate(ids, tide_config={"exit_threshold": 0.5}, **kwargs)
    assert eager.shape[1] < ids.shape[1] + 16
    assert torch.equal(model.generate(ids, tide_config=EXIT, compile_config=EAGER_BACKEND, **kwargs), eager)
    sampled = model.generate(ids, tide_config=EXIT, compile_config=EAGER_BACKEND, do_sample=True, top_k=1,
                             temperature=0.7, max_new_tokens=16)
    assert torch.equal(sampled, ref) and _graphs(model) == {"fused exit"}


@pytest.mark.parametrize("fused", [True, False], ids=["graph backend", "session walk"])
def test_one_graph_launch_and_few_host_reads_a_step(monkeypatch, fused):
    """Counted: each decode step calls one compiled graph and reads the device once in the graph backend (the token
    and the exit layer), twice in the session's walk (the exit layer, and the cache's length for the layers'
    arguments), however many checkpoints it passes."""
    from tide.decode.exits.session import ExitSession
    from tide.decode.exits.graph import GraphSteps

    model = _model()
    ids = prompt_ids()
    kwargs = dict(do_sample=False, max_new_tokens=12, compile_config=EAGER_BACKEND, tide_config=EXIT)
    if not fused:
        monkeypatch.setattr(tide.decode.exits.loop, "graph_steps", lambda *args, **kw: "walked")
    model.generate(ids, **kwargs)
    launches, reads = (count_fused_work(monkeypatch, GraphSteps, "step") if fused else
                       count_fused_work(monkeypatch, ExitSession, "decode_step"))
    model.generate(ids, **kwargs)
    steps = model.last_stats.decode_steps
    assert steps == 11 and launches[0] == steps and len(set(model.last_stats.exits)) == 3
    assert reads[0] == (steps if fused else 2 * steps), reads  # (inside the graph, `torch.cond` reads its
    # predicate where it runs eagerly)


def test_the_backend_is_chosen_once_with_a_reason_where_the_graph_does_not_fit(monkeypatch):
    """After the prompt's token the loop asks once for the graph backend, which says why not where the call does not
    fit it: a processor that reads the sequence, more than one row, per-token scores."""
    chosen = []
    original = tide.decode.exits.loop.graph_steps

    def recorded(*args, **kwargs):
        chosen.append(original(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(tide.decode.exits.loop, "graph_steps", recorded)
    model, ids = _model(), prompt_ids()
    kwargs = dict(do_sample=False, max_new_tokens=8, compile_config=EAGER_BACKEND, tide_config=EXIT)
    model.generate(ids, **kwargs)
    model.generate(ids, no_repeat_ngram_size=2, **kwargs)
    model.generate(ids.repeat(2, 1), **kwargs)
    model.generate(ids, return_dict_in_generate=True, output_scores=True, **kwargs)
    assert not isinstance(chosen[0], str) and chosen[1:] == [
        "logits processors that do not run in the graph", "more than one row", "per-token scores or logits asked for"]


@pytest.mark.parametrize("extra", [{}, {"no_repeat_ngram_size": 2}], ids=["graph backend", "session walk"])
def test_no_graph_made_again_across_prompt_lengths_and_cache_buckets(extra):
    """Prompts of 6 to 700 tokens and 8 to 24 new tokens, on lent caches of 256, 384 and 768 positions: the first
    call's one graph serves them all (the cache's length, the masks' and the rotary table's, dynamic dimensions),
    0 graphs and 0 recompiles after it, every output the eager walk's with the same exits."""
    model, _ = noisy_tide("llama", model_overrides=dict(max_position_embeddings=2048))
    model.exit_tests = exits_by_sign(DIMS["llama"])
    lengths = [(8, 16), (40, 24), (300, 20), (700, 16), (12, 8)] + [(n, 10) for n in range(6, 12)]
    assert len({bucket(n + new) for n, new in lengths}) == 3
    for i, (n, new) in enumerate(lengths):
        ids, kwargs = prompt_ids(n, seed=n), dict(do_sample=False, max_new_tokens=new, **extra)
        eager = model.generate(ids, tide_config={"exit_threshold": 0.5}, **kwargs)
        exits = dict(model.last_stats.exits)
        out = model.generate(ids, tide_config=EXIT, compile_config=EAGER_BACKEND, **kwargs)
        stats = model.last_stats
        assert torch.equal(out, eager) and dict(stats.exits) == exits, (n, new)
        assert stats.recompiles == 0 and stats.graphs_compiled == (i == 0), (n, new, stats.compile_text())
    assert _graphs(model) == ({"fused exit"} if not extra else {"exit"})


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
    assert _graphs(model) == {"fused exit"}


@pytest.mark.parametrize("family", ["phi3", "qwen3", "opt"])  # fused qkv; k-norms; OPT: a projection after the
# final norm, so the walk backend
def test_compiled_exit_steps_equal_the_walk_on_other_families(family):
    """Compiled exit mode, whichever one-graph path the family takes, gives the eager walk's tokens with tokens
    leaving."""
    model, base = noisy_tide(family)
    model.exit_tests = exits_by_sign(dict.fromkeys(model.checkpoints, 0))
    ids = prompt_ids()
    kwargs = dict(do_sample=False, max_new_tokens=10)
    eager = model.generate(ids, tide_config={"exit_threshold": 0.5}, **kwargs)
    assert set(model.last_stats.exits) - {"full"}
    assert torch.equal(model.generate(ids, tide_config=EXIT, compile_config=EAGER_BACKEND, **kwargs), eager)
    assert _graphs(model) & {"fused exit", "exit"}
