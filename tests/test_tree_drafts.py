"""Lossless tree drafts (`draft_topk` > 1): output identical to the base model's, the cache compacted to exactly
what the base model holds, and a candidate that is not the exit head's top-1 really accepted."""

import pytest
import torch
import transformers
from transformers import LogitsProcessorList

from generation_helpers import BoostInPlace, chi_square, chi_square_limit
from tiny_models import FAMILIES, noisy_tide, prompt_ids
from tide.config import MAX_DRAFT_TOPK
from tide.layers.calltransforms import tree_mask_calls


def _wrap(family="llama"):
    return noisy_tide(family, heads=("translator", "draft"))  # exit and draft heads right only sometimes


def _tree(layer=1, topk=3):
    return {"mode": "lossless", "draft_layer": layer, "draft_topk": topk}


@pytest.mark.parametrize("draft_layer, topk", [(1, 2), (1, 4), (3, 3)])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_token_identical(family, draft_layer, topk):
    model, base = _wrap(family)
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=16)
    out = model.generate(ids, do_sample=False, max_new_tokens=16, tide_config=_tree(draft_layer, topk))
    assert torch.equal(out, ref)
    stats = model.last_stats
    assert stats.decode_tokens == 16
    tree = model.parts.spec.tree_drafts and family not in ("mistral", "qwen2", "gemma2", "gemma3_text")
    assert stats.draft_topk == (topk if tree else 1)  # sliding-window caches and alibi draft chains
    if tree:  # each tree cycle: x through layers 0..E, then the candidates' shallow and everyone's deep layers
        assert stats.layer_passes == stats.verify_passes * model.parts.num_layers + stats.drafted * (draft_layer + 1)


# Static caches that lossless mode cannot use: sliding windows drop evicted positions (mode='lossless' refuses), and
# this Falcon (alibi) does not decode on a static cache in transformers itself.
NO_STATIC_LOSSLESS = {"falcon", "gemma2", "gemma3_text", "mistral", "qwen2"}


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - NO_STATIC_LOSSLESS))
def test_compiled_trees_are_token_identical(family):
    """Compiled on a static cache, trees are verified by the backbone's own compiled forward with the tree as a 4-D
    mask (where the family takes one: full attention, positions in position_ids); token for token the base model,
    n-gram branches included."""
    from transformers import CompileConfig

    model, base = _wrap(family)
    ids = torch.cat([prompt_ids(), prompt_ids()], 1)  # a prompt that repeats itself: n-gram branches
    ref = base.generate(ids, do_sample=False, max_new_tokens=16)
    out = model.generate(ids, do_sample=False, max_new_tokens=16, compile_config=CompileConfig(backend="eager"),
                         tide_config={**_tree(1, 3), "draft_ngram": 3, "compile": True})
    assert torch.equal(out, ref)
    stats = model.last_stats
    # (greedy: one graph a cycle where the backbone fits a view, `decode/lossless/graphtree.py`; else the compiled
    # spans)
    assert stats.decode_tokens == 16 and (stats.tree_cycles + stats.fused_cycles > 0) == model.parts.spec.tree_drafts


def test_compiled_trees_serve_padding_stops_processors_and_sampling():
    """The backbone's compiled tree verification with a left-padded prompt (the mask's zeros reach the tree mask),
    an end-of-sequence token mid-way, a logits processor, returned scores, and sampling."""
    from transformers import CompileConfig

    model, base = _wrap()
    run = dict(compile_config=CompileConfig(backend="eager"),
               tide_config={**_tree(1, 3), "draft_ngram": 3, "compile": True})
    ids = torch.cat([prompt_ids(), prompt_ids()], 1)
    padded = torch.cat([torch.ones(1, 3, dtype=ids.dtype), ids], 1)  # three pad tokens on the left
    mask = (torch.arange(padded.shape[1]) >= 3).long()[None]
    assert torch.equal(model.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=20, **run),
                       base.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=20))
    assert model.last_stats.tree_cycles > 0
    eos = int(base.generate(ids, do_sample=False, max_new_tokens=12, repetition_penalty=1.3)[0, -1])
    options = dict(do_sample=False, max_new_tokens=20, eos_token_id=eos, repetition_penalty=1.3,
                   output_scores=True, return_dict_in_generate=True)
    out, ref = model.generate(ids, **options, **run), base.generate(ids, **options)
    assert ref.sequences.shape[1] < ids.shape[1] + 20  # it stopped at the end-of-sequence token
    assert torch.equal(out.sequences, ref.sequences) and len(out.scores) == len(ref.scores)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(out.scores, ref.scores))
    torch.manual_seed(0)  # (a repetition penalty keeps a sampled tree off the one-graph cycle, `lossless/graphtree.py`)
    out = model.generate(ids, do_sample=True, max_new_tokens=16, min_new_tokens=16, repetition_penalty=1.2, **run)
    assert out.shape[1] == ids.shape[1] + 16 and model.last_stats.tree_cycles > 0


class _RankedOracle:
    """A draft head that ranks the base model's true next token `rank`-th (0 = top-1), knowing the reference;
    installed as `model.draft_logits`."""

    def __init__(self, reference: torch.Tensor, start: int, vocab: int, rank: int, step: int = 2):
        self.reference, self.position, self.vocab, self.rank, self.step = reference[0], start, vocab, rank, step

    def __call__(self, layer, hidden, context, vocab_size=0):
        true = int(self.reference[min(self.position, self.reference.shape[0] - 1)])
        logits = torch.zeros(hidden.shape[0], self.vocab)
        for r in range(self.rank):
            logits[:, (true + 1 + r) % self.vocab] = 3.0 + r
        logits[:, true] = 2.0
        self.position += self.step  # tokens each cycle emits: 2 when a candidate is accepted
        return logits, hidden


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
def test_a_candidate_below_the_top_is_accepted(family):
    model, base = _wrap(family)
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=15)
    model.draft_logits = _RankedOracle(ref, ids.shape[1], base.config.vocab_size, rank=2)
    out = model.generate(ids, do_sample=False, max_new_tokens=15, tide_config=_tree(1, 3))
    assert torch.equal(out, ref)
    stats = model.last_stats
    assert stats.accepted == stats.drafted == 7 and stats.verify_passes == 8  # 7 cycles of 2 tokens, then 1
    assert stats.tree_cycles == 7 == stats.later_children_accepted  # the third candidate, each time


