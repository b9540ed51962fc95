import math

import pytest
import torch

from tide.calibration.thresholds import auc, binomial_upper_bound, calibrate_cascade, select_threshold


def test_clopper_pearson_zero_errors_closed_form():
    # With no errors the one-sided bound solves (1 - p)^n = alpha.
    assert math.isclose(binomial_upper_bound(0, 100, 0.95), 1 - 0.05 ** (1 / 100), rel_tol=1e-6)
    assert binomial_upper_bound(0, 0, 0.95) == 1.0
    assert binomial_upper_bound(5, 100, 0.95) > 0.05


def test_select_threshold_keeps_exits_clean():
    torch.manual_seed(0)
    scores = torch.rand(5000)
    agree = scores > 0.5  # tokens with high scores always agree
    t = select_threshold(scores, agree, max_error=0.01, confidence=0.95)
    assert 0.45 < t < 0.6
    assert agree[scores > t].float().mean() >= 0.99


def test_no_safe_threshold_means_never_exit():
    scores = torch.rand(200)
    assert select_threshold(scores, torch.zeros(200, dtype=torch.bool), 0.01, 0.95) == 1.0


def test_cascade_removes_earlier_exits():
    torch.manual_seed(0)
    n = 4000
    scores = {1: torch.rand(n), 3: torch.rand(n)}
    agree = {1: scores[1] > 0.7, 3: torch.ones(n, dtype=torch.bool)}
    out = calibrate_cascade([1, 3], scores, agree, agree, 0.99, 0.95).checkpoints
    assert out[0].exits + out[1].exits <= n
    assert out[1].exits == int(((scores[1] <= out[0].threshold) & (scores[3] > out[1].threshold)).sum())
    assert sum(r.errors for r in out) / n <= 0.01


def test_cascade_guarantees_overall_agreement_not_per_exit():
    """The bound is on all tokens: exits may disagree more than 1 - target as long as the total stays within it."""
    torch.manual_seed(0)
    n = 20000
    scores = {2: torch.rand(n)}
    agree = {2: torch.rand(n) < 0.2 + 0.8 * scores[2]}  # higher scores agree more often
    selection = calibrate_cascade([2], scores, agree, agree, 0.95, 0.95)
    row = selection.checkpoints[0]
    assert row.exits > 0 and row.errors / row.exits > 0.05  # per exit: worse than 0.95
    assert 1 - row.errors / n >= 0.95 and selection.agreement_bound >= 0.95


def test_unreachable_target_never_exits():
    scores = {1: torch.rand(500)}
    agree = {1: torch.zeros(500, dtype=torch.bool)}
    for target in (0.99, 1.0):
        selection = calibrate_cascade([1], scores, agree, agree, target, 0.95)
        assert selection.checkpoints[0].threshold == 1.0 and selection.checkpoints[0].exits == 0
    assert calibrate_cascade([1], scores, agree, agree, 1.0, 0.95).exit_error_budget == 0.0


def test_auc():
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8])
    assert auc(scores, torch.tensor([False, False, True, True])) == 0.75
    assert auc(torch.ones(4), torch.tensor([False, True, False, True])) == 0.5
    assert auc(scores, torch.zeros(4, dtype=torch.bool)) is None


def test_the_decode_check_jumps_to_the_budget_its_errors_point_at():
    from tide.calibration.run import allowed_errors, next_budget
    from tide.calibration.thresholds import EXIT_ERROR_BUDGETS, binomial_upper_bound

    allowed = allowed_errors(1024, 0.99, 0.95)
    assert 1.0 - binomial_upper_bound(allowed, 1024, 0.95) >= 0.99 > 1.0 - binomial_upper_bound(allowed + 1, 1024, 0.95)
    assert allowed_errors(10, 0.99, 0.95) == -1  # ten tokens cannot show 0.99 at 95%
    budget = EXIT_ERROR_BUDGETS[12]
    smaller = [b for b in EXIT_ERROR_BUDGETS if b < budget]
    assert next_budget(smaller, budget, 5, 4) == smaller[-1]  # a few errors too many: one step of 1.25 down
    assert next_budget(smaller, budget, 16, 4) <= budget / 2  # four times the errors: half the budget
    assert next_budget(smaller, budget, 16, 4) > budget / 2 / 1.25  # and no further
    assert next_budget(smaller, budget, 10**6, allowed) == smaller[0]  # never below the smallest budget
    assert next_budget(smaller, budget, 5, -1) == smaller[0]


