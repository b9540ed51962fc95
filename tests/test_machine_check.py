"""Whether the repo's drafting scheme pays on this machine (`tide.decode.machinecheck`): measured once, cached in
Tide's cache folder, and where it does not pay the call runs the base model."""

import json
import logging

import pytest
import torch

from tide.decode import machinecheck
from tiny_models import llama_repo, short_ids

GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
SCHEME = {"draft_layer": 1, "max_draft": 2}


@pytest.fixture(autouse=True)
def cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDE_CACHE", str(tmp_path))
    return tmp_path / "machine"


@pytest.fixture
def measured(monkeypatch):
    """Every measurement counted, and its cost in base steps fixed (`cost[0]`)."""
    calls, cost = [], [1.0]

    def fake(model, scheme, compiled, layout="auto", repeats=machinecheck.REPEATS, compile_config=None):
        calls.append((scheme, compiled))
        return cost[0]

    monkeypatch.setattr(machinecheck, "measure_cycle", fake)
    return calls, cost


def _repo(accepted=0.5, scheme=SCHEME):
    """A tiny repo whose default is lossless mode drafting `scheme`, its calibration record saying its timings
    accepted `accepted` drafts a cycle (None: no figure)."""
    model = llama_repo(thresholds=False, mode="lossless", **scheme)
    chosen = {**scheme, "draft_topk": 1, "measured": 1.1}
    if accepted is not None:
        chosen["accepted_per_cycle"] = accepted
    model.config.calibration = {"draft_selection": {"trials": [chosen], "chosen": chosen}}
    return model


def test_the_check_is_cached_and_reused(measured, cache_folder):
    calls, _ = measured
    model = _repo()
    model.generate(short_ids(), **GREEDY)
    assert model.last_stats.mode == "lossless" and len(calls) == 1
    assert "the chain pays on this machine: a cycle costs 1.00 base steps, 1.50 tokens expected" in \
        model.last_stats.plan
    model.generate(short_ids(), **GREEDY)
    assert len(calls) == 1  # the same process: kept on the model
    files = list(cache_folder.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["cost"]["cycle_steps"] == 1.0
    again = _repo()  # another model object (as in a later process): read from the cache folder
    again.generate(short_ids(), **GREEDY)
    assert len(calls) == 1 and again.last_stats.mode == "lossless"
    other = _repo(scheme={**SCHEME, "max_draft": 3})  # another scheme: measured again
    other.generate(short_ids(), **GREEDY)
    assert len(calls) == 2


def test_a_scheme_that_does_not_pay_runs_the_base_model(measured):
    _, cost = measured
    cost[0] = 1.95
    model = _repo(accepted=0.56)
    out = model.generate(short_ids(), **GREEDY)
    stats = model.last_stats
    assert stats.mode == "base"
    assert stats.plan == "the chain does not pay on this machine: a cycle costs 1.95 base steps, 1.56 tokens expected"
    assert torch.equal(out, model.base.generate(short_ids(), **GREEDY))


def test_a_compiled_chain_that_does_not_pay_runs_the_compiled_base(measured):
    calls, cost = measured
    cost[0] = 3.0
    chain = {"draft_layer": 1, "max_draft": 1, "draft_vocab_size": 0, "draft_ngram": 0}
    model = llama_repo(thresholds=False, compiled_chain=chain)
    model.config.calibration = {"compiled_chains": [{"chain": chain, "measured": 1.1, "active": True,
                                                     "timings": [1.1], "accepted_per_cycle": 0.4}]}
    plan = machinecheck.review(model, _plan(model, {"compile": True}))
    assert (plan.kind, plan.compile, plan.fused_chains) == ("base (compiled)", True, False)
    assert plan.reason.startswith("the chain does not pay on this machine") and calls[-1][1] is True


def test_what_the_check_compiles_counts_in_the_calls_stats(monkeypatch):
    """A compiled call's check compiles the base model's compiled step (`_compiled_step_seconds`); the call's stats
    count that compiling with its own."""
    def compiling_measure(model, scheme, compiled, layout="auto", repeats=machinecheck.REPEATS, compile_config=None):
        torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
        return 3.0

    monkeypatch.setattr(machinecheck, "measure_cycle", compiling_measure)
    chain = {"draft_layer": 1, "max_draft": 1, "draft_vocab_size": 0, "draft_ngram": 0}
    model = llama_repo(thresholds=False, compiled_chain=chain)
    model.config.calibration = {"compiled_chains": [{"chain": chain, "measured": 1.1, "active": True,
                                                     "timings": [1.1], "accepted_per_cycle": 0.4}]}
    plan = machinecheck.review(model, _plan(model, {"compile": True}))
    assert plan.kind == "base (compiled)" and plan.checked_compiling[1] == 1


def test_the_opt_out_and_a_call_that_names_its_scheme_are_not_checked(measured):
    calls, cost = measured
    cost[0] = 5.0
    model = _repo()
    model.generate(short_ids(), **GREEDY, tide_config={"machine_check": False})
    assert model.last_stats.mode == "lossless" and "on this machine" not in model.last_stats.plan
    model.generate(short_ids(), **GREEDY, tide_config={"mode": "lossless"})
    model.generate(short_ids(), **GREEDY, tide_config={"max_draft": 2})
    assert model.last_stats.mode == "lossless" and not calls


def test_a_repo_without_a_recorded_figure_is_not_checked(measured):
    calls, _ = measured
    model = _repo(accepted=None)
    model.generate(short_ids(), **GREEDY)
    assert model.last_stats.mode == "lossless" and not calls


@pytest.mark.parametrize("content", ["{not json", json.dumps({"key": {"format": "other"}, "cost": {"cycle_steps": 9}}),
                                     json.dumps({"cost": {}}), "{}"])
def test_a_stale_or_corrupt_cache_file_is_ignored_with_a_log_line(measured, content, caplog):
    calls, _ = measured
    model = _repo()
    scheme = machinecheck.as_verified(model.config.calibration, machinecheck.Scheme(1, 2))  # (the width it prices)
    path = machinecheck.cache_path(machinecheck._key(model, scheme, False, "auto"))
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="tide.decode.machinecheck"):
        model.generate(short_ids(), **GREEDY)
    assert model.last_stats.mode == "lossless" and len(calls) == 1
    assert "ignoring" in caplog.text and str(path) in caplog.text
    assert json.loads(path.read_text())["cost"]["cycle_steps"] == 1.0  # measured again, and kept