def test_a_tree_too_narrow_for_the_true_token_accepts_nothing():
    model, base = _wrap()
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=8)
    model.draft_logits = _RankedOracle(ref, ids.shape[1], base.config.vocab_size, rank=2, step=1)
    out = model.generate(ids, do_sample=False, max_new_tokens=8, tide_config=_tree(1, 2))
    assert torch.equal(out, ref) and model.last_stats.accepted == 0


def _assert_same_kv(mine, theirs, length: int) -> None:
    """Every layer of cache `mine` holds the K/V of cache `theirs` at positions 0..length-1."""
    for layer_mine, layer_theirs in zip(mine.layers, theirs.layers, strict=True):
        for name in ("keys", "values"):
            ours, reference = getattr(layer_mine, name), getattr(layer_theirs, name)
            torch.testing.assert_close(ours[..., :length, :], reference[..., :length, :], atol=1e-5, rtol=1e-4)


def _stop_at(base, model, ids, at: int):
    """(eos, the base model's greedy output): the base model's greedy token `at` positions after the prompt made the
    end-of-sequence token of both models, and what the base model then generates (12 tokens at most)."""
    eos = int(base.generate(ids, do_sample=False, max_new_tokens=12)[0, ids.shape[1] + at])
    for m in (base, model.base):
        m.generation_config.eos_token_id = eos
    return eos, base.generate(ids, do_sample=False, max_new_tokens=12)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("topk", [2, 3])
def test_the_cache_holds_what_the_base_model_holds(topk, cache):
    """(On a static cache the masks span the whole preallocated cache: the tree mask must block the chunk's own
    columns there, not the mask's last ones.)"""
    model, base = _wrap()
    ids = prompt_ids()
    kwargs = dict(do_sample=False, max_new_tokens=14, return_dict_in_generate=True, cache_implementation=cache)
    ref = base.generate(ids, **kwargs)
    model.draft_logits = _RankedOracle(ref.sequences, ids.shape[1], base.config.vocab_size, rank=topk - 1)
    out = model.generate(ids, tide_config=_tree(1, topk), **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    _assert_same_kv(out.past_key_values, ref.past_key_values, ref.sequences.shape[1] - 1)


@pytest.mark.parametrize("new_tokens", [1, 2, 3, 8])
def test_max_new_tokens(new_tokens):
    model, base = _wrap()
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=new_tokens)
    model.draft_logits = _RankedOracle(ref, ids.shape[1], base.config.vocab_size, rank=1)
    out = model.generate(ids, do_sample=False, max_new_tokens=new_tokens, tide_config=_tree(1, 2))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("at", [1, 2, 5])
def test_eos_comes_from_the_token_before_it(at):
    """A candidate that would stop generation is left to x's own logits (stopping criteria: test_lossless.py)."""
    model, base = _wrap()
    ids = prompt_ids()
    eos, ref = _stop_at(base, model, ids, at)
    model.draft_logits = _RankedOracle(ref, ids.shape[1], base.config.vocab_size, rank=1)
    out = model.generate(ids, do_sample=False, max_new_tokens=12, tide_config=_tree(1, 2))
    assert torch.equal(out, ref) and int(out[0, -1]) == eos


@pytest.mark.parametrize("token", [5, 17, 33, 60, 91])
def test_an_in_place_logits_processor_applies_once(token):
    """transformers applies the processors to the verification logits: the drafter must not have changed them."""
    model, base = _wrap()
    ids = prompt_ids()
    processors = LogitsProcessorList([BoostInPlace(token, 0.3)])
    ref = base.generate(ids, do_sample=False, max_new_tokens=12, logits_processor=processors)
    model.draft_logits = _RankedOracle(ref, ids.shape[1], base.config.vocab_size, rank=1)
    out = model.generate(ids, do_sample=False, max_new_tokens=12, logits_processor=processors, tide_config=_tree(1, 2))
    assert torch.equal(out, ref)


def test_left_padding_mask():
    model, base = _wrap()
    ids = prompt_ids()
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], 1)
    ref = base.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=10)
    model.draft_logits = _RankedOracle(ref, padded.shape[1], base.config.vocab_size, rank=1)
    out = model.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=10, tide_config=_tree(1, 2))
    assert torch.equal(out, ref) and model.last_stats.accepted > 0


def test_one_token_prompt():
    model, base = _wrap()
    ids = prompt_ids(length=1)
    ref = base.generate(ids, do_sample=False, max_new_tokens=10)
    model.draft_logits = _RankedOracle(ref, 1, base.config.vocab_size, rank=1)
    out = model.generate(ids, do_sample=False, max_new_tokens=10, tide_config=_tree(1, 2))
    assert torch.equal(out, ref) and model.last_stats.draft_topk == 2


def test_sampling_drafts_trees():
    model, _ = _wrap()
    torch.manual_seed(0)
    model.generate(prompt_ids(), do_sample=True, max_new_tokens=6, tide_config=_tree(1, 3))
    stats = model.last_stats
    assert stats.draft_topk == 3 and "tree of 3" in stats.summary() and stats.decode_tokens == 6
    assert stats.tree_cycles == stats.verify_passes - 1  # all but the last token's plain step (no room for a tree)


