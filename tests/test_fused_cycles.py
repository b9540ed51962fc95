"""Compiled chains as one graph and one host read a cycle (the lossless loop's graph backend,
`decode/lossless/graph.py`): token for token as the base model, counted launches and synchronisations, no recompilation
across prompt lengths."""

from collections import Counter

import pytest
import torch
from transformers import CompileConfig, TextStreamer
from transformers.modeling_outputs import BaseModelOutput

import tide.decode.lossless.loop
from tide.decode.lossless import graph as fused
from tide.decode import graphparts
from tide.decode.lossless.accept import sampling_verdict_on_device
from generation_helpers import chi_square, chi_square_limit, count_fused_work
from tiny_models import noisy_tide, prompt_ids, tiny_tokenizer

EAGER_BACKEND = CompileConfig(backend="eager")
SMALL = {"llama": {}, "gpt2": dict(n_layer=4)}  # (fewer layers where the model still talks: faster tracing)
LOSSLESS = {"mode": "lossless", "max_draft": 3, "compile": True}
# a greedy tree: one graph a cycle too (`decode/lossless/graphtree.py`)
TREE = {**LOSSLESS, "draft_topk": 3, "max_draft": 2}


@pytest.fixture(scope="module", autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def warm():
    """(Tide model, base) with every graph the tests below run made once: the longest call first (the lent static
    cache keeps its size), then every chain width the cap can take (it adapts per cycle), then the tree's."""
    model, base = noisy_tide("llama")
    generate(model, prompt_ids(20, seed=9), max_new_tokens=24)
    for width in range(1, LOSSLESS["max_draft"] + 1):
        model.generate(prompt_ids(20, seed=9), do_sample=False, compile_config=EAGER_BACKEND, max_new_tokens=12,
                       tide_config={**LOSSLESS, "max_draft": width})
    model.generate(prompt_ids(20, seed=9), do_sample=False, compile_config=EAGER_BACKEND, max_new_tokens=12,
                   tide_config=TREE)
    return model, base


def generate(model, ids, config=LOSSLESS, **kwargs):
    return model.generate(ids, do_sample=False, compile_config=EAGER_BACKEND, tide_config=config, **kwargs)


@pytest.mark.parametrize("family", ["gpt2"])  # learned positions taken off (llama: the tests on the warm model below)
def test_fused_cycles_equal_the_base_model(family):
    model, base = noisy_tide(family, model_overrides=SMALL[family])
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=24)
    out = generate(model, ids, max_new_tokens=24)
    stats = model.last_stats
    assert torch.equal(out, ref)
    assert stats.fused_cycles == stats.verify_passes > 0 and stats.accepted > 0  # drafts were accepted, some not
    assert 0 < stats.fused_graph_s < stats.decode_time_s and 0 < stats.fused_host_share < 1
    assert stats.accepted <= stats.drafted and stats.decode_tokens == 24
    assert torch.equal(generate(model, ids, TREE, max_new_tokens=24), ref)  # a tree, its nodes' positions taken off
    assert model.last_stats.fused_cycles and model.last_stats.draft_topk == TREE["draft_topk"]


def test_a_backbone_that_transforms_its_inputs_is_not_given_states():
    """The deep layers take layer-E states as the backbone's input embeddings: what a backbone adds to them (learned
    positions) is measured and taken off; one that transforms them otherwise (here: scales them) is not used."""

    class Adds(torch.nn.Module):
        def forward(self, inputs_embeds, position_ids, use_cache):
            return BaseModelOutput(last_hidden_state=inputs_embeds + position_ids[..., None])

    class Scales(torch.nn.Module):
        def forward(self, inputs_embeds, position_ids, use_cache):
            return BaseModelOutput(last_hidden_state=inputs_embeds * 2)

    class Passes(torch.nn.Module):
        def forward(self, inputs_embeds, position_ids, use_cache):
            return BaseModelOutput(last_hidden_state=inputs_embeds)

    like = torch.zeros(1)
    assert graphparts.input_offset(Passes(), 8, like) is False
    assert graphparts.input_offset(Adds(), 8, like) is True
    assert graphparts.input_offset(Scales(), 8, like) is None