def test_the_decode_check_stops_after_its_rounds_and_then_exits_nothing(monkeypatch):
    """A model whose exits never reach the target through the decode step: the check decodes at most
    MAX_VALIDATION_ROUNDS times (each round decodes every validation token again), then selects no exits."""
    from types import SimpleNamespace

    from tide.calibration import validation
    from tide.calibration.distributed import Processes
    from tide.calibration.thresholds import EXIT_ERROR_BUDGETS

    decoded, asked = [], []

    class Held:
        confidence = 0.95
        speedup = decoded = None  # (no costs measured)

        def step_speedup(self, selection, mean_layers=None):
            return self.speedup if mean_layers is None else self.decoded

        def thresholds(self, selection, checkpoints):
            return {"1": 0.5 if selection.exit_error_budget else 1.0}

        def select(self, target, max_budget=1.0):
            asked.append(max_budget)
            fitting = [b for b in EXIT_ERROR_BUDGETS if b <= max_budget]
            budget = fitting[-1] if fitting else 0.0
            return SimpleNamespace(exit_error_budget=budget, checkpoints=[SimpleNamespace(
                layer=1, threshold=0.5 if budget else 1.0)]), {}

    def teacher_forced(model, token_lists, config, stop_after_errors=None):
        decoded.append(config.thresholds)
        return SimpleNamespace(agreement=0.5, tokens=1000, mean_layers=1.0, stopped=False)

    monkeypatch.setattr(validation, "teacher_forced", teacher_forced)
    model = SimpleNamespace(heldout_selection=Held(), checkpoints=[1], config=SimpleNamespace(
        resolve_generation=lambda options: SimpleNamespace(thresholds=options["thresholds"])))
    start = SimpleNamespace(exit_error_budget=EXIT_ERROR_BUDGETS[-1],
                            checkpoints=[SimpleNamespace(layer=1, threshold=0.5)])
    selection, _, result = validation.validate(model, [list(range(1002))], start, {}, 0.99, Processes())
    assert len(decoded) == validation.MAX_VALIDATION_ROUNDS and asked[-1] == 0.0
    assert selection.exit_error_budget == 0.0 and result["agreement"] == 0.5
    # exits whose layer work would save less than the trials' keep margin are neither decoded nor timed
    from tide.calibration.trials import KEEP_SPEEDUP

    decoded.clear()
    model.heldout_selection.speedup = KEEP_SPEEDUP - 0.01
    selection, dropped, result = validation.validate(model, [list(range(1002))], start, {}, 0.99, Processes())
    assert decoded == [] and result is None and selection.exit_error_budget == 0.0
    assert isinstance(dropped[1], validation.SavesTooLittle) and "by the held-out scores" in dropped[1]
    # nor decoded again once a round's exits saved too little through the decode step (a lower budget exits less)
    decoded.clear()
    model.heldout_selection.speedup, model.heldout_selection.decoded = None, KEEP_SPEEDUP - 0.01
    selection, dropped, result = validation.validate(model, [list(range(1002))], start, {}, 0.99, Processes())
    assert len(decoded) == 1 and result["tokens"] == 1000 and selection.exit_error_budget == 0.0
    assert isinstance(dropped[1], validation.SavesTooLittle) and "by the tokens decoded" in dropped[1]
    # a round that holds the target, of exits that would still save too little, is not timed either
    monkeypatch.setattr(validation, "teacher_forced", lambda model, token_lists, config, stop_after_errors=None:
                        decoded.append(config.thresholds) or SimpleNamespace(agreement=1.0, tokens=1000,
                                                                             mean_layers=1.0, stopped=False))
    for speedup, exits in ((KEEP_SPEEDUP - 0.01, False), (KEEP_SPEEDUP + 0.01, True)):
        decoded.clear()
        model.heldout_selection.decoded = speedup
        selection, dropped, result = validation.validate(model, [list(range(1002))], start, {}, 0.99, Processes())
        assert len(decoded) == 1 and result["agreement"] == 1.0 and (selection.exit_error_budget > 0.0) == exits
        assert isinstance(dropped.get(1), validation.SavesTooLittle) != exits


