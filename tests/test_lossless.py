"""Lossless mode: output identical to the base model's for any exit heads, draft layer and draft length."""

import contextlib
from collections import Counter

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList, TextIteratorStreamer

from generation_helpers import BanToken, StopAfter, chi_square, chi_square_limit
from tiny_models import FAMILIES, noisy_tide, prompt_ids, tiny_model, tiny_tokenizer

LOSSLESS = {"mode": "lossless"}
# chain drafts, and tree drafts (tests/test_tree_drafts.py has their own cases)
SCHEMES = {"chain": LOSSLESS, "tree": {"mode": "lossless", "draft_layer": 1, "draft_topk": 4}}


@pytest.mark.parametrize("exit_head", ["tuned", "lens"])
@pytest.mark.parametrize("draft_layer, max_draft", [(1, 1), (1, 4), (3, 8)])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_token_identical(family, draft_layer, max_draft, exit_head):
    model, base = noisy_tide(family, exit_head=exit_head)
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=16)
    out = model.generate(ids, do_sample=False, max_new_tokens=16,
                         tide_config={"mode": "lossless", "draft_layer": draft_layer, "max_draft": max_draft})
    assert torch.equal(out, ref)
    stats = model.last_stats
    assert stats.decode_tokens == 16 and stats.verify_passes >= 1 and stats.drafted > 0
    # every draft ran layers 0..E once, every verification the whole stack once
    assert stats.layer_passes == stats.drafted * (draft_layer + 1) + stats.verify_passes * model.parts.num_layers


SDPA_FAMILIES = ["llama", "mistral", "qwen3", "gemma", "gpt2", "opt", "gpt_neox", "phi"]


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("family", SDPA_FAMILIES)
def test_sdpa_attention_is_token_identical(family, scheme, monkeypatch):
    """With SDPA, verification hands the layers additive float masks (converted once per pass)."""
    import tide.layers.calltransforms as layercalls

    model, base = noisy_tide(family, attention="sdpa")
    converted = []
    real = layercalls.additive_masks
    for module in ("tide.layers.args", "tide.decode.lossless.verifier"):
        monkeypatch.setattr(f"{module}.additive_masks", lambda parts, calls: converted.append(
            real(parts, calls)) or converted[-1])
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=16)
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=16, tide_config=SCHEMES[scheme]), ref)
    masks = [v for calls in converted for call in calls for v in [*call.args, *call.kwargs.values()]
             if isinstance(v, torch.Tensor) and v.dim() == 4]
    assert masks and all(m.dtype == torch.float32 for m in masks)


def test_verification_attends_grouped_query_heads_in_place(monkeypatch):
    """Verification passes on CPU attend the K/V heads in place (no per-group copy), bit-identically; outside
    them transformers decides as before."""
    from transformers.integrations import sdpa_attention

    from tide.models.compat import grouped_query_attention_in_place
    from tide.layers.calls import capture_layer_calls
    from tide.layers.calltransforms import additive_masks

    model, base = noisy_tide("llama", attention="sdpa")  # 4 query heads, 2 K/V heads
    parts, ids = model.parts, prompt_ids(length=10)
    copies = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(n) or real(x, n))

    def verify_pass(in_place: bool):
        cache = DynamicCache(config=base.config)
        base(input_ids=ids[:, :6], past_key_values=cache, use_cache=True)
        calls = additive_masks(parts, capture_layer_calls(parts, input_ids=ids[:, 6:], past_key_values=cache,
                                                          use_cache=True))
        hidden = calls[0].hidden
        with grouped_query_attention_in_place() if in_place else contextlib.nullcontext():
            for i in range(parts.num_layers):
                hidden = calls[i].run(parts, i, hidden)
        return hidden

    copied = verify_pass(False)
    assert copies  # transformers copies K/V heads for a masked pass of 4 positions
    copies.clear()
    assert torch.equal(verify_pass(True), copied) and not copies
    ref = base.generate(ids, do_sample=False, max_new_tokens=12)
    out = model.generate(ids, do_sample=False, max_new_tokens=12, tide_config=SCHEMES["tree"])
    assert torch.equal(out, ref) and model.last_stats.verify_passes > 0
    assert not copies  # generation's verification passes made no copy either
    mask, key = torch.zeros(1, 1, 4, 10), torch.zeros(1, 2, 10, 8)
    assert not sdpa_attention.use_gqa_in_sdpa(mask, key, key)  # outside Tide's passes: transformers' own choice
    with grouped_query_attention_in_place():
        assert sdpa_attention.use_gqa_in_sdpa(mask, key, key)
        assert not sdpa_attention.use_gqa_in_sdpa(mask[..., :1, :], key, key)  # one query: transformers' own


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral"])
def test_left_padded_prompt_is_token_identical(family, scheme):
    model, base = noisy_tide(family, attention="sdpa")
    ids = prompt_ids()
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], 1)
    ref = base.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=12)
    out = model.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=12, tide_config=SCHEMES[scheme])
    assert torch.equal(out, ref) and model.last_stats.verify_passes > 0


