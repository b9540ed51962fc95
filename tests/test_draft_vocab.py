"""Draft vocabularies: lossless drafts that rank only the tokens the full model predicts most (draftvocab.py).

The output stays the base model's on every family, for chains, trees and sampling; the restricted logits are
the head's own for those tokens; the vocabulary is chosen, saved and loaded with the routers; bad sizes and
damaged repos get a clear error."""

from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

import tide
from tide.calibration.costs import draft_candidates
from tide.calibration.measure import StepCosts
from tide.heads.draftvocab import candidate_sizes, ranked_vocabulary, restricted_ranks
from tiny_models import FAMILIES, VOCAB, noisy_tide, prompt_ids, sample_texts, tiny_model, tiny_tokenizer


def _model(family="llama", size=16):
    model, _ = noisy_tide(family)
    # a vocabulary that misses many of the base model's tokens: drafts outside it must cost time, never output
    model.draft_vocabulary = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:size]
    return model


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "gemma2"])
def test_restricted_logits_are_the_heads_own_for_those_tokens(family):
    model = _model(family, size=24)
    k, hidden = model.checkpoints[0], torch.randn(3, model.config.base_hidden_size)
    full, normed = model.draft_logits(k, hidden, None)
    restricted, same = model.draft_logits(k, hidden, None, vocab_size=20)
    ids = model.draft_vocabulary[:20]
    torch.testing.assert_close(restricted[:, ids], full[:, ids])
    outside = torch.ones(full.shape[-1], dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(restricted[:, outside]).all() and torch.equal(normed, same)


def test_restricted_logits_follow_a_new_or_changed_vocabulary_and_head():
    model = _model(size=24)
    k, hidden = model.checkpoints[0], torch.randn(2, model.config.base_hidden_size)

    def check():
        full = model.draft_logits(k, hidden, None)[0]
        restricted = model.draft_logits(k, hidden, None, vocab_size=16)[0]
        ids = model.draft_vocabulary[:16]
        torch.testing.assert_close(restricted[:, ids], full[:, ids])
        assert torch.isfinite(restricted).sum() == 2 * 16

    check()
    model.draft_vocabulary = model.draft_vocabulary.flip(0)  # a new tensor
    check()
    model.draft_vocabulary[:8] = model.draft_vocabulary[8:16].clone()  # changed in place
    model.draft_vocabulary[8:16] = torch.arange(VOCAB)[~torch.isin(torch.arange(VOCAB), model.draft_vocabulary)][:8]
    check()
    with torch.no_grad():
        model.parts.lm_head.weight.mul_(2.0)  # the head changed in place
    check()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", [dict(max_draft=4), dict(max_draft=1, draft_topk=3)])
def test_lossless_with_a_draft_vocabulary_is_token_identical(family, scheme):
    model = _model(family)
    ids = prompt_ids()
    ref = model.base.generate(ids, do_sample=False, max_new_tokens=14)
    config = {"mode": "lossless", "draft_layer": 1, "draft_vocab_size": 16, **scheme}
    out = model.generate(ids, do_sample=False, max_new_tokens=14, tide_config=config)
    assert torch.equal(out, ref)
    assert model.last_stats.draft_vocab_size == 16 and "16 most predicted tokens" in model.last_stats.summary()


def test_drafts_outside_the_vocabulary_are_never_offered():
    model = _model(size=16)
    offered = []
    original = model.draft_logits

    def spy(*args):
        logits, normed = original(*args)
        offered.append(logits.topk(3, -1).indices)
        return logits, normed

    model.draft_logits = spy
    model.generate(prompt_ids(), do_sample=False, max_new_tokens=10,
                   tide_config={"mode": "lossless", "draft_layer": 1, "max_draft": 1, "draft_topk": 3,
                                "draft_vocab_size": 8})
    allowed = set(model.draft_vocabulary[:8].tolist())
    assert offered and all(set(t.flatten().tolist()) <= allowed for t in offered)


def test_sampling_with_a_draft_vocabulary_keeps_the_base_distribution():
    """Speculative sampling from a restricted draft (probability 0 outside it) still samples the base model:
    the frequency of each first sampled token against the base model's own top-k distribution."""
    model = _model(size=8)
    ids = prompt_ids(length=5)
    top_k, temperature, runs = 4, 2.0, 400
    with torch.no_grad():
        logits = model.base(ids).logits[0, -1] / temperature
    best = logits.topk(top_k)
    exact = dict(zip(best.indices.tolist(), best.values.softmax(-1).tolist()))
    counts = Counter()
    for seed in range(runs):
        torch.manual_seed(seed)
        out = model.generate(ids, do_sample=True, top_k=top_k, temperature=temperature, max_new_tokens=2,
                             tide_config={"mode": "lossless", "draft_layer": 1, "draft_vocab_size": 8})
        counts[int(out[0, ids.shape[1]])] += 1
    assert set(counts) <= set(exact)
    chi2 = sum((counts[t] - p * runs) ** 2 / (p * runs) for t, p in exact.items())
    assert chi2 < 3 + 3.09 * 6**0.5 + 6, (chi2, counts, exact)  # far above the 99.9% quantile for 3 df


def test_bad_sizes_are_refused_with_what_to_do():
    model = _model(size=16)
    ids = prompt_ids()
    with pytest.raises(ValueError, match="holds 16 tokens"):
        model.generate(ids, max_new_tokens=2, tide_config={"mode": "lossless", "draft_vocab_size": 32})
    with pytest.raises(ValueError, match="at least 8"):
        model.generate(ids, max_new_tokens=2, tide_config={"mode": "lossless", "draft_vocab_size": 3})
    with pytest.raises(ValueError, match="draft_vocab_size"):
        tide.TideGenerationConfig(draft_vocab_size=-1)
    model.draft_vocabulary = None
    with pytest.raises(ValueError, match="none: calibrate"):
        model.generate(ids, max_new_tokens=2, tide_config={"mode": "lossless", "draft_vocab_size": 8})


def test_the_vocabulary_round_trips_and_repos_without_one_load(tmp_path):
    model = _model(size=16)
    model.config.set_generation_defaults(mode="lossless", draft_layer=1, draft_vocab_size=16)
    model.save_pretrained(tmp_path / "with")
    loaded = tide.TideForCausalLM.from_pretrained(tmp_path / "with", base_model=model.base)
    assert torch.equal(loaded.draft_vocabulary, model.draft_vocabulary)
    ids = prompt_ids()
    assert torch.equal(loaded.generate(ids, do_sample=False, max_new_tokens=8),
                       model.base.generate(ids, do_sample=False, max_new_tokens=8))
    plain = _model()
    plain.draft_vocabulary = None
    plain.save_pretrained(tmp_path / "without")
    assert "draft_vocabulary" not in load_file(tmp_path / "without" / "routers.safetensors")
    assert tide.TideForCausalLM.from_pretrained(tmp_path / "without", base_model=plain.base).draft_vocabulary is None


@pytest.mark.parametrize("damage, message", [(lambda v: v.float(), "integer"), (lambda v: v + VOCAB, "outside"),
                                             (lambda v: torch.cat([v, v[:1]]), "repeats")])
def test_a_damaged_vocabulary_is_refused(tmp_path, damage, message):
    model = _model(size=16)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "routers.safetensors")
    weights["draft_vocabulary"] = damage(weights["draft_vocabulary"])
    save_file(weights, tmp_path / "routers.safetensors")
    with pytest.raises(ValueError, match=message):
        tide.TideForCausalLM.from_pretrained(tmp_path, base_model=model.base)