def test_stopping_inside_a_cycle_drops_what_follows(warm):
    """EOS mid-cycle, the length limit, a stop string (a criterion called per token), a minimum length and the
    streamer: as generate."""
    model, base = warm
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=24)
    stop = int(ref[0, ids.shape[1] + 6])
    kwargs = dict(max_new_tokens=24, eos_token_id=stop, pad_token_id=stop)
    want = base.generate(ids, do_sample=False, **kwargs)
    assert want.shape[1] < ref.shape[1]
    assert torch.equal(generate(model, ids, **kwargs), want)
    assert model.last_stats.fused_cycles
    minimum = dict(max_new_tokens=12, min_new_tokens=10, eos_token_id=stop, pad_token_id=stop)  # in the graph
    assert torch.equal(generate(model, ids, **minimum), base.generate(ids, do_sample=False, **minimum))
    assert model.last_stats.fused_cycles
    for new in (1, 2, 7):
        assert torch.equal(generate(model, ids, max_new_tokens=new), ref[:, : ids.shape[1] + new])
    tokenizer = tiny_tokenizer()
    text = tokenizer.decode(ref[0, ids.shape[1] + 3: ids.shape[1] + 5])
    stops = dict(max_new_tokens=24, stop_strings=[text], tokenizer=tokenizer)
    assert torch.equal(generate(model, ids, **stops), base.generate(ids, do_sample=False, **stops))
    streamed = []

    class Collect(TextStreamer):
        def put(self, value):
            streamed.extend(value.view(-1).tolist())

        def end(self):
            pass

    out = generate(model, ids, max_new_tokens=24, streamer=Collect(tokenizer))
    assert streamed == ids[0].tolist() + out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("config", [LOSSLESS, TREE], ids=["chain", "tree"])
def test_a_cycle_is_one_graph_launch_and_one_host_read(warm, monkeypatch, config):
    """Counted, not assumed: compiled functions called and device reads (tolist, item, bool, int) during the graph
    backend's cycles of a warm call. A second launch or a second read in a cycle fails this."""
    model, base = warm
    ids = prompt_ids()
    launches, reads = count_fused_work(monkeypatch)
    out = generate(model, ids, config, max_new_tokens=24)
    cycles = model.last_stats.fused_cycles
    assert torch.equal(out, base.generate(ids, do_sample=False, max_new_tokens=24))
    assert cycles >= 5 and 0 < model.last_stats.accepted < model.last_stats.drafted  # accepted and rejected drafts
    assert launches[0] == cycles
    assert reads[0] == cycles  # (the loop's stopping criteria run on the host's tokens: no read)


@pytest.mark.parametrize("config", [LOSSLESS, TREE], ids=["chain", "tree"])
def test_no_recompilation_across_prompt_lengths(warm, config):
    """After warm-up, ten calls of other prompt lengths run the graphs already made."""
    model, base = warm
    with torch._dynamo.config.patch(error_on_recompile=True):
        for length in range(3, 13):
            ids = prompt_ids(length, seed=length)
            assert torch.equal(generate(model, ids, config, max_new_tokens=12),
                               base.generate(ids, do_sample=False, max_new_tokens=12))


def test_calls_the_graph_does_not_serve_draft_and_verify_with_the_reason(warm, monkeypatch):
    """The loop asks once a call for the graph backend, which says why not to logits processors that read the
    sequence (no repeated bigram), a tree with a repetition penalty, and per-token scores (the draft-and-verify
    backend serves them, correctly)."""
    model, base = warm
    ids = prompt_ids()
    built = []
    monkeypatch.setattr(tide.decode.lossless.loop, "graph_cycles",
                        lambda *a, **k: built.append(fused.graph_cycles(*a, **k)) or built[-1])
    for config, extra in ((LOSSLESS, {"no_repeat_ngram_size": 2}), (TREE, {"repetition_penalty": 1.3})):
        assert torch.equal(generate(model, ids, config, max_new_tokens=8, **extra),
                           base.generate(ids, do_sample=False, max_new_tokens=8, **extra))
    out = generate(model, ids, max_new_tokens=8, return_dict_in_generate=True, output_scores=True)
    assert len(out.scores) == 8
    assert built == ["logits processors that do not run in the graph", "a repetition penalty in a tree",
                     "per-token scores or logits asked for"]
    generate(model, ids, max_new_tokens=8)
    assert isinstance(built[-1], fused.GraphCycles)


