"""Calibration on conversations (`tide.calibration.chat`): ShareGPT records and message lists through the chat
template, trained on the answers only, teacher-forced; a ShareGPT file read record by record, cut short included;
the token budget."""

import json
from dataclasses import replace

import pytest
import torch

import tide
from tide.calibration.chat import ChatText, answer_mask, chat_texts, sharegpt_records
from tide.calibration.options import CalibrationOptions
from tide.calibration.texts import batches, stream_size, within_budget
from tiny_models import sample_texts, tiny_model, tiny_tokenizer

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _tok():
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def _records(n: int) -> list[dict]:
    texts = sample_texts(2 * n)
    return [{"id": str(i), "conversations": [{"from": "human", "value": texts[2 * i][:40]},
                                             {"from": "gpt", "value": texts[2 * i + 1][:120]}]} for i in range(n)]


def test_a_sharegpt_record_renders_through_the_template_with_its_answer_marked():
    tok = _tok()
    [text] = chat_texts(tok, [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}])
    assert text == "<user>hi\n<assistant>yo\n" and text.prompt == "<user>hi\n<assistant>"
    assert [text[a:b] for a, b in text.answers] == ["yo"]
    encoded = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    mask = answer_mask(text, encoded["offset_mapping"])
    # a marked position predicts a token that starts inside the answer; the last position predicts nothing
    starts = [s for s, _ in encoded["offset_mapping"]]
    assert mask.any() and not mask[-1]
    assert all((text.answers[0][0] <= starts[i + 1] < text.answers[0][1]) == bool(mask[i])
               for i in range(len(starts) - 1))


def test_message_lists_and_records_with_messages_give_the_same_text():
    tok = _tok()
    messages = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d"}]
    assert chat_texts(tok, [messages]) == chat_texts(tok, [{"messages": messages}])


def test_a_conversation_without_an_answer_is_left_out_with_a_warning():
    tok = _tok()
    with pytest.warns(UserWarning, match="1 conversation"):
        texts = chat_texts(tok, [[{"role": "user", "content": "q"}], [{"role": "user", "content": "q"},
                                                                    {"role": "assistant", "content": "a"}]])
    assert len(texts) == 1


@pytest.mark.parametrize("message", [{"content": "hi"}, {"role": "user"}, {"role": "alien", "content": "x"}])
def test_a_message_without_a_role_or_content_is_an_error_that_says_what_is_needed(message):
    with pytest.raises(ValueError, match="needs a role"):
        chat_texts(_tok(), [[message, {"role": "assistant", "content": "a"}]])


def test_conversations_need_a_chat_template():
    with pytest.raises(ValueError, match="chat template"):
        chat_texts(tiny_tokenizer(), _records(2))


def test_a_sharegpt_file_is_read_record_by_record_and_a_cut_file_ends_at_its_last_whole_record(tmp_path):
    records = _records(5)
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(records))
    assert list(sharegpt_records(whole)) == records
    assert list(sharegpt_records(whole, 1, 3)) == records[1:3]
    cut = tmp_path / "cut.json"
    text = json.dumps(records, indent=1)
    cut.write_text(text[:text.index('"id": "3"') + 20])  # inside record 3
    assert list(sharegpt_records(cut)) == records[:3]
    (tmp_path / "bad.json").write_text('{"not": "an array"}')
    with pytest.raises(ValueError, match="JSON array"):
        list(sharegpt_records(tmp_path / "bad.json"))


def test_batches_train_on_answer_positions_only_in_windows_of_a_long_conversation():
    tok = _tok()
    texts = chat_texts(tok, _records(3))
    opts = CalibrationOptions(max_length=16, batch_size=4)
    rows, tokens = stream_size(texts, tok, opts.max_length)
    got = list(batches(texts, tok, opts, "cpu"))
    assert sum(b["input_ids"].shape[0] for b in got) == rows and rows > 3  # windows of 16 tokens
    assert sum(int(b["trained"].sum()) for b in got) == tokens
    assert sum(b["texts"] for b in got) == 3
    for b in got:
        assert not (b["trained"] & ~b["attention_mask"].bool()).any()
    # plain strings: every real token, one row a text, as before
    plain = list(batches(["one two three", "four five"], tok, opts, "cpu"))
    assert plain[0]["trained"].equal(plain[0]["attention_mask"].bool())