@pytest.mark.parametrize("bad", [0, -1, MAX_DRAFT_TOPK + 1, 2.0, "3", True])
def test_bad_draft_topk_is_a_clear_error(bad):
    model, _ = _wrap()
    with pytest.raises(ValueError, match="draft_topk"):
        model.generate(prompt_ids(), max_new_tokens=2, tide_config=_tree(1, bad))


def test_tree_mask_blocks_only_siblings():
    from tide.layers.calls import LayerCall

    causal = torch.zeros(1, 1, 3, 5)
    causal[..., 0, 3:] = causal[..., 1, 4] = torch.finfo(torch.float32).min  # 2 cached keys, then a chunk of 3
    blocked = torch.zeros(3, 3, dtype=torch.bool)
    blocked[2, 1] = True
    (call,) = tree_mask_calls([LayerCall((torch.zeros(1, 3, 4),), {"attention_mask": causal})], blocked)
    mask = call.kwargs["attention_mask"]
    assert mask[0, 0, 2, 3] == torch.finfo(torch.float32).min and (mask[..., :2] == 0).all()
    assert torch.equal(mask.clone().index_put_((torch.tensor(0), torch.tensor(0), torch.tensor(2), torch.tensor(3)),
                                               torch.tensor(0.0)), causal)
    as_bool = tree_mask_calls([LayerCall((), {"attention_mask": causal == 0})], blocked)[0].kwargs["attention_mask"]
    assert not as_bool[0, 0, 2, 3] and as_bool[0, 0, 2, 2] and as_bool[0, 0, 2, 4]
    assert tree_mask_calls([LayerCall((torch.zeros(1, 3, 4),), {"attention_mask": None})], blocked) is None


@pytest.mark.parametrize("attention, converts", [("sdpa", True), ("eager", False)])
def test_additive_masks_are_what_sdpa_makes_of_boolean_ones(attention, converts):
    from tide.layers.calls import LayerCall, capture_layer_calls
    from tide.layers.calltransforms import additive_masks

    model, _ = _wrap()
    model.base.config._attn_implementation = attention
    parts = model.parts
    blocked = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    allowed = ~blocked
    allowed[..., 0, 3:] = allowed[..., 1, 4] = False
    shared = LayerCall((torch.zeros(1, 3, 4),), {"attention_mask": allowed, "position_ids": torch.arange(3)[None]})
    calls = additive_masks(parts, [shared, shared, LayerCall((torch.zeros(1, 3, 4),), {"attention_mask": allowed})])
    if not converts:
        assert calls[0] is shared
        return
    mask = calls[0].kwargs["attention_mask"]
    assert mask.dtype == torch.float32 and calls[0] is calls[1]
    assert torch.equal(mask == 0, allowed) and torch.isinf(mask[~allowed]).all() and (mask[~allowed] < 0).all()
    assert calls[2].kwargs["attention_mask"] is mask  # one conversion per mask, shared by the calls holding it
    assert calls[0].kwargs["position_ids"] is shared.kwargs["position_ids"]
    # a real pass: the layers' outputs over a chunk of 4 are the same, bit for bit
    ids = prompt_ids(12)
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.base.config)
        model.base(input_ids=ids[:, :8], past_key_values=cache, use_cache=True)
        chunk = capture_layer_calls(parts, input_ids=ids[:, 8:], past_key_values=cache, use_cache=True,
                                    attention_mask=torch.ones(1, 12, dtype=torch.long))
        assert chunk[0].kwargs["attention_mask"].dtype == torch.bool
        outputs = []
        for calls in (chunk, additive_masks(parts, chunk)):
            hidden = calls[0].hidden
            for i in range(parts.num_layers):
                hidden = calls[i].run(parts, i, hidden)
                cache.layers[i].crop(-4)
            outputs.append(hidden)
    assert torch.equal(*outputs)


def test_draft_candidates_weigh_chains_against_trees():
    from tide.calibration.costs import draft_candidates
    from tide.calibration.measure import StepCosts

    costs = StepCosts(layer_s=1.0, checkpoint_s=0.2, skipped_layer_s=0.1, head_s=1.0, capture_s=0.5, device="cpu",
                      verify_extra_s={4: 0.5})
    # the full model's token is the exit head's second choice at every position: only trees of 2+ catch it
    ranks = {1: torch.ones(400, dtype=torch.uint8)}
    schemes = draft_candidates(ranks, num_layers=12, costs=costs, max_draft=4, max_topk=4)
    best = schemes[0]
    assert (best.draft_layer, best.max_draft, best.draft_topk) == (1, 1, 2)  # every cycle emits 2 tokens
    base = 12 + 1.0 + 0.5
    verify = base + 0.5 * 2 / 3  # a pass over 3 positions: 2/3 of what 4 positions add (verify_extra, no wide one)
    assert best.estimate == pytest.approx(2 / (2 + 1.0 + 0.5 + verify) * base)
    chains = [s for s in schemes if s.draft_topk == 1]
    assert len(chains) == 4 and all(s.estimate < 1 for s in chains)  # no chain draft is ever accepted
    assert {s.draft_topk for s in schemes} == {1, 2, 3, 4}
    assert all(s.max_draft == 1 for s in schemes if s.draft_topk > 1)
    assert not [s for s in draft_candidates(ranks, 12, costs, max_draft=0) if s.draft_topk > 1]


