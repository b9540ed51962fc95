"""Layer arguments from one capture per window of positions (`tide.layers.args`): every slice is the backbone's own."""

import pytest
import torch

import tide
import tide.layers.args as layerargs
from generation_helpers import exits_by_sign
from tiny_models import FAMILIES, noisy_tide, prompt_ids, tiny_model, tiny_tokenizer

WINDOWED = ["falcon", "gemma", "gpt2", "gpt_neox", "llama", "mixtral", "phi", "phi3", "qwen3"]
NOT_WINDOWED = {"gemma2": "sliding-window", "gemma3_text": "sliding-window", "mistral": "sliding-window",
                "qwen2": "sliding-window", "opt": "transforms its input embeddings"}


class _NeverChecked(set):
    """A `checked` set that keeps nothing: every request's slice is compared with a fresh capture."""

    def add(self, item):
        pass


@pytest.fixture
def check_every_slice(monkeypatch):
    real = layerargs.LayerArgs.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.checked = _NeverChecked()

    monkeypatch.setattr(layerargs.LayerArgs, "__init__", init)


def test_the_table_of_windowed_families_is_complete():
    assert sorted(WINDOWED + list(NOT_WINDOWED)) == FAMILIES


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", WINDOWED)
def test_every_slice_equals_a_fresh_capture(family, attention, check_every_slice):
    """Lossless drafts and verifications, and exit steps of a left-padded batch: each request's sliced arguments
    (and layer-0 input) are compared with the backbone's own for those positions; one difference would turn the
    windows off."""
    try:
        model, base = noisy_tide(family, attention=attention)
    except ValueError:
        pytest.skip(f"{family} has no {attention} attention")
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=40)
    out = model.generate(ids, do_sample=False, max_new_tokens=40, tide_config={"mode": "lossless", "max_draft": 4})
    assert torch.equal(out, ref)
    assert model.last_stats.arg_windows_off is None
    tok = tiny_tokenizer(pad=True)
    tok.padding_side = "left"
    batch = tok(["The quick brown fox", "Hi", "a b c d e"], return_tensors="pt", padding=True)
    model.exit_tests = exits_by_sign({1: 0, 3: 1})  # rows leave at different checkpoints
    model.generate(**batch, do_sample=False, max_new_tokens=40, pad_token_id=0, tide_config={"exit_threshold": 0.5})
    stats = model.last_stats
    assert stats.arg_windows_off is None and sum(v for k, v in stats.exits.items() if k != "full") > 0


@pytest.mark.parametrize("family", WINDOWED)
def test_one_capture_serves_many_steps(family):
    model, base = noisy_tide(family)
    ids = prompt_ids()
    model.generate(ids, do_sample=False, max_new_tokens=48, tide_config={"exit_threshold": 0.5})
    stats = model.last_stats
    assert stats.arg_windows_off is None and stats.decode_steps == 47
    assert stats.arg_captures <= 8  # the embedding's form (2), two per window of 31 positions, the first slice's check
    model.generate(ids, do_sample=False, max_new_tokens=48, tide_config={"mode": "lossless", "max_draft": 4})
    stats = model.last_stats
    passes = stats.drafted + 2 * stats.verify_passes  # each of which once captured its own arguments
    assert stats.arg_windows_off is None and stats.arg_captures < passes / 4


@pytest.mark.parametrize("family", sorted(NOT_WINDOWED))
def test_families_without_windows_say_why_and_stay_exact(family):
    model, base = noisy_tide(family)
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=24)
    out = model.generate(ids, do_sample=False, max_new_tokens=24, tide_config={"mode": "lossless", "max_draft": 4})
    assert torch.equal(out, ref)
    assert NOT_WINDOWED[family] in model.last_stats.arg_windows_off


