"""What calibration's training and trials cost on large vocabularies: draft heads over a bounded draft vocabulary
(`heads.draftvocab.MAX_SIZE`), the heads' states stacked into one product a step (`headloss`), the full model's head
only at kept positions (`forward.capture`), and no timing for schemes the measured costs rule out
(`timing.schemes_to_time`)."""

import importlib

import pytest
import torch

import tide
from tide.calibration import forward, headloss
from tide.calibration.costs import DraftScheme
from tide.calibration.rankedrows import RankedRows
from tide.heads.draftvocab import MAX_SIZE, candidate_sizes
from tide.hub.card import calibration_table, model_card
from tide.models.architectures import resolve as model_parts
from tiny_models import sample_texts, tiny_model, tiny_tokenizer

timing = importlib.import_module("tide.calibration.timing")
trainer = importlib.import_module("tide.calibration.trainer")
run = importlib.import_module("tide.calibration.run")


def test_candidate_sizes_stop_at_the_largest_draft_vocabulary():
    assert candidate_sizes(4096) == [128, 256, 512, 1024]  # V / 32 ... V / 4, as before
    assert candidate_sizes(16384) == [512, 1024, 2048, 4096]
    for vocab in (49152, 151936, 262144):  # V / 4 above MAX_SIZE: halvings down from it
        assert candidate_sizes(vocab) == [MAX_SIZE // 8, MAX_SIZE // 4, MAX_SIZE // 2, MAX_SIZE]


def test_draft_heads_train_over_the_largest_draft_vocabulary_only():
    base = tiny_model("llama", vocab_size=32768)  # a quarter of the head would be 8,192 rows
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2))
    trained = trainer._Trainer(model, run.CalibrationOptions(), num_batches=1)
    assert trained.candidates and trained.drafts and trained.draft_rows == MAX_SIZE


def test_stacked_heads_take_the_mean_of_each_heads_loss():
    """One product over the stacked states of several heads gives each head's logits, and the KL of the stack is
    the mean of the heads' KLs: what the per-head steps computed."""
    parts = model_parts(tiny_model("gemma2"))  # a soft-capped head
    hidden = parts.norm.weight.shape[-1]
    teacher_state, heads = torch.randn(5, hidden), torch.randn(3, 5, hidden)
    candidates = headloss.Candidates(torch.stack([torch.randperm(64)[:6] for _ in range(5)]),
                                     torch.tensor([0, 1, 100, 101]))
    teacher = candidates.logits(parts, teacher_state)
    stacked = candidates.logits(parts, heads)
    per_head = [candidates.logits(parts, heads[i]) for i in range(3)]
    torch.testing.assert_close(stacked, torch.stack(per_head))
    expected = sum(headloss.head_kl(s, teacher) for s in per_head) / 3
    torch.testing.assert_close(headloss.head_kl(stacked, teacher), expected)
    rows = parts.head_rows(torch.tensor([3, 9, 27]))
    torch.testing.assert_close(parts.logits_from_normed(heads, rows), parts.logits_from_normed(heads)[..., [3, 9, 27]])


