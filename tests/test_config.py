import json
import warnings

import pytest

from tide import TideConfig


def test_interval_never_includes_last_layer():
    assert TideConfig(base_num_layers=16).resolve_checkpoints() == [3, 7, 11]
    assert TideConfig(checkpoint_interval=1).resolve_checkpoints(6) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(label="l2"), "label"),
        (dict(kv_strategy="copy"), "kv_strategy"),
        (dict(mode="fast"), "mode"),
        (dict(exit_threshold="0.5"), "exit_threshold"),
        (dict(exit_threshold=1.5), "exit_threshold"),
        (dict(min_layers=-1), "min_layers"),
        (dict(target_agreement=1.2), "target_agreement"),
        (dict(checkpoint_layers=[5, 3]), "checkpoint_layers"),
        (dict(checkpoint_layers=[5], base_num_layers=6), "checkpoint_layers"),
        (dict(checkpoint_layers=[1, 3], min_layers=5, base_num_layers=6), "min_layers"),
        (dict(router_hidden_size=0), "router_hidden_size"),
        (dict(prefill_exit="yes"), "prefill_exit"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TideConfig(**kwargs)


def test_json_round_trip(tmp_path):
    cfg = TideConfig(checkpoint_layers=[1, 3], thresholds={"1": 0.7, "3": 0.4}, base_model_name_or_path="x/y",
                     base_num_layers=6, exit_threshold=0.9, kv_strategy="recompute")
    cfg.save_pretrained(tmp_path)
    back = TideConfig.from_pretrained(tmp_path)
    for key in ("checkpoint_layers", "thresholds", "base_model_name_or_path", "generation"):
        assert getattr(back, key) == getattr(cfg, key)
    assert back.generation == {"exit_threshold": 0.9, "kv_strategy": "recompute"}
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "tide"


def test_unknown_keys_load_with_a_warning(tmp_path):
    TideConfig().save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["feature_from_the_future"] = 3
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="feature_from_the_future"):
        cfg = TideConfig.from_pretrained(tmp_path)
    assert not hasattr(cfg, "feature_from_the_future")


def test_known_keys_do_not_warn(tmp_path):
    TideConfig().save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TideConfig.from_pretrained(tmp_path)


def test_overrides():
    cfg = TideConfig(thresholds={"3": 0.5})
    assert cfg.resolve_generation({"exit_threshold": 1.0}).threshold_for(3) == 1.0
    run = cfg.resolve_generation()
    assert run.threshold_for(3) == 0.5 and run.threshold_for(7) == 1.0
    with pytest.raises(ValueError, match="unknown key"):
        cfg.resolve_generation({"exit_treshold": 0.5})
    with pytest.raises(ValueError, match="exit_threshold"):
        cfg.resolve_generation({"exit_threshold": "high"})


def test_generation_options_have_their_own_class_and_repo_defaults():
    from tide import TideGenerationConfig

    cfg = TideConfig(checkpoint_layers=[1, 3], min_layers=2)  # a generation field given to TideConfig: a default
    assert cfg.generation == {"min_layers": 2} and not hasattr(cfg, "min_layers")
    cfg.set_generation_defaults(draft_layer=3, max_draft=2)
    run = cfg.resolve_generation(TideGenerationConfig(kv_strategy="recompute"))
    assert (run.min_layers, run.draft_layer, run.max_draft, run.kv_strategy) == (2, 3, 2, "recompute")
    assert run.consulted_checkpoints([1, 3]) == [1, 3] and TideGenerationConfig(min_layers=3).consulted_checkpoints([1, 3]) == [3]
    assert cfg.resolve_generation({"min_layers": 0}).min_layers == 0
    with pytest.raises(ValueError, match="draft_layer"):
        TideConfig(checkpoint_layers=[1, 3], base_num_layers=6, draft_layer=2)
    with pytest.raises(ValueError, match="tide_config.kv_strategy"):
        TideGenerationConfig(kv_strategy="magic")


def test_old_config_files_with_top_level_generation_keys_load(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "tide", "checkpoint_layers": [1, 3],
                                                      "max_draft": 0, "exit_threshold": 0.7}))
    cfg = TideConfig.from_pretrained(tmp_path)
    assert cfg.generation == {"max_draft": 0, "exit_threshold": 0.7}
    assert cfg.resolve_generation().threshold_for(1) == 0.7
