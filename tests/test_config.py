import json
import warnings
from pathlib import Path

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
        (dict(row_skipping="off"), "row_skipping"),
        (dict(kernels="triton"), r"kernels must be one of \['auto', 'torch', 'kernel'\]"),
        (dict(kv_fill="batched"), r"kv_fill must be one of \['auto', 'layerwise'\]"),
        (dict(few_row_layout="on"), r"few_row_layout must be one of \['auto', 'plain', 'transposed', 'packed'\]"),
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
    assert (run.consulted_checkpoints([1, 3]) == [1, 3]
            and TideGenerationConfig(min_layers=3).consulted_checkpoints([1, 3]) == [3])
    assert cfg.resolve_generation({"min_layers": 0}).min_layers == 0
    with pytest.raises(ValueError, match="draft_layer"):
        TideConfig(checkpoint_layers=[1, 3], base_num_layers=6, draft_layer=2)
    with pytest.raises(ValueError, match="tide_config.kv_strategy"):
        TideGenerationConfig(kv_strategy="magic")


def test_engine_switches_are_generation_options_a_repo_can_default(tmp_path):
    from tide import TideGenerationConfig

    assert TideGenerationConfig().switches == {"row_skipping": True, "kernels": "auto", "kv_fill": "auto",
                                               "few_row_layout": "auto"}
    cfg = TideConfig(checkpoint_layers=[1, 3])
    cfg.set_generation_defaults(row_skipping=False, kv_fill="layerwise")
    assert cfg.generation == {"row_skipping": False, "kv_fill": "layerwise"}
    cfg.save_pretrained(tmp_path)
    back = TideConfig.from_pretrained(tmp_path)
    run = back.resolve_generation({"kernels": "torch", "few_row_layout": "packed"})
    assert run.switches == {"row_skipping": False, "kernels": "torch", "kv_fill": "layerwise",
                            "few_row_layout": "packed"}
    assert back.resolve_generation({"row_skipping": True}).switches["row_skipping"] is True


def test_old_config_files_with_top_level_generation_keys_load(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "tide", "checkpoint_layers": [1, 3],
                                                      "max_draft": 0, "exit_threshold": 0.7}))
    cfg = TideConfig.from_pretrained(tmp_path)
    assert cfg.generation == {"max_draft": 0, "exit_threshold": 0.7}
    assert cfg.resolve_generation().threshold_for(1) == 0.7


# Calibration records. tests/fixtures/: config.json files written before the records existed (`calibrated`: a
# tiny Llama calibrated with fixed timings; `older`: the same without the fields older Tide versions did not
# write; `variety`: the other branches: n-gram drafts only, cut trials, two processes), and the model card and
# calibration table that code rendered from each.
FIXTURES = Path(__file__).parent / "fixtures"
LAYOUTS = ("calibrated", "older", "variety")


def _saved(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}_config.json").read_text())


@pytest.mark.parametrize("name", LAYOUTS)
def test_saved_calibrations_load_as_records_and_render_as_before(name):
    from tide.hub.card import calibration_table, model_card
    from tide.records import CalibrationRecord

    cfg = TideConfig.from_pretrained(FIXTURES / f"{name}_config.json")
    assert cfg.calibration == _saved(name)["calibration"]  # the config keeps the saved description
    record = CalibrationRecord.from_dict(cfg.calibration)
    written = json.loads(json.dumps(record.to_dict()))
    # the same layout back; an older one gains only empty (None) fields
    assert {k: v for k, v in written.items() if v is not None or k in cfg.calibration} == cfg.calibration
    assert model_card(cfg) == (FIXTURES / f"{name}_card.md").read_text()
    assert calibration_table(cfg) + "\n" == (FIXTURES / f"{name}_table.txt").read_text()


def test_calibration_records_are_typed():
    from tide.records import BatchTiming, CalibrationRecord, CostsRecord, DraftRecord

    new = CalibrationRecord.from_dict(_saved("calibrated")["calibration"])
    assert new.checkpoints["1"].exits == 155 and new.checkpoints["3"].heldout_agreement is None
    assert isinstance(new.costs, CostsRecord) and new.costs.verify_extras["8"] > new.costs.verify_extras["2"]
    assert new.exit_timing.timings == [1.3, 1.3] and new.exit_timing.batch == BatchTiming(0.95, False, [0.95], rows=5)
    chosen = new.draft_selection.chosen
    assert isinstance(chosen, DraftRecord) and (chosen.draft_layer, chosen.max_draft, chosen.draft_ngram) == (3, 2, 3)
    assert new.draft_selection.ngram.active and new.compiled_timing.active and new.decode_validation.tokens == 64
    assert new.timing_budget.cut == [] and new.processes == 1

    old = CalibrationRecord.from_dict(_saved("older")["calibration"])
    assert old.exit_head is None and old.agreement_lower_bound is None and old.compiled_timing is None
    assert old.exit_timing.timings is None and old.exit_timing.batch is None
    assert old.costs.verify_extras is None and old.costs.verify_extra > 0 and old.checkpoints["1"].exits is None
    assert old.draft_selection.chosen.draft_vocab_size is None and old.decode_validation.tokens_per_rank is None

    variety = CalibrationRecord.from_dict(_saved("variety")["calibration"])
    assert variety.draft_selection.chosen.head_drafts is False and variety.draft_selection.ngram_only.active
    assert variety.draft_selection.cut[0].draft_topk == 3 and variety.processes == 2


def test_calibration_records_ignore_newer_keys_and_name_missing_ones():
    from tide.records import CalibrationRecord

    saved = _saved("calibrated")["calibration"]
    saved["from_a_newer_tide"] = 1
    saved["exit_timing"]["from_a_newer_tide"] = 1
    assert CalibrationRecord.from_dict(saved).exit_timing.measured == 1.3
    with pytest.raises(KeyError, match="label_rate"):
        CalibrationRecord.from_dict({"checkpoints": {"2": {}}})
