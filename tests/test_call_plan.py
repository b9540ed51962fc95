"""What a generate call will run, as `plan_call` decides it from the call alone (`tide.decode.plan`)."""

import dataclasses
import warnings

import pytest
import torch

import tide
from tide.decode.plan import KINDS, plan_call
from tide.decode.lossless.verifier import LosslessUnavailable
from tiny_models import llama_repo as _model
from tiny_models import short_ids as _ids

GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


def _plan(model, tide_config=None, rows=1, **kwargs):
    return plan_call(model, tide_config, (_ids(rows),), {**GREEDY, **kwargs})


def test_no_tide_config_and_no_thresholds_runs_the_base_model():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no tide_config: nothing to warn about
        plan = _plan(_model(thresholds=False))
    assert (plan.kind, plan.compile, plan.cache_length) == ("base", False, None)
    assert plan.reason.startswith("no thresholds") and plan.options.mode == "exit"


def test_a_tide_config_without_thresholds_warns_and_runs_the_base_model():
    with pytest.warns(UserWarning, match="no thresholds"):
        plan = _plan(_model(thresholds=False), {"min_layers": 1})
    assert plan.kind == "base"


def test_calibrated_thresholds_all_at_one_run_the_base_model():
    model = _model()
    model.config.thresholds = dict.fromkeys(model.config.thresholds, 1.0)
    plan = _plan(model)
    assert plan.kind == "base" and "no checkpoint pays" in plan.reason


def test_thresholds_run_exit_mode():
    plan = _plan(_model())
    assert (plan.kind, plan.reason) == ("exit", "thresholds, and exit mode is the default")
    assert plan.options.thresholds == {"1": 0.5, "3": 0.5} and plan.kv_cache and not plan.compile
    own = _plan(_model(thresholds=False), {"exit_threshold": 0.3})
    assert (own.kind, own.reason, own.options.exit_threshold) == ("exit", "the call set exit options", 0.3)


def test_auto_runs_lossless_for_one_sequence_and_exit_mode_for_a_batch():
    model = _model(mode="auto", draft_layer=1, max_draft=2)
    one = _plan(model)
    assert (one.kind, one.reason) == ("lossless", "the default mode is auto, and lossless can run the call")
    assert one.options.mode == "lossless" and not one.fused_chains
    batch = _plan(model, rows=2, attention_mask=torch.ones(2, 5, dtype=torch.long))
    assert batch.kind == "exit" and batch.options.mode == "exit"
    assert batch.reason.startswith("the default mode is auto, but lossless cannot run the call: ")
    assert "batch of 2" in batch.reason
    assert _plan(model, {"kv_strategy": "recompute"}).kind == "exit"  # an exit option asks for exit mode


def test_auto_without_thresholds_runs_the_base_model_where_lossless_cannot():
    model = _model(thresholds=False, mode="auto", draft_layer=1, max_draft=2)
    assert _plan(model).kind == "lossless"  # lossless drafts need no thresholds
    plan = _plan(model, rows=2)
    assert plan.kind == "base" and "exit mode has no thresholds" in plan.reason


def test_a_batch_with_batch_exits_off_runs_the_base_model():
    model = _model(batch_exits=False)
    plan = _plan(model, rows=2)
    assert (plan.kind, plan.reason) == ("base", "a batch, and batch exits are off")
    assert _plan(model, {"exit_threshold": 0.5}, rows=2).kind == "exit"  # the call's own thresholds exit
    assert _plan(model).kind == "exit"


def test_compiled_with_compiled_modes_off_runs_the_compiled_base():
    model = _model(compiled_modes=False)
    plan = _plan(model, {"compile": True})
    assert (plan.kind, plan.compile) == ("base (compiled)", True)
    assert plan.reason == "calibration timed no mode faster than the compiled base"
    assert plan.cache_length == 5 + 6 - 1  # generate's max_length - 1 positions
    named = _plan(model, {"compile": True, "mode": "exit"})  # a call that names a mode runs it
    assert (named.kind, named.compile, named.reason) == ("exit", True, "the call asked for exit")
    beams = _plan(model, {"compile": True}, num_beams=2)  # beams: transformers' own beam search, no lent cache
    assert (beams.kind, beams.compile, beams.cache_length) == ("base", False, None)


