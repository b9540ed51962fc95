"""Bad or unusual input, as a new user or a server would send it: a clear error, a warning, or the right result."""

import json
import math

import pytest
import torch
import transformers
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
    (dict(heldout_tokens=0), "heldout_tokens"),
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
    from tide.tools.cli import main

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


# ---------------------------------------------------------------------- repos: saving and loading
def _failing_save_file(*args, **kwargs):
    raise OSError("disk full (injected)")


@pytest.mark.parametrize("failure", ["weights", "card"])
def test_a_save_that_fails_part_way_leaves_the_previous_repo(tmp_path, monkeypatch, failure):
    repo = tmp_path / "repo"
    old = _model()
    old.save_pretrained(repo)
    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()}
    new = tide.TideForCausalLM.from_base(tiny_model("llama"), TideConfig(checkpoint_layers=[2], router_hidden_size=16))
    if failure == "weights":  # after config.json is written, before routers.safetensors
        monkeypatch.setattr(tide.hub.repos, "save_file", _failing_save_file)
        with pytest.raises(OSError, match="injected"):
            new.save_pretrained(repo)
    else:  # an edited calibration record: the model card cannot be written
        new.config.calibration = {"checkpoints": {"2": {}}}
        with pytest.raises(KeyError):
            new.save_pretrained(repo)
    assert {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]  # no temporary folder left behind
    assert tide.TideForCausalLM.from_pretrained(repo, base_model=old.base).checkpoints == [1, 3]
    monkeypatch.undo()
    new.config.calibration = None
    new.save_pretrained(repo)  # a save that succeeds replaces the files
    assert tide.TideForCausalLM.from_pretrained(repo, base_model=old.base).checkpoints == [2]


_LAYER_MAPS = ("thresholds", "checkpoints", "dropped_checkpoints", "router_auc", "verify_extra_s", "verify_extras")


def _add_unknown_keys(data: dict, where: list) -> None:
    """An extra key in `data` and in every dict section below it (maps keyed by layer excepted: their keys are
    layers, not fields); records where it went."""
    data["from_a_newer_tide"] = 1
    where.append(data)
    for key, value in list(data.items()):
        for item in value.values() if key in _LAYER_MAPS and isinstance(value, dict) else [value]:
            for section in item if isinstance(item, list) else [item]:
                if isinstance(section, dict):
                    _add_unknown_keys(section, where)


def test_a_repo_from_a_newer_tide_loads_with_warnings(tmp_path):
    model = _model(thresholds={"1": 0.5, "3": 1.0}, max_draft=2)
    model.config.calibration = {
        "dataset": "<list>", "num_samples": 12, "train_tokens": 300, "heldout_tokens": 80,
        "checkpoints": {"1": {"label_rate": 0.5, "exit_rate": 0.2, "heldout_agreement": 0.9, "threshold": 0.5},
                        "3": {"label_rate": 0.8, "exit_rate": 0.0, "heldout_agreement": None, "threshold": 1.0}},
        "dropped_checkpoints": {"3": "no token exits there"},
        "costs": {"device": "cpu", "checkpoint": 0.4, "skipped_layer": 0.1, "verify_extra_s": {"2": 0.1}},
        "exit_timing": {"measured": 1.1, "timings": [1.1], "active": True,
                        "batch": {"rows": 4, "measured": 0.9, "active": False}},
        "draft_selection": {"chosen": None, "trials": [{"draft_layer": 1, "max_draft": 2, "draft_topk": 1,
                                                        "estimate": 1.0, "measured": 1.1}]},
    }
    model.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    sections = []
    _add_unknown_keys(data, sections)
    assert len(sections) >= 9 and data["generation"]["from_a_newer_tide"] == 1
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.warns(UserWarning) as caught:
        loaded = tide.TideForCausalLM.from_pretrained(tmp_path, base_model=model.base)
    messages = " ".join(str(w.message) for w in caught)
    assert ("unknown keys ['from_a_newer_tide']" in messages
            and "unknown generation keys ['from_a_newer_tide']" in messages)
    assert loaded.config.generation == {"max_draft": 2} and loaded.config.thresholds == {"1": 0.5, "3": 1.0}
    with pytest.warns(UserWarning) as caught:
        assert isinstance(transformers.AutoConfig.from_pretrained(tmp_path), TideConfig)
    assert "unknown generation keys" in " ".join(str(w.message) for w in caught)
    loaded.generate(_ids(), **GREEDY)
    loaded.save_pretrained(tmp_path / "again")  # the model card reads the calibration record with its extra keys
    # A key the user passes is a typo, not a newer Tide: still an error.
    with pytest.raises(ValueError, match="unknown key"):
        loaded.generate(_ids(), tide_config={"from_a_newer_tide": 1}, **GREEDY)
    with pytest.raises(ValueError, match="generation: unknown key"):
        TideConfig(generation={"from_a_newer_tide": 1})


