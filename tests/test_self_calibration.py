"""Calibration on the model's own text (`calibrate(prompts=...)`, `calibration.selftext`) and the candidate-token
head loss for large vocabularies (`calibration.headloss`, `ModelParts.logits_for_ids`)."""

import math
import torch
import torch.nn.functional as F

import tide
from tide.calibration import headloss
from tide.calibration.selftext import SelfText, generated_texts, prompt_texts
from tide.heads.draftvocab import ranked_vocabulary
from tide.models.architectures import resolve as model_parts
from tiny_models import sample_texts, tiny_model, tiny_tokenizer

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")


def test_prompts_go_through_the_chat_template_where_there_is_one():
    tok = tiny_tokenizer()
    assert prompt_texts(tok, ["hi there"]) == ["hi there"]  # no template: the string itself
    tok.chat_template = TEMPLATE
    assert prompt_texts(tok, ["hi"]) == ["<user>hi\n<a>"]
    assert prompt_texts(tok, ["hi"], chat=False) == ["hi"]
    assert prompt_texts(tok, [[{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]]) == \
        ["<system>s\n<user>q\n<a>"]


def test_generated_texts_are_the_prompts_continued_by_the_base_model():
    """The greedy text of each prompt is the prompt plus what `generate` writes for it alone (left padding in the
    batch changes nothing), and each prompt also gets its sampled texts."""
    base, tok = tiny_model("llama"), tiny_tokenizer()
    prompts = ["The cat sat", "A much longer prompt here"]
    texts = generated_texts(base, tok, prompts, SelfText(new_tokens=6, samples=2, batch_size=2))
    assert len(texts) == 6 and tok.padding_side == "right" and tok.pad_token is None  # the tokenizer as it was
    for i, prompt in enumerate(prompts):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        alone = base.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=1)
        ends = (alone[0, ids.shape[1]:] == 1).nonzero()
        cut = ids.shape[1] + (int(ends[0]) + 1 if len(ends) else 6)
        assert texts[3 * i] == tok.decode(alone[0, :cut])
        assert all(t.startswith(prompt) for t in texts[3 * i:3 * i + 3])


def test_calibration_from_prompts_alone_records_its_data_and_generation_time():
    torch.manual_seed(0)
    prompts = [t[:24] for t in sample_texts(10)]
    model = tide.calibrate(tiny_model("llama"), tiny_tokenizer(), prompts=prompts,
                           config=tide.TideConfig(checkpoint_interval=2, target_agreement=0.5), prompt_new_tokens=8,
                           prompt_samples=1, head_steps=4, passes=1, validation_tokens=0, draft_trials=0,
                           measure_costs=False, progress=False)
    cal = model.config.calibration
    assert cal["dataset"] == "the model's answers to 10 prompts" and cal["num_samples"] == 20
    assert cal["phase_seconds"]["generation"] > 0 and cal["train_tokens"] > 0


def test_calibration_needs_a_dataset_or_prompts():
    import pytest

    with pytest.raises(ValueError, match="prompts"):
        tide.calibrate(tiny_model("llama"), tiny_tokenizer(), config=tide.TideConfig(checkpoint_interval=2))


def test_logits_for_ids_are_the_heads_logits_at_those_ids():
    """Per-row ids through the model's own head, scale and soft-cap included (gemma2 soft-caps its logits)."""
    for family in ("llama", "gemma2"):
        parts = model_parts(tiny_model(family))
        normed = torch.randn(3, parts.norm.weight.shape[-1])
        ids = torch.randint(0, 64, (3, 5))
        full = parts.logits_from_normed(normed)
        torch.testing.assert_close(parts.logits_for_ids(normed, ids), full.gather(-1, ids))


def test_the_candidate_kl_is_the_kl_over_the_candidates_with_duplicates_masked():
    parts = model_parts(tiny_model("llama"))
    normed_s, normed_t = torch.randn(4, parts.norm.weight.shape[-1]), torch.randn(4, parts.norm.weight.shape[-1])
    top = torch.stack([torch.randperm(64)[:6] for _ in range(4)])
    negatives = torch.cat([top[0, :2], torch.tensor([70, 71, 72])])  # two of row 0's own tokens among them
    cand = headloss.Candidates(top, negatives)
    assert cand.duplicate[0, :2].all() and not cand.duplicate[0, 2:].any()
    student, teacher = cand.logits(parts, normed_s), cand.logits(parts, normed_t)
    expected = 0.0
    for row in range(4):  # the KL of the two distributions renormalised over the row's distinct candidates
        ids = torch.unique(torch.cat([top[row], negatives]))
        s, t = parts.logits_from_normed(normed_s)[row, ids], parts.logits_from_normed(normed_t)[row, ids]
        expected += F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="sum")
    torch.testing.assert_close(headloss.head_kl(student, teacher), expected / 4)


def test_large_vocabularies_train_their_heads_on_candidates():
    """A vocabulary of 16 x (32 + 256) tokens and more takes the candidate loss at every head step, 1,000 steps by
    default (each costs far less than a step over the whole vocabulary), and calibration runs through with it."""
    assert not headloss.uses_candidates(4096, True) and headloss.uses_candidates(4608, True)
    assert not headloss.uses_candidates(4608, False)  # an offloaded head: the whole vocabulary
    torch.manual_seed(0)
    base = tiny_model("llama", vocab_size=8192)
    from tide.calibration import run, trainer

    seen, ranked = [], []
    original = trainer._Trainer._head_step

    def step(self):
        seen.append(self.candidates)
        # the draft heads learn over the tokens the full model predicted most so far, as many as the largest draft
        # vocabulary; the exit heads over candidates
        expected = ranked_vocabulary(self.predicted, 8192 // 4)
        original(self)
        ranked.append(torch.equal(self.draft_head[0], self.parts.head_rows(expected)[0]))
        assert self.draft_rows == 8192 // 4 and self.drafts

    trainer._Trainer._head_step = step
    try:
        model = tide.calibrate(base, tiny_tokenizer(), dataset=sample_texts(16),
                               config=tide.TideConfig(checkpoint_interval=2), num_samples=16, max_length=32,
                               head_steps=3, passes=1, validation_tokens=0, draft_trials=0, measure_costs=False,
                               progress=False)
    finally:
        trainer._Trainer._head_step = original
    assert seen == [True] * 3 and ranked == [True] * 3
    # no timing trials, no drafting scheme: the repo still keeps the ranked vocabulary, for a draft_vocab_size
    assert model.draft_vocabulary is not None and model.draft_vocabulary.numel() == 8192 // 4
    ids = torch.randint(3, 8192, (1, 6))
    config = {"mode": "lossless", "draft_layer": 1, "max_draft": 2, "draft_vocab_size": 1024}
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=8, tide_config=config),
                       base.generate(ids, do_sample=False, max_new_tokens=8))
    default = trainer._Trainer(tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2)),
                               run.CalibrationOptions(), num_batches=4)
    assert default.candidates and default.head_steps_left == trainer.HEAD_STEPS[True] == 1000
    # a longer stream: HEAD_PASSES minibatches' rows a training token (over candidates, 3 x 200,000 / 256 steps)
    longer = trainer._Trainer(tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_interval=2)),
                              run.CalibrationOptions(), num_batches=4, train_tokens=200_000)
    assert longer.head_steps_left == math.ceil(trainer.HEAD_PASSES[True] * 200_000 / 256) == 2344