def test_each_position_penalises_what_was_seen_and_drafted_before_it():
    """The penalty's tokens at x and each draft: the sequence's, and the drafts before the position; and the penalty
    as transformers' processor computes it."""
    from transformers import RepetitionPenaltyLogitsProcessor

    seen = torch.zeros(6, dtype=torch.bool)
    seen[1] = True
    rows = graphparts.seen_at(seen, torch.tensor([3, 1, 3, 5]))
    assert rows.tolist() == [[i in held for i in range(6)] for held in ({1}, {1, 3}, {1, 3}, {1, 3}, {1, 3, 5})]
    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0, -1.0, 2.0]])
    expected = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[3, 1]]), logits.clone())
    assert torch.equal(graphparts.penalised(logits, torch.tensor(1.5), rows[1]), expected)


def test_a_repetition_penalty_runs_in_the_graph(warm, monkeypatch):
    """A repetition penalty (with a minimum length beside it, and a prompt part it ignores) runs inside the cycle's
    graph, on the tokens seen so far and each position's drafts before it: the base model's tokens, greedy, one
    launch a cycle; sampled with top-k, the full model's penalised top-k support."""
    model, base = warm
    ids = prompt_ids(8, seed=4)  # (a prompt where leaving out the drafts before a position changes the tokens)
    for extra in ({"repetition_penalty": 2.0, "min_new_tokens": 4}, {"repetition_penalty": 0.5}):
        ref = base.generate(ids, do_sample=False, max_new_tokens=24, **extra)
        assert not torch.equal(ref, base.generate(ids, do_sample=False, max_new_tokens=24))  # (it changes tokens)
        launches, reads = count_fused_work(monkeypatch)
        assert torch.equal(generate(model, ids, max_new_tokens=24, **extra), ref), extra
        stats = model.last_stats
        assert launches[0] == stats.fused_cycles > 0 and 0 < stats.accepted < stats.drafted
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    ignoring = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=ids.shape[1])])
    ref = base.generate(ids, do_sample=False, max_new_tokens=16, logits_processor=ignoring)
    assert torch.equal(generate(model, ids, max_new_tokens=16, logits_processor=ignoring), ref)
    assert model.last_stats.fused_cycles
    torch.manual_seed(0)
    out = model.generate(ids, do_sample=True, top_k=2, repetition_penalty=1.3, max_new_tokens=12,
                         compile_config=EAGER_BACKEND, tide_config=LOSSLESS)
    assert model.last_stats.fused_cycles
    new = out[0, ids.shape[1]:]
    for i in range(new.shape[0]):  # the full model's penalised top-2 before each new token
        scores = RepetitionPenaltyLogitsProcessor(1.3)(out[:, : ids.shape[1] + i],
                                                       base(out[:, : ids.shape[1] + i]).logits[:, -1])
        assert new[i] in scores[0].topk(2).indices


def test_a_compiled_call_drafts_the_fused_chain_unless_it_names_a_tree(warm):
    """A repo's tree gives way to the fused chain (with the repo's n-gram drafts) in a compiled call; a call that
    names `draft_topk` drafts a tree, greedy calls as one graph a cycle too (`test_fused_trees.py`). Both: the base
    model's tokens."""
    model, base = warm
    ids = prompt_ids()
    ref = base.generate(ids, do_sample=False, max_new_tokens=12)
    model.config.generation = {"draft_topk": 2, "draft_ngram": 3}
    try:
        assert torch.equal(generate(model, ids, max_new_tokens=12), ref)
        assert model.last_stats.fused_cycles and model.last_stats.draft_topk == 1
        named = {**LOSSLESS, "draft_topk": 2}
        out = model.generate(ids, do_sample=False, compile_config=EAGER_BACKEND, tide_config=named, max_new_tokens=12)
        assert torch.equal(out, ref) and model.last_stats.fused_cycles and model.last_stats.draft_topk == 2
    finally:
        model.config.generation = {}


