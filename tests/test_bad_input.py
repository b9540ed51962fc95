"""Bad or unusual input, as a new user or a server would send it: a clear error, a warning, or the right result."""

import json
import warnings

import pytest
import torch
from safetensors.torch import save_file

import tide
from tide import TideConfig
from tiny_models import sample_texts, tiny_model, tiny_tokenizer

FAST = dict(num_samples=12, max_length=32, head_steps=5, passes=1, measure_costs=False, validation_tokens=0,
            draft_trials=0, progress=False)
GREEDY = dict(do_sample=False, max_new_tokens=6)


def _model(**cfg):
    return tide.TideForCausalLM.from_base(tiny_model("llama"), TideConfig(checkpoint_layers=[1, 3], **cfg))


def _ids():
    return torch.randint(4, 100, (1, 8), generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------- what the user owns
def test_saving_routers_into_the_base_models_folder_is_refused(tmp_path):
    base = tiny_model("llama")
    base.save_pretrained(tmp_path)
    (tmp_path / "README.md").write_text("my model card")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="model weights|another model"):
        tide.TideForCausalLM.from_base(base, TideConfig(checkpoint_layers=[1])).save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_readme_tide_did_not_write_is_never_overwritten(tmp_path):
    (tmp_path / "README.md").write_text("notes of mine")
    with pytest.raises(ValueError, match="README.md"):
        _model().save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "notes of mine"
    _model().save_pretrained(tmp_path / "fresh")
    _model().save_pretrained(tmp_path / "fresh")  # Tide's own card: rewritten


def test_from_base_copies_the_config():
    config = TideConfig(checkpoint_interval=2)
    a = tide.TideForCausalLM.from_base(tiny_model("llama"), config)
    b = tide.TideForCausalLM.from_base(tiny_model("gpt2"), config)
    assert a.config is not config and b.config is not config
    assert a.config.base_model_type == "llama" and b.config.base_model_type == "gpt2"
    assert config.base_model_type is None


def test_calibrating_a_tide_model_applies_the_given_config():
    model = _model()
    calibrated = tide.calibrate(model, tiny_tokenizer(), dataset=sample_texts(12), config=TideConfig(
        checkpoint_layers=[1, 3], target_agreement=0.5), **FAST)
    assert calibrated.config.target_agreement == 0.5
    with pytest.raises(ValueError, match="checkpoint"):
        tide.calibrate(model, tiny_tokenizer(), dataset=sample_texts(12), config=TideConfig(checkpoint_layers=[2]),
                       **FAST)


# ---------------------------------------------------------------------- crashes on accepted input
@pytest.mark.parametrize("field", ["target_agreement", "confidence"])
def test_a_certainty_of_one(field):
    if field == "confidence":
        with pytest.raises(ValueError, match="confidence"):
            TideConfig(confidence=1.0)
        return
    model = tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=sample_texts(12),
                           config=TideConfig(checkpoint_layers=[1, 3], target_agreement=1.0), **FAST)
    assert all(t == 1.0 for t in model.config.thresholds.values())  # nothing may ever disagree: nothing exits


def test_lossless_with_inputs_embeds_is_a_clear_error_before_generation():
    model = _model()
    embeds = model.get_input_embeddings()(_ids())
    with pytest.raises(ValueError, match="input_ids"):
        model.generate(inputs_embeds=embeds, tide_config={"mode": "lossless", "draft_layer": 1}, **GREEDY)


@pytest.mark.parametrize("options, needle", [
    (dict(batch_size=0), "batch_size"),
    (dict(num_samples=-1), "num_samples"),
    (dict(heldout_fraction=1.5), "heldout_fraction"),
    (dict(passes=-1), "passes"),
    (dict(head_lr=0.0), "head_lr"),
    (dict(batch_sise=4), "batch_sise"),
])
def test_bad_calibration_options_name_the_option(options, needle):
    with pytest.raises(ValueError, match=needle):
        tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=sample_texts(12),
                       config=TideConfig(checkpoint_layers=[1]), **{**FAST, **options})


# ---------------------------------------------------------------------- TIDE router.pt conversion
def _tide_pt(tmp_path, layers, hidden=32, bottleneck=8, **tensors):
    state = {"hidden_dim": hidden, "bottleneck_dim": bottleneck, "router_layers": {
        k: {"down.weight": tensors.get("down", torch.randn(bottleneck, hidden)),
            "up.weight": tensors.get("up", torch.randn(1, bottleneck))} for k in layers}}
    path = tmp_path / "router.pt"
    torch.save(state, path)
    return path


