"""Tide's own decode loops behind `generate`: the base model stays compilable, stop strings stop every mode,
and the acceptance rules alone."""

from collections import Counter

import pytest
import torch

from tide.decode.lossless.accept import greedy_verdict, sampling_verdict
from tiny_models import noisy_tide, prompt_ids, tiny_tokenizer

MODES = {"exit": {"mode": "exit", "exit_threshold": 0.5}, "chain": {"mode": "lossless", "draft_layer": 1},
         "tree": {"mode": "lossless", "draft_layer": 1, "draft_topk": 3}}


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
def test_the_wrapped_base_model_compiles_as_one_graph(family):
    """After every kind of Tide call (exit, lossless, exit-mode beams), dynamo traces the base model's forward as
    one graph, and the compiled forward gives the base model's logits."""
    model, base = noisy_tide(family)
    ids = prompt_ids()
    for config in MODES.values():
        model.generate(ids, max_new_tokens=6, do_sample=False, tide_config=config)
    model.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False, tide_config=MODES["exit"])
    compiled = torch.compile(model.base.forward, fullgraph=True, backend="eager", dynamic=False)
    with torch.no_grad():
        assert torch.allclose(compiled(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_stop_strings_stop_where_the_base_model_stops(family, mode):
    tok = tiny_tokenizer()
    model, base = noisy_tide(family)
    ids = prompt_ids()
    free = base.generate(ids, do_sample=False, max_new_tokens=16)
    config = MODES[mode]
    if mode == "exit":
        free = model.generate(ids, do_sample=False, max_new_tokens=16, tide_config=config)
    text = tok.decode(free[0, ids.shape[1] + 4:ids.shape[1] + 6])
    stop = text.strip()[-2:] or text
    kwargs = dict(do_sample=False, max_new_tokens=16, stop_strings=[stop], tokenizer=tok)
    ref = (model if mode == "exit" else base).generate(ids, **kwargs,
                                                       **({"tide_config": config} if mode == "exit" else {}))
    out = model.generate(ids, **kwargs, tide_config=config)
    assert ref.shape[1] < free.shape[1]  # the stop string really stopped the reference early
    assert torch.equal(out, ref)


def test_stop_strings_without_a_tokenizer_are_a_clear_error():
    model, _ = noisy_tide()
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(prompt_ids(), max_new_tokens=4, stop_strings=["x"], tide_config=MODES["chain"])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_scores_and_logits_match_the_base_model(family):
    model, base = noisy_tide(family)
    ids = prompt_ids()
    kwargs = dict(do_sample=False, max_new_tokens=8, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=1.3)
    ref = base.generate(ids, **kwargs)
    for config in (MODES["chain"], MODES["tree"]):
        out = model.generate(ids, **kwargs, tide_config=config)
        assert torch.equal(out.sequences, ref.sequences)
        assert len(out.scores) == len(ref.scores) == len(out.logits) == 8
        for mine, theirs in zip(out.scores, ref.scores):
            assert torch.allclose(mine, theirs, atol=1e-4)
        for mine, theirs in zip(out.logits, ref.logits):
            assert torch.allclose(mine, theirs, atol=1e-4)


def test_greedy_verdict_accepts_the_matching_prefix():
    scores = torch.full((1, 4, 5), -1.0)
    for position, token in enumerate([3, 1, 4, 2]):
        scores[0, position, token] = 1.0
    verdict = greedy_verdict(torch.tensor([[3, 1, 0]]), scores)
    assert verdict.accepted == 2 and verdict.tokens.tolist() == [[3, 1, 4]]
    verdict = greedy_verdict(torch.tensor([[3, 1, 4]]), scores)
    assert verdict.accepted == 3 and verdict.tokens.tolist() == [[3, 1, 4, 2]]
    assert greedy_verdict(torch.zeros(1, 0, dtype=torch.long), scores[:, :1]).tokens.tolist() == [[3]]


def test_sampling_verdict_keeps_the_target_distribution():
    """Whatever the draft distribution q, the first emitted token is distributed as the target p."""
    torch.manual_seed(0)
    p = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]]).log()
    q = torch.tensor([[[0.2, 0.2, 0.6]]]).log()
    runs, counts = 6000, Counter()
    for _ in range(runs):
        drafted = torch.multinomial(q[0, 0].softmax(-1), 1)[None]
        counts[int(sampling_verdict(drafted, q, p).tokens[0, 0])] += 1
    for token, prob in enumerate([0.5, 0.3, 0.2]):
        assert abs(counts[token] / runs - prob) < 4 * (prob * (1 - prob) / runs) ** 0.5


@pytest.mark.parametrize("static", ["cache_implementation", "compile"])
def test_exit_mode_beams_on_a_static_cache_equal_beams_on_a_dynamic_one(static):
    """On a static cache generate gives the forward a 4-D mask; exit mode's beam steps read its padding from it
    (a left-padded batch: a row's padding stays unseen) and decode as on a dynamic cache."""
    from transformers import CompileConfig

    model, _ = noisy_tide("llama")
    ids = torch.cat([prompt_ids(), prompt_ids(seed=1)])
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    options = dict(max_new_tokens=5, num_beams=2, do_sample=False, attention_mask=mask, pad_token_id=0)
    ref = model.generate(ids, tide_config={"mode": "exit", "exit_threshold": 0.3}, **options)
    if static == "compile":
        options["compile_config"] = CompileConfig(backend="eager")
        config = {"mode": "exit", "exit_threshold": 0.3, "compile": True}
    else:
        options["cache_implementation"] = "static"
        config = {"mode": "exit", "exit_threshold": 0.3}
    out = model.generate(ids, tide_config=config, **options)
    assert torch.equal(out, ref) and model.last_stats.exits != {"full": model.last_stats.decode_tokens}