def test_ranking_and_restricted_ranks():
    counts = torch.tensor([5, 0, 9, 5, 1])
    assert ranked_vocabulary(counts, 3).tolist() == [2, 0, 3]  # most frequent first, ties by id
    logits = torch.tensor([[0.0, 4.0, 3.0, 2.0, 1.0]] * 3)
    full_top1 = torch.tensor([2, 4, 1])
    ids = torch.tensor([3, 2, 4])
    # token 2 ranks first among {2, 3, 4}; token 4 third; token 1 is outside: the cap
    assert restricted_ranks(logits, full_top1, ids, cap=8).tolist() == [0, 2, 8]
    assert candidate_sizes(4096) == [128, 256, 512, 1024] and candidate_sizes(128) == []


def test_estimates_price_a_restricted_draft_by_its_share_of_the_head():
    costs = StepCosts(layer_s=1.0, checkpoint_s=0.2, skipped_layer_s=0.1, head_s=2.0, capture_s=0.5, device="cpu",
                      verify_extra_s={4: 0.5})
    ranks = {1: torch.zeros(400, dtype=torch.uint8)}  # every draft right
    same = {256: (ranks, ranks)}
    missing = {256: ({1: torch.full((400,), 8, dtype=torch.uint8)},) * 2}  # the vocabulary never holds the token
    best = draft_candidates(ranks, 12, costs, max_draft=1, restricted=same, head_rows=1024)[0]
    full = draft_candidates(ranks, 12, costs, max_draft=1)[0]
    assert best.draft_vocab_size == 256 and best.estimate > full.estimate
    base = 12 + 2.0 + 0.5
    assert best.estimate == pytest.approx(2 / (2 + 2.0 * 256 / 1024 + 0.5 + base + 0.5 * 1 / 3) * base)
    assert draft_candidates(ranks, 12, costs, max_draft=1, restricted=missing, head_rows=1024)[0].draft_vocab_size == 0


