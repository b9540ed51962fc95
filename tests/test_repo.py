"""Calibration end to end, router repos on disk and through an offline Hub cache, TIDE import."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import tide
from tide.calibration.data import DatasetLoadError
from tide.config.generation import CHAIN_FIELDS
from tide.hub.repos import REPO_FILES, repo_files
from tiny_models import FAMILIES, sample_texts, tiny_model, tiny_tokenizer

FAST = dict(num_samples=16, batch_size=8, max_length=32, progress=False, head_steps=20, draft_trials=1,
            validation_tokens=128)


def _calibrated(family="llama", **cfg):
    config = tide.TideConfig(checkpoint_interval=2, target_agreement=0.6, **cfg)
    return tide.calibrate(tiny_model(family), tiny_tokenizer(), dataset=sample_texts(16), config=config, **FAST)


@pytest.fixture(scope="module")
def calibrated():
    """`_calibrated()`, made once: the tests that take it only read it, save it and load it onto other bases."""
    return _calibrated()


@pytest.mark.parametrize("family", FAMILIES)
def test_calibrate_and_round_trip(family, tmp_path):
    model = _calibrated(family)
    cal = model.config.calibration
    assert set(cal["checkpoints"]) == {"1", "3"} and set(model.config.thresholds) == {"1", "3"}
    for row in cal["checkpoints"].values():
        assert 0.0 <= row["label_rate"] <= 1.0 and 0.0 <= row["exit_rate"] <= 1.0
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(REPO_FILES + ("custom_generate",))  # no base weights, no pickle
    loaded = tide.TideForCausalLM.from_pretrained(tmp_path, base_model=model.base)
    for (name, a), (_, b) in zip(model.routers.state_dict().items(), loaded.routers.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.config.thresholds == model.config.thresholds


def test_cosine_label_rule(calibrated):
    """cos(h, h_final) > 1.0 never holds: under the cosine rule nothing is labelled, unlike under top-1."""
    cosine = _calibrated(label="cosine", cosine_threshold=1.0).config.calibration["checkpoints"]
    top1 = calibrated.config.calibration["checkpoints"]
    assert all(row["label_rate"] == 0.0 for row in cosine.values())
    assert any(row["label_rate"] > 0.0 for row in top1.values())


def test_the_calibration_record_is_saved_and_read_back(calibrated, tmp_path):
    """config.json holds the calibration record's dict; reading it back as records and writing them gives it again."""
    from tide.records import CalibrationRecord

    calibrated.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["calibration"]
    record = CalibrationRecord.from_dict(saved)
    assert json.loads(json.dumps(record.to_dict())) == saved
    assert set(record.checkpoints) == {"1", "3"} and record.costs.device == "cpu"
    assert record.decode_validation.tokens > 0 and record.draft_selection.trials


def test_router_file_is_safetensors_with_metadata(calibrated, tmp_path):
    calibrated.save_pretrained(tmp_path)
    with safe_open(tmp_path / "routers.safetensors", "pt") as f:
        assert f.metadata()["checkpoints"] == "1,3"
        params = ("down.weight", "down.bias", "up.weight", "up.bias", "translator.weight", "translator.bias")
        drafts = ("draft.own.weight", "draft.own.bias", "draft.context", "draft.mlp_in.weight", "draft.mlp_in.bias",
                  "draft.mlp_out")  # draft heads: the first half of the stack
        expected = [f"{k}.{p}" for k in (1, 3) for p in params] + [f"1.{p}" for p in drafts]
        assert sorted(f.keys()) == sorted(expected)
    card = (tmp_path / "README.md").read_text()
    assert "tide.calibrate" in card and "| 3 |" in card


