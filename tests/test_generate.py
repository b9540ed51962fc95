"""Early-exit generation: exactness against the base model, forced exits against a reference,
per-row batches, KV strategies, and the standard generate features."""

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

import tide
from tide.tools.support_matrix import reference_forced_exit, work_after_cache_write
from generation_helpers import BanToken, MarkDecodeSteps, StopAfter
from tiny_models import FAMILIES, tiny_model

SLIDING = {"mistral", "qwen2", "gemma2", "gemma3_text"}  # sliding-window caches: propagate only
GREEDY = dict(do_sample=False, max_new_tokens=10)


def _wrap(family, **cfg):
    base = tiny_model(family)
    return tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2, **cfg)), base


def _prompt(seed=0, length=9, rows=1):
    torch.manual_seed(seed)
    return torch.randint(4, 100, (rows, length))


@pytest.mark.parametrize("family", FAMILIES)
def test_no_tide_config_is_the_base_model(family):
    model, base = _wrap(family)
    ids = _prompt()
    assert torch.equal(model.generate(ids, **GREEDY), base.generate(ids, **GREEDY))
    assert model.last_stats.mode == "base"


@pytest.mark.parametrize("strategy", ["propagate", "recompute"])
@pytest.mark.parametrize("family", FAMILIES)
def test_threshold_one_never_exits_and_equals_the_base(family, strategy):
    if strategy == "recompute" and family in SLIDING:
        pytest.skip("recompute needs full-attention caches")
    model, base = _wrap(family)
    ids = _prompt()
    ref = base.generate(ids, output_scores=True, return_dict_in_generate=True, **GREEDY)
    out = model.generate(ids, output_scores=True, return_dict_in_generate=True,
                         tide_config={"exit_threshold": 1.0, "kv_strategy": strategy}, **GREEDY)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    stats = out["tide_stats"]
    assert stats.exits == {"full": stats.decode_tokens} and stats.layer_passes == stats.decode_steps * 6


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_exit_matches_reference_and_skips_the_work(family):
    model, base = _wrap(family, checkpoint_layers=[2])
    ids = _prompt()
    expected = reference_forced_exit(base, model.parts, ids, k=2, steps=10)
    after_update = _modules_after_cache_update(model.parts, base, ids, layer=3)
    called, decoding = {}, []  # decoding: set once the prompt's forward is done

    def count(*_args, key):
        if decoding:
            called[key] = called.get(key, 0) + 1

    hooks = [mod.register_forward_hook(lambda *a, key=(j, name): count(key=key))
             for j in range(3, model.parts.num_layers)
             for name, mod in model.parts.layers[j].named_modules() if not list(mod.children())]
    flag = MarkDecodeSteps(decoding)
    query_computed = []  # K/V-only passes skip the query projection's computation
    query = model.parts.layers[3].get_submodule(model.parts.spec.query_proj) if model.parts.spec.query_proj else None
    query_cls = type(query) if query is not None else None
    original_query_forward = query_cls.forward if query is not None else None

    def counting_forward(self, *args, **kwargs):
        if self is query and decoding:
            query_computed.append(1)
        return original_query_forward(self, *args, **kwargs)

    if query is not None:
        query_cls.forward = counting_forward
    try:
        out = model.generate(ids, tide_config={"exit_threshold": -1}, logits_processor=LogitsProcessorList([flag]),
                             **GREEDY)
    finally:
        if query is not None:
            query_cls.forward = original_query_forward
        for h in hooks:
            h.remove()
    assert torch.equal(out, expected)
    if model.parts.spec.kv_projections is None:  # else the batched fill writes K/V without calling the layers
        assert called, "the skipped layers should still write K/V"
    ran_after_update = {name for (j, name) in called if j == 3} & after_update
    assert not ran_after_update, f"layers after the exit ran {ran_after_update} for decode tokens"
    assert not query_computed, "K/V-only passes should not compute queries"
    stats = model.last_stats
    assert stats.exits == {"2": 10 - 1} and stats.layer_passes == 3 * 9 and stats.kv_only_passes == 3 * 9
    assert stats.mean_layers == 3 and stats.layers_skipped == 3 * 9


def _modules_after_cache_update(parts, base, ids, layer):
    """What a skipped layer must never run (attention core, output projection, MLP), checked to have teeth."""
    after = work_after_cache_write(base, parts, layer, ids)
    assert any(("mlp" in n or "fc" in n) for n in after), after
    return after