def test_calibration_keeps_the_vocabulary_of_the_scheme_it_chose(monkeypatch, tmp_path):
    """Calibration ranks the full model's predictions, scores restricted drafts on held-out text, and keeps
    the ranked vocabulary whole (the largest size scored), with the chosen scheme's size as the default."""
    heldout = __import__("tide.calibration.heldout", fromlist=["candidate_sizes"])
    timing = __import__("tide.calibration.timing", fromlist=["choose_draft"])
    monkeypatch.setattr(heldout, "candidate_sizes", lambda rows: [16, 32])
    seen = {}

    def choose(tide_model, tokenizer, texts, candidates, **options):
        seen["candidates"] = candidates
        pick = candidates[0]._replace(draft_vocab_size=16)  # as if calibration had timed this one fastest
        return {"trials": [{**pick._asdict(), "measured": 1.5}], "chosen": {**pick._asdict(), "measured": 1.5}}

    monkeypatch.setattr(timing, "choose_draft", choose)
    scored = []
    original_candidates = timing.draft_candidates
    monkeypatch.setattr(timing, "draft_candidates",
                        lambda *a, **kw: scored.append(kw["restricted"]) or original_candidates(*a, **kw))
    model = tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=sample_texts(24),
                           config=tide.TideConfig(checkpoint_interval=2), num_samples=16, batch_size=8,
                           max_length=32, progress=False, head_steps=10, draft_trials=400, validation_tokens=64)
    assert sorted(scored[0]) == [16, 32]  # both sizes were scored on held-out text
    shapes = [(c.draft_layer, c.max_draft, c.draft_topk) for c in seen["candidates"]]
    assert len(shapes) == len(set(shapes)) > 1  # trials differ in more than the vocabulary
    assert model.draft_vocabulary.numel() == 32 and model.config.generation["draft_vocab_size"] == 16
    ids = prompt_ids()
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=10),
                       model.base.generate(ids, do_sample=False, max_new_tokens=10))
    assert model.last_stats.draft_vocab_size == 16
    model.save_pretrained(tmp_path)
    assert load_file(tmp_path / "routers.safetensors")["draft_vocabulary"].numel() == 32
    wider = model.generate(ids, do_sample=False, max_new_tokens=10, tide_config={"draft_vocab_size": 32})
    assert torch.equal(wider, model.base.generate(ids, do_sample=False, max_new_tokens=10))
    assert "over the 16 most predicted tokens" in (tmp_path / "README.md").read_text()


