"""`tide_config={"compile": True}`: compiled runs of layers on a static cache, token for token as eager ones."""

from contextlib import contextmanager

import pytest
import torch
from transformers import CompileConfig, DynamicCache

from generation_helpers import exits_by_sign
from tiny_models import noisy_tide, prompt_ids

EAGER_BACKEND = CompileConfig(backend="eager")  # dynamo's graph capture without inductor's code generation: fast


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """After each test here, dynamo forgets what it compiled (`torch._dynamo.reset()`): every test compiles as in a
    fresh process, and earlier tests' cache entries and guards (on code that every model of a family shares, such as
    its forward) do not slow later tests' compiles (the eager-backend tests here took a quarter longer without it)."""
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # (later calls replaying: tests/test_fused_cycles.py)
def test_compiled_graphs_are_token_identical(family, monkeypatch):
    """Compiled runs of layers (a single row's exit steps as one graph: tests/test_exit_graph.py, off here)."""
    from tide.decode.exits.walkgraph import ExitGraph

    monkeypatch.setattr(ExitGraph, "for_session", classmethod(lambda cls, session: None))
    model, base = noisy_tide(family)
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=20)
    compiled = dict(do_sample=False, max_new_tokens=20, compile_config=EAGER_BACKEND)
    for scheme in ({"max_draft": 1}, {"max_draft": 4}):
        out = model.generate(ids, tide_config={"mode": "lossless", "compile": True, **scheme}, **compiled)
        assert torch.equal(out, ref), scheme
    assert torch.equal(model.generate(ids, tide_config={"exit_threshold": 1.0, "compile": True}, **compiled), ref)
    model.exit_tests = exits_by_sign({1: 0, 3: 1})
    eager = model.generate(ids, do_sample=False, max_new_tokens=20, tide_config={"exit_threshold": 0.5})
    assert set(model.last_stats.exits) - {"full"}
    assert torch.equal(model.generate(ids, tide_config={"exit_threshold": 0.5, "compile": True}, **compiled), eager)
    assert len(model.span_runners) == 1  # one set of graphs for these compile options


def test_grouped_query_sdpa_verification_compiles():
    """Multi-position passes on CPU attend grouped K/V heads in place (a ContextVar-driven choice) when eager; under
    dynamo transformers' own choice stands, so the compiled verification traces."""
    model, base = noisy_tide("llama", attention="sdpa")  # 4 query heads, 2 K/V heads
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=16)
    out = model.generate(ids, do_sample=False, max_new_tokens=16, compile_config=EAGER_BACKEND,
                         tide_config={"mode": "lossless", "max_draft": 3, "compile": True})
    assert torch.equal(out, ref)


def test_inductor_lossless_and_exit_equal_the_base_model():
    """The default backend (inductor, CPU code generation) on a tiny model: lossless = base, no exits = base, exits =
    the eager walk.

    The one test here that generates code (the others capture graphs with the eager backend): a 2-layer model with a
    checkpoint after its first layer has every kind of graph (a draft step, a greedy chain, a verification, exit
    mode's runs of layers), and inductor's time goes by the kernels it compiles, not by the layers."""
    model, base = noisy_tide("llama", model_overrides=dict(num_hidden_layers=2), checkpoint_interval=1)
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=16)
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=16,
                                      tide_config={"mode": "lossless", "max_draft": 2, "compile": True}), ref)
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=16,
                                      tide_config={"exit_threshold": 1.0, "compile": True}), ref)
    model.exit_tests = exits_by_sign({0: 0})  # some tokens leave after the first layer: exit mode's one graph a step
    eager = model.generate(ids, do_sample=False, max_new_tokens=16, tide_config={"exit_threshold": 0.5})
    assert set(model.last_stats.exits) == {"0", "full"}
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=16,
                                      tide_config={"exit_threshold": 0.5, "compile": True}), eager)
    (runner,) = model.span_runners.values()  # compiled: the fused cycles' graphs, exit mode's graph steps (torch.cond)
    graphs = {key[1][0] for key in runner._compiled if key[0] == "graph"}
    assert {"cycle", "fused exit"} <= graphs, list(runner._compiled)


def test_compile_needs_a_static_cache():
    model, base = noisy_tide("llama")
    ids = prompt_ids()
    with pytest.raises(ValueError, match="static cache"):
        model.generate(ids, max_new_tokens=4, past_key_values=DynamicCache(config=base.config),
                       tide_config={"mode": "lossless", "compile": True})
    with pytest.raises(ValueError, match="cache_implementation='dynamic'"):
        model.generate(ids, max_new_tokens=4, cache_implementation="dynamic",
                       tide_config={"mode": "lossless", "compile": True})
    with pytest.raises(ValueError, match="compile must be True or False"):
        model.generate(ids, max_new_tokens=4, tide_config={"mode": "lossless", "compile": "yes"})