def test_the_token_budget_keeps_the_first_texts_that_hold_it():
    tok = _tok()
    texts = chat_texts(tok, _records(6))
    assert within_budget(texts, tok, 64, 1) == texts[:1]
    assert within_budget(texts, tok, 64, None) == texts
    for bad in (0, "lots", True):
        with pytest.raises(ValueError, match="train_tokens"):
            CalibrationOptions(train_tokens=bad)


def test_the_default_budget_reads_what_num_samples_plain_texts_of_max_length_hold():
    """`train_tokens="auto"` (the default) caps the stream at `num_samples` x `max_length` tokens: plain texts are
    never cut by it, and long conversations (read in windows of `max_length`) stop there; None reads every text."""
    from tide.calibration.phases import Context
    from tide.calibration.texts import read_texts

    tok = _tok()
    model = tide.TideForCausalLM.from_base(tiny_model("llama"), tide.TideConfig(checkpoint_interval=2))
    assert CalibrationOptions().train_tokens == "auto"
    opts = CalibrationOptions(num_samples=20, max_length=4, heldout_fraction=0.5, progress=False)
    assert opts.train_budget == 80
    capped = read_texts(Context.start(model, tok, opts), _records(20))
    assert stream_size(capped.train_texts[:-1], tok, 4)[1] < 80 <= stream_size(capped.train_texts, tok, 4)[1]
    whole = read_texts(Context.start(model, tok, CalibrationOptions(num_samples=20, max_length=4, heldout_fraction=0.5,
                                                                      train_tokens=None, progress=False)),
                       _records(20))
    assert len(capped.train_texts) < len(whole.train_texts) == 10


def test_calibration_on_conversations_trains_on_answers_and_times_on_held_out_questions():
    torch.manual_seed(0)
    tok = _tok()
    records = _records(12)
    model = tide.calibrate(tiny_model("llama"), tok, dataset=records,
                           config=tide.TideConfig(checkpoint_interval=2, target_agreement=0.5), max_length=48,
                           head_steps=4, passes=1, validation_tokens=0, draft_trials=0, measure_costs=False,
                           progress=False)
    cal = model.config.calibration
    texts = chat_texts(tok, records)
    answers = sum(stream_size([t], tok, 48)[1] for t in texts)
    assert 0 < cal["train_tokens"] < answers  # answer positions of the training conversations only
    # a datasets.Dataset with a "conversations" column reads the same
    import datasets

    ds = datasets.Dataset.from_list(records)
    again = tide.calibrate(tiny_model("llama"), tok, dataset=ds,
                           config=tide.TideConfig(checkpoint_interval=2, target_agreement=0.5), max_length=48,
                           head_steps=4, passes=1, validation_tokens=0, draft_trials=0, measure_costs=False,
                           progress=False)
    assert again.config.calibration["train_tokens"] == cal["train_tokens"]


def test_a_chat_text_survives_pickling_with_its_spans():
    import pickle

    text = ChatText("<user>q\n<assistant>a\n", [(19, 20)], "<user>q\n<assistant>")
    again = pickle.loads(pickle.dumps(text))
    assert again == text and again.answers == text.answers and again.prompt == text.prompt


def test_the_budget_caps_training_and_held_out_conversations_in_proportion():
    from tide.calibration.phases import Context
    from tide.calibration.texts import read_texts

    tok = _tok()
    model = tide.TideForCausalLM.from_base(tiny_model("llama"), tide.TideConfig(checkpoint_interval=2))
    opts = CalibrationOptions(max_length=48, train_tokens=40, heldout_fraction=0.5, progress=False)
    texts = read_texts(Context.start(model, tok, opts), _records(20))
    assert len(texts.train_texts) < 10 and len(texts.held_texts) < 10  # 10 of each without the budget
    assert stream_size(texts.train_texts[:-1], tok, 48)[1] < 40 <= stream_size(texts.train_texts, tok, 48)[1]
    assert [t.prompt for t in texts.held_texts] == texts.timing_texts
    # `heldout_tokens` cuts the held-out texts further, and leaves the training texts as they were
    opts = CalibrationOptions(max_length=48, train_tokens=160, heldout_fraction=0.5, progress=False)
    proportional = read_texts(Context.start(model, tok, opts), _records(20))
    capped = read_texts(Context.start(model, tok, replace(opts, heldout_tokens=10)), _records(20))
    assert capped.train_texts == proportional.train_texts
    assert len(capped.held_texts) < len(proportional.held_texts)
    assert stream_size(capped.held_texts[:-1], tok, 48)[1] < 10 <= stream_size(capped.held_texts, tok, 48)[1]