def test_load_base_by_name_and_through_automodel(tmp_path):
    base = tiny_model("llama")
    base.save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    model = tide.calibrate(base, tiny_tokenizer(), dataset=sample_texts(16),
                           config=tide.TideConfig(checkpoint_interval=2), **FAST)
    assert model.config.base_model_name_or_path == str(tmp_path / "base")
    model.save_pretrained(tmp_path / "routers")
    for loaded in (tide.TideForCausalLM.from_pretrained(tmp_path / "routers"),
                   AutoModelForCausalLM.from_pretrained(tmp_path / "routers")):
        assert isinstance(loaded, tide.TideForCausalLM)
        torch.testing.assert_close(loaded.routers[3].down.weight, model.routers[3].down.weight)


@pytest.mark.parametrize("overrides, needle", [
    (dict(num_hidden_layers=8), "number of layers"),
    (dict(hidden_size=48), "hidden size"),
])
def test_mismatched_base_fails_naming_the_mismatch(calibrated, tmp_path, overrides, needle):
    calibrated.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=needle):
        tide.TideForCausalLM.from_pretrained(tmp_path, base_model=tiny_model("llama", **overrides))


def test_wrong_model_type_is_named(calibrated, tmp_path):
    calibrated.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model type"):
        tide.TideForCausalLM.from_pretrained(tmp_path, base_model=tiny_model("qwen3"))


def test_missing_dataset_fails_loudly():
    with pytest.raises(DatasetLoadError, match="Pass local text"):
        tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset="no-such-user/no-such-dataset", **FAST)


def test_local_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("\n".join(sample_texts(20)))
    model = tide.calibrate(tiny_model("llama"), tiny_tokenizer(), dataset=str(tmp_path / "a.txt"),
                           config=tide.TideConfig(checkpoint_interval=2), **FAST)
    assert model.config.calibration["num_samples"] == 16


