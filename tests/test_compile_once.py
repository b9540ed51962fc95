"""Compiled calls compile once: the lent static cache's length is a dynamic dimension of the one-graph cycles (calls
whose prompts grow make no graph again), each call's stats count its compiling, and compiled work persists in Tide's
cache folder (`decode/compilecache.py`), a stale or foreign file ignored with a log line."""

import json
import logging

import pytest
import torch
from transformers import CompileConfig

from tide.decode import compilecache
from tide.decode.cachepool import bucket
from tide.layers.spans import compile_options
from tiny_models import noisy_tide, prompt_ids

EAGER_BACKEND = CompileConfig(backend="eager")
CHAIN = {"mode": "lossless", "max_draft": 1, "compile": True}
TREE = {"mode": "lossless", "max_draft": 1, "draft_topk": 2, "compile": True}


@pytest.fixture(scope="module", autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("config", [CHAIN, TREE], ids=["chain", "tree"])
def test_growing_prompts_compile_no_graph_again(config):
    """Calls whose prompts and lengths grow across cache buckets (256, 384 and 768 positions): the first call's
    graphs serve them all (0 graphs and 0 recompiles after it), every output the base model's; a chain call
    compiles one graph (its prefill runs eagerly), a tree call at most 3."""
    model, base = noisy_tide("llama", model_overrides=dict(max_position_embeddings=2048))
    lengths = [(8, 16), (40, 24), (300, 20), (700, 16), (12, 8)]
    assert len({bucket(n + new + 4) for n, new in lengths}) == 3
    for i, (n, new) in enumerate(lengths):
        ids = prompt_ids(n, seed=n)
        out = model.generate(ids, do_sample=False, max_new_tokens=new, compile_config=EAGER_BACKEND,
                             tide_config=config)
        stats = model.last_stats
        assert torch.equal(out, base.generate(ids, do_sample=False, max_new_tokens=new)), (n, new)
        assert stats.fused_cycles and stats.compiled and stats.recompiles == 0, (n, stats.compile_text())
        if i == 0:
            assert 1 <= stats.graphs_compiled <= (1 if config is CHAIN else 3) and stats.compile_s > 0
            assert "compiling" in stats.summary() and "graph" in stats.compile_text()
        else:
            assert stats.graphs_compiled == 0, (n, stats.compile_text())


@pytest.mark.parametrize("config, most", [
    ({"mode": "lossless", "max_draft": 2, "draft_ngram": 3, "compile": True}, 3),
    ({"mode": "lossless", "max_draft": 2, "draft_topk": 2, "draft_ngram": 3, "compile": True}, 2),
], ids=["chain", "tree"])
def test_the_graphs_a_compiled_greedy_call_compiles_are_counted(config, most):
    """Graphs counted over the calls of a fresh model, on a text that repeats (n-gram drafts) and two that do not,
    drafts accepted and rejected (the cap moves): a chain of up to 2 drafts with n-gram drafts (the shipped SmolLM2
    repo's `compiled_chain`) compiles at most 3 graphs, one per width the cap takes (1 and 2) and the n-gram pass's
    (one graph for all of them measured slower a token: docs/benchmarks.md); a tree of 2 candidates with an n-gram
    branch at most 2, its shape with the branch and without. The prompt is prefilled eagerly: no graph. Every output
    the base model's, no recompile."""
    model, base = noisy_tide("llama", heads=("translator", "draft"))
    graphs = 0
    for i, ids in enumerate([torch.cat([prompt_ids(6, seed=3)] * 3, 1), prompt_ids(20, seed=5), prompt_ids(9)]):
        out = model.generate(ids, do_sample=False, max_new_tokens=40, compile_config=EAGER_BACKEND,
                             tide_config=config)
        stats = model.last_stats
        assert torch.equal(out, base.generate(ids, do_sample=False, max_new_tokens=40))
        assert stats.recompiles == 0 and (i or stats.graphs_compiled >= 1) and stats.fused_cycles
        assert stats.ngram_drafted or i, "the repeated text drafted no n-gram continuation"
        graphs += stats.graphs_compiled
    assert graphs <= most, graphs


def test_the_compiled_base_decode_makes_no_graph_again_as_prompts_grow():
    """The base model's compiled decode (a compiled call where Tide's modes do not pay): its mask sized from the
    cache's tensors, one graph for caches of 256, 384 and 768 positions, the base model's tokens."""
    model, base = noisy_tide("llama", model_overrides=dict(max_position_embeddings=2048))
    model.config.set_generation_defaults(mode="lossless", max_draft=2, compiled_modes=False)
    for i, (n, new) in enumerate([(8, 16), (300, 20), (700, 16)]):
        ids = prompt_ids(n, seed=n)
        out = model.generate(ids, do_sample=False, max_new_tokens=new, compile_config=EAGER_BACKEND,
                             tide_config={"compile": True})
        stats = model.last_stats
        assert stats.mode == "base (compiled)" and torch.equal(out, base.generate(ids, do_sample=False,
                                                                                  max_new_tokens=new))
        assert (stats.graphs_compiled, stats.recompiles) == ((1, 0) if i == 0 else (0, 0)), stats.compile_text()


def test_persisted_artifacts_load_once_and_a_stale_or_foreign_file_is_ignored(tmp_path, monkeypatch, caplog):
    """`save` writes torch's artifacts under a key of the model, torch version, device and options; the first
    compiled call of a model loads them (once); a file made for another key, or one torch cannot load, is skipped
    with a log line and the call runs."""
    monkeypatch.setenv("TIDE_CACHE", str(tmp_path))
    model, base = noisy_tide("llama")
    options = compile_options(EAGER_BACKEND)
    loaded = []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled\nwork", None))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)
    path = compilecache.save(model, options, "cpu")
    assert path.parent == tmp_path / "compiled" and path.is_file()
    ids = prompt_ids()
    model.generate(ids, do_sample=False, max_new_tokens=4, compile_config=EAGER_BACKEND, tide_config=CHAIN)
    model.generate(ids, do_sample=False, max_new_tokens=4, compile_config=EAGER_BACKEND, tide_config=CHAIN)
    assert loaded == [b"compiled\nwork"]  # once, the payload after the header line

    other, _ = noisy_tide("llama")
    key = compilecache.artifact_key(other, options, "cpu")
    stale = dict(key, torch="0.0.1")
    compilecache.artifact_path(key).write_bytes(json.dumps(stale).encode() + b"\nold")
    with caplog.at_level(logging.WARNING, logger=compilecache.__name__):
        assert not compilecache.load(other, options, "cpu")
    assert "another torch" in caplog.text and loaded == [b"compiled\nwork"]

    def refuses(payload):
        raise RuntimeError("bad artifacts")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", refuses)
    third, _ = noisy_tide("llama")
    compilecache.save(third, options, "cpu")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=compilecache.__name__):
        out = third.generate(ids, do_sample=False, max_new_tokens=6, compile_config=EAGER_BACKEND, tide_config=CHAIN)
    assert "could not load" in caplog.text
    assert torch.equal(out, base.generate(ids, do_sample=False, max_new_tokens=6))


