"""`timing_budget_s`: the timing trials stop starting once they have taken the budget; the record, the table and
the card say which were cut. Timings here advance a fake clock by TRIAL_S each, so the cut is deterministic."""

import importlib
import types
import warnings

import pytest
import torch

import tide
from tide.tools.cli import build_parser
from tide.hub.card import draft_scheme_text, model_card
from tiny_models import sample_texts, tiny_model, tiny_tokenizer

calibration = importlib.import_module("tide.calibration.run")
trials = importlib.import_module("tide.calibration.trials")
phases = importlib.import_module("tide.calibration.phases")
TRIAL_S = 10.0


def _calibrate(monkeypatch, budget, threads=None, **options):
    clock = [0.0]
    timed, threads = [], [] if threads is None else threads

    def fake_speedup(model, prompts, tide_config, new_tokens=24, repeats=3, baseline="generate", bar=None):
        clock[0] += TRIAL_S
        timed.append((tide_config["mode"], baseline, tide_config.get("draft_layer"), tide_config.get("max_draft"),
                      tide_config.get("draft_topk")))
        threads.append(torch.get_num_threads())
        return 1.3 if tide_config["mode"] == "exit" else 1.5

    monkeypatch.setattr(trials, "measured_speedup", fake_speedup)
    monkeypatch.setattr(phases, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    torch.manual_seed(0)
    model = tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=sample_texts(24),
                           config=tide.TideConfig(checkpoint_interval=2, target_agreement=0.05), num_samples=24,
                           batch_size=8, max_length=32, head_steps=5, passes=1, validation_tokens=0, draft_trials=3,
                           progress=False, timing_budget_s=budget, **{"compiled_trials": True, **options})
    return model, timed


def test_no_budget_times_everything_and_records_no_budget(monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, timed = _calibrate(monkeypatch, None)
    assert not [w for w in caught if "timing budget" in str(w.message)]
    assert "timing_budget" not in model.config.calibration
    assert len(model.config.calibration["draft_selection"]["trials"]) == 3


def test_trials_run_on_the_decode_threads_and_the_record_says_how_many(monkeypatch):
    """`decode_threads`: costs, the decode check and the trials run on that many threads, training on the process's
    own, restored after; the record names the processor and threads the trials ran on."""
    own = torch.get_num_threads()
    asked = 2 if own == 1 else 1
    threads = []
    model, timed = _calibrate(monkeypatch, None, threads=threads, decode_threads=asked)
    assert timed and set(threads) == {asked} and torch.get_num_threads() == own
    assert model.config.calibration["timing_machine"].endswith(f":{asked} threads")
    with pytest.raises(ValueError, match="decode_threads must be a positive integer"):
        tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=sample_texts(4), decode_threads=0)


def test_a_zero_budget_cuts_every_trial(monkeypatch):
    # the caller hears of it, with the way round
    with pytest.warns(UserWarning, match=r"timing budget \(0 s, timing_budget_s\) cut 5 timing trials: exit mode;.*"
                                         r"timing_budget_s=None"):
        model, timed = _calibrate(monkeypatch, 0.0)
    cal = model.config.calibration
    assert timed == [] and cal["exit_timing"] is None and cal["draft_selection"]["chosen"] is None
    budget = cal["timing_budget"]
    assert budget["seconds"] == 0.0 and budget["spent"] == 0.0
    # exit mode, the 3 drafting schemes, and the default mode (exit mode, kept untimed) compiled
    assert budget["cut"][0] == "exit mode" and budget["cut"][-1] == "the default mode compiled"
    assert len(budget["cut"]) == 5 and all(c.startswith("lossless ") for c in budget["cut"][1:4])
    # untimed exits are kept as selected (as with measure_costs=False), and lossless mode decodes plainly
    assert any(t < 1.0 for t in model.config.thresholds.values()) and model.config.generation_config.max_draft == 0
    assert ("timing trials: budget 0 s, took 0.0 s; cut: exit mode; lossless"
            in calibration.calibration_table(model.config))


def test_trials_run_by_estimate_until_the_budget_is_spent(monkeypatch):
    """Exit mode: 4 timings (again for one sequence, twice on a batch) = 40 s; the best-estimated drafting scheme
    then starts (50 s) and the budget of 45 s is spent: the other schemes are cut, and so is the compiled timing,
    but the timed scheme still gets the second timing that keeping it needs (60 s), and is kept."""
    model, timed = _calibrate(monkeypatch, 45.0)
    cal = model.config.calibration
    assert [t[0] for t in timed] == ["exit"] * 4 + ["lossless"] * 2
    draft = cal["draft_selection"]
    assert len(draft["trials"]) == 1 and draft["chosen"]["measured"] == 1.5
    first = draft["trials"][0]
    assert len(draft["cut"]) == 2 and all(first["estimate"] >= c["estimate"] for c in draft["cut"])  # best first
    assert timed[4][2:] == timed[5][2:] == (first["draft_layer"], first["max_draft"], first["draft_topk"])
    cut = cal["timing_budget"]["cut"]
    assert cut[:2] == [f"lossless {draft_scheme_text(c)} (estimated x{c['estimate']:.3f})" for c in draft["cut"]]
    assert cut[-4:] == ["the default mode compiled", f"a chain of 1 from layer {first['draft_layer']}, compiled",
                        f"a chain of 2 from layer {first['draft_layer']} with n-gram drafts (draft_ngram=3), compiled",
                        f"2 candidates for one position from layer {first['draft_layer']}, compiled"]
    assert cal["timing_budget"]["spent"] == 60.0
    assert cal["exit_timing"]["active"] and cal["compiled_timing"] is None
    assert "Timing trials, capped by `timing_budget_s`: budget 45 s, took 60.0 s; cut: lossless" in \
        model_card(model.config)


