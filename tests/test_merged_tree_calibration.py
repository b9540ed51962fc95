"""Calibration times trees with n-gram branches as drafting schemes of their own: the head's top-k candidates
merged in one verification tree with the n-gram continuation (`draft_topk > 1` and `draft_ngram > 0`). They are
estimated as the same tree without the branches, timed in turn with the head's own schemes, and kept only where
they time fastest; the model card and `tide bench` name the shape kept. Where no source pays, the base model runs."""

import importlib
from types import SimpleNamespace

import pytest
import torch

import tide
from tide.calibration.costs import MERGED_TOPK, DraftScheme, draft_candidates
from tide.hub.card import calibration_table, draft_scheme_text, model_card
from tiny_models import sample_texts, tiny_model, tiny_tokenizer

calibration = importlib.import_module("tide.calibration.run")
trials = importlib.import_module("tide.calibration.trials")
GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)


def _costs(**extra):
    from tide.calibration.measure import StepCosts

    return StepCosts(layer_s=1.0, checkpoint_s=0.1, skipped_layer_s=0.05, head_s=1.0, capture_s=0.0,
                     device="cpu", verify_extra_s={2: 0.1, 3: 0.2, 4: 0.3, 6: 0.5, 8: 0.8}, **extra)


def _merged(scheme) -> bool:
    return scheme.draft_topk > 1 and scheme.draft_ngram > 0


# ---------------------------------------------------------------------- candidates and the trials' order
def test_trees_with_ngram_branches_are_candidates_estimated_as_the_tree_alone():
    ranks = {0: torch.tensor([0, 1, 2, 0, 3, 0, 1, 5] * 8, dtype=torch.uint8)}
    plain = draft_candidates(ranks, 12, _costs(), max_draft=4)
    schemes = draft_candidates(ranks, 12, _costs(), max_draft=4, ngram=trials.NGRAM, ngram_depth=4)
    merged = [s for s in schemes if s.draft_ngram]
    assert sorted(s.draft_topk for s in merged) == list(range(2, MERGED_TOPK + 1))  # no chain, no wider tree
    assert all(s.max_draft == 4 and s.draft_ngram == trials.NGRAM for s in merged)
    trees = {s.draft_topk: s.estimate for s in plain if s.draft_topk > 1}
    assert all(s.estimate == trees[s.draft_topk] for s in merged)  # the branches are free drafts: no estimate
    assert [s for s in schemes if not s.draft_ngram] == plain  # the head's own schemes, as without
    # listed right after the same tree without branches (the stable sort keeps that order on equal estimates)
    for s in merged:
        i = schemes.index(s)
        assert schemes[i - 1] == s._replace(max_draft=1, draft_ngram=0)


def test_timed_schemes_take_turns_between_the_head_and_trees_with_ngram_branches():
    tree8, tree3, chain2 = DraftScheme(0, 1, 8, 1.3), DraftScheme(0, 1, 3, 1.2), DraftScheme(1, 2, 1, 1.1)
    merged4, merged2 = DraftScheme(0, 4, 4, 1.25, draft_ngram=3), DraftScheme(0, 4, 2, 1.15, draft_ngram=3)
    ranked = sorted([tree8, tree3, chain2, merged4, merged2], key=lambda s: -s.estimate)
    assert trials.timed_schemes(ranked, 1) == [tree8]
    assert trials.timed_schemes(ranked, 3) == [tree8, merged4, tree3]  # head, n-gram branches, head (narrower)
    assert trials.timed_schemes(ranked, 10) == [tree8, merged4, tree3, merged2, chain2]  # a source left out of turns
    assert trials.timed_schemes([merged2, merged4], 2) == [merged2, merged4]  # no head scheme: the other source
    # the shape includes the branches: the same tree with and without them are two trials
    assert trials.timed_schemes([tree3, tree3._replace(max_draft=4, draft_ngram=3)], 2)[1].draft_ngram == 3


