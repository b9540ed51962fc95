"""Logits processors, stopping criteria and the sampling test's statistic, shared by the generation tests."""

import torch
from transformers import LogitsProcessor, StoppingCriteria


class BanToken(LogitsProcessor):
    def __init__(self, token):
        self.token, self.calls = token, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        scores[:, self.token] = -float("inf")
        return scores


class StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


class BoostInPlace(LogitsProcessor):
    """Adds `amount` to one token's score, in place (applying it twice to the same logits would differ)."""

    def __init__(self, token, amount):
        self.token, self.amount = token, amount

    def __call__(self, input_ids, scores):
        scores[:, self.token] += self.amount
        return scores


def exits_by_sign(layer_dims: dict):
    """A replacement for `TideForCausalLM.exit_tests` that decides from the state itself (so a row decides the same
    alone or in a batch, on any cache): at checkpoint k, exit when hidden[:, layer_dims[k]] > 0."""
    def make(layer):
        def test(hidden):
            exits = hidden[:, layer_dims[layer]] > 0
            return exits.float(), exits, hidden
        return test
    return lambda thresholds: {k: make(k) for k in thresholds if k in layer_dims}


class MarkDecodeSteps(LogitsProcessor):
    """Appends True to `box` at every decode step: generate calls processors once per new token, the first right
    after prefill (so a hook can tell prefill from decoding by whether `box` is empty)."""

    def __init__(self, box: list):
        self.box = box

    def __call__(self, input_ids, scores):
        self.box.append(True)
        return scores


def chi_square(counts, exact: dict, runs: int) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom for `runs` draws counted in `counts` against the `exact`
    probabilities; cells expected fewer than 5 times are pooled into one (dropped if it too is under 5)."""
    cells = [(counts[k], p * runs) for k, p in exact.items() if p * runs >= 5]
    rest_obs, rest_exp = runs - sum(o for o, _ in cells), runs - sum(e for _, e in cells)
    if rest_exp >= 5:
        cells.append((rest_obs, rest_exp))
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def chi_square_limit(df: int) -> float:
    """Well above the statistic's 99.9% quantile at `df` degrees of freedom (a 0.1% false alarm at most)."""
    return df + 3.09 * (2 * df) ** 0.5 + 6


def count_fused_work(monkeypatch, owner=None, method: str = "cycle") -> tuple[list, list]:
    """([compiled-function launches], [device reads: tolist, item, bool, int, index, float] outside them) counted
    while `owner.method` runs (default `lossless.graph.GraphCycles.cycle`: a cycle), from now until `monkeypatch` undoes
    it."""
    from tide.decode.lossless import graph as fused
    from tide.layers.spans import SpanRunner

    owner = owner or fused.GraphCycles
    launches, reads, counting = [0], [0], [False]
    original_function = SpanRunner._function

    def counted_function(self, function, key, name, lean=False):
        compiled = original_function(self, function, key, name, lean)

        def call(*args, **kwargs):  # (reads inside a compiled call are its own: `torch.cond` run eagerly reads its
            launches[0] += counting[0]  # predicate, as inductor's CPU code does)
            before = counting[0]
            counting[0] = False
            try:
                return compiled(*args, **kwargs)
            finally:
                counting[0] = before
        return call

    monkeypatch.setattr(SpanRunner, "_function", counted_function)
    for reader in ("tolist", "item", "__bool__", "__int__", "__index__", "__float__"):
        original = getattr(torch.Tensor, reader)

        def read(self, *args, _original=original, **kwargs):
            reads[0] += counting[0]
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, reader, read)
    counted = getattr(owner, method)

    def counted_call(self, *args, **kwargs):
        counting[0] = True
        try:
            return counted(self, *args, **kwargs)
        finally:
            counting[0] = False

    monkeypatch.setattr(owner, method, counted_call)
    return launches, reads
