"""The mode a call runs in by default: `"auto"` (lossless where the call allows it, else exit mode), and exit
mode with every calibrated threshold at 1.0 (calibration found no exit that pays) running the base model."""

import importlib
import warnings

import pytest
import torch
from transformers import CompileConfig

import tide
from tiny_models import llama_repo as _model
from tiny_models import sample_texts, tiny_model, tiny_tokenizer
from tiny_models import short_ids as _ids

calibration = importlib.import_module("tide.calibration.run")
trials = importlib.import_module("tide.calibration.trials")
GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


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
    assert model.last_stats.mode == "base"  # the base model's own generate ran, not the layer-wise engine
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
    def fake_speedup(model, prompts, tide_config, new_tokens=24, repeats=3, baseline="generate", bar=None):
        return exit_speed if tide_config["mode"] == "exit" else lossless_speed

    return _calibrate_timed_by(monkeypatch, fake_speedup, draft_trials=2)


def _calibrate_timed_by(monkeypatch, fake_speedup, draft_trials: int = 1, **options):
    """A tiny Llama calibrated with `fake_speedup` as every timing trial's measurement."""
    monkeypatch.setattr(trials, "measured_speedup", fake_speedup)
    torch.manual_seed(0)
    config = tide.TideConfig(checkpoint_interval=2, target_agreement=0.05)
    return tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=sample_texts(24), config=config,
                          num_samples=24, batch_size=8, max_length=32, head_steps=5, passes=1, validation_tokens=0,
                          draft_trials=draft_trials, progress=False, **options)


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
    assert (timing["measured"], timing["active"]) == (exit_speed, exits_on)
    assert timing["timings"] == [exit_speed] * (2 if exit_speed >= trials.KEEP_SPEEDUP else 1)
    assert any(t < 1.0 for t in model.config.thresholds.values()) == exits_on
    assert model.config.generation_config.mode == mode
    assert ("default mode: auto" in calibration.calibration_table(model.config)) == (mode == "auto")
    assert (model.config.generation_config.max_draft > 0) == (lossless_speed >= trials.KEEP_SPEEDUP)


@pytest.mark.parametrize("exit_speed", [1.3, 0.9])
def test_other_targets_are_chosen_as_calibration_chooses_its_own(monkeypatch, exit_speed):
    # `tide bench`'s target rows: each is what calibrating at that target would keep, timing included.
    model = _calibrate(monkeypatch, exit_speed, 0.95)
    own = calibration.operating_point(model, 0.05)
    assert own.thresholds == model.config.thresholds and own.exit_timing == model.config.calibration["exit_timing"]
    strict = calibration.operating_point(model, 0.99999)  # no exit can keep this: nothing to time
    assert not strict.exits and strict.exit_timing is None
    assert calibration.thresholds_for_target(model, 0.05) == own.thresholds
    variants, chosen = importlib.import_module("tide.tools.bench")._variants(model, (0.05, 0.99999))
    assert variants["exit target 0.05"]["thresholds"] == own.thresholds
    assert chosen["exit target 0.05"]["exits"] == (exit_speed >= trials.KEEP_SPEEDUP)
    timing = chosen["exit target 0.05"]["exit_timing"]
    assert (timing["measured"], timing["active"]) == (exit_speed, exit_speed >= trials.KEEP_SPEEDUP)
    # calibration's layer speed-up at the target, which the timing is compared with
    assert chosen["exit target 0.05"]["expected_speedup"] == own.expected_speedup > 1.0


def test_operating_point_needs_a_calibration_in_this_process():
    with pytest.raises(ValueError, match="calibrated in this process"):
        calibration.operating_point(_model(), 0.9)


# ---------------------------------------------------------------------- timings that keep a mode, batches
def test_a_mode_is_kept_only_when_a_second_timing_agrees(monkeypatch):
    """One timing on a busy machine can read a slower mode as faster: a mode is kept when two timings both
    find it faster, and reported at the lower one; a mode slower at the first timing is not timed again."""
    def timings(*values):
        values = list(values)
        monkeypatch.setattr(trials, "timed", lambda *args: values.pop(0))
        return values

    left = timings(1.06, 0.97)
    assert trials.kept(None, [], {}) == {"measured": 0.97, "timings": [1.06, 0.97], "active": False} and not left
    timings(1.06, 1.04)
    assert trials.kept(None, [], {}) == {"measured": 1.04, "timings": [1.06, 1.04], "active": True}
    left = timings(0.9, 1.5)
    assert trials.kept(None, [], {}) == {"measured": 0.9, "timings": [0.9], "active": False} and left == [1.5]