def test_the_sampled_verdict_draws_from_the_full_model():
    """The speculative-sampling rule as the graph runs it (`accept.sampling_verdict_on_device`), against fixed
    distributions: the first emitted token is distributed as the full model's first row, and the second, after an
    accepted first draft, as its second row (chi-square, 4,000 draws of drafts from their own distributions)."""
    torch.manual_seed(0)
    vocab, runs = 6, 4000
    p, q = torch.rand(3, vocab), torch.rand(2, vocab)
    p = p / p.sum(-1, keepdim=True)
    q = q / q.sum(-1, keepdim=True)
    first, second = Counter(), Counter()
    for _ in range(runs):
        drafts = torch.multinomial(q, 1)[:, 0]  # [2]
        tokens, accepted = sampling_verdict_on_device(p, drafts, q[None])
        tokens, accepted = tokens[0].tolist(), int(accepted)
        first[tokens[0]] += 1
        if accepted >= 1:
            second[tokens[1]] += 1
    for counts, row in ((first, p[0]), (second, p[1])):
        chi2, df = chi_square(counts, dict(enumerate(row.tolist())), sum(counts.values()))
        assert chi2 < chi_square_limit(df), (chi2, df, counts)
    assert sum(second.values()) > runs / 4  # the second row was really reached


def test_sampled_calls_run_fused_with_their_warpers(warm):
    """Sampling with temperature and top-k runs in the graph: the tokens stay in the full model's top-k support at
    every step, drafts are accepted, and a later call (new processor objects, same values) replays the graphs."""
    model, base = warm
    ids = prompt_ids()
    config = {**LOSSLESS, "max_draft": 2}
    sample = dict(do_sample=True, top_k=2, temperature=1.5, max_new_tokens=12, compile_config=EAGER_BACKEND)
    torch.manual_seed(0)
    model.generate(ids, tide_config=config, **sample)
    accepted = 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            torch.manual_seed(seed)
            out = model.generate(ids, tide_config=config, **sample)
            assert model.last_stats.fused_cycles
            accepted += model.last_stats.accepted
            logits = base(out).logits[0, ids.shape[1] - 1: -1]  # the full model's scores before each new token
            allowed = logits.topk(2, -1).indices
            assert (allowed == out[0, ids.shape[1]:, None]).any(-1).all()
    assert accepted > 0


def test_ngram_continuations_are_the_drafts_where_the_text_repeats(warm):
    """With `draft_ngram`, a repeated n-gram's continuation is drafted (by the host, run in one pass): greedy equals
    the base model, and sampled calls keep to the full model's top-k support."""
    model, base = warm
    ids = torch.cat([prompt_ids(6, seed=3)] * 3, 1)  # the model's text repeats its prompt
    ref = base.generate(ids, do_sample=False, max_new_tokens=16)
    config = {**LOSSLESS, "draft_ngram": 3}
    out = model.generate(ids, do_sample=False, max_new_tokens=16, compile_config=EAGER_BACKEND, tide_config=config)
    assert torch.equal(out, ref)
    stats = model.last_stats
    assert stats.fused_cycles and stats.ngram_drafted and stats.ngram_accepted
    torch.manual_seed(0)
    out = model.generate(ids, do_sample=True, top_k=2, max_new_tokens=16, compile_config=EAGER_BACKEND,
                         tide_config=config)
    assert model.last_stats.ngram_drafted
    allowed = base(out).logits[0, ids.shape[1] - 1: -1].topk(2, -1).indices
    assert (allowed == out[0, ids.shape[1]:, None]).any(-1).all()


