"""Exit heads (tuned lens per checkpoint) and the decode step's checkpoint test."""

import pytest
import torch

import tide
from tiny_models import FAMILIES, sample_texts, tiny_model, tiny_tokenizer

FAST = dict(num_samples=16, batch_size=8, max_length=32, progress=False, head_steps=20, draft_trials=1,
            validation_tokens=128)


def _model(family="llama", **cfg):
    return tide.TideForCausalLM.from_base(tiny_model(family), tide.TideConfig(checkpoint_interval=2, **cfg))


def _perturb(model, scale=0.05):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.routers.parameters():
            p.add_(torch.randn_like(p) * scale)


@pytest.mark.parametrize("rank", [None, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_test_equals_route(family, rank):
    """The folded fast path gives the reference's scores, decisions and exit states."""
    model = _model(family, exit_head_rank=rank)
    _perturb(model)
    hidden = torch.randn(5, model.config.base_hidden_size)
    for k, test in model.exit_tests({k: 0.5 for k in model.checkpoints}).items():
        scores, exits, state = test(hidden)
        ref_scores, ref_exits, ref_state = model.route(k, hidden, 0.5)
        torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-4)
        assert torch.equal(exits, ref_exits)


def test_fresh_exit_heads_are_the_logit_lens():
    model = _model()
    parts, hidden = model.parts, torch.randn(3, model.config.base_hidden_size)
    for k in model.checkpoints:
        lens = parts.logits_from_normed(parts.final_norm(hidden))
        torch.testing.assert_close(model.exit_logits(k, hidden), lens)


def test_lens_config_has_no_translators_and_tuned_has_one_per_checkpoint():
    assert all(model.routers[k].translator is None for model in [_model(exit_head="lens")] for k in model.checkpoints)
    model = _model(exit_head_rank=4)
    assert all(model.routers[k].translator.rank == 4 for k in model.checkpoints)


def test_forced_exit_logits_come_from_the_exit_head():
    """A token leaving at a checkpoint gets head(norm(translator(h))), not the raw state's logits."""
    model = _model(checkpoint_layers=[2])
    _perturb(model, 0.2)
    ids = torch.randint(4, 100, (1, 7))
    out = model.generate(ids, tide_config={"exit_threshold": -1}, do_sample=False, max_new_tokens=3,
                         output_logits=True, return_dict_in_generate=True)
    state = {}
    hook = model.parts.layers[2].register_forward_hook(lambda _m, _a, o: state.update(h=model.parts.layer_output(o)))
    with torch.no_grad():
        model.base(out.sequences[:, :-2])  # the first decode step's input: the prompt and first token
    hook.remove()
    expected = model.exit_logits(2, state["h"][:, -1])
    torch.testing.assert_close(out.logits[1], expected, atol=1e-4, rtol=1e-4)


def test_calibration_trains_the_exit_heads_toward_the_full_model():
    """After calibration the exits' KL to the full model is lower than the logit lens's."""
    base = tiny_model("llama")
    tok = tiny_tokenizer()
    model = tide.calibrate(base, tok, dataset=sample_texts(24), config=tide.TideConfig(checkpoint_interval=2),
                           **{**FAST, "head_steps": 60, "head_lr": 1e-2})
    texts = sample_texts(30)[-4:]
    ids = torch.tensor([tok(texts[0])["input_ids"][:32]])
    states = {}
    hooks = [model.parts.layers[k].register_forward_hook(
        lambda _m, _a, o, k=k: states.update({k: model.parts.layer_output(o)})) for k in model.checkpoints]
    with torch.no_grad():
        full = torch.log_softmax(base(ids).logits.float(), -1)
        for h in hooks:
            h.remove()
        for k in model.checkpoints:
            tuned = torch.log_softmax(model.exit_logits(k, states[k]).float(), -1)
            lens = torch.log_softmax(model.parts.logits_from_normed(model.parts.final_norm(states[k])).float(), -1)
            kl = lambda lp: float(torch.nn.functional.kl_div(lp, full, log_target=True, reduction="batchmean"))  # noqa: E731
            assert kl(tuned) < kl(lens), k
    assert model.config.calibration["exit_head"] == "tuned"
    assert set(model.config.calibration["router_auc"]) == {str(k) for k in model.checkpoints}


def test_repo_without_exit_head_key_loads_as_lens(tmp_path):
    """Router repos written before exit heads existed hold no translators and load unchanged."""
    import json

    model = _model(exit_head="lens")
    model.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    del data["exit_head"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    loaded = tide.TideForCausalLM.from_pretrained(tmp_path, base_model=model.base)
    assert loaded.config.exit_head == "lens" and loaded.routers[1].translator is None