def test_calibration_times_restricted_drafts_through_generate(monkeypatch):
    """The trials run `generate` with each scheme's draft vocabulary (timings replaced: a restricted draft is
    made the fastest), and the kept one decodes as the base model."""
    heldout = __import__("tide.calibration.heldout", fromlist=["candidate_sizes"])
    timing = __import__("tide.calibration.timing", fromlist=["timed_schemes"])
    trials = __import__("tide.calibration.trials", fromlist=["timed"])
    monkeypatch.setattr(heldout, "candidate_sizes", lambda rows: [16, 32])
    monkeypatch.setattr(timing, "timed_schemes", lambda candidates, count: candidates[:count])
    monkeypatch.setattr(timing, "MIN_TIMED_ESTIMATE", 0.0)  # every scheme timed, however its estimate
    ran = []

    def timed(tide_model, prompts, config, baseline="generate", bar=None):
        if config.get("mode") == "lossless":
            out = tide_model.generate(prompts[0], do_sample=False, max_new_tokens=4, tide_config=config)
            ran.append((config.get("draft_vocab_size"), out))
        return 1.5 if config.get("draft_vocab_size") else 1.1

    monkeypatch.setattr(trials, "timed", timed)
    model = tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=sample_texts(24),
                           config=tide.TideConfig(checkpoint_interval=2), num_samples=16, batch_size=8,
                           max_length=32, progress=False, head_steps=10, draft_trials=400, validation_tokens=64,
                           timing_budget_s=None)  # every trial, however long the machine takes to run them
    selection = model.config.calibration["draft_selection"]
    assert "unavailable" not in selection and {n for n, _ in ran} >= {0, 16, 32}
    chosen = selection["chosen"]["draft_vocab_size"]
    assert chosen in (16, 32) and model.draft_vocabulary.numel() == 32
    ids = prompt_ids()
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=10),
                       model.base.generate(ids, do_sample=False, max_new_tokens=10))


def test_draft_trials_stop_only_where_lossless_mode_is_unavailable(monkeypatch):
    """A model whose cache cannot roll back makes calibration record lossless mode as unavailable; any other
    error in a trial is a bug and propagates (it once hid a restricted trial's missing vocabulary)."""
    from types import SimpleNamespace

    from tide.calibration.costs import DraftScheme
    from tide.decode.lossless.verifier import LosslessUnavailable

    trials = __import__("tide.calibration.trials", fromlist=["choose_draft"])
    monkeypatch.setattr(trials, "timing_prompts", lambda *args: [])
    model, scheme = SimpleNamespace(base=SimpleNamespace(device="cpu")), DraftScheme(1, 1, 2, 1.2)

    def unavailable(*args):
        raise LosslessUnavailable("mode='lossless' needs sliding-window cache layers that can roll back")

    monkeypatch.setattr(trials, "timed", unavailable)
    assert "roll back" in trials.choose_draft(model, None, [], [scheme])["unavailable"]

    def broken(*args):
        raise ValueError("draft_vocab_size=64, but these routers' draft vocabulary holds 0 tokens")

    monkeypatch.setattr(trials, "timed", broken)
    with pytest.raises(ValueError, match="holds 0 tokens"):
        trials.choose_draft(model, None, [], [scheme])


def test_timed_schemes_spread_over_verification_widths():
    """Calibration times the best-estimated scheme, then the best-estimated one verifying at most half as many
    positions, else the next best shape; a shape differing only in its vocabulary is not timed twice."""
    from tide.calibration.costs import DraftScheme

    trials = __import__("tide.calibration.trials", fromlist=["timed_schemes"])
    tree8, tree8_vocab, tree7, tree3, chain2 = (DraftScheme(0, 1, 8, 1.3), DraftScheme(0, 1, 8, 1.29, 256),
                                                DraftScheme(0, 1, 7, 1.28), DraftScheme(0, 1, 3, 1.2),
                                                DraftScheme(1, 2, 1, 1.1))
    ranked = [tree8, tree8_vocab, tree7, tree3, chain2]
    assert trials.timed_schemes(ranked, 3) == [tree8, tree3, tree7]  # 9 positions, then 4, then none <= 2
    assert trials.timed_schemes(ranked, 10) == [tree8, tree3, tree7, chain2]
    assert trials.timed_schemes([], 3) == []