def test_wrapping_a_tide_model_again_is_a_clear_error(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match=r"already a Tide model.*\.base"):
        tide.TideForCausalLM.from_base(model, TideConfig(checkpoint_layers=[1]))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"already a Tide model.*\.base"):
        tide.TideForCausalLM.from_pretrained(tmp_path, base_model=model)
    assert tide.TideForCausalLM.from_base(model.base, TideConfig(checkpoint_layers=[1])).checkpoints == [1]


@pytest.mark.parametrize("base_name", ["absolute", "./no-such-base-model"])
def test_a_missing_local_base_model_folder_is_named(tmp_path, base_name):
    from transformers import AutoTokenizer

    base_name = str(tmp_path / "deleted-base") if base_name == "absolute" else base_name
    model = _model()
    model.config.base_model_name_or_path = base_name
    model.save_pretrained(tmp_path / "routers")
    for load in (tide.TideForCausalLM.from_pretrained, AutoTokenizer.from_pretrained):
        with pytest.raises(FileNotFoundError, match="base model folder") as err:
            load(tmp_path / "routers")
        assert base_name in str(err.value) and "Repo id" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="base_model="):
        tide.TideForCausalLM.from_pretrained(tmp_path / "routers")
    assert tide.TideForCausalLM.from_pretrained(tmp_path / "routers", base_model=model.base).checkpoints == [1, 3]


def test_a_repo_without_base_num_layers_on_a_deeper_base_names_the_layer_count(tmp_path):
    _model().save_pretrained(tmp_path)  # on 6 layers: a draft head at checkpoint 1 (the first half of the stack)
    data = json.loads((tmp_path / "config.json").read_text())
    data["base_num_layers"] = None
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="8 layers") as err:
        tide.TideForCausalLM.from_pretrained(tmp_path, base_model=tiny_model("llama", num_hidden_layers=8))
    message = str(err.value)
    assert "base_num_layers" in message and "draft heads at [1]" in message and "missing" not in message


def test_lossless_after_casting_the_base_model_names_align_routers():
    """Casting the base model leaves the routers behind: lossless mode says what to do, as exit mode does."""
    from tiny_models import noisy_tide, prompt_ids

    model, base = noisy_tide("llama")
    base.to(torch.float64)
    with pytest.raises(RuntimeError, match="align_routers"):
        model.generate(prompt_ids(), max_new_tokens=4, tide_config={"mode": "lossless"})
    model.align_routers()
    ref = base.generate(prompt_ids(), do_sample=False, max_new_tokens=8)
    assert torch.equal(model.generate(prompt_ids(), do_sample=False, max_new_tokens=8,
                                      tide_config={"mode": "lossless"}), ref)


@pytest.mark.parametrize("tide_config", [{"mode": "lossless", "max_draft": 2}, {"exit_threshold": 0.5},
                                         {"exit_threshold": 1.0, "compile": True}])