@pytest.mark.real_timing
def test_the_measurement_runs_on_a_tiny_model():
    """Eager and compiled; a compiled measurement times Tide's compiled base step (it compiles it, with the
    lowered products' graphs of the linears) and leaves the model's last stats as they were."""
    from tide.models.compat import CompileWatch

    model = _repo()
    model.generate(short_ids(), **GREEDY)
    before = model.last_stats
    for compiled in (False, True):
        with CompileWatch() as watch:
            cost = machinecheck.measure_cycle(model, machinecheck.Scheme(1, 2), compiled, repeats=1)
        assert 0.5 < cost < 50
        assert (watch.graphs > 0) == compiled and model.last_stats is before


@pytest.mark.real_timing
def test_a_width_between_two_is_priced_between_them(monkeypatch):
    """A chain whose cycles verified 2.5 positions on average costs what cycles of 2 and of 3 cost, averaged (its
    drafts and its verification's rows both in between)."""
    monkeypatch.setattr(machinecheck, "_pass_seconds", lambda linears, rows, plain, options=None: rows * 1e-3)
    monkeypatch.setattr(machinecheck, "_step_seconds", lambda model, repeats: 0.5)
    model = _repo()
    cost = {w: machinecheck.measure_cycle(model, machinecheck.Scheme(1, 2, verified=w), False, repeats=1)
            for w in (2.0, 2.5, 3.0)}
    assert cost[2.0] < cost[2.5] < cost[3.0] and cost[2.5] == pytest.approx((cost[2.0] + cost[3.0]) / 2)


@pytest.mark.real_timing
def test_a_compiled_measurement_compiles_as_the_call_does(monkeypatch):
    """The check measures a compiled call's costs with the call's own `CompileConfig` (another backend: its linears
    as `F.linear`, its base step compiled with that config), and keeps the measurement under that config."""
    from transformers import CompileConfig

    model, eager = _repo(), CompileConfig(backend="eager")
    configs = []
    monkeypatch.setattr(machinecheck, "_compiled_step_seconds",
                        lambda model, repeats, compile_config=None: configs.append(compile_config) or 1e-3)
    monkeypatch.setattr(machinecheck, "_compiled_linears", lambda *args: pytest.fail("inductor's linears compiled"))
    assert machinecheck.measure_cycle(model, machinecheck.Scheme(1, 2), True, repeats=1, compile_config=eager) > 0
    assert configs == [eager]
    scheme = machinecheck.Scheme(1, 2)
    keys = [machinecheck._key(model, scheme, True, "auto", config) for config in (None, eager, CompileConfig())]
    assert keys[0] != keys[1] and keys[0] == keys[2]  # (the defaults, named or not, are one measurement)


def _plan(model, tide_config):
    from tide.decode.plan import plan_call

    return plan_call(model, tide_config, (short_ids(),), dict(GREEDY))