def test_max_draft_zero_is_the_plain_base_model():
    model, base = noisy_tide()
    ids = prompt_ids()
    out = model.generate(ids, do_sample=False, max_new_tokens=8, tide_config={"mode": "lossless", "max_draft": 0})
    assert torch.equal(out, base.generate(ids, do_sample=False, max_new_tokens=8)) and model.last_stats.mode == "base"


def test_exit_threshold_with_lossless_is_a_clear_error():
    model, _ = noisy_tide()
    with pytest.raises(ValueError, match="exit_threshold"):
        model.generate(prompt_ids(), max_new_tokens=4, tide_config={"mode": "lossless", "exit_threshold": 0.5})


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gemma3_text"])
def test_sliding_window_models_stay_token_identical_past_the_window(family):
    """Window 8, 24-token prompt, 24 new tokens: drafts are verified and rejected long after eviction began."""
    model, base = noisy_tide(family)
    ids = prompt_ids(length=24)
    ref = base.generate(ids, do_sample=False, max_new_tokens=24)
    out = model.generate(ids, do_sample=False, max_new_tokens=24,
                         tide_config={"mode": "lossless", "draft_layer": 1, "max_draft": 4})
    assert torch.equal(out, ref)
    stats = model.last_stats
    assert stats.accepted < stats.drafted, "some drafts should be rejected (cache rolled back past the window)"


def test_a_sliding_cache_that_cannot_roll_back_is_a_clear_error():
    from tide.decode.lossless.verifier import check_rollback
    from transformers import DynamicCache

    base = tiny_model("mistral")
    cache = DynamicCache(config=base.config)
    base(prompt_ids(length=12), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="roll back"):
        check_rollback(cache)


def test_batch_is_a_clear_error():
    model, _ = noisy_tide()
    with pytest.raises(ValueError, match="batch size 1"):
        model.generate(torch.randint(4, 100, (2, 5)), max_new_tokens=4, tide_config=LOSSLESS)


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_eos_inside_a_draft(family):
    model, base = noisy_tide(family)
    ids = prompt_ids()
    plain = base.generate(ids, do_sample=False, max_new_tokens=12)
    eos = int(plain[0, ids.shape[1] + 5])
    for m in (base, model.base):
        m.generation_config.eos_token_id = eos
    ref = base.generate(ids, do_sample=False, max_new_tokens=12)
    out = model.generate(ids, do_sample=False, max_new_tokens=12, tide_config=LOSSLESS)
    assert torch.equal(out, ref) and int(out[0, -1]) == eos