def test_draft_trials_keep_the_fastest_scheme_that_times_faster_again(monkeypatch):
    from tide.calibration.costs import DraftScheme

    schemes = [DraftScheme(0, 1, 3, 1.3), DraftScheme(0, 1, 8, 1.2), DraftScheme(0, 2, 1, 1.1)]
    first = {3: 1.10, 8: 1.20, 1: 0.95}  # the tree of 8 times fastest once, and slower when timed again
    again = {3: 1.08, 8: 0.99}
    calls = []

    def timed(model, prompts, config, baseline="generate", bar=None):
        if config.get("draft_ngram"):  # the chosen scheme with n-gram drafts: as fast as without
            return 1.08
        calls.append(config["draft_topk"])
        return (again if calls.count(config["draft_topk"]) > 1 else first)[config["draft_topk"]]

    monkeypatch.setattr(trials, "timed", timed)
    monkeypatch.setattr(trials, "timing_prompts", lambda *args: [])
    model = type("M", (), {"base": type("B", (), {"device": "cpu"})()})()
    selection = trials.choose_draft(model, None, [], schemes)
    assert calls == [3, 8, 1, 8, 3]  # every scheme once, then the fastest ones again until one holds
    assert selection["chosen"]["draft_topk"] == 3 and selection["chosen"]["measured"] == 1.08
    assert selection["ngram"]["active"] and selection["chosen"]["draft_ngram"] == trials.NGRAM
    assert [t["timings"] for t in selection["trials"][:2]] == [[1.10, 1.08], [1.20, 0.99]]


@pytest.mark.parametrize("batch_speed", [0.9, 1.2])
def test_calibration_times_exits_on_a_batch(monkeypatch, batch_speed):
    """Exits kept for one sequence are timed on a batch too; where they do not pay there, batches run the base
    model by default, and the calibration table says so."""
    def fake_speedup(model, prompts, tide_config, new_tokens=24, repeats=3, baseline="generate", bar=None):
        if tide_config["mode"] != "exit":
            return 0.9
        return batch_speed if prompts[0].shape[0] > 1 else 1.3

    model = _calibrate_timed_by(monkeypatch, fake_speedup)
    batch = model.config.calibration["exit_timing"]["batch"]
    assert batch["rows"] > 1 and (batch["measured"], batch["active"]) == (batch_speed, batch_speed > 1.02)
    assert model.config.generation_config.batch_exits == (batch_speed > 1.02)
    assert ("batches run the base model" in calibration.calibration_table(model.config)) == (batch_speed < 1)
    ids = _ids(2)
    mask = torch.ones(2, 5, dtype=torch.long)
    out = model.generate(ids, attention_mask=mask, **GREEDY)
    assert (model.last_stats.mode == "exit") == (batch_speed > 1)  # "base": the base model's own generate ran
    model.generate(ids[:1], **GREEDY)
    assert model.last_stats is not None and model.last_stats.mode == "exit"  # one sequence: the exits run
    if batch_speed < 1:
        assert torch.equal(out, model.base.generate(ids, attention_mask=mask, **GREEDY))


@pytest.mark.parametrize("call,exits", [
    (None, False), ({"mode": "exit"}, False), ({"exit_threshold": 0.5}, True), ({"thresholds": {"1": 0.5}}, True),
    ({"batch_exits": True}, True),
])
def test_batch_exits_off_runs_batches_on_the_base_model_unless_the_call_asks(call, exits):
    model = _model(mode="auto", draft_layer=1, max_draft=2, batch_exits=False)
    ids, mask = _ids(2), torch.ones(2, 5, dtype=torch.long)
    out = model.generate(ids, attention_mask=mask, tide_config=call, **GREEDY)
    assert (model.last_stats is not None and model.last_stats.mode == "exit") == exits
    if not exits:
        assert torch.equal(out, model.base.generate(ids, attention_mask=mask, **GREEDY))
    model.generate(_ids(1), tide_config={"mode": "exit"}, **GREEDY)  # one sequence: the calibrated exits run
    assert model.last_stats is not None and model.last_stats.mode == "exit"
    model.generate(_ids(1), tide_config={"mode": "exit"}, num_return_sequences=2, do_sample=True, max_new_tokens=3)
    assert model.last_stats.mode == "base"  # two sequences from one prompt are a batch too