def test_tide_check_prints_the_verdict(measured, monkeypatch, capsys):
    from tide.tools import cli

    _, cost = measured
    cost[0] = 1.95
    model = _repo(accepted=0.56)
    monkeypatch.setattr(cli, "_load", lambda name, dtype="auto": (model, None))
    assert cli.main(["check", "repo"]) == 0
    out = capsys.readouterr().out
    assert "eager: the chain does not pay on this machine: a cycle costs 1.95 base steps, 1.56 tokens expected" in out
    assert "compile=True: the chain does not pay on this machine" in out  # (the default mode, compiled)
    assert cli.main(["check", "repo"]) == 0 and "read from" in capsys.readouterr().out


def _chain_repo(accepted=0.6):
    """A tiny repo whose eager default drafts nothing and whose compiled calls draft a chain, its calibration record
    saying the chain's timings accepted `accepted` drafts a cycle (None: no figure)."""
    chain = {"draft_layer": 1, "max_draft": 2, "draft_vocab_size": 0, "draft_ngram": 0}
    model = llama_repo(thresholds=False, compiled_chain=chain, max_draft=0)
    entry = {"chain": chain, "measured": 1.1, "active": True, "timings": [1.1]}
    if accepted is not None:
        entry["accepted_per_cycle"] = accepted
    model.config.calibration = {"compiled_chains": [entry]}
    return model


@pytest.mark.parametrize("cost, accepted, runs", [(1.0, 0.6, "lossless"), (3.0, 0.6, "base"), (1.0, None, "base")],
                         ids=["pays", "does-not-pay", "no-figure"])
def test_an_eager_call_tries_the_compiled_chain_where_the_eager_default_drafts_nothing(measured, cost, accepted,
                                                                                      runs):
    """An eager call at the defaults of a repo that keeps a compiled chain and no eager scheme runs the chain where
    this machine's eager check finds that it pays, else the base model (a record with no figure too), and says
    why; the tokens are the base model's either way. A call that turns the check off runs the base model."""
    calls, fixed = measured
    fixed[0] = cost
    model = _chain_repo(accepted)
    ids = short_ids()
    out = model.generate(ids, **GREEDY)
    stats = model.last_stats
    assert stats.mode == runs and torch.equal(out, model.base.generate(ids, **GREEDY))
    if accepted is not None:
        assert calls and calls[-1][1] is False  # (weighed eagerly)
        verdict = "pays" if runs == "lossless" else "does not pay"
        assert f"the chain {verdict} on this machine" in stats.plan
    else:
        assert not calls and "holds no drafts accepted a cycle" in stats.plan
    if runs == "lossless":
        assert stats.plan.startswith("an eager call that names no mode drafts the repo's compiled_chain")
        assert stats.verify_passes > 0 and stats.drafted > 0
    model.generate(ids, **GREEDY, tide_config={"machine_check": False})
    assert model.last_stats.mode == "base"


@pytest.mark.parametrize("measured_speedup, mode", [(1.12, "lossless"), (0.97, "base")])
def test_calibration_timed_on_this_machine_decides(measured, measured_speedup, mode):
    """Where the record says its trials ran on this machine (processor and threads: `timing_machine`), the scheme's
    own timing there decides, with nothing measured; a record from another machine is weighed as before."""
    calls, cost = measured
    cost[0] = 1.95  # what the linears' estimate would say: does not pay
    model = _repo(accepted=0.52)
    model.config.calibration["draft_selection"]["chosen"]["measured"] = measured_speedup
    model.config.calibration["timing_machine"] = machinecheck.machine_name(model)
    model.generate(short_ids(), **GREEDY)
    assert model.last_stats.mode == mode and not calls
    verdict = "pays" if mode == "lossless" else "does not pay"
    assert f"the chain {verdict} on this machine: calibration timed it here at x{measured_speedup:.2f}" in \
        model.last_stats.plan
    other = _repo(accepted=0.52)
    other.config.calibration["timing_machine"] = "cpu:another processor:64 threads"
    other.generate(short_ids(), **GREEDY)
    assert other.last_stats.mode == "base" and len(calls) == 1