def test_features_read_in_bfloat16_train_float32_heads_and_leave_the_model_as_it_was(monkeypatch):
    from tide.calibration import trainer
    from tide.calibration.forward import WeightsIn

    losses = []  # (autocast on, its dtype, the logits' dtype) at each head loss

    def head_kl(student, teacher):
        losses.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), student.dtype))
        return trainer_kl(student, teacher)

    trainer_kl = trainer.head_kl
    monkeypatch.setattr(trainer, "head_kl", head_kl)
    torch.manual_seed(0)
    tok = _tok()
    base = tiny_model("llama")
    own = {name: p.data_ptr() for name, p in base.named_parameters()}
    before = {name: p.detach().clone() for name, p in base.named_parameters()}
    seen = []
    hook = base.model.layers[0].register_forward_hook(lambda m, args, out: seen.append(
        (out[0] if isinstance(out, tuple) else out).dtype))
    model = tide.calibrate(base, tok, dataset=_records(12), config=tide.TideConfig(checkpoint_interval=2,
                                                                                    target_agreement=0.5),
                           max_length=48, head_steps=4, passes=1, validation_tokens=0, draft_trials=0,
                           measure_costs=False, progress=False, feature_dtype="bfloat16")
    hook.remove()
    assert torch.bfloat16 in seen and torch.float32 in seen  # the training stream in bfloat16, held-out scoring not
    for name, p in model.base.named_parameters():  # the very tensors the model had, unchanged
        assert p.data_ptr() == own[name] and p.dtype == torch.float32 and torch.equal(p.data, before[name])
    assert all(p.dtype == torch.float32 for p in model.routers.parameters())
    assert model.config.calibration["train_tokens"] > 0 and model.config.calibration["feature_dtype"] == "bfloat16"
    # the heads' products in bfloat16 under autocast, their KL in float32
    assert losses and all(on and dtype == torch.bfloat16 and logits == torch.float32 for on, dtype, logits in losses)
    losses.clear()  # a float32 stream: float32 products
    tide.calibrate(tiny_model("llama"), tok, dataset=_records(12), config=tide.TideConfig(checkpoint_interval=2),
                   max_length=48, head_steps=2, passes=1, validation_tokens=0, draft_trials=0, measure_costs=False,
                   progress=False, feature_dtype=None)
    assert losses and not any(on for on, _, _ in losses)
    # a float32 model asked for float32 features swaps nothing
    assert WeightsIn(base, "float32")._swaps == [] and WeightsIn(base, None)._swaps == []
    with pytest.raises(ValueError, match="feature_dtype"):
        CalibrationOptions(feature_dtype="int8")


def test_features_auto_read_in_bfloat16_only_where_it_times_faster_on_a_wide_float32_model(monkeypatch):
    """`feature_dtype="auto"` (the default): bfloat16 for a float32 model of hidden size 512 or more whose products
    time BF16_MIN_GAIN faster in it; the model's own dtype for a narrow model (never timed), a bfloat16 model, or
    where bfloat16 is not faster; a dtype asked for is taken as it is."""
    from tide.calibration import forward
    from tide.calibration.forward import AUTO_MIN_HIDDEN, BF16_MIN_GAIN, stream_dtype

    assert CalibrationOptions().feature_dtype == "auto"
    assert 0.0 < forward._bf16_gain(64, torch.device("cpu")) < float("inf")  # (timed: any ratio)
    narrow = tide.TideForCausalLM.from_base(tiny_model("llama"), tide.TideConfig(checkpoint_interval=2))
    wide = tide.TideForCausalLM.from_base(tiny_model("llama", hidden_size=AUTO_MIN_HIDDEN, intermediate_size=64,
                                                     num_hidden_layers=2), tide.TideConfig(checkpoint_interval=1))
    gain = [BF16_MIN_GAIN]
    timed = []
    monkeypatch.setattr(forward, "_bf16_gain", lambda hidden, device: timed.append(hidden) or gain[0])
    assert stream_dtype(narrow, "auto") is None and not timed
    assert stream_dtype(wide, "auto") == "bfloat16" and timed == [AUTO_MIN_HIDDEN]
    gain[0] = BF16_MIN_GAIN * 0.9
    assert stream_dtype(wide, "auto") is None
    assert stream_dtype(wide, "float16") == "float16" and stream_dtype(wide, None) is None
    gain[0] = 10.0
    half = tide.TideForCausalLM.from_base(wide.base.to(torch.bfloat16), tide.TideConfig(checkpoint_interval=1))
    assert stream_dtype(half, "auto") is None