def test_a_scheme_starts_only_while_it_and_a_confirmation_fit(monkeypatch):
    """Budget 75 s: exit mode's 4 timings (40 s), the first scheme (50 s); 25 s are left, room for two more timings
    of 10 s, so the second scheme starts (60 s); 15 s are left, not room for two: the third is cut, and the fastest
    gets its second timing (70 s), within the budget. The n-gram timing would not fit either."""
    model, timed = _calibrate(monkeypatch, 75.0, compiled_trials=False)
    cal = model.config.calibration
    draft = cal["draft_selection"]
    assert [t[0] for t in timed] == ["exit"] * 4 + ["lossless"] * 3
    assert len(draft["trials"]) == 2 and len(draft["cut"]) == 1
    assert cal["timing_budget"]["spent"] == 70.0 <= cal["timing_budget"]["seconds"]


class _Clocked:
    """A model on a fake clock: each of the base model's `generate` calls takes 1 s, and the mode's calls take
    `mode_s` in turn (the first is the warm-up's)."""

    def __init__(self, mode_s: list[float]):
        self.now, self.mode_s = 0.0, list(mode_s)
        self.base = types.SimpleNamespace(generate=self._base, generation_config=types.SimpleNamespace(pad_token_id=0))

    def _base(self, ids, **kwargs):
        self.now += 1.0

    def generate(self, ids, tide_config, **kwargs):
        self.now += self.mode_s.pop(0)


@pytest.mark.real_timing
@pytest.mark.parametrize("bar, repeats_run", [(1.02, 4), (None, 5)])
def test_repeats_stop_once_most_are_below_the_bar(monkeypatch, bar, repeats_run):
    """Five repeats: the mode runs 1.25 s where the base model runs 1 s (x0.8) in three of them, so the median of
    five is below the bar whatever the others give; with a bar the timing stops after the third slow repeat."""
    model = _Clocked([1.0, 1.25, 0.5, 1.25, 1.25, 0.5])
    monkeypatch.setattr(trials, "seconds_of", lambda fn: (start := model.now, fn(), model.now - start)[-1])
    prompts = [torch.zeros(1, 4, dtype=torch.long)]
    assert trials.measured_speedup(model, prompts, {"mode": "lossless"}, repeats=5, bar=bar) == 0.8
    assert len(model.mode_s) == 5 - repeats_run


def test_the_auto_budget_is_a_third_of_the_other_phases_at_least_its_floor(monkeypatch):
    """The other phases take no time on the fake clock: the budget is the floor (30 s), spent after exit mode's 4
    timings (40 s); every drafting scheme is cut."""
    model, timed = _calibrate(monkeypatch, "auto")
    budget = model.config.calibration["timing_budget"]
    assert budget["seconds"] == phases.AUTO_TRIAL_FLOOR_S == 30.0 and budget["spent"] == 40.0
    assert [t[0] for t in timed] == ["exit"] * 4 and budget["cut"][-1] == "the default mode compiled"
    assert calibration.CalibrationOptions().timing_budget_s == "auto"


def test_the_cli_passes_the_budget():
    args = build_parser().parse_args(["calibrate", "m", "--dataset", "d", "--out", "o", "--timing-budget-s", "30"])
    assert args.timing_budget_s == 30.0
    args = build_parser().parse_args(["calibrate", "m", "--dataset", "d", "--out", "o"])
    assert args.timing_budget_s == "auto" and not args.compiled_trials and args.decode_threads is None
    assert build_parser().parse_args(["calibrate", "m", "--dataset", "d", "--out", "o", "--decode-threads",
                                      "1"]).decode_threads == 1
    args = build_parser().parse_args(["calibrate", "m", "--dataset", "d", "--out", "o", "--timing-budget-s", "none",
                                      "--compiled-trials"])
    assert args.timing_budget_s is None and args.compiled_trials
    with pytest.raises(SystemExit):
        build_parser().parse_args(["calibrate", "m", "--dataset", "d", "--out", "o", "--timing-budget-s", "-1"])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "10", True])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(ValueError, match="timing_budget_s"):
        calibration.CalibrationOptions(timing_budget_s=bad)
