"""`cache_implementation="static"`: exit and lossless modes on a preallocated cache, token for token as on a dynamic
one."""

import pytest
import torch
from transformers import CompileConfig

from generation_helpers import exits_by_sign
from tiny_models import noisy_tide, prompt_ids

STATIC = {"cache_implementation": "static"}
FAMILIES = ["llama", "qwen3", "gpt2", "phi3", "gemma"]


@pytest.mark.parametrize("family", FAMILIES)
def test_exit_mode_on_a_static_cache_equals_a_dynamic_one(family):
    model, base = noisy_tide(family)
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=20)
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=20, tide_config={"exit_threshold": 1.0},
                                      **STATIC), ref)
    config = {"exit_threshold": 0.5}
    model.exit_tests = exits_by_sign({1: 0, 3: 1})
    dynamic = model.generate(ids, do_sample=False, max_new_tokens=20, tide_config=config)
    exits = dict(model.last_stats.exits)
    assert set(exits) - {"full"}, "some tokens should exit"
    static = model.generate(ids, do_sample=False, max_new_tokens=20, tide_config=config, **STATIC)
    assert torch.equal(static, dynamic) and model.last_stats.exits == exits
    assert model.last_stats.arg_windows_off is None


@pytest.mark.parametrize("scheme", [{"max_draft": 1}, {"max_draft": 4}, {"draft_layer": 3, "max_draft": 8}])
@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_on_a_static_cache_is_token_identical(family, scheme):
    model, base = noisy_tide(family)
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=24)
    out = model.generate(ids, do_sample=False, max_new_tokens=24, tide_config={"mode": "lossless", **scheme}, **STATIC)
    assert torch.equal(out, ref)
    stats = model.last_stats
    assert stats.drafted > 0
    if family == "llama":
        assert stats.drafted > stats.accepted  # drafts were rejected, and the cache rolled back
    assert stats.arg_windows_off is None


def test_lossless_sampling_on_a_static_cache_runs_and_stops_at_the_budget():
    model, _ = noisy_tide("llama")
    torch.manual_seed(0)
    out = model.generate(prompt_ids(), do_sample=True, max_new_tokens=16, min_new_tokens=16,
                         tide_config={"mode": "lossless", "max_draft": 4}, **STATIC)
    assert out.shape[1] == prompt_ids().shape[1] + 16


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_drafts_on_a_static_cache_are_token_identical(family):
    """A tree writes x and its k candidates past the static layers' length, keeps the full model's pick in place
    and moves the length back; near the end of the cache, where k + 1 slots do not fit, it drafts a chain."""
    model, base = noisy_tide(family)
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=24)
    out = model.generate(ids, do_sample=False, max_new_tokens=24, **STATIC,
                         tide_config={"mode": "lossless", "max_draft": 1, "draft_topk": 3})
    assert torch.equal(out, ref)
    assert model.last_stats.draft_topk == 3 and model.last_stats.drafted > 0


def test_tree_verification_runs_the_compiled_backbone(monkeypatch):
    """Compiled, drafted and verified (where a tree cycle is not one graph: here forced), a tree is verified in one
    pass of the backbone's own compiled forward, the tree as a 4-D mask: x and its 3 candidates (one width, one
    graph, replayed by later calls), token for token the base model."""
    from transformers import CompileConfig

    import tide.decode.lossless.loop
    monkeypatch.setattr(tide.decode.lossless.loop, "graph_cycles", lambda *args, **kwargs: "forced")
    model, base = noisy_tide("llama")
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=16)
    config = {"mode": "lossless", "max_draft": 1, "draft_topk": 3, "compile": True}
    out = model.generate(ids, do_sample=False, max_new_tokens=16, compile_config=CompileConfig(backend="eager"),
                         tide_config=config)
    assert torch.equal(out, ref) and model.last_stats.draft_topk == 3
    runner = next(iter(model.span_runners.values()))
    widths, real = [], runner.backbone
    runner.backbone = lambda **inputs: (widths.append(inputs["input_ids"].shape[1]), real(**inputs))[1]
    with torch._dynamo.config.patch(error_on_recompile=True):  # the tree's width replays its graph
        out = model.generate(ids, do_sample=False, max_new_tokens=16, compile_config=CompileConfig(backend="eager"),
                             tide_config=config)
    assert torch.equal(out, ref) and widths and set(widths) == {4}
    assert model.last_stats.tree_cycles == len(widths)


def test_compiled_calls_on_sliding_window_layers():
    """compile=True on a model with sliding-window layers (Gemma 2): the compiled base and compiled exit mode run on
    the static cache Tide lends (its sliding layers included), token for token the base model's and the eager exit
    walk's; lossless mode, whose rejected drafts those layers cannot roll back, says what to do instead."""
    model, base = noisy_tide("gemma2", heads=("translator", "draft"))
    ids = prompt_ids(12)
    greedy = dict(max_new_tokens=20, do_sample=False, compile_config=CompileConfig(backend="eager"))
    out = model.generate(ids, tide_config={"compile": True, "compiled_modes": False}, **greedy)
    assert model.last_stats.mode == "base (compiled)" and torch.equal(out, base.generate(ids, max_new_tokens=20,
                                                                                           do_sample=False))
    exits = {"mode": "exit", "exit_threshold": 0.5}
    walked = model.generate(ids, max_new_tokens=20, do_sample=False, tide_config=exits)
    out = model.generate(ids, tide_config={**exits, "compile": True}, **greedy)
    assert model.last_stats.compiled and torch.equal(out, walked)
    with pytest.raises(ValueError, match="Drop compile=True and cache_implementation"):
        model.generate(ids, tide_config={"mode": "lossless", "compile": True}, **greedy)