def test_chain_estimates_use_the_later_drafts_ranks():
    from tide.calibration.costs import draft_candidates
    from tide.calibration.measure import StepCosts

    costs = StepCosts(layer_s=1.0, checkpoint_s=0.2, skipped_layer_s=0.1, head_s=1.0, capture_s=0.5, device="cpu",
                      verify_extra_s={4: 0.5})
    ranks = {1: torch.zeros(400, dtype=torch.uint8)}  # a chain's first draft is always right
    later = {1: torch.ones(400, dtype=torch.uint8)}  # the drafts after it never are
    alone = {(s.max_draft, s.draft_topk): s.estimate for s in draft_candidates(ranks, 12, costs, max_draft=3)}
    chained = {(s.max_draft, s.draft_topk): s.estimate
               for s in draft_candidates(ranks, 12, costs, max_draft=3, chain_ranks=later)}
    assert alone[(3, 1)] > alone[(1, 1)]  # every draft right: longer chains pay
    assert chained[(3, 1)] < chained[(2, 1)] < chained[(1, 1)]  # one right draft a cycle: the shortest chain
    assert chained[(1, 1)] == pytest.approx(alone[(1, 1)]) and chained[(1, 2)] == pytest.approx(alone[(1, 2)])


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "phi", "gpt_neox"])
def test_one_capture_serves_both_tree_passes(family, monkeypatch):
    """The candidates' shallow calls are sliced from the deep chunk's calls (same keys, same positions)."""
    import tide.decode.lossless.verifier as verifier

    model, base = _wrap(family)
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=9)
    model.draft_logits = _RankedOracle(ref, ids.shape[1], base.config.vocab_size, rank=1)
    captures = []
    real = verifier.capture_layer_calls
    monkeypatch.setattr(verifier, "capture_layer_calls", lambda *a, **kw: captures.append(1) or real(*a, **kw))
    out = model.generate(ids, do_sample=False, max_new_tokens=9, tide_config=_tree(1, 2))
    assert torch.equal(out, ref)
    assert len(captures) == model.last_stats.drafted == 4  # four tree cycles of two tokens, then one plain step


def test_without_first_position_slices_every_per_position_argument():
    from tide.layers.calls import LayerCall
    from tide.layers.calltransforms import without_first_position

    q = 3
    hidden, mask = torch.randn(1, q, 16), torch.randn(1, 1, q, 7)
    rotary = (torch.randn(1, q, 6), torch.randn(1, q, 6))
    call = LayerCall((hidden, "cache"), {"attention_mask": mask, "position_embeddings": rotary,
                                          "position_ids": torch.arange(q)[None],
                                          "cache_position": torch.arange(4, 4 + q), "use_cache": True})
    (cut,) = without_first_position([call], q)
    assert torch.equal(cut.args[0], hidden[:, 1:]) and cut.args[1] == "cache"
    assert torch.equal(cut.kwargs["attention_mask"], mask[..., 1:, :])
    assert all(torch.equal(a, b[:, 1:]) for a, b in zip(cut.kwargs["position_embeddings"], rotary))
    assert cut.kwargs["position_ids"].tolist() == [[1, 2]] and cut.kwargs["cache_position"].tolist() == [5, 6]
    ambiguous = LayerCall((hidden,), {"something": torch.randn(q, q)})  # a q-sized axis it cannot place
    assert without_first_position([ambiguous], q) is None


def test_verification_cost_follows_the_measured_points():
    from tide.calibration.costs import draft_candidates
    from tide.calibration.measure import StepCosts

    costs = StepCosts(layer_s=2.0, checkpoint_s=0.0, skipped_layer_s=0.0, head_s=2.0, capture_s=0.0, device="cpu",
                      verify_extra_s={4: 0.0, 8: 16.0})  # 4 positions cost nothing more, 8 cost 8 layers
    assert [costs.verify_extra_at(p) for p in (1, 2, 4, 6, 8, 10)] == pytest.approx([0, 0, 0, 4, 8, 12])
    assert costs.as_dict()["wide_verify_extra"] == pytest.approx(8.0)
    # every head's top-8 holds the full model's token, its top-3 half the time: the wide trees pay for their width
    ranks = {0: torch.tensor([0, 2, 5, 7] * 100, dtype=torch.uint8)}
    best = draft_candidates(ranks, num_layers=12, costs=costs, max_draft=2)[0]
    assert best.draft_topk == 3


def test_a_jump_between_measured_points_is_not_smoothed_away():
    from tide.calibration.costs import draft_candidates
    from tide.calibration.measure import StepCosts
    from tide.hub.card import verify_extras_text

    # three positions cost almost nothing more, four cost 8 layers more (a kernel switch at 4 rows)
    costs = StepCosts(layer_s=1.0, checkpoint_s=0.0, skipped_layer_s=0.0, head_s=1.0, capture_s=0.0, device="cpu",
                      verify_extra_s={2: 0.1, 3: 0.2, 4: 8.0, 6: 2.0})
    assert [costs.verify_extra_at(p) for p in (1, 2, 3, 4, 5, 6)] == pytest.approx([0, 0.1, 0.2, 8.0, 8.0, 8.0])
    assert costs.verify_extra == pytest.approx(8.0)  # 6 positions measured cheaper than 4 count as 4's cost
    ranks = {1: torch.zeros(400, dtype=torch.uint8)}  # every draft right
    estimates = {s.max_draft: s.estimate for s in draft_candidates(ranks, 12, costs, max_draft=3, max_topk=1)}
    assert estimates[2] > estimates[3]  # a chain of 3 verifies 4 positions: past the jump
    smoothed = StepCosts(**{**costs.__dict__, "verify_extra_s": {4: 8.0}})  # 3 positions read off the line to 4
    assert estimates[2] > draft_candidates(ranks, 12, smoothed, max_draft=2, max_topk=1)[0].estimate
    assert verify_extras_text(costs.as_dict()) == ("verifying 2 / 3 / 4 / 6 positions instead of 1: "
                                                   "+0.10 / +0.20 / +8.00 / +8.00 layer")
    saved = {"verify_extras": {"2": 0.1, "4": 8.0}}  # as a router repo's config.json holds it
    assert verify_extras_text(saved) == "verifying 2 / 4 positions instead of 1: +0.10 / +8.00 layer"
    older = {"verify_extra": 2.0, "wide_verify_extra": 5.0}  # a repo calibrated before the narrow points
    assert verify_extras_text(older) == "verifying 4 / 8 positions instead of 1: +2.00 / +5.00 layer"
    assert verify_extras_text({}) == ""


