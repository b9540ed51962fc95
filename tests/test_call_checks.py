"""A generate call reads its options wherever generate would (keywords, the call's generation config, the model's),
leaves stats whatever ran, and refuses what it cannot do with an error that says what to do."""

import json

import pytest
import torch
from transformers import GenerationConfig

import tide
from tide.decode.lossless.verifier import LosslessUnavailable
from tiny_models import llama_repo, short_ids

GREEDY = dict(do_sample=False, max_new_tokens=5, pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    return llama_repo()


def _asks(flag: str, form: str) -> dict:
    """A call that asks for `flag` in a dict output, as keywords or in a generation config."""
    if form == "keywords":
        return dict(GREEDY, return_dict_in_generate=True, **{flag: True})
    return {"generation_config": GenerationConfig(**GREEDY, return_dict_in_generate=True, **{flag: True})}


@pytest.mark.parametrize("form", ["keywords", "generation_config"])
@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_per_layer_outputs_are_refused_by_tides_modes_and_served_by_auto(model, flag, form):
    """Neither mode returns hidden states or attentions: an explicit mode says so, "auto" runs the base model, which
    returns them."""
    with pytest.raises(LosslessUnavailable, match=flag):
        model.generate(short_ids(), **_asks(flag, form), tide_config={"mode": "lossless"})
    with pytest.raises(ValueError, match=f"exit mode does not return .*{flag}.*tide_config=False"):
        model.generate(short_ids(), **_asks(flag, form), tide_config={"mode": "exit"})
    out = model.generate(short_ids(), **_asks(flag, form), tide_config={"mode": "auto"})
    reference = model.base.generate(short_ids(), **_asks(flag, form))
    key = flag.removeprefix("output_")
    assert out[key] is not None and len(out[key]) == len(reference[key])
    assert out["tide_stats"].mode == "base" and "lossless cannot run the call" in out["tide_stats"].plan


@pytest.mark.parametrize("form", ["keywords", "generation_config"])
@pytest.mark.parametrize("flag", ["output_scores", "output_logits"])
def test_scores_and_logits_are_served_however_they_are_asked_for(model, flag, form):
    for mode in ("exit", "lossless"):
        out = model.generate(short_ids(), **_asks(flag, form), tide_config={"mode": mode})
        assert out["tide_stats"].mode == mode and len(out[flag.removeprefix("output_")]) == 5


@pytest.mark.parametrize("call", [False, {"mode": "lossless"}])
def test_a_call_that_runs_the_base_model_leaves_stats(call):
    """max_draft=0 (what calibration writes where no draft pays) and tide_config=False run the base model's own
    generate; the call's stats say so, on the model and in the output."""
    model = llama_repo(max_draft=0)
    out = model.generate(short_ids(), **GREEDY, min_new_tokens=5, return_dict_in_generate=True, tide_config=call)
    stats = out["tide_stats"]
    assert stats is model.last_stats and stats.mode == "base" and stats.plan
    assert stats.decode_tokens == 4 and stats.mean_layers == model.parts.num_layers and stats.wall_time_s > 0
    assert "base" in stats.summary() and stats.to_dict()["mode"] == "base"
    model.generate(short_ids(), **GREEDY, tide_config=call)  # a tensor output: the stats on the model
    assert model.last_stats.mode == "base" and model.last_stats is not stats


@pytest.mark.parametrize("form", ["dict", "config"])
def test_an_exit_threshold_with_lossless_mode_is_refused_in_either_form(model, form):
    with pytest.raises(ValueError, match="exit_threshold applies to mode='exit'"):
        options = dict(mode="lossless", exit_threshold=0.5)
        model.generate(short_ids(), **GREEDY, tide_config=options if form == "dict" else
                       tide.TideGenerationConfig(**options))


@pytest.mark.parametrize("chain", ["abc", [1, 2], 5, {"max_draft": 2}])
def test_a_compiled_chain_that_is_not_a_chain_names_the_config_entry(model, tmp_path, chain):
    model.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["generation"] = {"compiled_chain": chain}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"TideConfig.generation .*config.json.*compiled_chain must be None or a dict"):
        tide.TideForCausalLM.from_pretrained(tmp_path, base_model=model.base)


@pytest.mark.parametrize("thresholds", [[0.5], "0.5", 0.5])
def test_thresholds_that_are_not_a_dict_are_named(thresholds):
    with pytest.raises(ValueError, match="thresholds must be None or a dict"):
        tide.TideGenerationConfig(thresholds=thresholds)


def test_custom_generate_on_a_tide_model_says_to_call_its_generate(model, tmp_path):
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="already has Tide routers .* without custom_generate"):
        model.generate(short_ids(), **GREEDY, custom_generate=str(tmp_path), trust_remote_code=True)
    assert torch.equal(model.generate(short_ids(), **GREEDY), model.generate(short_ids(), **GREEDY))