@pytest.mark.parametrize("family", ["llama", "gemma2", "opt", "gpt2"])
def test_the_capture_runs_the_head_at_kept_positions_only(family, monkeypatch):
    """The capture's top-1 and best tokens are the base model's, at the kept positions; the base forward computes
    one position's logits (`logits_to_keep=1`), and a model whose forward cannot do that still gets them right."""
    base = tiny_model(family)
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2))
    ids = torch.randint(3, 128, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    expected = base(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    shapes, forward_call = [], base.forward

    def spy(*args, **kwargs):
        out = forward_call(*args, **kwargs)
        shapes.append(tuple(out.logits.shape))
        return out

    monkeypatch.setattr(base, "forward", spy)
    monkeypatch.setattr(forward, "head_chunk", lambda vocab_size: 4)  # several chunks of rows
    for own_head in (True, False):
        monkeypatch.setattr(forward, "_head_at_kept_positions", lambda tide_model, own=own_head: own)
        cap = forward.capture(model, {"input_ids": ids, "attention_mask": mask}, top=True)
        assert torch.equal(cap.full_top1, expected.argmax(-1))
        assert torch.equal(cap.top, expected.topk(headloss.TEACHER_TOP, -1).indices)
        assert cap.final.shape[0] == int(mask.sum())
    assert shapes == [(3, 1, 128), (3, 12, 128)]


def _scheme(layer, drafts, topk, estimate):
    return DraftScheme(layer, drafts, topk, estimate)


def test_schemes_the_costs_price_too_slow_are_not_timed():
    fast, slow_tree, slow_chain = _scheme(1, 2, 1, 1.2), _scheme(1, 1, 3, 0.5), _scheme(3, 1, 1, 0.59)
    timed, untimed = timing.schemes_to_time([fast, slow_tree, slow_chain], 3)
    assert timed == [fast] and untimed == [slow_tree, slow_chain]
    assert timing.schemes_to_time([slow_tree], 3) == ([], [slow_tree])
    assert timing.schemes_to_time([fast], 0) == ([], [])


def test_a_calibration_where_no_scheme_can_pay_times_none_and_says_so(monkeypatch):
    slow = [_scheme(1, 1, 1, 0.41), _scheme(1, 1, 2, 0.38)]
    monkeypatch.setattr(timing, "draft_candidates", lambda *a, **kw: slow)

    def choose_draft(*args, **kwargs):
        raise AssertionError("no scheme should be timed")

    monkeypatch.setattr(timing, "choose_draft", choose_draft)
    torch.manual_seed(0)
    model = tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=sample_texts(24),
                           config=tide.TideConfig(checkpoint_interval=2, target_agreement=0.05), num_samples=16,
                           batch_size=8, max_length=32, head_steps=3, passes=1, validation_tokens=0, progress=False)
    selection = model.config.calibration["draft_selection"]
    assert selection["trials"] == [] and selection["chosen"] is None
    assert [u["estimate"] for u in selection["untimed"]] == [0.41, 0.38]
    assert model.config.generation_config.max_draft == 0
    assert "estimated x0.410, not timed" in calibration_table(model.config)
    assert "estimated every drafting scheme too slow to time (the best at x0.410" in model_card(model.config)
    assert set(model.config.calibration["draft_top1"]) == {str(k) for k in model.checkpoints}


def test_drafts_are_scored_over_the_ranked_vocabulary_alone():
    """With the ranked vocabulary's head rows, held-out ranks within each draft vocabulary are those read from the
    drafts' logits over the whole vocabulary (draft heads' first and chained drafts, and exit heads'), agreement
    and labels are the whole head's, and no whole-vocabulary ranks are kept."""
    heldout = importlib.import_module("tide.calibration.heldout")
    model = tide.TideForCausalLM.from_base(tiny_model("llama", vocab_size=8192), tide.TideConfig(checkpoint_interval=2))
    torch.manual_seed(0)
    for k in model.config.draft_head_layers():
        with torch.no_grad():
            model.routers[k].draft.context.normal_(std=0.3)
    ids = torch.randint(3, 8192, (3, 10))
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    cap = forward.capture(model, {"input_ids": ids, "attention_mask": mask})
    top = set(cap.full_top1.tolist())  # the full model's tokens first, then others at random
    ranked = torch.tensor(sorted(top) + [i for i in torch.randperm(8192).tolist() if i not in top])[:2048]
    whole = heldout._score(model, cap, model.config, ranked)
    alone = heldout._score(model, cap, model.config, ranked, RankedRows.of(model.parts, ranked, model.num_head_rows))
    drafts = set(model.config.draft_head_layers())
    assert drafts and drafts != set(model.checkpoints) and alone["ranks"] == alone["chain_ranks"] == {}
    for k in model.checkpoints:
        assert torch.equal(alone["agree"][k], whole["agree"][k]) and torch.equal(alone["labels"][k], whole["labels"][k])
    assert set(alone["vocab_ranks"]) == set(whole["vocab_ranks"])
    for key in whole["vocab_ranks"]:
        assert torch.equal(alone["vocab_ranks"][key], whole["vocab_ranks"][key])
        assert torch.equal(alone["vocab_chain_ranks"][key], whole["vocab_chain_ranks"][key])
    assert any(int((alone["vocab_ranks"][(k, 2048)] == 0).sum()) for k in drafts)  # some drafts right


def test_agreement_reads_the_ranked_rows_first_and_the_whole_head_only_where_needed(monkeypatch):
    """`RankedRows.agreement` is the whole head's argmax test; rows that a ranked token beats skip the whole head.
    The trainer labels its routers' tokens the same with the rows as without."""
    parts = model_parts(tiny_model("gemma2", vocab_size=8192))  # a soft-capped head
    hidden = parts.norm.weight.shape[-1]
    torch.manual_seed(0)
    normed = torch.randn(300, hidden)
    logits = parts.logits_from_normed(normed)
    full_top1 = torch.where(torch.rand(300) < 0.5, logits.argmax(-1), torch.randint(0, 8192, (300,)))
    rows = RankedRows.of(parts, torch.randperm(8192)[:1024], 8192)
    whole_rows = []
    original = parts.logits_from_normed

    def counted(states, head=None):
        if head is None:
            whole_rows.append(states.shape[0])
        return original(states, head)

    monkeypatch.setattr(parts, "logits_from_normed", counted)
    assert torch.equal(rows.agreement(parts, normed, full_top1), logits.argmax(-1) == full_top1)
    assert int((logits.argmax(-1) == full_top1).sum()) <= sum(whole_rows) < 300
    monkeypatch.undo()

    model = tide.TideForCausalLM.from_base(tiny_model("llama", vocab_size=8192), tide.TideConfig(checkpoint_interval=2))
    trained = trainer._Trainer(model, run.CalibrationOptions(head_steps=0), num_batches=1)
    ids = torch.randint(3, 8192, (4, 16))
    trained.add(forward.capture(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, top=True))
    ranked = RankedRows.of(model.parts, torch.randperm(8192)[:2048], 8192)
    for k in model.checkpoints:
        for plain, screened in zip(trained._router_data(k), trained._router_data(k, ranked)):
            assert torch.equal(plain, screened)


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_training_time_test_trains_drafts_on_the_context_a_chain_reads(share):
    """`training_time_test`: that share of the draft rows learns from what a chain's later drafts read, the head's
    own normed draft at the position before (as held-out scoring's chain drafts read it), never across a text's
    first token; the rest, and every row at 0, from the full model's final normed state there."""
    from tide.calibration.forward import capture
    from tide.calibration.texts import batches

    base = tiny_model("llama")
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2))
    opts = run.CalibrationOptions(training_time_test=share, max_length=24, batch_size=2)
    trained = trainer._Trainer(model, opts, num_batches=1)
    batch = next(batches(sample_texts()[:2], tiny_tokenizer(), opts, base.device))
    trained._buffer(capture(model, batch))
    pick = torch.arange(trained.filled)
    k, draft = next(iter(trained.drafts.items()))
    got = trained._draft_context(k, draft, pick)
    first = trained.first[pick]
    assert first[0] and first.sum() == 2  # each text's first token
    torch.testing.assert_close(got[first], trained.context[pick][first])
    before = pick - 1
    own = model.parts.final_norm(draft(trained.states[k][before], trained.context[before]))
    expected = own if share else trained.context[pick]
    torch.testing.assert_close(got[~first], expected[~first])
    if share:
        assert not torch.allclose(got[~first], trained.context[pick][~first])
    with pytest.raises(ValueError, match="training_time_test"):
        run.CalibrationOptions(training_time_test=1.5)
