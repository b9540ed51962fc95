"""Batched exit mode: rows that have exited leave the running batch, and a batch still equals its rows alone."""

import pytest
import torch

import tide
from generation_helpers import exits_by_sign
from tiny_models import tiny_model, tiny_tokenizer

GREEDY = dict(do_sample=False, max_new_tokens=8)
PROMPTS = ["The quick brown fox", "Hello", "import os; print(os.getcwd())", "a b c d e f"]


def _model(family, attention="eager"):
    base = tiny_model(family, attention=attention)
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_layers=[1, 3]))
    model.exit_tests = exits_by_sign({1: 0, 3: 1})
    return model


def _rows_per_layer(model):
    seen = {i: [] for i in range(model.parts.num_layers)}
    hooks = [layer.register_forward_pre_hook(
        lambda _m, args, kwargs, i=i: seen[i].append((args[0] if args else kwargs["hidden_states"]).shape[0]),
        with_kwargs=True) for i, layer in enumerate(model.parts.layers)]
    return seen, hooks


@pytest.mark.parametrize("family, attention", [("llama", "eager"), ("gpt2", "eager"), ("qwen3", "eager"),
                                               ("falcon", "eager"), ("phi", "eager"), ("llama", "sdpa"),
                                               ("gpt2", "sdpa")])
def test_rows_exiting_at_different_checkpoints_equal_each_row_alone(family, attention):
    model = _model(family, attention)
    tok = tiny_tokenizer(pad=True)
    tok.padding_side = "left"
    cfg = {"exit_threshold": 0.5}
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    seen, hooks = _rows_per_layer(model)
    try:
        together = model.generate(**batch, tide_config=cfg, pad_token_id=0, **GREEDY)
    finally:
        for h in hooks:
            h.remove()
    stats = model.last_stats
    assert {"1", "3", "full"} <= set(stats.exits), (
        f"rows should leave at both checkpoints and not at all: {stats.exits}")
    for i, prompt in enumerate(PROMPTS):
        alone = model.generate(**tok([prompt], return_tensors="pt"), tide_config=cfg, pad_token_id=0, **GREEDY)
        assert torch.equal(together[i, -GREEDY["max_new_tokens"]:], alone[0, -GREEDY["max_new_tokens"]:]), i
    deepest = seen[model.parts.num_layers - 1]
    if family == "falcon":  # tiny falcon uses alibi
        return  # alibi biases are laid out [batch x heads, ...]: the whole batch keeps running
    # decode steps (batch of 4, one new token each) where some row had left ran the last layer on fewer rows
    assert min(deepest) < len(PROMPTS), deepest


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_threshold_one_batch_equals_base_greedy(attention):
    model = tide.TideForCausalLM.from_base(tiny_model("llama", attention=attention),
                                           tide.TideConfig(checkpoint_layers=[1, 3]))
    tok = tiny_tokenizer(pad=True)
    tok.padding_side = "left"
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    expected = model.base.generate(**batch, pad_token_id=0, **GREEDY)
    assert torch.equal(model.generate(**batch, tide_config={"exit_threshold": 1.0}, pad_token_id=0, **GREEDY), expected)


def test_without_row_skipping_every_row_keeps_running_and_the_tokens_stay():
    """`row_skipping=False`: exited rows ride along (every layer call takes the whole batch), the same tokens."""
    model = _model("llama")
    tok = tiny_tokenizer(pad=True)
    tok.padding_side = "left"
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    skipping = model.generate(**batch, tide_config={"exit_threshold": 0.5}, pad_token_id=0, **GREEDY)
    assert model.last_stats.switches["row_skipping"] is True
    seen, hooks = _rows_per_layer(model)
    try:
        kept = model.generate(**batch, tide_config={"exit_threshold": 0.5, "row_skipping": False}, pad_token_id=0,
                              **GREEDY)
    finally:
        for h in hooks:
            h.remove()
    stats = model.last_stats
    assert stats.switches["row_skipping"] is False and "row_skipping=False" in stats.summary()
    assert {"1", "3"} <= set(stats.exits)
    assert {rows for calls in seen.values() for rows in calls} == {len(PROMPTS)}
    assert torch.equal(kept, skipping)