def test_chain_estimates_follow_the_adaptive_cap():
    from collections import Counter

    from tide.calibration.costs import chain_cycles, draft_candidates
    from tide.calibration.measure import StepCosts

    assert chain_cycles([0] * 10, 4) == (10, Counter({4: 1, 1: 9}))  # a rejection drops the cap to 1 and keeps it
    assert chain_cycles([9] * 10, 4) == (10, Counter({4: 2}))  # every draft right: 4 drafts, 5 tokens a cycle
    # 1 agreeing draft at 0 (cap 4 -> 2), none at 2 (-> 1), 1 at 3 (all of the cap: -> 2), 2 at 5 (-> 3)
    assert chain_cycles([1, 0, 0, 1, 0, 2, 0, 0], 4) == (8, Counter({4: 1, 2: 2, 1: 1}))
    costs = StepCosts(layer_s=1.0, checkpoint_s=0.0, skipped_layer_s=0.0, head_s=1.0, capture_s=0.0, device="cpu",
                      verify_extra_s={2: 0.5, 4: 4.0, 8: 8.0})
    never = {1: torch.full((400,), 3, dtype=torch.uint8)}  # no draft is ever right
    estimates = {s.max_draft: s.estimate for s in draft_candidates(never, 12, costs, max_draft=4, max_topk=1)}
    # after the first rejection a chain of up to 4 drafts one at a time, like a chain of 1
    assert estimates[4] == pytest.approx(estimates[1], rel=0.01)


@pytest.mark.real_timing
@pytest.mark.parametrize("family, wide", [("llama", True), ("mistral", False)])
def test_measure_costs_times_each_verification_point(family, wide, monkeypatch):
    from tide.calibration.measure import LOOP_TOKENS, VERIFY_POINTS, measure_costs

    model, _ = _wrap(family)
    runs = []
    real = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **kw: runs.append((kw["tide_config"], kw["max_new_tokens"],
                                                                         kw["min_new_tokens"])) or real(*a, **kw))
    costs = measure_costs(model, prompt_length=8, repeats=3)
    # mistral's 8-token window has room for the narrow passes only
    assert set(costs.verify_extra_s) == (set(VERIFY_POINTS) if wide else {2, 3, 4})
    assert all(v >= 0 for v in costs.verify_extra_s.values())
    # generate's own work: lossless mode timed with a chain of one from the first checkpoint, at both lengths
    chain = {"mode": "lossless", "draft_layer": model.checkpoints[0], "max_draft": 1, "draft_topk": 1,
             "draft_vocab_size": 0}
    assert runs and all(config == chain and n == minimum for config, n, minimum in runs)
    assert {n for _, n, _ in runs} == set(LOOP_TOKENS)
    assert costs.step_extra_s >= 0 and costs.cycle_extra_s >= 0


@pytest.mark.real_timing
def test_loop_extras_are_zero_where_lossless_mode_cannot_run(monkeypatch):
    from tide.calibration import measure as costs_module
    from tide.hub.card import loop_extras_text
    from tide.decode.lossless.verifier import LosslessUnavailable

    model, _ = _wrap()

    def unavailable(*args, tide_config=None, **kwargs):
        raise LosslessUnavailable("not here")

    monkeypatch.setattr(model, "generate", unavailable)
    costs = costs_module.measure_costs(model, prompt_length=8, repeats=3)
    assert (costs.step_extra_s, costs.cycle_extra_s) == (0.0, 0.0)
    assert loop_extras_text(costs.as_dict()) == ""


def test_estimates_charge_generates_own_work():
    from tide.calibration.costs import draft_candidates
    from tide.calibration.measure import StepCosts
    from tide.hub.card import loop_extras_text

    costs = StepCosts(layer_s=1.0, checkpoint_s=0.0, skipped_layer_s=0.0, head_s=1.0, capture_s=0.5, device="cpu",
                      verify_extra_s={4: 0.5}, step_extra_s=2.0, cycle_extra_s=6.0)
    ranks = {1: torch.ones(400, dtype=torch.uint8)}  # the full model's token is always the draft's second choice
    tree = next(s for s in draft_candidates(ranks, 12, costs, max_draft=1, max_topk=2) if s.draft_topk == 2)
    step = 12 + 1.0 + 0.5
    draft, verify = 2 + 1.0 + 0.5, step + 0.5 * 2 / 3 + 6.0  # a cycle pays its own work once
    assert tree.estimate == pytest.approx(2 / (draft + verify) * (step + 2.0))  # and a base token its own
    assert loop_extras_text(costs.as_dict()) == ("generate's own work +2.00 layer a base token, "
                                                 "+6.00 layer a lossless cycle")


@pytest.mark.parametrize("padded", [False, True])
def test_candidates_captured_when_their_calls_cannot_be_sliced(padded, monkeypatch):
    import tide.decode.lossless.verifier as verifier

    model, base = _wrap()
    ids = prompt_ids()
    mask = torch.ones_like(ids)
    if padded:
        ids = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1)
        mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), mask], 1)
    ref = base.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=9)
    model.draft_logits = _RankedOracle(ref, ids.shape[1], base.config.vocab_size, rank=2)
    monkeypatch.setattr(verifier, "without_first_position", lambda calls, q: None)
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=9, tide_config=_tree(1, 3))
    assert torch.equal(out, ref) and model.last_stats.accepted == 4


# ---------------------------------------------------------------- merged trees: n-gram branch + head candidates

