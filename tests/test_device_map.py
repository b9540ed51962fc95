"""A base model loaded with an explicit accelerate `device_map`: calibration and generation through accelerate's hooks.

One CPU cannot hold a real multi-device split, so this uses what one machine can: a device map that offloads
some decoder layers to disk, which makes accelerate wrap those layers (and the model) in its hooks that move
weights onto the execution device at every call, as it does across GPUs.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import tide
from tiny_models import sample_texts, tiny_model, tiny_tokenizer

GREEDY = dict(do_sample=False, max_new_tokens=8)


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    pytest.importorskip("accelerate")
    folder = tmp_path_factory.mktemp("base")
    tiny_model("llama").save_pretrained(folder)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" if i in (2, 4) else "cpu" for i in range(6)})
    model = AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, offload_folder=str(folder / "offload"))
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    return model.eval(), reference


def test_the_offloaded_layers_run_through_accelerate_hooks(offloaded):
    model, _ = offloaded
    assert hasattr(model.model.layers[2], "_hf_hook") and model.hf_device_map["model.layers.2"] == "disk"


def test_generation_through_hooks_equals_the_base_model(offloaded):
    model, reference = offloaded
    tide_model = tide.TideForCausalLM.from_base(model, tide.TideConfig(checkpoint_layers=[1, 3]))
    ids = torch.randint(4, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    expected = reference.generate(ids, **GREEDY)
    assert torch.equal(tide_model.generate(ids, tide_config={"exit_threshold": 1.0}, **GREEDY), expected)
    assert torch.equal(tide_model.generate(ids, tide_config={"mode": "lossless", "draft_layer": 1, "max_draft": 3},
                                           **GREEDY), expected)
    forced = tide_model.generate(ids, tide_config={"exit_threshold": -1}, **GREEDY)
    assert forced.shape == expected.shape and tide_model.last_stats.exits == {"1": GREEDY["max_new_tokens"] - 1}


def test_calibration_through_hooks(offloaded):
    model, _ = offloaded
    calibrated = tide.calibrate(model, tiny_tokenizer(), dataset=sample_texts(12), num_samples=12, max_length=32,
                                config=tide.TideConfig(checkpoint_layers=[1, 3], target_agreement=0.5),
                                head_steps=5, passes=1, measure_costs=False, validation_tokens=0, draft_trials=0,
                                progress=False)
    assert calibrated.config.thresholds and set(calibrated.config.thresholds) == {"1", "3"}
    ids = torch.randint(4, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    out = calibrated.generate(ids, **GREEDY)
    assert out.shape == (2, 6 + GREEDY["max_new_tokens"])


def test_restricted_drafts_through_hooks_equal_the_base_model(offloaded):
    model, reference = offloaded
    tide_model = tide.TideForCausalLM.from_base(model, tide.TideConfig(checkpoint_layers=[1, 3]))
    tide_model.draft_vocabulary = torch.arange(4, 36)
    ids = torch.randint(4, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    expected = reference.generate(ids, **GREEDY)
    for scheme in ({"max_draft": 3}, {"max_draft": 1, "draft_topk": 3}):
        config = {"mode": "lossless", "draft_layer": 1, "draft_vocab_size": 32, **scheme}
        assert torch.equal(tide_model.generate(ids, tide_config=config, **GREEDY), expected)


def test_an_offloaded_head_gives_no_rows_to_copy():
    """A head whose weight accelerate keeps off the device (meta until its hook loads it) is read whole, then
    the draft vocabulary's ids are picked from its logits."""
    model = tide.TideForCausalLM.from_base(tiny_model("llama"))
    model.parts.lm_head = torch.nn.Linear(32, 128, bias=False, device="meta")
    assert model.parts.head_rows(torch.arange(8)) is None
    model.draft_vocabulary = torch.arange(4, 20)
    ids, rows = model._draft_head(8)
    assert rows is None and ids.device.type == "cpu" and ids.tolist() == list(range(4, 12))


def test_calibration_offers_no_restricted_drafts_for_an_offloaded_head(monkeypatch):
    """Calibration and generation agree on which heads' rows can be read alone: an offloaded head's drafts
    would read the whole head, so calibration does not price them as cheaper."""
    import importlib
    import types

    heldout = importlib.import_module("tide.calibration.heldout")
    model = tide.TideForCausalLM.from_base(tiny_model("llama"))
    monkeypatch.setattr(heldout, "candidate_sizes", lambda rows: [16])  # the tiny head is too small for any
    trainer, procs = types.SimpleNamespace(predicted=torch.arange(128)), types.SimpleNamespace(world=1)
    assert model.parts.head_rows_readable
    assert heldout.ranked_draft_vocabulary(model, trainer, procs).tolist()[:3] == [127, 126, 125]
    model.parts.lm_head = torch.nn.Linear(32, 128, bias=False, device="meta")
    assert not model.parts.head_rows_readable and heldout.ranked_draft_vocabulary(model, trainer, procs) is None