# ---------------------------------------------------------------------- choosing between them by timing
def _choose(monkeypatch, speed, schemes, **options):
    calls = []

    def timed(model, prompts, config, baseline="generate", bar=None):
        calls.append(dict(config))
        return speed(config)

    monkeypatch.setattr(trials, "timed", timed)
    monkeypatch.setattr(trials, "timing_prompts", lambda *args: [])
    model = SimpleNamespace(base=SimpleNamespace(device="cpu"))
    return trials.choose_draft(model, None, [], schemes, **options), calls


def test_a_tree_with_ngram_branches_that_times_fastest_is_kept_as_it_was_timed(monkeypatch):
    tree, merged = DraftScheme(1, 1, 3, 1.3), DraftScheme(1, 4, 3, 1.3, draft_ngram=trials.NGRAM)
    selection, calls = _choose(monkeypatch, lambda c: 1.4 if c.get("draft_ngram") else 1.1, [tree, merged])
    chosen = selection["chosen"]
    assert (chosen["draft_topk"], chosen["max_draft"], chosen["draft_ngram"]) == (3, 4, trials.NGRAM)
    assert chosen["measured"] == 1.4 and chosen["timings"] == [1.4, 1.4]
    assert "ngram" not in selection and "ngram_cut" not in selection  # it was timed with its branches already
    assert len(calls) == 3 and calls[1]["draft_ngram"] == trials.NGRAM and calls[1]["max_draft"] == 4
    assert "draft_ngram" not in selection["trials"][0]  # the head's own tree: no n-gram key in its record
    assert trials.lossless_config(chosen) == {"mode": "lossless", "draft_layer": 1, "max_draft": 4, "draft_topk": 3,
                                              "draft_vocab_size": 0, "draft_ngram": trials.NGRAM}


@pytest.mark.parametrize("merged_speed", [1.08, 0.9])
def test_a_kept_head_tree_gets_ngram_branches_where_they_do_not_time_slower(monkeypatch, merged_speed):
    """The chosen tree is timed with n-gram branches `ngram_depth` deep (its twin's first timing from the trials
    is reused); they are kept unless slower than the tree alone by more than the timing's noise."""
    tree, merged = DraftScheme(1, 1, 3, 1.3), DraftScheme(1, 2, 3, 1.3, draft_ngram=trials.NGRAM)
    selection, calls = _choose(monkeypatch, lambda c: merged_speed if c.get("draft_ngram") else 1.1, [tree, merged],
                               ngram_depth=2)
    kept = merged_speed >= 1.1 / trials.KEEP_SPEEDUP
    chosen = selection["chosen"]
    assert chosen["draft_topk"] == 3 and selection["ngram"]["max_draft"] == 2
    assert selection["ngram"]["active"] == kept and selection["ngram"]["timings"][0] == merged_speed
    assert (chosen["draft_ngram"], chosen["max_draft"]) == ((trials.NGRAM, 2) if kept else (0, 1))
    assert len([c for c in calls if c.get("draft_ngram")]) == 1 + kept  # the trial, and a second timing if kept


def test_where_no_source_pays_nothing_is_chosen(monkeypatch):
    tree, merged = DraftScheme(1, 1, 3, 1.3), DraftScheme(1, 4, 3, 1.3, draft_ngram=trials.NGRAM)
    selection, calls = _choose(monkeypatch, lambda c: 0.97, [tree, merged])
    assert selection["chosen"] is None and not selection["ngram_only"]["active"]
    assert [c.get("head_drafts", True) for c in calls] == [True, True, False]  # both trees, then n-gram drafts alone


# ---------------------------------------------------------------------- calibration end to end
def _calibrate(monkeypatch, speed, **options):
    def fake_speedup(model, prompts, tide_config, new_tokens=24, repeats=3, baseline="generate", bar=None):
        return speed(tide_config, baseline)

    monkeypatch.setattr(trials, "measured_speedup", fake_speedup)
    torch.manual_seed(0)
    config = tide.TideConfig(checkpoint_interval=2, target_agreement=0.05)
    return tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=sample_texts(24), config=config,
                          num_samples=24, batch_size=8, max_length=32, head_steps=5, passes=1, validation_tokens=0,
                          progress=False, **options)


def _ids():
    return torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0)).repeat(1, 3)  # repeats itself


