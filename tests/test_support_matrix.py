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


def test_every_falcon_configuration_transformers_builds_has_a_full_row():
    """Falcon's switches (layout, multi-query, parallel blocks, norms, alibi; eager or SDPA attention) take other
    code paths in its modeling file: each combination that builds and runs has a row, and every row passes all
    four checks, exit and lossless mode alike."""
    import itertools

    import torch

    from tide.models.tiny import VARIANTS, tiny_model

    def path(config, attention):  # what selects a code path in modeling_falcon.py
        new = config.new_decoder_architecture
        return (new, None if new else config.multi_query, config.parallel_attn,
                config.num_ln_in_parallel_attn if new else None, config.alibi, attention)

    rows = {path(tiny_model(name).config, VARIANTS[name][1]["attn_implementation"]) for name in VARIANTS
            if VARIANTS[name][0] == "falcon"} | {path(tiny_model("falcon").config, "eager")}
    for new, mq, parallel, norms, alibi, attention in itertools.product(
            (False, True), (False, True), (False, True), (1, 2), (False, True), ("eager", "sdpa")):
        values = dict(new_decoder_architecture=new, multi_query=mq, parallel_attn=parallel,
                      num_ln_in_parallel_attn=norms, alibi=alibi)
        if not (new or mq):
            values["num_kv_heads"] = 4  # per-head fused qkv: as many K/V heads as query heads
        try:
            model = tiny_model("falcon", attn_implementation=attention, **values)
            model(torch.tensor([[5, 6, 7]]))
        except (AttributeError, NameError, RuntimeError):
            continue  # the new layout needs parallel blocks (`ln_attn`, the MLP norm)
        assert path(model.config, attention) in rows, values
    falcon = [t for t in model_types() if t.split("[")[0] == "falcon"]
    assert len(falcon) == len(rows) and all(_result(t).status == "full" for t in falcon), \
        {t: _result(t).reason for t in falcon if _result(t).status != "full"}