def test_warmup_runs_the_compiled_calls_and_saves(tmp_path, monkeypatch):
    """`tide warmup`'s function: the repo's compiled call on its prompts, then the save (here: torch's artifacts
    faked, the graphs traced without inductor)."""
    from tide.tools.warmup import warmup

    monkeypatch.setenv("TIDE_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"work", None))
    model, _ = noisy_tide("llama")
    model.config.set_generation_defaults(mode="lossless", max_draft=2)
    report = warmup(model, new_tokens=8, compile_config=EAGER_BACKEND)
    assert report["file"] and len(report["calls"]) == 2
    assert report["calls"][0]["graphs_compiled"] >= 1 and all(run["recompiles"] == 0 for run in report["calls"])


def test_calibration_persists_what_its_compiled_trials_compiled(tmp_path, monkeypatch):
    """Calibration with `compiled_trials`: the first compiled timing's call compiles graphs (traced without inductor
    here: the base model's generation config names the eager backend; the timings themselves faked), and
    what torch compiled is written under the key of the repo as calibration leaves it, which the saved repo's first
    compiled call in a later process loads. Where nothing compiled, nothing is written."""
    import tide
    from tide.calibration import trials
    from tide.calibration.persist import persist_compiled
    from tiny_models import sample_texts, tiny_model, tiny_tokenizer

    monkeypatch.setenv("TIDE_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled\nwork", None))
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)
    compiled = []

    def fake_speedup(model, prompts, tide_config, new_tokens=24, repeats=3, baseline="generate", bar=None):
        if baseline == "compiled" and not compiled:  # the first compiled trial: one real call, its graphs compile
            model.generate(prompts[0], tide_config={**tide_config, "compile": True}, do_sample=False,
                           max_new_tokens=4, pad_token_id=0)
            compiled.append(model.last_stats.graphs_compiled)
        return 0.9

    monkeypatch.setattr(trials, "measured_speedup", fake_speedup)
    base = tiny_model("llama")
    base.generation_config.compile_config = EAGER_BACKEND
    torch.manual_seed(0)
    model = tide.calibrate(base, tiny_tokenizer(), dataset=sample_texts(24), num_samples=24, batch_size=8,
                           max_length=32, head_steps=5, passes=1, validation_tokens=0, draft_trials=1, progress=False,
                           config=tide.TideConfig(checkpoint_interval=2, target_agreement=0.05), compiled_trials=True)
    assert compiled[0] >= 1
    options = compile_options(EAGER_BACKEND)
    key = compilecache.artifact_key(model, options, "cpu")
    path = compilecache.artifact_path(key)
    assert path.is_file() and json.loads(path.read_bytes().partition(b"\n")[0]) == key

    model.save_pretrained(tmp_path / "repo")
    later = tide.TideForCausalLM.from_pretrained(tmp_path / "repo", base_model=base)
    assert compilecache.artifact_key(later, options, "cpu") == key and compilecache.load(later, options, "cpu")
    assert loaded == [b"compiled\nwork"]

    path.unlink()
    assert persist_compiled(model, graphs=0) is None and not path.exists()