def test_calibration_keeps_a_tree_with_ngram_branches_where_it_times_fastest(monkeypatch, tmp_path):
    def speed(config, baseline):
        if config["mode"] == "exit" or baseline == "compiled":
            return 0.9
        return 1.5 if config.get("draft_topk", 1) > 1 and config.get("draft_ngram") else 1.1

    model = _calibrate(monkeypatch, speed)
    selection = model.config.calibration["draft_selection"]
    assert any(t.get("draft_ngram") for t in selection["trials"]) and any(not t.get("draft_ngram")
                                                                         for t in selection["trials"])
    generation = model.config.generation_config
    assert generation.draft_topk > 1 and generation.draft_ngram == trials.NGRAM and generation.head_drafts
    assert generation.max_draft == trials.NGRAM_DEPTH and generation.mode == "auto"
    chosen = selection["chosen"]
    assert (chosen["draft_layer"], chosen["draft_topk"], chosen["measured"]) == (generation.draft_layer,
                                                                                  generation.draft_topk, 1.5)
    shape = (f"tree of {generation.draft_topk} head candidates + n-gram branches up to {trials.NGRAM_DEPTH} deep, "
             f"from layer {generation.draft_layer}")
    assert draft_scheme_text(generation).startswith(shape)
    assert f"Lossless mode: {shape}" in model_card(model.config)
    assert f"lossless mode: {shape}" in calibration_table(model.config)
    # the repo's defaults run it: one verification tree with the n-gram branch, the base model's tokens
    ids = _ids()
    out = model.generate(ids, **GREEDY)
    stats = model.last_stats
    assert stats.mode == "lossless" and stats.draft_topk == generation.draft_topk and stats.merged_cycles > 0
    assert torch.equal(out, model.base.generate(ids, **GREEDY))
    model.save_pretrained(tmp_path)
    saved = tide.TideConfig.from_pretrained(tmp_path).generation_config
    assert (saved.draft_topk, saved.draft_ngram, saved.max_draft) == (generation.draft_topk, trials.NGRAM,
                                                                       trials.NGRAM_DEPTH)
    assert shape in (tmp_path / "README.md").read_text()


def test_calibration_where_no_source_pays_runs_the_base_model(monkeypatch):
    model = _calibrate(monkeypatch, lambda config, baseline: 0.97)
    cal = model.config.calibration
    selection = cal["draft_selection"]
    assert any(t.get("draft_ngram") and t["draft_topk"] > 1 for t in selection["trials"])  # a merged tree was timed
    assert selection["chosen"] is None and not selection["ngram_only"]["active"]
    generation = model.config.generation_config
    assert generation.max_draft == 0 and generation.draft_ngram == 0 and generation.mode == "exit"
    assert not any(t < 1.0 for t in model.config.thresholds.values())  # no exit kept either
    assert "Lossless mode: no drafting scheme timed faster than the base model" in model_card(model.config)
    ids = _ids()
    for call in (None, {"mode": "lossless"}):
        out = model.generate(ids, tide_config=call, **GREEDY)
        assert model.last_stats.mode == "base"  # the base model's own generate ran
        assert torch.equal(out, model.base.generate(ids, **GREEDY))


def test_bench_names_the_shape_a_lossless_row_ran():
    bench = importlib.import_module("tide.tools.bench")
    row = {"ratio_range": [1.1, 1.3], "decode_tokens_per_s": 100.0, "ratio_to_base": 1.2, "greedy_identical": True,
           "draft": {"draft_layer": 2, "max_draft": 4, "draft_topk": 3, "draft_vocab_size": 0, "draft_ngram": 3,
                     "head_drafts": True}}
    assert "tree of 3 head candidates + n-gram branches up to 4 deep, from layer 2" in bench._line("lossless", row)
    row["draft"]["draft_topk"] = 1  # where the tree fell back to chains (e.g. sliding windows)
    assert "chain of 4 from layer 2 with n-gram drafts" in bench._line("lossless", row)
    row["draft"] = None
    assert "no draft pays here" in bench._line("lossless", row)