def test_batch_exits_must_be_a_bool():
    with pytest.raises(ValueError, match="batch_exits must be True or False"):
        tide.TideGenerationConfig(batch_exits="no")


@pytest.mark.parametrize("compiled_speed", [0.85, 1.1])
def test_the_kept_mode_is_timed_compiled_against_the_compiled_base(monkeypatch, compiled_speed):
    """A call with compile=True is measured against the base model's compiled static-cache decode: calibration
    times the kept mode compiled against it, and where it is not faster such calls run that decode."""
    def fake_speedup(model, prompts, tide_config, new_tokens=24, repeats=3, baseline="generate", bar=None):
        if baseline == "compiled":
            return compiled_speed
        return 1.3 if tide_config["mode"] == "exit" else 0.9

    model = _calibrate_timed_by(monkeypatch, fake_speedup, compiled_trials=True)
    timing = model.config.calibration["compiled_timing"]
    assert timing["measured"] == compiled_speed and timing["active"] == (compiled_speed > 1)
    assert model.config.generation_config.compiled_modes == (compiled_speed > 1)
    assert "default mode compiled: measured" in calibration.calibration_table(model.config)
    ids = _ids()
    out = model.generate(ids, tide_config={"compile": True}, compile_config=CompileConfig(backend="eager"), **GREEDY)
    assert model.last_stats.mode == ("exit" if compiled_speed > 1 else "base (compiled)")
    eager = model.generate(ids, **GREEDY) if compiled_speed > 1 else model.base.generate(ids, **GREEDY)
    assert torch.equal(out, eager)


def test_calibration_compiles_only_when_asked(monkeypatch):
    """Without compiled_trials=True no timing compiles anything: compiled_modes keeps its default."""
    baselines = []

    def fake_speedup(model, prompts, tide_config, new_tokens=24, repeats=3, baseline="generate", bar=None):
        baselines.append(baseline)
        return 1.3 if tide_config["mode"] == "exit" else 0.9

    model = _calibrate_timed_by(monkeypatch, fake_speedup)
    assert baselines and "compiled" not in baselines
    assert model.config.calibration["compiled_timing"] is None and model.config.generation_config.compiled_modes


@pytest.mark.parametrize("chain_speed, tree_speed", [(0.97, 0.9), (1.15, 1.05), (1.05, 1.2)])
def test_a_greedy_chain_that_times_faster_compiled_is_what_compiled_calls_draft(monkeypatch, chain_speed, tree_speed):
    """Where no mode pays eagerly, calibration with compiled_trials still times greedy drafts compiled against the
    compiled base (from the draft layer of the best-timed scheme: a chain of one, of two with n-gram drafts, two
    candidates for one position); the fastest that pays becomes `compiled_chain`, which calls with compile=True then
    draft (one graph a cycle), token for token the base model's output. A call that names a draft option runs what
    it names; an eager call runs the repo's default."""
    timed = []

    def fake_speedup(model, prompts, tide_config, new_tokens=24, repeats=3, baseline="generate", bar=None):
        timed.append((baseline, dict(tide_config)))
        if baseline == "compiled":  # the chain of one draft and the tree may pay, the chain of two does not
            if tide_config.get("draft_topk", 1) > 1:
                return tree_speed
            return chain_speed if tide_config.get("max_draft") == 1 else 0.9
        return 0.9

    model = _calibrate_timed_by(monkeypatch, fake_speedup, compiled_trials=True)
    cal = model.config.calibration
    compiled = [cfg for baseline, cfg in timed if baseline == "compiled"]
    assert list(dict.fromkeys((c["max_draft"], c["draft_topk"]) for c in compiled)) == [(1, 1), (2, 1), (1, 2)]
    assert [c["chain"]["max_draft"] for c in cal["compiled_chains"]] == [1, 2, 1]
    chain = model.config.generation_config.compiled_chain
    assert (chain is not None) == (max(chain_speed, tree_speed) > 1.02)
    if tree_speed > chain_speed:
        assert chain["draft_topk"] == 2
        out = model.generate(_ids(), tide_config={"compile": True}, compile_config=CompileConfig(backend="eager"),
                             **GREEDY)
        assert torch.equal(out, model.base.generate(_ids(), **GREEDY))
        assert model.last_stats.fused_cycles and model.last_stats.draft_topk == 2
        return
    assert "chains compiled: " in calibration.calibration_table(model.config)
    ids = _ids()
    options = dict(compile_config=CompileConfig(backend="eager"), **GREEDY)
    out = model.generate(ids, tide_config={"compile": True}, **options)
    assert torch.equal(out, model.base.generate(ids, **GREEDY))
    if chain is None:
        assert model.last_stats.mode == "base (compiled)"
        return
    assert chain["max_draft"] == 1 and chain["draft_layer"] in model.checkpoints
    stats = model.last_stats
    assert stats.mode == "lossless" and stats.fused_cycles > 0 and stats.drafted <= stats.fused_cycles  # 1 a cycle
    from tide.decode.plan import plan_call
    assert plan_call(model, {"compile": True, "max_draft": 2}, (ids,), dict(GREEDY)).options.max_draft == 2
    assert plan_call(model, {"compile": True}, (ids,), dict(GREEDY)).options.max_draft == 1
    model.generate(ids, **GREEDY)
    assert model.last_stats.fused_cycles == 0  # eager: the repo's default
    saved = tide.TideConfig.from_dict(model.config.to_dict())
    assert saved.generation_config.compiled_chain == chain