def test_compiled_call_runs_the_compiled_base_where_modes_do_not_pay():
    """compile=True where calibration timed Tide's modes no faster than the base model's compiled decode
    (`compiled_modes=False`), or where there is nothing to run (no thresholds): the base model's compiled decode,
    token for token the base model, its steps replayed from one graph."""
    model, base = noisy_tide("llama")
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=16)
    model.config.set_generation_defaults(mode="auto", max_draft=2, compiled_modes=False)
    compiled = dict(do_sample=False, max_new_tokens=16, compile_config=EAGER_BACKEND)
    assert torch.equal(model.generate(ids, tide_config={"compile": True}, **compiled), ref)
    assert model.last_stats.mode == "base (compiled)" and model.last_stats.decode_steps == 15
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(ids, tide_config={"compile": True}, **compiled), ref)
    # a call that names a mode runs it; a plain call runs the repo's default eagerly
    model.generate(ids, tide_config={"compile": True, "mode": "lossless"}, **compiled)
    assert model.last_stats.mode == "lossless"
    model.generate(ids, do_sample=False, max_new_tokens=16)
    assert model.last_stats.mode == "lossless"


def test_compiled_base_steps_get_their_tokens_laid_out_afresh(monkeypatch):
    """Each compiled base step gets its tokens in a tensor of their own, not a slice of the sequence: a slice's
    stride holds the sequence's length, and a compiled forward records a graph (on a GPU, a CUDA graph) for every
    stride it sees."""
    from tide.decode.baseline import BaseSession

    model, base = noisy_tide("llama")
    model.config.set_generation_defaults(compiled_modes=False)
    strides, forward = [], BaseSession.forward

    def recording(self, input_ids=None, **kwargs):
        strides.append(input_ids.stride())
        return forward(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(BaseSession, "forward", recording)
    ids = prompt_ids()
    out = model.generate(ids, do_sample=False, max_new_tokens=6, compile_config=EAGER_BACKEND,
                         tide_config={"compile": True})
    assert torch.equal(out, base.generate(ids, do_sample=False, max_new_tokens=6))
    assert len(strides) == 6 and set(strides[1:]) == {(1, 1)}  # the prompt, then one token a step


def test_compiled_base_serves_processors_stops_and_padded_batches():
    model, base = noisy_tide("llama")
    model.config.set_generation_defaults(compiled_modes=False, exit_threshold=0.5)
    ids = prompt_ids()
    options = dict(do_sample=False, max_new_tokens=12, repetition_penalty=1.3, eos_token_id=int(
        base.generate(ids, do_sample=False, max_new_tokens=6)[0, -1]))
    ref = base.generate(ids, **options)
    out = model.generate(ids, tide_config={"compile": True}, compile_config=EAGER_BACKEND, **options)
    assert torch.equal(out, ref)
    batch = torch.cat([ids, ids.flip(1)])
    mask = torch.ones_like(batch)
    mask[1, :2] = 0  # a padded row: its steps carry a mask and run eagerly
    ref = base.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=8)
    out = model.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=8, compile_config=EAGER_BACKEND,
                         tide_config={"compile": True})
    assert torch.equal(out, ref)


def test_compiled_base_leaves_beam_search_to_transformers():
    model, base = noisy_tide("llama")
    model.config.set_generation_defaults(compiled_modes=False)
    ids = prompt_ids()
    options = dict(do_sample=False, max_new_tokens=8, num_beams=2)
    out = model.generate(ids, tide_config={"compile": True}, compile_config=EAGER_BACKEND, **options)
    assert torch.equal(out, base.generate(ids, **options))