def test_a_generation_config_gets_no_deprecation_warning_for_options_tide_sets(tide_config):
    """Tide asks generate for a KV cache (and, compiled, a static one): beside a caller's generation_config it sets
    them there, not as keywords that transformers warns about ("Passing `generation_config` together with...")."""
    from transformers import CompileConfig, GenerationConfig
    from transformers.testing_utils import CaptureLogger

    model = tide.TideForCausalLM.from_base(tiny_model("llama"), TideConfig(checkpoint_interval=2))
    ids = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    config = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=0,
                              compile_config=CompileConfig(backend="eager"))
    logger = transformers.logging.get_logger("transformers.generation.utils")
    with CaptureLogger(logger) as captured:
        out = model.generate(ids, generation_config=config, tide_config=tide_config)
    assert "deprecated" not in captured.out
    assert torch.equal(out, model.base.generate(ids, generation_config=config)) or "exit_threshold" in tide_config
    assert config.cache_implementation is None  # the caller's object is not changed


# ---------------------------------------------------------------------- calibration data
def test_a_dataset_file_that_is_not_utf8_names_the_file_the_offset_and_how_to_convert(tmp_path):
    from tide.calibration.data import DatasetLoadError

    path = tmp_path / "latin.txt"
    path.write_bytes("\n".join(sample_texts(6)).encode() + "\ncaf\xe9 au lait\n".encode("latin-1"))
    offset = len("\n".join(sample_texts(6)).encode()) + len(b"\ncaf")
    with pytest.raises(DatasetLoadError) as err:
        tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=str(path),
                       config=TideConfig(checkpoint_layers=[1]), **FAST)
    message = str(err.value)
    assert str(path) in message and f"offset {offset}" in message and "0xe9" in message and "iconv" in message


def test_a_file_that_ends_inside_a_character_names_the_offset(tmp_path):
    from tide.calibration.data import DatasetLoadError, check_local_dataset

    path = tmp_path / "cut.txt"
    path.write_bytes("caf\u00e9".encode()[:-1])
    with pytest.raises(DatasetLoadError, match="incomplete character at offset 3"):
        check_local_dataset(str(path))


def test_fewer_texts_than_asked_is_one_warning_with_both_numbers():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=sample_texts(5),
                       config=TideConfig(checkpoint_layers=[1, 3], target_agreement=0.6), **{**FAST, "num_samples": 32})
    mine = [str(w.message) for w in caught if "num_samples" in str(w.message)]
    assert len(mine) == 1 and "32" in mine[0] and " 5" in mine[0] and "\n" not in mine[0]


def test_calibration_that_keeps_nothing_on_too_little_data_says_how_many_texts_it_needs():
    """At 99% agreement with 95% confidence even a flawless exit needs 299 held-out tokens before the bound allows
    it; one held-out text of 32 tokens cannot: the warning says so, with the texts that would take."""
    with pytest.warns(UserWarning, match=r"kept no exits: on 32 held-out tokens \(1 held-out texts\).*about 299 "
                                         r"held-out tokens, i\.e\. about 47 texts \(num_samples >= 47\)"):
        model = tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=sample_texts(6),
                               config=TideConfig(checkpoint_layers=[1, 3], target_agreement=0.99), **FAST)
    assert all(t == 1.0 for t in model.config.thresholds.values())


def test_held_out_tokens_for_a_bound():
    from tide.calibration.thresholds import binomial_upper_bound, tokens_for_bound

    assert tokens_for_bound(0.0, 0.99, 0.95) == 299  # 1 - 0.05 ** (1 / n) <= 0.01
    n = tokens_for_bound(0.004, 0.99, 0.95)  # the fewest tokens whose bound at that rate holds
    assert binomial_upper_bound(math.ceil(0.004 * n), n, 0.95) <= 0.01
    assert binomial_upper_bound(math.ceil(0.004 * (n - 1)), n - 1, 0.95) > 0.01
    assert tokens_for_bound(0.02, 0.99, 0.95) is None  # the rate itself is above what the target allows