def test_a_decode_steps_speedup_counts_what_every_step_pays():
    """`step_speedup`: the exits' layer work beside the head, the capture and `generate`'s own work, which a step
    pays whether or not a token exits; decoded, each token also pays its skipped layers' K/V and the checkpoints
    consulted."""
    from types import SimpleNamespace

    from tide.calibration.measure import StepCosts
    from tide.calibration.operating import _HeldoutSelection

    costs = StepCosts(layer_s=1.0, checkpoint_s=0.2, skipped_layer_s=0.1, head_s=6.0, capture_s=0.5, device="cpu",
                      step_extra_s=1.5)
    held = _HeldoutSelection([1], {}, {}, {}, 100, 30, 0.95, costs)
    selection = SimpleNamespace(checkpoints=[SimpleNamespace(layer=11, threshold=0.9),
                                             SimpleNamespace(layer=23, threshold=1.0)])
    cost = 27.0 + 3 * 0.1 + 1 * 0.2  # one consulted checkpoint
    assert held.step_speedup(selection, mean_layers=27.0) == pytest.approx((30 + 8.0) / (cost + 8.0))
    assert _HeldoutSelection([1], {}, {}, {}, 100, 30, 0.95, None).step_speedup(selection, 27.0) is None


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2"])
def test_teacher_forced_texts_side_by_side_equal_one_at_a_time(family):
    """Texts of different lengths decoded as one batch (each leaving it at its end) give the counts, layers and
    perplexities of decoding them one at a time, with exits at every threshold kind."""
    import tide
    from tide.calibration.evaluate import teacher_forced
    from tiny_models import prompt_ids, tiny_model

    model = tide.TideForCausalLM.from_base(tiny_model(family), tide.TideConfig(checkpoint_interval=2))
    texts = [prompt_ids(n, seed=s)[0].tolist() for s, n in enumerate([40, 12, 33, 40, 7, 25])]
    for threshold in (0.0, 0.5, 1.0):
        run = {"mode": "exit", "thresholds": {str(k): threshold for k in model.checkpoints}}
        together, alone = teacher_forced(model, texts, run), teacher_forced(model, texts, run, rows=1)
        assert together.tokens == alone.tokens == sum(len(t) - 2 for t in texts)
        assert together.agreement == alone.agreement and together.mean_layers == alone.mean_layers
        assert together.ppl_tide == pytest.approx(alone.ppl_tide) and together.ppl_base == pytest.approx(alone.ppl_base)


def test_a_decode_check_round_stops_once_it_cannot_pass():
    """Exits that always leave at a shallow layer of a random model disagree often: a round stops decoding at the
    disagreement that makes the target unreachable for the whole round, and its record says so; unstopped, the same
    call decodes every token."""
    from types import SimpleNamespace

    import tide
    from tide.calibration.distributed import Processes
    from tide.calibration.evaluate import teacher_forced
    from tide.calibration.thresholds import allowed_errors
    from tide.calibration.validation import validate
    from tiny_models import prompt_ids, tiny_model

    model = tide.TideForCausalLM.from_base(tiny_model("llama"), tide.TideConfig(checkpoint_interval=2))
    texts = [prompt_ids(40, seed=s)[0].tolist() for s in range(4)]
    every = {"mode": "exit", "thresholds": {str(k): 0.0 for k in model.checkpoints}}
    whole = teacher_forced(model, texts, every)
    assert whole.tokens == 4 * 38 and not whole.stopped and whole.agreement < 0.9
    stopped = teacher_forced(model, texts, every, stop_after_errors=3)
    assert stopped.stopped and stopped.tokens < whole.tokens
    # the step with the disagreement past the three allowed is the last (its 4 rows decode together)
    assert 4 <= round(stopped.tokens * (1 - stopped.agreement)) <= 3 + len(texts)
    one_by_one = teacher_forced(model, texts, every, stop_after_errors=3, rows=1)
    assert round(one_by_one.tokens * (1 - one_by_one.agreement)) == 4

    class Held:
        confidence = 0.95
        decoded_per_rank = None

        def step_speedup(self, selection, mean_layers=None):
            return None

        def thresholds(self, selection, checkpoints):
            return {str(k): 0.0 if selection.exit_error_budget else 1.0 for k in checkpoints}

        def select(self, target, max_budget=1.0):
            return SimpleNamespace(exit_error_budget=min(max_budget, 0.1)), {}

    model.heldout_selection = Held()
    selection, _, result = validate(model, texts, SimpleNamespace(exit_error_budget=0.1), {}, 0.9, Processes())
    assert selection.exit_error_budget == 0.0  # nothing exits
    assert result["stopped_early"] and result["tokens"] < 4 * 38
    assert round(result["tokens"] * (1 - result["agreement"])) == allowed_errors(4 * 38, 0.9, 0.95) + 1