def test_hub_repo_from_offline_cache(tmp_path):
    """A repo id resolved from a local Hugging Face cache with HF_HUB_OFFLINE=1 (set before import)."""
    cache = tmp_path / "hub"
    base = tiny_model("llama")
    for repo, save in (("tide-test/tiny-llama", base.save_pretrained), ("tide-test/tiny-llama-tide", None)):
        snap = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / ("a" * 40)
        snap.mkdir(parents=True)
        (snap.parent.parent / "refs").mkdir()
        (snap.parent.parent / "refs" / "main").write_text("a" * 40)
        if save:
            save(snap)
        else:
            model = tide.calibrate(base, tiny_tokenizer(), dataset=sample_texts(16),
                                   config=tide.TideConfig(checkpoint_interval=2), **FAST)
            model.config.base_model_name_or_path = "tide-test/tiny-llama"
            model.save_pretrained(snap)
    script = textwrap.dedent("""
        import tide, torch
        from transformers import AutoModelForCausalLM
        m = tide.TideForCausalLM.from_pretrained("tide-test/tiny-llama-tide")
        a = AutoModelForCausalLM.from_pretrained("tide-test/tiny-llama-tide")
        assert type(m).__name__ == type(a).__name__ == "TideForCausalLM"
        assert m.checkpoints == [1, 3] and m.parts.num_layers == 6
        print("OK")
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_convert_tide_routers(tmp_path):
    base = tiny_model("llama")
    hidden, bottleneck = 32, 16
    state = {"hidden_dim": hidden, "bottleneck_dim": bottleneck, "router_layers": {
        k: {"down.weight": torch.randn(bottleneck, hidden), "up.weight": torch.randn(1, bottleneck)} for k in (1, 3, 5)
    }}
    torch.save(state, tmp_path / "router.pt")
    with pytest.warns(UserWarning):
        model = tide.convert_tide_routers(tmp_path / "router.pt", base)
    assert model.checkpoints == [1, 3]  # layer 5 is the last layer: not an exit
    torch.testing.assert_close(model.routers[3].down.weight, state["router_layers"][3]["down.weight"])
    model.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["router_hidden_size"] == bottleneck


def test_not_a_tide_checkpoint(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "router.pt")
    with pytest.raises(ValueError, match="not a TIDE router checkpoint"):
        tide.convert_tide_routers(tmp_path / "router.pt", tiny_model("llama"))


def test_router_dtype_mismatch_is_a_clear_error():
    model = tide.TideForCausalLM.from_base(tiny_model("llama"), tide.TideConfig(checkpoint_interval=2))
    with pytest.raises(RuntimeError, match="align_routers"):
        model.routers.score(1, torch.zeros(1, 32, dtype=torch.float64))


def test_push_to_hub_uploads_only_the_repo_files(calibrated, monkeypatch):
    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls["repo"] = repo_id

        def upload_folder(self, repo_id, folder_path, allow_patterns, commit_message):
            calls["files"] = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*")
                                    if p.is_file())
            calls["allow"] = sorted(allow_patterns)

    monkeypatch.setattr(tide.hub.repos, "HfApi", FakeApi)
    calibrated.push_to_hub("user/llama-tide")
    assert calls["repo"] == "user/llama-tide"
    assert calls["files"] == calls["allow"] == sorted(repo_files())


@pytest.mark.parametrize("base_name", ["org/base-model", None])
def test_model_card_front_matter_parses(tmp_path, base_name):
    from huggingface_hub import ModelCard

    from tide.hub.card import model_card

    config = tide.TideConfig(checkpoint_layers=[1, 3], base_model_name_or_path=base_name, base_model_type="llama",
                             base_num_layers=6, base_hidden_size=32)
    (tmp_path / "README.md").write_text(model_card(config))
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.library_name == "tide-transformers" and "early-exit" in card.data.tags
    assert card.data.base_model == base_name
    assert card.text.lstrip().startswith("# Tide routers for")


def test_unknown_attributes_come_from_the_base_model():
    base = tiny_model("llama")
    model = tide.TideForCausalLM.from_base(base, tide.TideConfig(checkpoint_layers=[1]))
    assert model.model is base.model and model.vocab_size == base.vocab_size
    assert not hasattr(model, "no_such_attribute")
    assert model.routers is not None and model.base is base  # own attributes stay the wrapper's


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_saved_files_get_the_permissions_the_umask_gives(tmp_path, umask):
    """Every repo file as `open` would create it (a group-shared repo's routers readable like its config), still
    written beside the repo and moved into place."""
    model = tide.TideForCausalLM.from_base(tiny_model("llama"), tide.TideConfig(checkpoint_interval=2))
    old = os.umask(umask)
    try:
        model.save_pretrained(tmp_path / "repo")
    finally:
        os.umask(old)
    modes = {name: (tmp_path / "repo" / name).stat().st_mode & 0o777 for name in repo_files()}
    assert modes == {name: 0o666 & ~umask for name in repo_files()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]  # no temporary folder left behind


@pytest.mark.parametrize("name, scheme", [("routers-smollm2", "compiled_chain"), ("routers-smollm2-sharegpt", None)])
def test_the_shipped_smollm2_routers_load_and_draft_exactly(name, scheme):
    """The SmolLM2-135M-Instruct router repos in examples/bench_real (the benchmark of record's) load onto a random
    model of SmolLM2's shape (narrower MLP), and the scheme each drafts (the chain `routers-smollm2` keeps for
    compiled calls, run eagerly here; the tree `routers-smollm2-sharegpt` drafts by default) gives the base model's
    tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    repo = Path(__file__).resolve().parents[1] / "examples" / "bench_real" / name
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=64, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=256)).eval()
    model = tide.TideForCausalLM.from_pretrained(repo, base_model=base)
    defaults = model.config.generation
    drafts = defaults[scheme] if scheme else {k: defaults[k] for k in CHAIN_FIELDS if k in defaults}
    assert model.checkpoints == [3] and drafts["draft_layer"] == 3
    ids = torch.randint(0, 49152, (1, 12))
    greedy = dict(do_sample=False, max_new_tokens=12, min_new_tokens=12)
    expected = base.generate(ids, **greedy)
    out = model.generate(ids, **greedy, tide_config={**drafts, "mode": "lossless", "machine_check": False})
    assert torch.equal(out, expected)
    assert model.last_stats.mode == "lossless"
    assert (model.last_stats.tree_cycles > 0) == (drafts.get("draft_topk", 1) > 1)