def test_a_cycle_is_priced_at_the_width_calibration_verified(measured):
    """Where the record says how many positions its timings verified a cycle (`verified_per_cycle`), the check
    prices a cycle at that width (an average: between two) and its drafts, rather than at the widest the scheme can
    verify; where it holds only the drafts accepted a cycle, a chain is priced at the width its cap gives them."""
    calls, _ = measured
    model = _repo()
    model.config.calibration["draft_selection"]["chosen"]["verified_per_cycle"] = 2.4
    model.generate(short_ids(), **GREEDY)
    (scheme, _), = calls
    assert (scheme.width, scheme.drafts) == (2.4, pytest.approx(1.4))
    # no figure: the width the chain's cap gives at the drafts accepted a cycle (accepted + 1 drafts, up to the cap)
    for accepted, width, drafts in ((0.2, 2.2, 1.2), (1.6, 3, 2)):
        priced = machinecheck.as_verified(_repo(accepted=accepted).config.calibration, machinecheck.Scheme(1, 2))
        assert (priced.width, priced.drafts) == (pytest.approx(width), pytest.approx(drafts))
    tree = machinecheck.Scheme(1, 1, draft_topk=3, tree=True)  # a tree: its widest where no width is recorded
    assert machinecheck.as_verified(_repo(accepted=0.2).config.calibration, tree).width == tree.width


@pytest.mark.real_timing
@pytest.mark.parametrize("scheme, widest", [({"max_draft": 2}, 3), ({"max_draft": 1, "draft_topk": 2}, 3)],
                         ids=["chain", "tree"])
def test_the_trials_record_the_positions_a_cycle_verified(scheme, widest):
    """`trials.kept(accepted=True)` records the drafts accepted and the positions verified a cycle of the lossless
    runs it timed: between the last token alone and the scheme's widest cycle."""
    from tide.calibration import trials

    model = llama_repo(thresholds=False)
    timing = trials.kept(model, [short_ids()], {"mode": "lossless", "draft_layer": 1, **scheme}, accepted=True,
                         bar=0.0)
    assert 1.0 < timing["verified_per_cycle"] <= widest
    assert 0.0 <= timing["accepted_per_cycle"] <= timing["verified_per_cycle"] - 1


@pytest.mark.real_timing
def test_ngram_drafts_timed_record_their_own_cycle_counts():
    """A chain timed with n-gram drafts (`trials.time_ngram`) records what its own cycles accepted and verified, which
    the chosen scheme then carries where the n-gram drafts are kept."""
    from tide.calibration import trials

    model = llama_repo(thresholds=False)
    scheme = {"draft_layer": 1, "max_draft": 2, "draft_topk": 1, "draft_vocab_size": 0, "measured": 0.0}
    timing = trials.time_ngram(model, [short_ids()], scheme)
    assert 1.0 < timing["verified_per_cycle"] <= 3
    assert 0.0 <= timing["accepted_per_cycle"] <= timing["verified_per_cycle"] - 1


@pytest.mark.parametrize("timed, here, mode", [(1.30, 1.6, "lossless"), (0.98, 1.3, "base")])
def test_another_machine_scales_the_calibration_timing_by_its_cycle_steps(measured, timed, here, mode):
    """Where the record holds the scheme's timing and what a cycle cost there in base steps (`cycle_steps`), a call
    on another machine expects the timing times the steps there over the steps here; the tokens a cycle emits over
    the steps here would decide the other way in both cases (1.52 / 1.6 does not pay, 1.52 / 1.3 does)."""
    calls, cost = measured
    cost[0] = here
    model = _repo(accepted=0.52)
    chosen = model.config.calibration["draft_selection"]["chosen"]
    chosen.update(measured=timed, cycle_steps=1.2 if timed < 1 else 1.5)
    model.config.calibration["timing_machine"] = "cpu:another processor:64 threads"
    model.generate(short_ids(), **GREEDY)
    assert model.last_stats.mode == mode and len(calls) == 1
    expected = timed * chosen["cycle_steps"] / here
    assert (f"calibration timed it at x{timed:.2f} where a cycle cost {chosen['cycle_steps']:.2f} base steps; it "
            f"costs {here:.2f} here: x{expected:.2f} expected") in model.last_stats.plan


def test_calibration_records_a_cycle_s_steps_beside_its_timing(measured):
    """`record_cycle_steps` measures the default call's scheme as the check would (at the width its timings
    verified) and writes the steps beside that scheme's timing in the record; a record without a timing of the
    scheme is left as it is."""
    calls, cost = measured
    cost[0] = 1.37
    model = _repo()
    model.config.calibration["draft_selection"]["chosen"]["verified_per_cycle"] = 2.4
    record = machinecheck.record_cycle_steps(model)
    assert record is model.config.calibration and record["draft_selection"]["chosen"]["cycle_steps"] == 1.37
    (scheme, compiled), = calls
    assert not compiled and scheme.width == 2.4
    untimed = _repo()
    del untimed.config.calibration["draft_selection"]["chosen"]["measured"]
    machinecheck.record_cycle_steps(untimed)
    assert "cycle_steps" not in untimed.config.calibration["draft_selection"]["chosen"] and len(calls) == 1