def test_compile_watch_counts_graphs_recompiles_and_seconds():
    """`CompileWatch` (dynamo's compile callbacks): a function compiled for one shape, then compiled again for
    another (a guard failed: a recompile), then run on a third shape with the graph already made (dynamic)."""
    from tide.models.compat import CompileWatch

    double = torch.compile(lambda x: x * 2, backend="eager")
    with CompileWatch() as watch:
        for size in (3, 3, 4, 5):
            double(torch.ones(size))
    assert (watch.graphs, watch.recompiles) == (2, 1) and watch.seconds > 0
    with CompileWatch() as idle:
        double(torch.ones(6))
    assert (idle.graphs, idle.recompiles, idle.seconds) == (0, 0, 0.0)


def test_precompiled_graphs_load_without_tracing_and_fall_back_where_they_cannot(tmp_path, monkeypatch, caplog):
    """Inside `precompiling()` (`tide warmup`) a compiled call's cycle graph is precompiled whole and saved; another
    model object of the same repo (as a later process) loads it at its first call: no graph compiled, the base model's
    tokens across cache lengths. A file made under another key is ignored with a log line, and a loaded graph whose
    guards refuse the arguments gives way to a variant compiled for them: the call's output stays the base model's."""
    from tide.decode.precompiled import precompiling

    monkeypatch.setenv("TIDE_CACHE", str(tmp_path))
    overrides = dict(max_position_embeddings=2048)
    calls = [(prompt_ids(n, seed=n), new) for n, new in [(8, 16), (300, 12)]]

    def run(model, base):
        for ids, new in calls:
            out = model.generate(ids, do_sample=False, max_new_tokens=new, compile_config=EAGER_BACKEND,
                                 tide_config=CHAIN)
            assert torch.equal(out, base.generate(ids, do_sample=False, max_new_tokens=new))
            assert model.last_stats.fused_cycles and model.last_stats.recompiles == 0
        (runner,) = model.span_runners.values()
        return runner.precompiled.events

    first, base = noisy_tide("llama", model_overrides=overrides)
    with precompiling():
        assert [e.get("saved") for e in run(first, base)] == [True]
    (path,) = (tmp_path / "compiled").glob("*.aot")

    later, base = noisy_tide("llama", model_overrides=overrides)
    ids, new = calls[0]
    later.generate(ids, do_sample=False, max_new_tokens=new, compile_config=EAGER_BACKEND, tide_config=CHAIN)
    assert later.last_stats.graphs_compiled == 0
    assert [e.get("loaded") for e in run(later, base)] == [True]

    (runner,) = later.span_runners.values()
    (graph,) = [fn for fn in runner._compiled.values() if hasattr(fn, "variants")]
    (loaded,) = graph.variants
    monkeypatch.setattr(loaded, "guard_check", lambda *args: False)
    with caplog.at_level(logging.WARNING, logger="tide.decode.precompiled"):
        ids, new = calls[0]
        out = later.generate(ids, do_sample=False, max_new_tokens=new, compile_config=EAGER_BACKEND,
                             tide_config=CHAIN)
    assert torch.equal(out, base.generate(ids, do_sample=False, max_new_tokens=new))
    assert "does not take these arguments" in caplog.text and len(graph.variants) == 2
    assert (later.last_stats.graphs_compiled, later.last_stats.recompiles) == (1, 1)

    header, _, payload = path.read_bytes().partition(b"\n")
    path.write_bytes(json.dumps(dict(json.loads(header), tide_source="another")).encode() + b"\n" + payload)
    caplog.clear()
    other, base = noisy_tide("llama", model_overrides=overrides)
    with caplog.at_level(logging.WARNING, logger="tide.decode.precompiled"):
        assert run(other, base) == []
    assert "made for another tide_source" in caplog.text and other.last_stats.recompiles == 0


