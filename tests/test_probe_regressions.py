"""Regressions found by issue 29's second probe (a demanding new user's ~230 cases)."""

import pytest
import torch
from transformers import GenerationConfig, StaticCache

import tide
from tide.decode.lossless.verifier import LosslessUnavailable
from tiny_models import noisy_tide, prompt_ids

GREEDY = dict(do_sample=False, max_new_tokens=12, pad_token_id=0)


@pytest.fixture(scope="module")
def shipped():
    """The shipped model (trained: tiny random models hardly notice shifted positions) with fresh routers."""
    from tide.tools.demo import _load_base

    base, tokenizer = _load_base()
    return tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2)), base, tokenizer


@pytest.mark.parametrize("draft", [{"max_draft": 3}, {"draft_topk": 3}, {"draft_ngram": 2}])
def test_lossless_on_a_left_padded_prompt_equals_the_base_model(shipped, draft):
    """The prompt's prefill takes its positions from the attention mask, as generate gives them, not from the
    cache's length: a left-padded row's tokens start at position 0."""
    model, base, tokenizer = shipped
    prompt = tokenizer("The list type", return_tensors="pt")
    ids = torch.cat([torch.full((1, 3), 1), prompt.input_ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt.attention_mask], 1)
    options = dict(GREEDY, max_new_tokens=20, pad_token_id=1)
    ref = base.generate(ids, attention_mask=mask, **options)
    out = model.generate(ids, attention_mask=mask, **options, tide_config={"mode": "lossless", **draft})
    assert torch.equal(out, ref)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
@pytest.mark.parametrize("length", [1, 2])
def test_lossless_from_a_one_token_prompt_with_sdpa_equals_the_base_model(family, length):
    """From position 0, SDPA's masks may be None (its is_causal shortcut, true only for a chunk that starts at 0):
    no window of layer arguments opens there, or later multi-position verifications would attend without a mask."""
    model, base = noisy_tide(family, heads=("translator", "draft"), attention="sdpa")
    ids = prompt_ids(length, seed=3)
    ref = base.generate(ids, **GREEDY)
    for draft in ({"max_draft": 1}, {"max_draft": 4}):
        assert torch.equal(model.generate(ids, **GREEDY, tide_config={"mode": "lossless", **draft}), ref), draft


def _auto(family: str):
    model, base = noisy_tide(family)
    model.config.set_generation_defaults(mode="auto")
    model.config.thresholds = {str(k): 0.9 for k in model.checkpoints}  # exit mode has an operating point
    return model, base


@pytest.mark.parametrize("cache", ["implementation", "passed"])
def test_auto_with_a_static_cache_on_sliding_window_layers_runs_like_the_base_model(cache):
    """A static cache's sliding-window layers cannot roll back a rejected draft: the repo default "auto" then runs
    exit mode, never an error the base model would not raise; an explicit lossless call says what to do up front."""
    model, base = _auto("mistral")
    ids = prompt_ids(9, seed=3)

    def options():
        if cache == "implementation":
            return {"cache_implementation": "static"}
        return {"past_key_values": StaticCache(config=base.config, max_cache_len=32)}

    out = model.generate(ids, **GREEDY, **options())
    assert out.shape == base.generate(ids, **GREEDY, **options()).shape
    assert model.last_stats.mode == "exit"
    with pytest.raises(LosslessUnavailable, match="DynamicCache"):
        model.generate(ids, **GREEDY, **options(), tide_config={"mode": "lossless"})


@pytest.mark.parametrize("no_cache", [{"use_cache": False},
                                      {"generation_config": GenerationConfig(use_cache=False, **GREEDY)}])
def test_auto_without_a_kv_cache_runs_the_base_model(no_cache):
    """use_cache=False (as a keyword or in a generation_config): "auto" can run neither lossless nor exit mode, so
    it runs the base model; explicit modes say what to do."""
    model, base = _auto("llama")
    ids = prompt_ids(9, seed=3)
    kwargs = dict(no_cache) if "generation_config" in no_cache else dict(GREEDY, **no_cache)
    assert torch.equal(model.generate(ids, **kwargs), base.generate(ids, **kwargs))
    for mode in ({"mode": "lossless"}, {"mode": "exit", "exit_threshold": 0.5}):
        with pytest.raises(ValueError, match="use_cache=False"):
            model.generate(ids, **kwargs, tide_config=mode)