def test_a_compiled_lossless_call_lends_room_for_a_whole_draft():
    plan = _plan(_model(mode="lossless", draft_layer=1, max_draft=2), {"compile": True})
    assert (plan.kind, plan.compile, plan.fused_chains) == ("lossless", True, True)
    assert plan.cache_length == 5 + 6 - 1 + 2 + 1
    own = _plan(_model(mode="lossless", draft_layer=1, max_draft=2), {"compile": True, "draft_topk": 2})
    assert own.kind == "lossless" and not own.fused_chains  # the call's own scheme


def test_a_compiled_call_drafts_the_repos_compiled_chain():
    chain = {"draft_layer": 1, "max_draft": 1}
    model = _model(compiled_modes=False, compiled_chain=chain)
    plan = _plan(model, {"compile": True})
    assert (plan.kind, plan.compile) == ("lossless", True)
    assert (plan.options.draft_layer, plan.options.max_draft, plan.options.draft_topk) == (1, 1, 1)
    assert plan.reason.startswith("a compiled call that names no mode drafts the repo's compiled_chain")
    assert plan.cache_length == 5 + 6 - 1 + 1 + 1
    own = _plan(model, {"compile": True, "max_draft": 2})  # a draft option: the call's scheme, not the chain
    assert own.kind == "exit" and own.options.max_draft == 2
    assert _plan(model).kind == "exit"  # not compiled: no chain


def test_call_named_options_override_the_repos():
    model = _model(mode="lossless", draft_layer=1, max_draft=2, draft_ngram=2)
    for call in ({"max_draft": 3}, tide.TideGenerationConfig(max_draft=3)):
        plan = _plan(model, call)
        assert plan.kind == "lossless" and plan.reason == "the default mode is lossless"
        assert (plan.options.max_draft, plan.options.draft_layer, plan.options.draft_ngram) == (3, 1, 2)
    assert _plan(model, {"mode": "exit"}).reason == "the call asked for exit"


def test_max_draft_zero_runs_the_base_model():
    plan = _plan(_model(mode="lossless", draft_layer=1, max_draft=0))
    assert plan.kind == "base" and "no drafting scheme pays" in plan.reason


def test_tide_config_false_runs_the_base_model():
    plan = _plan(_model(mode="lossless", draft_layer=1), False)
    assert (plan.kind, plan.options, plan.compile, plan.cache_length) == ("base", None, False, None)


def test_calls_that_cannot_run_are_refused_as_before():
    model = _model(draft_layer=1)
    with pytest.raises(LosslessUnavailable, match="drop use_cache=False"):
        _plan(model, {"mode": "lossless"}, use_cache=False)
    with pytest.raises(ValueError, match="exit mode decodes on the KV cache"):
        _plan(model, use_cache=False)
    with pytest.raises(ValueError, match="exit_threshold applies to mode='exit'"):
        _plan(model, {"mode": "lossless", "exit_threshold": 0.5})


def test_planning_changes_nothing():
    model = _model(mode="auto", draft_layer=1, max_draft=2)
    kwargs, before = {**GREEDY}, model.config.to_dict()
    plan = plan_call(model, {"compile": True}, (_ids(),), kwargs)
    assert kwargs == GREEDY and model.config.to_dict() == before and plan.kind in KINDS
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.kind = "base"


def test_the_stats_say_why():
    model = _model()
    model.generate(_ids(), **GREEDY)
    assert model.last_stats.plan == "thresholds, and exit mode is the default"
    assert "thresholds, and exit mode is the default" in model.last_stats.summary()
    assert model.last_stats.to_dict()["plan"] == model.last_stats.plan


def test_plan_kinds_are_an_enum_that_reads_as_its_words():
    from tide.decode.plan import PlanKind

    assert KINDS == ("base", "base (compiled)", "exit", "lossless")
    assert PlanKind.BASE_COMPILED == "base (compiled)" and f"{PlanKind.EXIT}" == "exit"
    assert str(PlanKind.LOSSLESS) == "lossless"