def test_a_slice_that_differs_turns_windows_off(monkeypatch):
    """If a window's slice ever differed from the backbone's arguments, the request gets the backbone's own."""
    model, base = noisy_tide("llama")
    real = layerargs.LayerArgs._slice

    def shifted(self, *args):
        hidden, calls = real(self, *args)
        return hidden + 1.0, calls

    monkeypatch.setattr(layerargs.LayerArgs, "_slice", shifted)
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=16)
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=16, tide_config={"mode": "lossless"}), ref)
    assert "differed" in model.last_stats.arg_windows_off


def test_request_wider_than_the_window():
    parts = tide.TideForCausalLM.from_base(tiny_model("llama"), tide.TideConfig(checkpoint_interval=2)).parts
    from transformers import DynamicCache
    base_model = tiny_model("llama")
    cache = DynamicCache(config=base_model.config)
    ids = prompt_ids(12)
    base_model(input_ids=ids[:, :4], past_key_values=cache, use_cache=True)
    args = layerargs.LayerArgs(tide.models.architectures.resolve(base_model), width=3)
    hidden, calls = args.calls(ids[:, 4:12], cache, position_ids=torch.arange(4, 12)[None])
    assert hidden.shape[1] == 8 and args.off_reason is None and parts.num_layers == len(calls)


def test_head_dim_equal_to_the_windows_key_length_and_caches_one_after_another():
    """A head dim of 32 equals the key length of a window of 31 opened after one cached position, and teacher-forced
    scoring runs one session over a new cache per text (a freed cache's id can come back): no axis or window is
    taken for another, and with no exits every token agrees with the full model."""
    from tide.calibration.evaluate import teacher_forced

    base = tiny_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2))
    texts = [prompt_ids(12, seed=s)[0].tolist() for s in range(4)]
    report = teacher_forced(model, texts, {"exit_threshold": 1.0})
    assert report.tokens == 4 * 10 and report.agreement == 1.0


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3_text", "qwen2"])
def test_windows_hold_on_sliding_layers_below_their_window(family, check_every_slice):
    """Below the sliding window a sliding layer keeps and sees every earlier position, as a full one does: the
    windows hold there (every slice checked against the backbone's own), and turn off where positions reach it."""
    base = tiny_model(family, sliding_window=32)
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2))
    ids = prompt_ids()
    short = dict(do_sample=False, max_new_tokens=12)
    assert torch.equal(model.generate(ids, tide_config={"mode": "lossless", "max_draft": 3}, **short),
                       base.generate(ids, **short))
    assert model.last_stats.arg_windows_off is None and model.last_stats.arg_captures > 0
    model.exit_tests = exits_by_sign({1: 0, 3: 1})
    model.generate(ids, tide_config={"exit_threshold": 0.5}, **short)
    assert model.last_stats.arg_windows_off is None
    long = dict(do_sample=False, max_new_tokens=40)  # 9 + 40 positions: past the window of 32
    del model.exit_tests
    assert torch.equal(model.generate(ids, tide_config={"mode": "lossless", "max_draft": 3}, **long),
                       base.generate(ids, **long))
    assert "reach their window" in model.last_stats.arg_windows_off


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_backbone_that_passes_masks_that_see_every_key_gets_them(attention):
    """Falcon's rotary layouts always pass the decode step's mask (its eager attention adds it unconditionally):
    the one-query slice keeps the mask there, rather than the None most backbones pass, and the windows stay on."""
    base = tiny_model("falcon", alibi=False, attention=attention)
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2))
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=12)
    for cfg in ({"exit_threshold": 1.0}, {"mode": "lossless", "draft_layer": 1, "max_draft": 3}):
        assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=12, tide_config=cfg), ref)
        assert model.last_stats.arg_windows_off is None
    masks = []
    model.parts.layers[3].register_forward_pre_hook(
        lambda _m, _a, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True)
    model.generate(ids, do_sample=False, max_new_tokens=3, tide_config={"exit_threshold": 1.0})
    assert len(masks) >= 2 and all(m is not None for m in masks)
