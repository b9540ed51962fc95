"""Lossless draft heads: a draft reads the token's shallow state and the full model's final normed state at the
position before it (`draft_head="context"`). Output stays identical to the base model's; these tests check the
context a draft is given is that state, and that the heads are built, trained, saved and loaded."""

import json

import pytest
import torch

import tide
from tiny_models import FAMILIES, prompt_ids, sample_texts, tiny_model, tiny_tokenizer

FAST = dict(num_samples=16, batch_size=8, max_length=32, progress=False, head_steps=20, draft_trials=1,
            validation_tokens=128)


def _model(family="llama", perturb=0.3, **cfg):
    model = tide.TideForCausalLM.from_base(tiny_model(family), tide.TideConfig(checkpoint_interval=1, **cfg))
    torch.manual_seed(1)
    with torch.no_grad():  # heads whose context term matters
        for k in model.checkpoints:
            if model.routers[k].draft is not None:
                for p in model.routers[k].draft.parameters():
                    p.add_(torch.randn_like(p) * perturb)
    return model


def test_heads_sit_on_the_first_half_of_the_stack():
    model = _model()
    layers = model.config.draft_head_layers()
    assert layers == [k for k in model.checkpoints if k < model.parts.num_layers // 2] and layers
    assert all((model.routers[k].draft is not None) == (k in layers) for k in model.checkpoints)
    exit_only = _model(draft_head="exit")
    assert all(exit_only.routers[k].draft is None for k in exit_only.checkpoints)


def test_bad_draft_head_is_refused():
    with pytest.raises(ValueError, match="draft_head"):
        tide.TideConfig(draft_head="medusa")
    with pytest.raises(ValueError, match="draft_head_mlp"):
        tide.TideConfig(draft_head_mlp=-1)


@pytest.mark.parametrize("mlp", [0, 16])
def test_the_two_layer_term_has_the_configured_width(mlp):
    model = _model(draft_head_mlp=mlp)
    head = model.routers[0].draft
    assert (head.mlp_in is None) if mlp == 0 else (head.mlp_in.out_features == mlp and head.mlp_out.shape[1] == mlp)
    hidden, context = torch.randn(2, model.config.base_hidden_size), torch.randn(2, model.config.base_hidden_size)
    linear = head.own(hidden) + context @ head.context.t()
    assert torch.allclose(head(hidden, context), linear) == (mlp == 0)  # the perturbed term adds to the affine part


@pytest.mark.parametrize("rank", [None, 4])
def test_a_fresh_draft_head_is_the_exit_head(rank):
    """Initialised as the identity on the token's state and zero on the context: the exit head's logits."""
    model = _model(perturb=0.0, exit_head_rank=rank)
    hidden, context = torch.randn(3, model.config.base_hidden_size), torch.randn(3, model.config.base_hidden_size)
    for k in model.config.draft_head_layers():
        torch.testing.assert_close(model.draft_logits(k, hidden, context)[0], model.exit_logits(k, hidden))
        assert model.routers[k].draft.own.rank == rank


def test_draft_logits_read_the_context_and_fall_back_to_the_exit_head():
    model = _model()
    hidden, context = torch.randn(2, model.config.base_hidden_size), torch.randn(2, model.config.base_hidden_size)
    first, deep = model.config.draft_head_layers()[0], model.checkpoints[-1]
    logits, normed = model.draft_logits(first, hidden, context)
    assert not torch.allclose(logits, model.draft_logits(first, hidden, None)[0])  # None: zeros
    assert normed.shape == hidden.shape
    torch.testing.assert_close(model.draft_logits(deep, hidden, context)[0], model.exit_logits(deep, hidden))


def _record_drafts(model):
    """Wrap every draft head to record (token state, context) of each call."""
    calls = []
    for k in model.config.draft_head_layers():
        head = model.routers[k].draft
        original = head.forward

        def spy(hidden, context, original=original):
            calls.append((hidden.detach().clone(), context.detach().clone()))
            return original(hidden, context)

        head.forward = spy
    return calls


@pytest.mark.parametrize("topk", [1, 3])
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3", "phi"])
def test_each_draft_gets_the_full_models_state_before_it(family, topk):
    """With one draft per cycle every draft's context is verified, so it must equal the base model's final
    normed state at the position before the drafted-from token (found by its layer-0 state)."""
    model = _model(family)
    ids = prompt_ids()
    base = model.base
    ref = base.generate(ids, do_sample=False, max_new_tokens=12)
    calls = _record_drafts(model)
    out = model.generate(ids, do_sample=False, max_new_tokens=12,
                         tide_config={"mode": "lossless", "draft_layer": 0, "max_draft": 1, "draft_topk": topk})
    assert torch.equal(out, ref)
    states = {}
    hooks = [model.parts.layers[k].register_forward_hook(
        lambda _m, _a, o, k=k: states.update({k: model.parts.layer_output(o)}))
        for k in (0, model.parts.num_layers - 1)]
    with torch.no_grad():
        base(ref)
    for h in hooks:
        h.remove()
    shallow, final = states[0][0], model.parts.final_norm(states[model.parts.num_layers - 1][0])
    assert len(calls) >= 6
    for hidden, context in calls:
        position = int((shallow - hidden.reshape(1, -1)).abs().amax(-1).argmin())
        torch.testing.assert_close(hidden.reshape(-1), shallow[position], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(context.reshape(-1), final[position - 1], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", [dict(max_draft=4), dict(max_draft=1, draft_topk=3)])
def test_lossless_with_draft_heads_is_token_identical(family, scheme):
    model = _model(family)
    ids = prompt_ids()
    ref = model.base.generate(ids, do_sample=False, max_new_tokens=14)
    out = model.generate(ids, do_sample=False, max_new_tokens=14,
                         tide_config={"mode": "lossless", "draft_layer": 0, **scheme})
    assert torch.equal(out, ref)


def test_a_one_token_prompt_drafts_without_context():
    model = _model()
    ids = prompt_ids(length=1)
    ref = model.base.generate(ids, do_sample=False, max_new_tokens=8)
    calls = _record_drafts(model)
    out = model.generate(ids, do_sample=False, max_new_tokens=8, tide_config={"mode": "lossless", "draft_layer": 0})
    assert torch.equal(out, ref)
    assert not calls[0][1].any()  # no position before the first token: zeros


def test_draft_heads_round_trip_and_old_repos_load_without_them(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path / "new")
    loaded = tide.TideForCausalLM.from_pretrained(tmp_path / "new", base_model=model.base)
    for k in model.config.draft_head_layers():
        for a, b in zip(model.routers[k].draft.parameters(), loaded.routers[k].draft.parameters()):
            assert torch.equal(a, b)
    assert "Draft head: `context`" in (tmp_path / "new" / "README.md").read_text()
    old = _model(draft_head="exit")  # a repo from before draft heads: no key, no weights
    old.save_pretrained(tmp_path / "old")
    data = json.loads((tmp_path / "old" / "config.json").read_text())
    del data["draft_head"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(data))
    loaded = tide.TideForCausalLM.from_pretrained(tmp_path / "old", base_model=old.base)
    assert loaded.config.draft_head == "exit" and all(loaded.routers[k].draft is None for k in loaded.checkpoints)


def test_calibration_trains_draft_heads_that_read_the_context():
    base, tok = tiny_model("llama"), tiny_tokenizer()
    model = tide.calibrate(base, tok, dataset=sample_texts(24), config=tide.TideConfig(checkpoint_interval=2),
                           **{**FAST, "head_steps": 40, "head_lr": 1e-2})
    layers = model.config.draft_head_layers()
    assert layers
    for k in layers:
        assert model.routers[k].draft.context.abs().sum() > 0  # trained away from its zero start
    held = model.config.calibration["draft_selection"]
    assert held  # the schemes calibration timed were ranked on the draft heads' held-out ranks


def test_held_out_chain_ranks_read_the_previous_drafts_state():
    """A chain's later drafts read the previous draft's normed state: held-out scoring ranks them that way,
    per text (a text's first token reads zeros), whatever the padding."""
    import importlib

    forward = importlib.import_module("tide.calibration.forward")
    heldout = importlib.import_module("tide.calibration.heldout")
    model = _model()
    ids = torch.randint(4, 100, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on the second text
    cap = forward.capture(model, {"input_ids": ids, "attention_mask": mask})
    scored = heldout._score(model, cap, model.config)
    k = model.config.draft_head_layers()[0]
    for row in range(2):
        keep = mask[row].bool()
        with torch.no_grad():
            full = model.base(input_ids=ids[row:row + 1, keep]).logits[0].argmax(-1)
        states = cap.states[k][cap.first.cumsum(0) == row + 1]
        _, normed = model.draft_logits(k, states, cap.context[cap.first.cumsum(0) == row + 1])
        chained = torch.cat([torch.zeros_like(normed[:1]), normed[:-1]])
        logits = model.draft_logits(k, states, chained)[0]
        expected = (logits > logits.gather(-1, full[:, None])).sum(-1).clamp(max=tide.config.MAX_DRAFT_TOPK)
        got = scored["chain_ranks"][k][cap.first.cumsum(0) == row + 1]
        assert torch.equal(got.long(), expected)
    assert not torch.equal(scored["chain_ranks"][k], scored["ranks"][k])  # the context matters for these heads