@pytest.mark.parametrize("new_tokens", [1, 2, 5, 11])
def test_max_new_tokens_mid_draft(new_tokens):
    model, base = noisy_tide(max_draft=8)
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=new_tokens)
    out = model.generate(ids, do_sample=False, max_new_tokens=new_tokens, tide_config=LOSSLESS)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5, 6])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_stopping_criterion_mid_draft(scheme, stop_after):
    model, base = noisy_tide()
    ids = prompt_ids()
    criteria = StoppingCriteriaList([StopAfter(ids.shape[1] + stop_after)])
    ref = base.generate(ids, do_sample=False, max_new_tokens=20, stopping_criteria=criteria)
    out = model.generate(ids, do_sample=False, max_new_tokens=20, stopping_criteria=criteria,
                         tide_config=SCHEMES[scheme])
    assert torch.equal(out, ref) and out.shape[1] == ids.shape[1] + stop_after


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_logits_processor_applies_to_verified_tokens(scheme):
    model, base = noisy_tide()
    ids = prompt_ids()
    banned = int(base.generate(ids, do_sample=False, max_new_tokens=3)[0, -1])
    ref = base.generate(ids, do_sample=False, max_new_tokens=12,
                        logits_processor=LogitsProcessorList([BanToken(banned)]))
    out = model.generate(ids, do_sample=False, max_new_tokens=12,
                         logits_processor=LogitsProcessorList([BanToken(banned)]), tide_config=SCHEMES[scheme])
    assert torch.equal(out, ref) and banned not in out[0, ids.shape[1]:].tolist()


def test_streamer_receives_only_accepted_tokens():
    from threading import Thread

    tok = tiny_tokenizer()
    model, _ = noisy_tide()
    inputs = tok(["Hello there"], return_tensors="pt")
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    cfg = LOSSLESS
    thread = Thread(target=model.generate, kwargs=dict(**inputs, streamer=streamer, tide_config=cfg, do_sample=False,
                                                       max_new_tokens=12))
    thread.start()
    text = "".join(streamer)
    thread.join()
    out = model.generate(**inputs, tide_config=cfg, do_sample=False, max_new_tokens=12)
    assert text == tok.decode(out[0, inputs["input_ids"].shape[1]:])


def _exact_joint(base, ids, steps, top_k, temperature):
    """Closed-form distribution of the next `steps` sampled tokens under top-k + temperature."""
    probs = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for prefix, p in probs.items():
            with torch.no_grad():
                logits = base(torch.cat([ids, torch.tensor([prefix], dtype=torch.long).view(1, -1)], 1)).logits[0, -1]
            top = torch.topk(logits / temperature, top_k)
            for tok, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist()):
                nxt[prefix + (tok,)] = p * q
        probs = nxt
    return probs


def test_sampling_matches_the_closed_form_distribution():
    """Lossless sampling draws from the base model's distribution: a chi-square test against the exact
    joint distribution of three sampled tokens (top-k keeps the support small)."""
    model, base = noisy_tide()
    ids = prompt_ids(length=5)
    steps, top_k, temperature, runs = 3, 3, 2.0, 600
    exact = _exact_joint(base, ids, steps, top_k, temperature)
    counts = Counter()
    drafted = 0
    for seed in range(runs):
        torch.manual_seed(seed)
        out = model.generate(ids, do_sample=True, top_k=top_k, temperature=temperature, max_new_tokens=steps,
                             tide_config=LOSSLESS)
        counts[tuple(out[0, -steps:].tolist())] += 1
        drafted += model.last_stats.drafted
    assert drafted > runs  # drafts really came from the early-exit distribution
    assert set(counts) <= set(exact)
    chi2, df = chi_square(counts, exact, runs)
    assert chi2 < chi_square_limit(df), (chi2, df, counts.most_common(6))


def test_stats_and_summary():
    model, _ = noisy_tide()
    out = model.generate(prompt_ids(), do_sample=False, max_new_tokens=12, return_dict_in_generate=True,
                         tide_config=LOSSLESS)
    stats = out["tide_stats"]
    assert stats.mode == "lossless" and 0 <= stats.accepted <= stats.drafted
    assert 0.0 <= stats.acceptance_rate <= 1.0
    text = stats.summary()
    assert "drafted / accepted" in text and "verification passes" in text
