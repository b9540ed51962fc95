"""The support matrix: every causal-LM model type in transformers is either checked end to end on a tiny
random-init model or refused at `from_base` with a clear reason; none crashes during generate."""

import functools

import pytest

from tide.tools.support_matrix import CHECKS, check_model_type, model_types


@functools.cache
def _result(model_type):
    return check_model_type(model_type)


@pytest.mark.parametrize("model_type", model_types())
def test_model_type_is_supported_or_clearly_refused(model_type):
    result = _result(model_type)
    assert result.status != "fails", f"{model_type}: {result.reason}"
    if result.status == "full":
        assert result.checks == {check: "pass" for check in CHECKS}
    if result.status == "refused":
        assert "Tide" in result.reason and len(result.reason) > 40, result.reason


def test_at_least_sixty_model_types_pass_every_check():
    full = [t for t in model_types() if _result(t).status == "full"]
    assert len(full) >= 60, f"only {len(full)} model types pass all four checks: {full}"


def test_at_least_ninety_model_types_skip_everything_but_the_kv():
    """`forced_exit` includes the stronger check: in decode steps a skipped layer computes only the linear outputs
    that reach its K/V (no query projection, only the K/V rows of a fused qkv projection), counted with hooks."""
    full = [t for t in model_types() if _result(t).status == "full"]
    assert len(full) >= 90, f"only {len(full)} model types pass the stronger forced-exit check: {full}"


def test_families_in_the_table_are_fully_supported():
    from tide import supported_model_types

    partial = {t: _result(t).reason for t in supported_model_types() if _result(t).status != "full"}
    assert not partial, partial