@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon", "qwen3"])
def test_recompute_with_forced_exit_keeps_placeholders(family):
    """With every token leaving at the first checkpoint nothing runs deep, so recompute = propagate."""
    model, _ = _wrap(family, checkpoint_layers=[2])
    ids = _prompt()
    a = model.generate(ids, tide_config={"exit_threshold": -1}, **GREEDY)
    b = model.generate(ids, tide_config={"exit_threshold": -1, "kv_strategy": "recompute"}, **GREEDY)
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "opt", "phi", "mixtral"])
def test_recompute_rewrites_stale_kv_exactly(family):
    """After a deep step, every stale entry holds the K/V the full model would have written."""
    from transformers import DynamicCache

    model, base = _wrap(family, checkpoint_layers=[1, 3])
    ids = _prompt(length=6)
    # Alternate: a token that exits at layer 1, then one that runs the whole stack.
    scripted = iter([True, False] * 10)

    def scripted_test(layer):
        def test(hidden):
            exits = torch.full(hidden.shape[:1], next(scripted) if layer == 1 else False)
            return exits.float(), exits, hidden
        return test

    model.exit_tests = lambda thresholds: {k: scripted_test(k) for k in thresholds}
    out = model.generate(ids, tide_config={"exit_threshold": 0.5, "kv_strategy": "recompute"},
                         do_sample=False, max_new_tokens=5, return_dict_in_generate=True)
    stats = out["tide_stats"]
    assert stats.recomputed_positions > 0
    # The full model's own cache for the same tokens (all but the last, whose deep K/V is a placeholder).
    full = DynamicCache(config=base.config)
    with torch.no_grad():
        base(out.sequences[:, :-1], past_key_values=full, use_cache=True)
    n = out.sequences.shape[1] - 2  # positions stored before the last step, all exact after it ran deep
    for j in range(model.parts.num_layers):
        torch.testing.assert_close(out.past_key_values.layers[j].keys[:, :, :n], full.layers[j].keys[:, :, :n],
                                   atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("strategy", ["propagate", "recompute"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon", "opt", "gemma2", "qwen2"])
def test_left_padded_batch_matches_each_row_alone(family, strategy):
    if strategy == "recompute" and family in SLIDING:
        pytest.skip("recompute needs full-attention caches")
    model, _ = _wrap(family, checkpoint_layers=[1, 3])
    _spread_router_scores(model)
    from tiny_models import tiny_tokenizer

    tok = tiny_tokenizer(pad=True)
    tok.padding_side = "left"
    prompts = ["The quick brown fox", "Hello", "import os; print(os.getcwd())"]
    cfg = {"exit_threshold": 0.5, "kv_strategy": strategy}
    batch = tok(prompts, return_tensors="pt", padding=True)
    together = model.generate(**batch, tide_config=cfg, pad_token_id=0, **GREEDY)
    exits = model.last_stats.exits
    assert len(exits) > 1, f"rows should exit at different layers: {exits}"
    for i, prompt in enumerate(prompts):
        alone = model.generate(**tok([prompt], return_tensors="pt"), tide_config=cfg, pad_token_id=0, **GREEDY)
        assert torch.equal(together[i, -(GREEDY["max_new_tokens"]):], alone[0, -(GREEDY["max_new_tokens"]):]), i


def _spread_router_scores(model):
    """Make random routers decisive (scores far from 0.5) so rows exit at different layers robustly."""
    with torch.no_grad():
        for layer in model.checkpoints:
            model.routers[layer].up.weight.mul_(40.0)


def test_prefill_exit_runs_and_counts():
    model, base = _wrap("llama", checkpoint_layers=[2])
    ids = _prompt()
    out = model.generate(ids, tide_config={"exit_threshold": -1, "prefill_exit": True}, **GREEDY)
    assert out.shape == (1, ids.shape[1] + 10)
    assert model.last_stats.prefill_token_layers == 3 * ids.shape[1]


def test_recompute_on_sliding_window_model_is_a_clear_error():
    model, _ = _wrap("mistral")
    with pytest.raises(ValueError, match="propagate"):
        model.generate(_prompt(), tide_config={"exit_threshold": 0.5, "kv_strategy": "recompute"}, **GREEDY)


# ---------------------------------------------------------------------- standard generate features
def test_sampling_with_a_seed_is_reproducible():
    model, _ = _wrap("llama")
    ids = _prompt()
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(model.generate(ids, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=10,
                                   tide_config={"exit_threshold": 0.5}))
    assert torch.equal(runs[0], runs[1])


def test_threshold_one_sampling_equals_base_sampling():
    model, base = _wrap("qwen3")
    ids = _prompt()
    torch.manual_seed(7)
    ref = base.generate(ids, do_sample=True, max_new_tokens=10)
    torch.manual_seed(7)
    out = model.generate(ids, do_sample=True, max_new_tokens=10, tide_config={"exit_threshold": 1.0})
    assert torch.equal(ref, out)


def test_custom_logits_processor_is_applied():
    model, _ = _wrap("llama")
    ids = _prompt()
    plain = model.generate(ids, tide_config={"exit_threshold": -1}, **GREEDY)
    banned = int(plain[0, ids.shape[1]])
    proc = BanToken(banned)
    out = model.generate(ids, tide_config={"exit_threshold": -1}, logits_processor=LogitsProcessorList([proc]),
                         **GREEDY)
    assert proc.calls == 10 and banned not in out[0, ids.shape[1]:].tolist()


def test_custom_stopping_criterion():
    model, _ = _wrap("llama")
    ids = _prompt()
    out = model.generate(ids, tide_config={"exit_threshold": -1}, do_sample=False, max_new_tokens=20,
                         stopping_criteria=StoppingCriteriaList([StopAfter(ids.shape[1] + 4)]))
    assert out.shape[1] == ids.shape[1] + 4


def test_eos_from_generation_config_stops():
    model, base = _wrap("llama")
    ids = _prompt()
    first = int(model.generate(ids, tide_config={"exit_threshold": -1}, **GREEDY)[0, ids.shape[1] + 2])
    model.generation_config.eos_token_id = first
    out = model.generate(ids, tide_config={"exit_threshold": -1}, **GREEDY)
    assert int(out[0, -1]) == first and out.shape[1] <= ids.shape[1] + 3


def test_streamer_receives_every_token():
    from transformers import TextIteratorStreamer
    from threading import Thread
    from tiny_models import tiny_tokenizer

    tok = tiny_tokenizer()
    model, _ = _wrap("llama")
    inputs = tok(["Hello there"], return_tensors="pt")
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    kwargs = dict(**inputs, streamer=streamer, tide_config={"exit_threshold": -1}, **GREEDY)
    thread = Thread(target=model.generate, kwargs=kwargs)
    thread.start()
    text = "".join(streamer)
    thread.join()
    out = model.generate(**inputs, tide_config={"exit_threshold": -1}, **GREEDY)
    assert text == tok.decode(out[0, inputs["input_ids"].shape[1]:])


def test_num_return_sequences_and_dict_output():
    model, _ = _wrap("llama")
    ids = _prompt()
    torch.manual_seed(0)
    out = model.generate(ids, do_sample=True, num_return_sequences=3, return_dict_in_generate=True,
                         max_new_tokens=5, tide_config={"exit_threshold": 0.5})
    assert out.sequences.shape == (3, ids.shape[1] + 5)
    assert out["tide_stats"].decode_tokens == 3 * 4
    assert "mean layers per token" in out["tide_stats"].summary()


def test_pipeline_with_model_object_and_router_repo(tmp_path):
    from transformers import pipeline
    from tiny_models import tiny_tokenizer

    tok = tiny_tokenizer()
    model, base = _wrap("llama")
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    model.config.base_model_name_or_path = str(tmp_path / "base")
    model.save_pretrained(tmp_path / "routers")
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    a = pipe("Hello", max_new_tokens=5, do_sample=False, tide_config={"exit_threshold": -1})[0]["generated_text"]
    assert a.startswith("Hello") and model.last_stats.decode_tokens == 4
    pipe2 = pipeline("text-generation", model=str(tmp_path / "routers"))  # the base's tokenizer, found by name
    b = pipe2("Hello", max_new_tokens=5, do_sample=False, tide_config={"exit_threshold": -1})[0]["generated_text"]
    assert a == b


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("cfg, needle", [
    ({"exit_treshold": 0.5}, "unknown key"),
    ({"exit_threshold": "0.5"}, "exit_threshold"),
    ({"exit_threshold": 0.5, "min_layers": 5}, "min_layers"),
    ({"kv_strategy": "copy"}, "kv_strategy"),
])
def test_bad_tide_config_is_a_clear_error(cfg, needle):
    model, _ = _wrap("llama")
    with pytest.raises(ValueError, match=needle):
        model.generate(_prompt(), tide_config=cfg, **GREEDY)


def test_router_on_wrong_dtype_is_a_clear_error():
    model, _ = _wrap("llama")
    model.routers.double()
    with pytest.raises(RuntimeError, match="align_routers"):
        model.generate(_prompt(), tide_config={"exit_threshold": 0.5}, **GREEDY)
    model.align_routers()
    model.generate(_prompt(), tide_config={"exit_threshold": 0.5}, **GREEDY)


def test_tide_config_without_thresholds_warns_and_runs_the_base():
    model, base = _wrap("llama")
    ids = _prompt()
    with pytest.warns(UserWarning, match="no thresholds"):
        out = model.generate(ids, tide_config={"kv_strategy": "propagate"}, **GREEDY)
    assert torch.equal(out, base.generate(ids, **GREEDY))


@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon"])
def test_bfloat16_model(family):
    """Routers follow their layer's dtype; no exit and lossless mode still give the base model's tokens."""
    base = tiny_model(family).to(torch.bfloat16)
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2))
    assert model.routers[1].down.weight.dtype == torch.bfloat16
    ids = _prompt()
    ref = base.generate(ids, **GREEDY)
    assert torch.equal(model.generate(ids, tide_config={"exit_threshold": 1.0}, **GREEDY), ref)
    assert torch.equal(model.generate(ids, tide_config={"mode": "lossless"}, **GREEDY), ref)
    assert model.generate(ids, tide_config={"exit_threshold": 0.5}, **GREEDY).shape == ref.shape


def test_prefill_exit_with_recompute_refuses_sliding_window_models():
    model, _ = _wrap("mistral")
    with pytest.raises(ValueError, match="propagate"):
        model.generate(_prompt(), tide_config={"exit_threshold": 0.5, "kv_strategy": "recompute", "prefill_exit": True},
                       **GREEDY)


def test_recompute_keeps_at_most_max_pending_positions():
    """Past MAX_PENDING stale positions, the oldest keep their placeholder; generation goes on and stays bounded."""
    from tide.layers.recompute import MAX_PENDING

    model, _ = _wrap("llama", checkpoint_layers=[1])
    seen = []
    original_after_step = tide.layers.recompute.RecomputeState.after_step

    def watching(self, steps, walk):
        original_after_step(self, steps, walk)
        seen.append(self.pending)

    tide.layers.recompute.RecomputeState.after_step = watching
    try:
        new = MAX_PENDING + 6
        out = model.generate(_prompt(), tide_config={"exit_threshold": -1, "kv_strategy": "recompute"},
                             do_sample=False, max_new_tokens=new)
    finally:
        tide.layers.recompute.RecomputeState.after_step = original_after_step
    assert out.shape[1] == _prompt().shape[1] + new
    assert max(seen) == MAX_PENDING and seen[-1] == MAX_PENDING  # every token exits: none ever becomes exact
    stats = model.last_stats
    assert stats.recomputed_positions == 0 and stats.exits == {"1": new - 1}


def test_tide_config_as_a_generation_config_equals_the_dict():
    model, _ = _wrap("llama", checkpoint_layers=[1, 3])
    _spread_router_scores(model)
    ids = _prompt()
    as_dict = model.generate(ids, tide_config={"exit_threshold": 0.5, "kv_strategy": "recompute"}, **GREEDY)
    exits = model.last_stats.exits
    as_class = model.generate(ids, tide_config=tide.TideGenerationConfig(exit_threshold=0.5, kv_strategy="recompute"),
                              **GREEDY)
    assert (torch.equal(as_dict, as_class) and model.last_stats.exits == exits
            and model.last_stats.kv_strategy == "recompute")


def test_repo_generation_defaults_apply_and_a_call_overrides_them():
    model, base = _wrap("llama", checkpoint_layers=[1, 3])
    model.config.set_generation_defaults(exit_threshold=-1)  # every token leaves at the first checkpoint
    ids = _prompt()
    model.generate(ids, **GREEDY)
    assert model.last_stats.exits == {"1": GREEDY["max_new_tokens"] - 1}
    assert torch.equal(model.generate(ids, tide_config={"exit_threshold": 1.0}, **GREEDY), base.generate(ids, **GREEDY))


def test_tide_passes_run_without_cudnn_attention_on_cuda():
    """On CUDA the loops' SDPA leaves out cuDNN's attention (`tide.decode.attention_backends`; the flags need no
    device); elsewhere nothing changes."""
    from types import SimpleNamespace

    from tide.decode import attention_backends

    with attention_backends(SimpleNamespace(device=torch.device("cuda"))):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored
    with attention_backends(SimpleNamespace(device=torch.device("cpu"))):
        assert torch.backends.cuda.cudnn_sdp_enabled()
