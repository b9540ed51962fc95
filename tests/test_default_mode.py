"""The mode a call runs in by default: `"auto"` (lossless where the call allows it, else exit mode), and exit
mode with every calibrated threshold at 1.0 (calibration found no exit that pays) running the base model."""

import importlib
import warnings

import pytest
import torch

import tide
from tiny_models import sample_texts, tiny_model, tiny_tokenizer

calibration = importlib.import_module("tide.calibrate")  # the module (`tide.calibrate` is the function)
GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


def _model(**generation):
    model = tide.TideForCausalLM.from_base(tiny_model("llama"), tide.TideConfig(checkpoint_interval=2))
    model.config.thresholds = {str(k): 0.5 for k in model.checkpoints}
    if generation:
        model.config.set_generation_defaults(**generation)
    return model


def _ids(rows=1):
    return torch.randint(3, 100, (rows, 5), generator=torch.Generator().manual_seed(0))


def test_auto_runs_lossless_for_one_sequence():
    model = _model(mode="auto", draft_layer=1, max_draft=2)
    ids = _ids()
    out = model.generate(ids, **GREEDY)
    assert model.last_stats.mode == "lossless"
    assert torch.equal(out, model.base.generate(ids, **GREEDY))


def test_auto_runs_exit_mode_for_a_batch():
    model = _model(mode="auto", draft_layer=1, max_draft=2)
    model.generate(_ids(2), attention_mask=torch.ones(2, 5, dtype=torch.long), **GREEDY)
    assert model.last_stats.mode == "exit"


@pytest.mark.parametrize("call", [{"exit_threshold": 0.5}, {"kv_strategy": "recompute"}, {"mode": "exit"},
                                  tide.TideGenerationConfig(min_layers=1)])
def test_auto_runs_exit_mode_when_the_call_sets_exit_options(call):
    model = _model(mode="auto", draft_layer=1, max_draft=2)
    model.generate(_ids(), tide_config=call, **GREEDY)
    assert model.last_stats.mode == "exit"


def test_auto_runs_exit_mode_when_the_model_defaults_to_beams():
    model = _model(mode="auto", draft_layer=1, max_draft=2)
    model.base.generation_config.num_beams = 2
    model.generate(_ids(), **GREEDY)
    assert model.last_stats.mode == "exit"


def test_explicit_lossless_with_default_beams_is_refused():
    model = _model()
    model.base.generation_config.num_beams = 2
    with pytest.raises(ValueError, match="no beams"):
        model.generate(_ids(), tide_config={"mode": "lossless"}, **GREEDY)


def test_exits_turned_off_by_calibration_run_the_base_model():
    model = _model(mode="auto", draft_layer=1, max_draft=2)
    model.config.thresholds = dict.fromkeys(model.config.thresholds, 1.0)
    ids = _ids(2)
    mask = torch.ones(2, 5, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # calibrated: no "not calibrated" warning
        out = model.generate(ids, attention_mask=mask, **GREEDY)
        out_exit = model.generate(ids, attention_mask=mask, tide_config={"mode": "exit"}, **GREEDY)
    assert model.last_stats is None  # the base model's own generate ran, not the layer-wise engine
    expected = model.base.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(out, expected) and torch.equal(out_exit, expected)


def test_an_exit_threshold_still_runs_the_engine_when_calibrated_exits_are_off():
    model = _model()
    model.config.thresholds = dict.fromkeys(model.config.thresholds, 1.0)
    model.generate(_ids(), tide_config={"exit_threshold": 1.0}, **GREEDY)
    assert model.last_stats is not None and model.last_stats.mode == "exit"


def test_auto_is_accepted_from_the_command_line_config():
    assert tide.TideGenerationConfig(mode="auto").mode == "auto"
    with pytest.raises(ValueError, match="mode"):
        tide.TideGenerationConfig(mode="fastest")


def _calibrate(monkeypatch, exit_speed, lossless_speed):
    def fake_speedup(model, prompts, tide_config, new_tokens=24, repeats=3):
        return exit_speed if tide_config["mode"] == "exit" else lossless_speed

    monkeypatch.setattr(calibration, "measured_speedup", fake_speedup)
    torch.manual_seed(0)
    config = tide.TideConfig(checkpoint_interval=2, target_agreement=0.05)
    return tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=sample_texts(24), config=config,
                          num_samples=24, batch_size=8, max_length=32, head_steps=5, passes=1, validation_tokens=0,
                          draft_trials=2, progress=False)


@pytest.mark.parametrize("exit_speed,lossless_speed,exits_on,mode", [
    (1.3, 1.2, True, "exit"),  # exit mode pays and is the faster: it stays the default
    (1.1, 1.2, True, "auto"),  # both pay, lossless is faster: "auto"
    (0.9, 1.2, False, "auto"),  # exit mode is slower than the base model: its exits go off
    (0.9, 0.95, False, "exit"),  # neither pays: exit mode (with its exits off) runs the base model
    (1.01, 1.01, False, "exit"),  # within the timing's noise of the base model: neither is kept
])
def test_calibration_times_exit_mode_and_picks_the_default(monkeypatch, exit_speed, lossless_speed, exits_on, mode):
    model = _calibrate(monkeypatch, exit_speed, lossless_speed)
    timing = model.config.calibration["exit_timing"]
    assert timing is not None, "the tiny model's calibration selected no exit; the test needs one"
    assert timing == {"measured": exit_speed, "active": exits_on}
    assert any(t < 1.0 for t in model.config.thresholds.values()) == exits_on
    assert model.config.generation_config.mode == mode
    assert ("default mode: auto" in calibration.calibration_table(model.config)) == (mode == "auto")
    assert (model.config.generation_config.max_draft > 0) == (lossless_speed >= calibration.KEEP_SPEEDUP)


@pytest.mark.parametrize("exit_speed", [1.3, 0.9])
def test_other_targets_are_chosen_as_calibration_chooses_its_own(monkeypatch, exit_speed):
    # `tide bench`'s target rows: each is what calibrating at that target would keep, timing included.
    model = _calibrate(monkeypatch, exit_speed, 0.95)
    own = calibration.operating_point(model, 0.05)
    assert own.thresholds == model.config.thresholds and own.exit_timing == model.config.calibration["exit_timing"]
    strict = calibration.operating_point(model, 0.99999)  # no exit can keep this: nothing to time
    assert not strict.exits and strict.exit_timing is None
    assert calibration.thresholds_for_target(model, 0.05) == own.thresholds
    variants, chosen = importlib.import_module("tide.bench")._variants(model, (0.05, 0.99999))
    assert variants["exit target 0.05"]["thresholds"] == own.thresholds
    assert chosen["exit target 0.05"]["exits"] == (exit_speed >= calibration.KEEP_SPEEDUP)
    assert chosen["exit target 0.05"]["exit_timing"] == {"measured": exit_speed, "active": exit_speed >= calibration.KEEP_SPEEDUP}
    # calibration's layer speed-up at the target, which the timing is compared with
    assert chosen["exit target 0.05"]["expected_speedup"] == own.expected_speedup > 1.0


def test_operating_point_needs_a_calibration_in_this_process():
    with pytest.raises(ValueError, match="calibrated in this process"):
        calibration.operating_point(_model(), 0.9)