def test_compiled_chain_is_checked():
    with pytest.raises(ValueError, match="compiled_chain must be None or a dict with draft_layer"):
        tide.TideGenerationConfig(compiled_chain={"max_draft": 2})
    with pytest.raises(ValueError, match="max_draft must be an integer"):
        tide.TideGenerationConfig(compiled_chain={"draft_layer": 1, "max_draft": -1})
    model = _model()
    with pytest.raises(ValueError, match="not a checkpoint"):
        model.generate(_ids(), tide_config={"compiled_chain": {"draft_layer": 2}}, **GREEDY)


def test_no_compiled_timing_where_nothing_is_kept(monkeypatch):
    model = _calibrate(monkeypatch, 0.9, 0.95)
    assert model.config.calibration["compiled_timing"] is None


def test_calibration_records_its_phase_times(monkeypatch):
    model = _calibrate(monkeypatch, 1.3, 0.9)
    seconds = model.config.calibration["phase_seconds"]
    assert list(seconds) == ["data", "generation", "training", "held-out scoring", "thresholds", "decode validation",
                             "cost measurement", "timing trials"]
    assert seconds["training"] > 0 and seconds["decode validation"] == 0  # validation_tokens=0: none
    assert "calibration took" in calibration.calibration_table(model.config)


@pytest.mark.parametrize("ngram_speed, kept", [(1.0, True), (0.9, False)])
def test_ngram_drafts_are_kept_unless_they_time_slower_than_the_scheme_alone(monkeypatch, ngram_speed, kept):
    monkeypatch.setattr(trials, "timed", lambda model, prompts, config, baseline="generate", bar=None:
                        ngram_speed if config.get("draft_ngram") else 1.0)
    timing = trials.time_ngram(None, [], {"draft_layer": 0, "max_draft": 2, "draft_topk": 1, "draft_vocab_size": 0,
                                          "measured": 1.0})
    assert timing["active"] == kept and timing["timings"] == [ngram_speed] * (2 if kept else 1)


@pytest.mark.parametrize("ngram_speed", [1.1, 0.98])
def test_where_no_head_scheme_pays_ngram_drafts_alone_are_timed(monkeypatch, ngram_speed):
    from tide.calibration.costs import DraftScheme

    def timed(model, prompts, config, baseline="generate", bar=None):
        return ngram_speed if config.get("head_drafts") is False else 0.95

    monkeypatch.setattr(trials, "timed", timed)
    monkeypatch.setattr(trials, "timing_prompts", lambda *args: [])
    model = type("M", (), {"base": type("B", (), {"device": "cpu"})()})()
    selection = trials.choose_draft(model, None, [], [DraftScheme(0, 1, 1, 1.3)])
    assert selection["ngram_only"]["active"] == (ngram_speed > 1)
    chosen = selection["chosen"]
    if ngram_speed > 1:
        assert chosen["head_drafts"] is False and chosen["draft_ngram"] == trials.NGRAM
        config = tide.TideGenerationConfig(mode="auto", **{k: v for k, v in chosen.items()
                                                          if k not in ("measured", "timings")})
        assert "n-gram drafts only" in tide.hub.card.draft_scheme_text(config.to_dict())
    else:
        assert chosen is None