@pytest.mark.parametrize("case, needle", [
    (dict(down=torch.randn(1, 32)), "down.weight"),
    (dict(up=torch.randn(2, 8)), "up.weight"),
    (dict(down=torch.full((8, 32), float("nan"))), "finite"),
])
def test_converted_tide_routers_are_checked(tmp_path, case, needle):
    with pytest.raises(ValueError, match=needle):
        tide.convert_tide_routers(_tide_pt(tmp_path, [1, 3], **case), tiny_model("llama"))


def test_converted_tide_routers_need_layers_and_keys(tmp_path):
    with pytest.raises(ValueError, match="router_layers"):
        tide.convert_tide_routers(_tide_pt(tmp_path, []), tiny_model("llama"))
    path = tmp_path / "missing.pt"
    torch.save({"hidden_dim": 32, "bottleneck_dim": 8, "router_layers": {1: {"down.weight": torch.randn(8, 32)}}}, path)
    with pytest.raises(ValueError, match="up.weight"):
        tide.convert_tide_routers(path, tiny_model("llama"))


# ---------------------------------------------------------------------- accepted, and wrong or ignored
def test_nan_router_weights_in_a_repo_are_refused(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "routers.safetensors")
    weights["1.down.weight"][0, 0] = float("nan")
    save_file(weights, tmp_path / "routers.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="finite"):
        tide.TideForCausalLM.from_pretrained(tmp_path, base_model=model.base)


def test_thresholds_for_layers_that_are_not_checkpoints_are_refused():
    with pytest.raises(ValueError, match="thresholds"):
        _model(thresholds={"2": 0.5})
    model = _model()
    with pytest.raises(ValueError, match="thresholds"):
        model.generate(_ids(), tide_config={"thresholds": {"2": 0.5}}, **GREEDY)


def test_use_cache_false_with_exits_is_a_clear_error():
    with pytest.raises(ValueError, match="use_cache"):
        _model().generate(_ids(), tide_config={"exit_threshold": -1}, use_cache=False, **GREEDY)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(checkpoint_layers=[1.7, 3.2]), "checkpoint_layers"),
    (dict(thresholds={"1": True}), "thresholds"),
    (dict(thresholds={"1": "abc"}), "thresholds"),
])
def test_config_values_are_not_coerced(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        TideConfig(**kwargs)


def test_last_stats_is_cleared_by_a_failing_call():
    model = _model()
    model.generate(_ids(), tide_config={"exit_threshold": -1}, **GREEDY)
    assert model.last_stats is not None
    with pytest.raises(ValueError):
        model.generate(_ids(), tide_config={"exit_threshold": 3.0}, **GREEDY)
    assert model.last_stats is None


# ---------------------------------------------------------------------- unclear messages
def test_a_config_json_that_is_not_an_object(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="config.json"):
        tide.TideForCausalLM.from_pretrained(tmp_path, base_model=model.base)


def test_a_missing_local_directory_says_so(tmp_path):
    with pytest.raises(OSError, match="no such directory|does not exist"):
        tide.TideForCausalLM.from_pretrained(str(tmp_path / "nope"))


def test_a_repo_without_base_fields_and_other_shapes(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.update(base_model_type=None, base_hidden_size=None, base_num_layers=None)
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="shape"):
        tide.TideForCausalLM.from_pretrained(tmp_path, base_model=tiny_model("llama", hidden_size=48))


def test_a_garbled_router_file_names_the_file(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    (tmp_path / "routers.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="routers.safetensors"):
        tide.TideForCausalLM.from_pretrained(tmp_path, base_model=model.base)


def test_cli_expected_failures_are_one_line_with_exit_code_2(tmp_path, capsys):
    from tide.cli import main

    model = _model()
    model.save_pretrained(tmp_path)
    (tmp_path / "routers.safetensors").write_bytes(b"garbage")
    bad_pt = tmp_path / "router.pt"
    bad_pt.write_bytes(b"not a pickle")
    model.base.save_pretrained(tmp_path / "base")
    capsys.readouterr()
    for argv in (["generate", str(tmp_path), "hi"], ["import-tide", str(bad_pt), "--base", str(tmp_path / "base"),
                                                                  "--out", str(tmp_path / "out")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        lines = [line for line in err.replace("\r", "\n").splitlines() if "error" in line.lower()]
        assert len(lines) == 1 and lines[0].startswith(f"tide {argv[0]}: error: ") and "Traceback" not in err, err