class _Oracles:
    """An n-gram lookup and a draft head that know the base model's output `reference`. The lookup continues
    the reference (its first token wrong every other cycle, so the head's candidate must win there); the head
    ranks the true next token second. Installed over `NgramLookup.continuation` and `model.draft_logits`."""

    def __init__(self, reference: torch.Tensor, vocab: int):
        self.reference, self.vocab, self.at, self.cycles = reference[0].tolist(), vocab, 0, 0

    def continuation(self, lookup, length: int) -> list[int]:
        self.at, self.cycles = len(lookup.tokens), self.cycles + 1  # asked once a cycle, before the head
        tokens = self.reference[self.at:self.at + length]
        if self.cycles % 2 == 0 and tokens:
            tokens = [(tokens[0] + 1) % self.vocab, *tokens[1:]]
        return tokens

    def draft_logits(self, layer, hidden, context, vocab_size=0):
        true = self.reference[min(self.at, len(self.reference) - 1)]
        logits = torch.zeros(hidden.shape[0], self.vocab)
        logits[:, (true + 1) % self.vocab], logits[:, true] = 3.0, 2.0
        return logits, hidden


def _merged(topk=3, max_draft=3, **options):
    return {"mode": "lossless", "draft_layer": 1, "draft_topk": topk, "draft_ngram": 3, "max_draft": max_draft,
            **options}


def _install_oracles(monkeypatch, model, reference):
    from tide.decode.lossless.ngram import NgramLookup

    oracles = _Oracles(reference, model.base.config.vocab_size)
    monkeypatch.setattr(NgramLookup, "continuation", lambda lookup, length: oracles.continuation(lookup, length))
    model.draft_logits = oracles.draft_logits
    return oracles


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "opt", "gpt_neox"])
def test_merged_tree_accepts_deep_ngram_branches_and_head_candidates(family, monkeypatch):
    model, base = _wrap(family)
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=20)
    _install_oracles(monkeypatch, model, ref)
    out = model.generate(ids, do_sample=False, max_new_tokens=20, tide_config=_merged())
    assert torch.equal(out, ref)
    stats = model.last_stats
    assert stats.draft_topk == 3 and stats.merged_cycles == stats.verify_passes  # every cycle had both kinds
    assert stats.decode_tokens == 20 == stats.accepted + stats.verify_passes  # accepted + the bonus, per cycle
    # right continuations: 3 tokens accepted from the n-gram branch (4 emitted); wrong ones: the head's second
    # candidate (2 emitted)
    assert stats.ngram_accepted >= 9 and stats.accepted - stats.ngram_accepted >= 3
    assert stats.layer_passes == stats.verify_passes * (model.parts.num_layers + 2)  # x's shallow step, then the tree


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_merged_tree_cache_holds_what_the_base_model_holds(cache, monkeypatch):
    """The accepted path's K/V moved right after x, in order, for every layer; the other nodes' dropped."""
    model, base = _wrap()
    ids = prompt_ids()
    kwargs = dict(do_sample=False, max_new_tokens=14, return_dict_in_generate=True, cache_implementation=cache)
    ref = base.generate(ids, **kwargs)
    _install_oracles(monkeypatch, model, ref.sequences)
    out = model.generate(ids, tide_config=_merged(), **kwargs)
    assert torch.equal(out.sequences, ref.sequences) and model.last_stats.merged_cycles > 2
    _assert_same_kv(out.past_key_values, ref.past_key_values, ref.sequences.shape[1] - 1)


@pytest.mark.parametrize("at", [1, 3, 6])
def test_merged_tree_stops_where_the_base_model_stops(at, monkeypatch):
    """An end-of-sequence token inside the n-gram branch is never entered: it comes from its parent's logits."""
    model, base = _wrap()
    ids = prompt_ids()
    eos, ref = _stop_at(base, model, ids, at)
    _install_oracles(monkeypatch, model, torch.cat([ref, ref], 1))  # the continuation runs past the end
    out = model.generate(ids, do_sample=False, max_new_tokens=12, tide_config=_merged(max_draft=4))
    assert torch.equal(out, ref) and int(out[0, -1]) == eos


def test_merged_tree_with_an_in_place_processor(monkeypatch):
    model, base = _wrap()
    ids = prompt_ids()
    processors = LogitsProcessorList([BoostInPlace(17, 0.3)])
    ref = base.generate(ids, do_sample=False, max_new_tokens=14, logits_processor=processors)
    _install_oracles(monkeypatch, model, ref)
    out = model.generate(ids, do_sample=False, max_new_tokens=14, logits_processor=processors, tide_config=_merged())
    assert torch.equal(out, ref) and model.last_stats.merged_cycles > 0


