"""`calibrate(prompts=...)` refuses what is not a list of prompts, before any work, and never calibrates silently on
prompts cut before the model's answer."""

import warnings

import pytest

import tide
from tide.calibration.selftext import check_lengths
from tiny_models import tiny_model, tiny_tokenizer

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")
FAST = dict(prompt_new_tokens=4, prompt_samples=0, head_steps=1, passes=1, validation_tokens=0, draft_trials=0,
            measure_costs=False, progress=False)


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama")


def _calibrate(base, prompts, tokenizer=None, **options):
    tokenizer = tokenizer or tiny_tokenizer()
    return tide.calibrate(base, tokenizer, prompts=prompts, config=tide.TideConfig(checkpoint_interval=2),
                          **{**FAST, **options})


@pytest.mark.parametrize("prompts, needle", [
    ("What is Python? Explain.", r"prompts must be a list .* got str; for one prompt pass \[prompt\]"),
    ([["hi"], ["yo"]], r"prompts\[0\] .* message 0 \('hi'\) is not a chat message"),
    ([[{"content": "hi"}], [{"role": "user", "content": "yo"}]], r"prompts\[0\] .*needs a 'role'"),
    ([[{"role": "user"}], [{"role": "user", "content": "yo"}]], r"prompts\[0\] .*and a 'content'"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": "yo"}], "not conversations"),
    (["", "", ""], r"prompts\[0\] \(''\) is blank"),
    (["a question", "   "], r"prompts\[1\] .* is blank"),
    ([[{"role": "user", "content": " "}], ["yo"]], r"prompts\[0\] .* holds no text"),
    ([3, 4], r"prompts\[0\] \('3'\) is a int"),
])
def test_prompts_that_are_not_a_list_of_prompts_are_refused_before_any_work(base, prompts, needle):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    with pytest.raises(ValueError, match=needle):
        _calibrate(base, prompts, tokenizer)


@pytest.mark.parametrize("chat", ["no", 0, "False"])
def test_prompt_chat_must_be_a_bool_or_none(base, chat):
    with pytest.raises(ValueError, match="prompt_chat must be True, False or None"):
        _calibrate(base, ["a question", "another one"], prompt_chat=chat)


def test_a_prompt_longer_than_the_models_positions_says_how_long_it_may_be(base):
    prompts = ["x" * 300, "a short question"]  # the tiny Llama takes 256 positions
    with pytest.raises(ValueError, match=r"300 tokens .* past the model's 256 positions; shorten the prompt"):
        _calibrate(base, prompts)
    with pytest.raises(ValueError, match=r"250 tokens .* prompt_new_tokens=8 .* 256 positions"):
        _calibrate(base, ["y" * 250, "a short question"], prompt_new_tokens=8)


def test_prompts_that_fill_max_length_leave_no_answer_and_are_refused(base):
    """Six prompts of about 165 characters and max_length=32: every text would be cut before its answer."""
    prompts = [f"Question {i}: " + "tell me about the seasons and why they change " * 4 for i in range(6)]
    with pytest.raises(ValueError, match=r"6 of 6 prompts are 32 tokens or longer .* none of the model's answers"):
        _calibrate(base, prompts, max_length=32)


def test_some_prompts_that_fill_max_length_are_a_warning(base):
    tokenizer = tiny_tokenizer()
    with pytest.warns(UserWarning, match=r"1 of 2 prompts are 16 tokens or longer"):
        check_lengths(tokenizer, base, ["a" * 40, "short"], new_tokens=4, max_length=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_lengths(tokenizer, base, ["a" * 10, "short"], new_tokens=4, max_length=16)