class Doubled(torch.nn.Linear):
    """A linear layer that computes otherwise: twice its product."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_graphs_check_their_guards_once_per_signature_in_a_call(monkeypatch):
    """A compiled call's graphs are AOT-compiled at their first call and run their guards where the arguments'
    signature is new in a call (not every cycle); a call after a module of the model was swapped for one that computes
    otherwise runs them again, and the graph is compiled again: the output follows the swap, as a plain
    torch.compile's would."""
    model, base = noisy_tide("llama")
    ids = prompt_ids(12)

    def run():
        out = model.generate(ids, do_sample=False, max_new_tokens=24, compile_config=EAGER_BACKEND, tide_config=CHAIN)
        assert torch.equal(out, base.generate(ids, do_sample=False, max_new_tokens=24))
        return model.last_stats

    assert run().graphs_compiled == 1
    (runner,) = model.span_runners.values()
    (graph,) = [fn for fn in runner._compiled.values() if hasattr(fn, "variants")]
    (variant,) = graph.variants
    checks = []
    real_check = variant.guard_check
    monkeypatch.setattr(variant, "guard_check", lambda *args: checks.append(real_check(*args)) or checks[-1])
    stats = run()
    assert stats.graphs_compiled == 0 and checks and all(checks) and len(checks) < stats.fused_cycles

    mlp = model.base.model.layers[-1].mlp  # (the base model's own module: `base` decodes with the swap too)
    swapped = Doubled(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    swapped.weight.data.copy_(mlp.down_proj.weight)
    mlp.down_proj = swapped
    checked = len(checks)
    stats = run()
    assert len(checks) > checked and stats.graphs_compiled == stats.recompiles == 1 and len(graph.variants) == 2


_LATER_PROCESS = """
import contextlib, json, sys
import torch
from transformers import CompileConfig
from tide.decode.precompiled import precompiling
from tiny_models import noisy_tide, prompt_ids

EAGER, calls = CompileConfig(backend="eager"), []
with precompiling() if sys.argv[1] == "save" else contextlib.nullcontext():
    for defaults in ({}, {"compiled_modes": False}):  # the chain's cycle graph; the base model's compiled step
        model, base = noisy_tide("llama", model_overrides=dict(max_position_embeddings=2048))
        model.config.set_generation_defaults(mode="lossless", max_draft=1, **defaults)
        for n, new in [(8, 16), (300, 12)]:
            ids = prompt_ids(n, seed=n)
            out = model.generate(ids, do_sample=False, max_new_tokens=new, compile_config=EAGER,
                                 tide_config={"compile": True, "machine_check": False})
            same = torch.equal(out, base.generate(ids, do_sample=False, max_new_tokens=new))
            calls.append([model.last_stats.mode, model.last_stats.graphs_compiled, same])
print(json.dumps(calls))
"""


def test_precompiled_graphs_load_in_a_later_process(tmp_path):
    """`tide warmup`'s precompiling in one process (a chain's cycle graph, and the base model's compiled step where a
    compiled call runs the base model), and a later process that loads both: no graph compiled there, the base
    model's tokens across cache lengths (what a saved graph names must exist in a fresh process: a graph that names
    an object of the saving process does not load)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = dict(os.environ, TIDE_CACHE=str(tmp_path), PYTHONPATH=os.pathsep.join([str(tests), *sys.path]))

    def run(kind: str) -> list:
        out = subprocess.run([sys.executable, "-c", _LATER_PROCESS, kind], env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr

    saved, _ = run("save")
    assert [mode for mode, _, _ in saved] == ["lossless"] * 2 + ["base (compiled)"] * 2
    assert [graphs for _, graphs, _ in saved] == [1, 0, 1, 0] and all(same for _, _, same in saved)
    names = sorted(path.name.split("-")[0] for path in (tmp_path / "compiled").glob("*.aot"))
    assert names == ["tide_base_step", "tide_cycle_1"]
    loaded, log = run("load")
    assert [graphs for _, graphs, _ in loaded] == [0, 0, 0, 0] and all(same for _, _, same in loaded), log[-3000:]
    assert "Tide:" not in log  # (nothing ignored, nothing fallen back)