def test_merged_tree_compiled_pads_its_ngram_trees_to_one_width(monkeypatch):
    """Compiled (static cache): trees with n-gram branches run compiled, padded to one width (x, k candidates and
    the longest continuation), through the backbone's compiled forward; the padding leaves no trace in the tokens
    or the cache."""
    from transformers import CompileConfig

    from tide.layers.spans import SpanRunner

    model, base = _wrap()
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=14, return_dict_in_generate=True)
    _install_oracles(monkeypatch, model, ref.sequences)
    runs, trees, run, backbone = [], [], SpanRunner.run, SpanRunner.backbone

    def recording(self, start, stop, hidden, calls, eager=False):
        runs.append((start, hidden.shape[1], eager))
        return run(self, start, stop, hidden, calls, eager=eager)

    def verifying(self, **inputs):
        trees.append(inputs["input_ids"].shape[1])
        return backbone(self, **inputs)

    monkeypatch.setattr(SpanRunner, "run", recording)
    monkeypatch.setattr(SpanRunner, "backbone", verifying)
    out = model.generate(ids, do_sample=False, max_new_tokens=14, compile_config=CompileConfig(backend="eager"),
                         return_dict_in_generate=True, tide_config=_merged(compile=True))
    assert torch.equal(out.sequences, ref.sequences) and model.last_stats.merged_cycles > 0
    widest = 1 + 3 + 3  # x, 3 candidates, a continuation of up to 3
    # every tree compiled at one of two widths (head-only, or with n-gram branches, padded)
    assert widest in trees and set(trees) <= {1 + 3, widest}
    # only the last chain verifications, with no room left in the static cache for a tree, run eagerly
    deep = [(width, eager) for start, width, eager in runs if start == 2 and width > 1]  # (layer 1 drafts)
    assert all(width <= 1 + 3 for width, eager in deep if eager)
    full = base(out.sequences[:, :-1], use_cache=True).past_key_values
    _assert_same_kv(out.past_key_values, full, out.sequences.shape[1] - 1)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sampled_trees_keep_the_cache_the_path_needs(cache, monkeypatch):
    """Sampled trees (the oracle's: later children and n-gram branches accepted) leave the cache holding the K/V
    the base model computes for the sampled sequence, on dynamic and static caches."""
    model, base, oracle, ids = _with_sampled_oracle(monkeypatch)
    torch.manual_seed(0)
    out = model.generate(ids, do_sample=True, top_k=3, temperature=2.0, max_new_tokens=14, min_new_tokens=14,
                         return_dict_in_generate=True, cache_implementation=cache, tide_config=_merged(max_draft=3))
    stats = model.last_stats
    assert out.sequences.shape[1] == ids.shape[1] + 14 and stats.tree_cycles > 2 and stats.later_children_accepted > 0
    ref = base(out.sequences[:, :-1], use_cache=True).past_key_values
    _assert_same_kv(out.past_key_values, ref, out.sequences.shape[1] - 1)


def test_merged_tree_sampling_drafts_trees():
    model, _ = _wrap()
    torch.manual_seed(0)
    repeats = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
    model.generate(repeats, do_sample=True, max_new_tokens=8, tide_config=_merged())
    stats = model.last_stats
    assert stats.draft_topk == 3 and stats.merged_cycles > 0 and stats.decode_tokens == 8
    assert stats.tree_cycles > 0 and stats.decode_tokens == stats.accepted + stats.verify_passes


# ---------------------------------------------------------------- sampling: the multi-draft rule over a tree

def test_among_certain_drafts_samples_the_distribution():
    """The rule alone: accepted drafts and residual draws together come out as `probs` (a chi-square test), a
    draft of probability 0 is never accepted, and the draft tried second is accepted about p(t2) of the time."""
    from collections import Counter

    from tide.decode.lossless.accept import among_certain_drafts

    probs = torch.tensor([0.05, 0.3, 0.0, 0.25, 0.15, 0.25])
    drafted, runs = [3, 2, 1], 6000
    torch.manual_seed(0)
    draws = [among_certain_drafts(probs, drafted) for _ in range(runs)]
    counts = Counter(token for _, token in draws)
    assert all(tried == -1 or drafted[tried] == token for tried, token in draws)
    assert all(tried == -1 for tried, token in draws if token not in drafted) and counts[2] == 0
    chi2, df = chi_square(counts, {t: float(p) for t, p in enumerate(probs) if p > 0}, runs)
    assert chi2 < chi_square_limit(df), (chi2, counts)
    assert among_certain_drafts(torch.tensor([0.0, 1.0]), [1]) == (0, 1)  # a certain draft: always accepted
    assert among_certain_drafts(torch.tensor([0.0, 1.0]), [0]) == (-1, 1)  # an impossible one: never


class _SampledOracle:
    """A draft head and an n-gram lookup that know the base model. Among the base model's four likeliest tokens
    at the sequence so far (t1 > t2 > t3 > t4) the head ranks t3 first, t2 second and t4 third: with top_k=3 it
    never offers t1 and offers t4, which has probability 0. The lookup continues with the base model's greedy
    tokens (t1 first): the deep branch, tried after the head's candidates. Installed as `model.draft_logits` and
    over `NgramLookup.continuation`; `TreeDrafter.draft` tells it the sequence."""

    def __init__(self, base):
        self.base, self.ids = base, None

    def _top(self, ids, k):
        with torch.no_grad():
            return self.base(ids).logits[0, -1].topk(k).indices.tolist()

    def draft_logits(self, layer, hidden, context, vocab_size=0):
        top = self._top(self.ids, 4)
        logits = torch.zeros(hidden.shape[0], self.base.config.vocab_size)
        logits[:, top[2]], logits[:, top[1]], logits[:, top[3]] = 3.0, 2.0, 1.0
        return logits, hidden

    def continuation(self, lookup, length):
        ids = self.ids
        for _ in range(length):
            ids = torch.cat([ids, torch.tensor([self._top(ids, 1)])], 1)
        return ids[0, self.ids.shape[1]:].tolist()


def _with_sampled_oracle(monkeypatch):
    """(model, base, oracle, a repetitive prompt): the model's draft head and n-gram lookup replaced by a
    `_SampledOracle` of the base model, which sees the sequence each tree is drafted for."""
    from tide.decode.lossless.ngram import NgramLookup
    from tide.decode.lossless.tree import TreeDrafter

    model, base = _wrap()
    oracle = _SampledOracle(base)
    model.draft_logits = oracle.draft_logits
    real = TreeDrafter.draft
    monkeypatch.setattr(TreeDrafter, "draft", lambda drafter, seq: setattr(oracle, "ids", seq) or real(drafter, seq))
    monkeypatch.setattr(NgramLookup, "continuation", lambda lookup, length: oracle.continuation(lookup, length))
    return model, base, oracle, torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])