@pytest.mark.parametrize("config", [TREE, {**TREE, "draft_topk": 2}], ids=["3", "2"])
def test_fused_trees_equal_the_base_model(warm, config):
    """Greedy trees (the head's candidates for the next position): one graph a cycle, the base model's tokens,
    some drafts accepted and some not."""
    model, base = warm
    ids = prompt_ids()
    out = generate(model, ids, config, max_new_tokens=24)
    stats = model.last_stats
    assert torch.equal(out, base.generate(ids, do_sample=False, max_new_tokens=24))
    assert stats.fused_cycles == stats.verify_passes > 0 and stats.draft_topk == config["draft_topk"]
    assert 0 < stats.tree_cycles <= stats.fused_cycles  # (a cycle near the length limit may verify a chain)
    # the summary counts them, and claims no count of later children accepted (fused cycles do not count those)
    assert f"{stats.tree_cycles} over trees)" in stats.summary() and "first child" not in stats.summary()
    assert "ran all layers" not in stats.summary()  # (no exits in lossless mode: no count of them, not a zero)
    assert 0 < stats.accepted < stats.drafted


def test_a_tree_with_an_ngram_branch_equals_the_base_model(warm):
    """Where the text repeats, the n-gram continuation is a branch of the tree: drafted there, and the tokens are
    the base model's; a minimum length and EOS inside a cycle too. Sampled trees run in the graph too, their tokens
    in the full model's top-k support."""
    model, base = warm
    ids = torch.cat([prompt_ids(6, seed=3)] * 3, 1)
    ref = base.generate(ids, do_sample=False, max_new_tokens=16)
    config = {**TREE, "draft_ngram": 3}
    assert torch.equal(generate(model, ids, config, max_new_tokens=16), ref)
    stats = model.last_stats
    assert stats.fused_cycles and stats.ngram_drafted and 0 < stats.merged_cycles <= stats.tree_cycles
    stop = int(ref[0, ids.shape[1] + 5])
    kwargs = dict(max_new_tokens=16, min_new_tokens=3, eos_token_id=stop, pad_token_id=stop)
    assert torch.equal(generate(model, ids, config, **kwargs), base.generate(ids, do_sample=False, **kwargs))
    torch.manual_seed(0)
    out = model.generate(ids, do_sample=True, top_k=2, max_new_tokens=12, compile_config=EAGER_BACKEND,
                         tide_config=config)
    stats = model.last_stats
    assert stats.fused_cycles == stats.verify_passes > 0 and stats.ngram_drafted and stats.accepted
    allowed = base(out).logits[0, ids.shape[1] - 1: -1].topk(2, -1).indices
    assert (allowed == out[0, ids.shape[1]:, None]).any(-1).all()


def test_sampled_trees_in_the_graph_draw_from_the_full_model(warm):
    """Sampled trees with an n-gram branch, one graph a cycle: a chi-square test against the exact joint distribution
    of three tokens sampled with top-k and temperature; the trees ran in the graph, and drafts were accepted."""
    from test_lossless import _exact_joint

    model, base = warm
    ids = torch.cat([prompt_ids(6, seed=3)] * 3, 1)  # the text repeats: n-gram branches
    steps, top_k, temperature, runs = 3, 3, 2.0, 300
    exact = _exact_joint(base, ids, steps, top_k, temperature)
    config = {**TREE, "draft_ngram": 3}
    counts, cycles, accepted = Counter(), 0, 0
    for seed in range(runs):
        torch.manual_seed(seed)
        out = model.generate(ids, do_sample=True, top_k=top_k, temperature=temperature, max_new_tokens=steps,
                             compile_config=EAGER_BACKEND, tide_config=config)
        counts[tuple(out[0, -steps:].tolist())] += 1
        cycles += model.last_stats.fused_cycles
        accepted += model.last_stats.accepted
    assert set(counts) <= set(exact)
    chi2, df = chi_square(counts, exact, runs)
    assert chi2 < chi_square_limit(df), (chi2, df, counts.most_common(6))
    assert cycles >= runs and accepted > runs / 10  # (the rule's own power: tests/test_fused_trees.py, 6,000 runs)