def test_compiled_calls_share_one_static_cache():
    """Compiled calls decode on one lent static cache (the same tensors call after call: CUDA graphs captured on
    its addresses replay), reset each call, its length rounded up to a bucket (calls of nearby lengths share it); a
    call that returns its cache, and a call while the cache is lent, get one of their own."""
    from tide.decode.cachepool import MIN_BUCKET, bucket

    model, base = noisy_tide("llama")
    ids, longer = prompt_ids(), prompt_ids(length=12, seed=1)
    seen, original = [], model.static_caches.lend

    @contextmanager
    def lend(*args, **kwargs):  # the caches lent, as the calls see them
        with original(*args, **kwargs) as cache:
            seen.append(cache)
            yield cache

    model.static_caches.lend = lend
    run = dict(do_sample=False, compile_config=EAGER_BACKEND, tide_config={"mode": "lossless", "max_draft": 3,
                                                                          "compile": True})
    for prompt, new in ((ids, 20), (longer, 8), (ids, 20)):
        assert torch.equal(model.generate(prompt, max_new_tokens=new, **run),
                           base.generate(prompt, do_sample=False, max_new_tokens=new))
    assert len(seen) == 3 and seen[0] is seen[1] is seen[2]
    held, keys = seen[0], seen[0].layers[0].keys
    # as generate sizes it (max_length - 1), and room for a whole draft (max_draft + 1) after the last token, in a
    # bucket: at least MIN_BUCKET, above it four a doubling (at most a quarter more positions than asked)
    assert held.layers[0].max_cache_len == MIN_BUCKET == bucket(ids.shape[1] + 20 - 1 + 3 + 1)
    assert [bucket(n) for n in (1, 256, 257, 321, 1000, 1024, 1025, 3000)] == [256, 256, 320, 384, 1024, 1024,
                                                                             1280, 3072]
    assert all(n <= bucket(n) <= max(256, n * 1.25) for n in range(1, 5000))
    out = model.generate(ids, max_new_tokens=20, return_dict_in_generate=True, **run)
    assert len(seen) == 3 and out.past_key_values is not held  # a returned cache: generate made it, not lent
    with original(base.config, 8, 1, next(base.parameters())) as taken:
        assert taken is held  # the free one of that bucket
        assert torch.equal(model.generate(ids, max_new_tokens=20, **run),
                           base.generate(ids, do_sample=False, max_new_tokens=20))
        assert seen[-1] is not held  # lent elsewhere meanwhile: a cache of its own
    model.generate(ids, max_new_tokens=20, **run)
    assert seen[-1] is held and held.layers[0].keys is keys
    pool = model.static_caches
    for rows in range(1, pool.KEEP + 2):  # one free cache per batch size, the most recent KEEP of them
        with original(base.config, 8, rows, next(base.parameters())):
            pass
    assert len(pool._free) == pool.KEEP and all(key[1] > 1 for key in pool._free)
    model.static_caches.clear()  # frees them: the next call gets a new one
    model.generate(ids, max_new_tokens=8, **run)
    assert seen[-1] is not held and seen[-1].layers[0].max_cache_len == MIN_BUCKET


def test_the_draft_head_runs_in_the_shallow_layers_graph():
    """Compiled drafts of the draft-and-verify backend (here: a call with a logits processor that reads the
    sequence) run the shallow layers and the draft head as one graph; a `draft_logits` replaced on the model is
    called instead (eagerly), and both give the base model's tokens."""
    model, base = noisy_tide("llama")
    ids = prompt_ids()
    general = dict(do_sample=False, max_new_tokens=16, no_repeat_ngram_size=2)
    ref = base.generate(ids, **general)
    config = {"mode": "lossless", "max_draft": 3, "compile": True}
    out = model.generate(ids, **general, tide_config=config, compile_config=EAGER_BACKEND)
    assert torch.equal(out, ref)
    (runner,) = model.span_runners.values()
    assert [key for key in runner._compiled if key[-1] == "then"], list(runner._compiled)
    calls = []
    original = model.draft_logits

    def replaced(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    model.draft_logits = replaced
    out = model.generate(ids, **general, tide_config=config, compile_config=EAGER_BACKEND)
    assert torch.equal(out, ref) and calls


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # gpt2: learned positions added to the embeddings
def test_greedy_chains_draft_in_one_compiled_call(family, monkeypatch):
    """Where the graph backend declines (`decode/lossless/graph.py`; forced here), compiled greedy chains with no logits
    processors draft every token of a chain in one call (one graph per chain length); a chain cut by a stopping
    draft, and calls with a processor (drafted a call a token), give the base model's tokens."""
    monkeypatch.setattr("tide.decode.lossless.loop.graph_cycles", lambda *args, **kwargs: "forced")
    model, base = noisy_tide(family)
    ids = prompt_ids()
    config = {"mode": "lossless", "max_draft": 4, "compile": True}
    ref = base.generate(ids, do_sample=False, max_new_tokens=20)
    out = model.generate(ids, do_sample=False, max_new_tokens=20, tide_config=config, compile_config=EAGER_BACKEND)
    assert torch.equal(out, ref)
    (runner,) = model.span_runners.values()
    chains = [key for key in runner._compiled if "chain" in key]
    assert chains and model.last_stats.drafted > model.last_stats.verify_passes  # chains of 2+ drafts ran
    stop = int(ref[0, ids.shape[1] + 5])  # a token the base model emits mid-way: generation stops there
    ref = base.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=stop, pad_token_id=stop)
    out = model.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=stop, pad_token_id=stop,
                         tide_config=config, compile_config=EAGER_BACKEND)
    assert torch.equal(out, ref) and out.shape[1] < ids.shape[1] + 20
    ref = base.generate(ids, do_sample=False, max_new_tokens=20, repetition_penalty=1.3)
    out = model.generate(ids, do_sample=False, max_new_tokens=20, repetition_penalty=1.3, tide_config=config,
                         compile_config=EAGER_BACKEND)
    assert torch.equal(out, ref)
