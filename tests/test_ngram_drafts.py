"""n-gram drafts (`draft_ngram`): continuations of the latest n-gram where it occurred before, verified as
lossless mode verifies any draft: greedy output token for token the base model's, sampling its distribution."""

from collections import Counter

import pytest
import torch

from generation_helpers import chi_square, chi_square_limit
from test_lossless import _exact_joint
from tide.decode.lossless.ngram import NgramLookup
from tiny_models import noisy_tide

REPEATS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6]])


def test_lookup_reads_only_new_tokens_and_prefers_the_longest_match():
    lookup = NgramLookup(3)
    lookup.update(torch.tensor([[1, 2, 3, 4, 5, 1, 2]]))
    assert lookup.continuation(3) == [3, 4, 5]  # "1 2" occurred at the start
    lookup.update(torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3]]))
    assert len(lookup.tokens) == 8 and lookup.continuation(2) == [4, 5]
    lookup.update(torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 9]]))
    assert lookup.continuation(3) == []  # "3 9" never occurred before
    longest = NgramLookup(3)
    longest.update(torch.tensor([[7, 1, 2, 8, 0, 1, 2, 9, 7, 1, 2]]))
    assert longest.continuation(1) == [8]  # "7 1 2" beats the later "1 2"


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
@pytest.mark.parametrize("scheme", [{"max_draft": 3}, {"max_draft": 3, "draft_topk": 3}])
def test_greedy_ngram_drafts_equal_the_base_model(family, scheme):
    model, base = noisy_tide(family)
    ref = base.generate(REPEATS, do_sample=False, max_new_tokens=20)
    out = model.generate(REPEATS, do_sample=False, max_new_tokens=20,
                         tide_config={"mode": "lossless", "draft_ngram": 3, **scheme})
    assert torch.equal(out, ref)
    stats = model.last_stats
    assert stats.ngram_drafted > 0 and 0 <= stats.ngram_accepted <= stats.ngram_drafted
    assert "n-gram drafts" in stats.summary()
    assert stats.decode_tokens == 20 == stats.accepted + stats.verify_passes  # accepted + one, per cycle
    if "draft_topk" in scheme:  # the continuation and the head's candidates verified as one tree
        assert stats.merged_cycles > 0 and stats.draft_topk == 3 and "merged trees" in stats.summary()
    else:
        assert stats.merged_cycles == 0


def test_ngram_drafts_stop_where_the_base_model_stops():
    model, base = noisy_tide()
    stop = int(base.generate(REPEATS, do_sample=False, max_new_tokens=4)[0, -1])
    options = dict(do_sample=False, max_new_tokens=20, eos_token_id=stop)
    ref = base.generate(REPEATS, **options)
    out = model.generate(REPEATS, tide_config={"mode": "lossless", "draft_ngram": 2, "max_draft": 4}, **options)
    assert torch.equal(out, ref)


def test_ngram_sampling_matches_the_closed_form_distribution():
    """Sampling with n-gram drafts: a chi-square test against the exact joint distribution of three tokens."""
    model, base = noisy_tide()
    ids = torch.tensor([[5, 6, 7, 5, 6]])
    steps, top_k, temperature, runs = 3, 3, 2.0, 600
    exact = _exact_joint(base, ids, steps, top_k, temperature)
    counts, drafted = Counter(), 0
    for seed in range(runs):
        torch.manual_seed(seed)
        out = model.generate(ids, do_sample=True, top_k=top_k, temperature=temperature, max_new_tokens=steps,
                             tide_config={"mode": "lossless", "draft_ngram": 2, "max_draft": 2})
        counts[tuple(out[0, -steps:].tolist())] += 1
        drafted += model.last_stats.ngram_drafted
    assert drafted > runs / 2  # "5 6" occurred before: its continuation "7" was drafted
    assert set(counts) <= set(exact)
    chi2, df = chi_square(counts, exact, runs)
    assert chi2 < chi_square_limit(df), (chi2, df, counts.most_common(6))


def test_draft_ngram_is_range_checked():
    model, _ = noisy_tide()
    with pytest.raises(ValueError, match="draft_ngram"):
        model.generate(REPEATS, max_new_tokens=2, tide_config={"mode": "lossless", "draft_ngram": 99})


@pytest.mark.parametrize("do_sample", [False, True])
def test_ngram_drafts_alone_run_plain_steps_where_nothing_matches(do_sample):
    """head_drafts=False: n-gram continuations are the only drafts; a cycle without one is a plain step."""
    model, base = noisy_tide()
    options = dict(do_sample=do_sample, max_new_tokens=20, top_k=4)
    torch.manual_seed(0)
    ref = base.generate(REPEATS, **options)
    torch.manual_seed(0)
    out = model.generate(REPEATS, tide_config={"mode": "lossless", "draft_ngram": 3, "max_draft": 4,
                                               "head_drafts": False}, **options)
    stats = model.last_stats
    assert stats.drafted == stats.ngram_drafted > 0 and stats.decode_tokens == 20
    if not do_sample:
        assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="draft_ngram"):
        model.generate(REPEATS, max_new_tokens=2, tide_config={"mode": "lossless", "head_drafts": False})