@pytest.mark.parametrize("head", ["model", "oracle"])
def test_tree_sampling_matches_the_closed_form_distribution(head, monkeypatch):
    """Sampled tree drafts (three head candidates and an n-gram branch) draw from the base model's distribution:
    a chi-square test against the exact joint distribution of three sampled tokens; the trees really ran (not
    the chain fallback), with n-gram branches, and with the oracles candidates other than a node's first child
    were accepted, the n-gram branch's among them. (The tiny model's own heads rarely offer a token of its top 3,
    and it does not repeat the prompt: the head "model" checks the rule where nearly everything is rejected.)"""
    from collections import Counter

    from test_lossless import _exact_joint
    from tide.decode.lossless.ngram import NgramLookup
    from tide.decode.lossless.tree import TreeDrafter

    model, base = _wrap()
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])  # "5 6" occurred before: the n-gram branch is "7 8"
    if head == "oracle":
        oracle = _SampledOracle(base)
        model.draft_logits = oracle.draft_logits
        real = TreeDrafter.draft
        monkeypatch.setattr(TreeDrafter, "draft",
                            lambda drafter, seq: setattr(oracle, "ids", seq) or real(drafter, seq))
        monkeypatch.setattr(NgramLookup, "continuation", lambda lookup, length: oracle.continuation(lookup, length))
    steps, top_k, temperature, runs = 3, 3, 2.0, 600
    exact = _exact_joint(base, ids, steps, top_k, temperature)
    counts, totals = Counter(), Counter()
    for seed in range(runs):
        torch.manual_seed(seed)
        out = model.generate(ids, do_sample=True, top_k=top_k, temperature=temperature, max_new_tokens=steps,
                             tide_config={"mode": "lossless", "draft_layer": 1, "draft_topk": 3, "draft_ngram": 2,
                                          "max_draft": 2})
        counts[tuple(out[0, -steps:].tolist())] += 1
        stats = model.last_stats
        assert stats.draft_topk == 3 and stats.decode_tokens == steps == stats.accepted + stats.verify_passes
        totals.update({name: getattr(stats, name) for name in ("tree_cycles", "merged_cycles", "accepted",
                                                               "ngram_accepted", "later_children_accepted")})
    assert set(counts) <= set(exact)
    chi2, df = chi_square(counts, exact, runs)
    print(f"tree sampling ({head} head): chi2 = {chi2:.1f}, df = {df}, {dict(totals)}")
    assert chi2 < chi_square_limit(df), (chi2, df, counts.most_common(6))
    assert totals["tree_cycles"] >= runs and totals["merged_cycles"] > runs / 2  # trees, with n-gram branches
    if head == "oracle":  # t2 (the head's second candidate) and t1 (the n-gram branch, tried last) are accepted
        assert totals["later_children_accepted"] > runs / 2 and totals["ngram_accepted"] > runs / 4


def test_draft_tree_shares_prefixes_and_blocks_non_ancestors():
    from tide.decode.lossless.drafts import DraftTree

    tree = DraftTree()
    for token in (7, 3, 9):  # the head's candidates
        tree.add(0, token)
    tree.add_chain([3, 4, 5], ngram=True)  # its first token is the second candidate: one node
    assert tree.tokens == [-1, 7, 3, 9, 4, 5] and tree.parents == [-1, 0, 0, 0, 2, 4]
    assert tree.depths == [0, 1, 1, 1, 2, 3] and tree.ngram == [False, False, True, False, True, True]
    assert tree.children[2] == {4: 4} and tree.has_ngram
    sees = ~tree.blocked() & torch.ones(6, 6, dtype=torch.bool).tril()
    assert [row.nonzero().flatten().tolist() for row in sees] == [[0], [0, 1], [0, 2], [0, 3], [0, 2, 4], [0, 2, 4, 5]]
    assert not tree.blocked().triu(1).any()  # later nodes are the causal mask's


@pytest.mark.parametrize("static", [False, True])
def test_keep_of_tail_moves_the_kept_positions_in_order(static):
    from transformers import DynamicCache, StaticCache

    from tide.models.compat import keep_of_tail, layer_length

    config = _wrap()[1].config
    cache = StaticCache(config=config, max_cache_len=16) if static else DynamicCache(config=config)
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    keys = torch.arange(8.0).view(1, 1, 8, 1).expand(1, heads, 8, dim).contiguous()
    cache.update(keys, -keys, 0, {"cache_position": torch.arange(8)})
    keep_of_tail(cache, 0, 5, [1, 3, 4])  # positions 0..2 stay, then 4, 6, 7 of the tail 3..7
    assert layer_length(cache, 0) == 6
    assert cache.layers[0].keys[0, 0, :6, 0].tolist() == [0, 1, 2, 4, 6, 7]
    assert cache.layers[0].values[0, 0, :6, 0].tolist() == [0, -1, -2, -4, -6, -7]
    keep_of_tail(cache, 0, 3, [])
    assert layer_length(cache, 0) == 3


def test_tree_sampling_stops_at_an_accepted_stopping_child(monkeypatch):
    """A child that would stop generation, once accepted, is the cycle's last token: nothing follows it, and it
    comes out as often as the base model samples it."""
    model, base, oracle, ids = _with_sampled_oracle(monkeypatch)
    oracle.ids = ids
    eos = oracle.continuation(None, 1)[0]  # the base model's likeliest first token: the n-gram branch's first node
    with torch.no_grad():
        p = float((base(ids).logits[0, -1] / 2.0).topk(3).values.softmax(-1)[0])
    runs, first = 200, 0
    for seed in range(runs):
        torch.manual_seed(seed)
        out = model.generate(ids, do_sample=True, top_k=3, temperature=2.0, max_new_tokens=4, eos_token_id=eos,
                             pad_token_id=0, tide_config=_merged(max_draft=3))
        new = out[0, ids.shape[1]:].tolist()
        assert eos not in new[:-1] and (new[-1] == eos or len(new) == 4)
        first += new[0] == eos
        assert model.last_stats.tree_cycles > 0
    assert abs(first - p * runs) < 4 * (p * (1 - p) * runs) ** 0.5 + 1, (first, p * runs)
