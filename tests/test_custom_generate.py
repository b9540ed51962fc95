"""A router repo run by a plain transformers model: `base.generate(custom_generate=<repo>, trust_remote_code=True)`
and the pipeline, on local folders (offline), against the wrapped model."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, pipeline

import tide
from tide.hub import custom_generate as runner
from tide.hub.repos import CUSTOM_GENERATE_FILES, REPO_FILES
from tide.models import compat
from tiny_models import noisy_tide, prompt_ids, tiny_model, tiny_tokenizer

FAMILIES = ("llama", "qwen3", "gpt2")


def _repo(tmp_path, family="llama", **config):
    """(router repo folder, base model folder): perturbed routers (lossless drafts get accepted and rejected) whose
    repo names the saved base model and defaults to lossless mode."""
    model, base = noisy_tide(family, mode="lossless", **config)
    base.save_pretrained(tmp_path / "base")
    model.config.base_model_name_or_path = str(tmp_path / "base")
    model.save_pretrained(tmp_path / "routers")
    return tmp_path / "routers", tmp_path / "base"


def _base(folder):
    return AutoModelForCausalLM.from_pretrained(folder)


def _run(base, repo, **kwargs):
    return base.generate(prompt_ids(), max_new_tokens=40, do_sample=False, custom_generate=str(repo),
                         trust_remote_code=True, **kwargs)


def _wrapped(base, repo):
    """The router repo as the wrapped model, on the base model (its routers are in the cache where one is there)."""
    return tide.TideForCausalLM.from_pretrained(repo, base_model=base)


def _held(base) -> dict:
    return base.__dict__.get(runner.CACHE_ATTRIBUTE, {})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_repo_on_a_plain_model_is_the_wrapped_model_token_for_token(family, tmp_path):
    """The issue's call (no tide_config: the repo's default, lossless here) equals the wrapped model's call and the
    base model's own greedy output, and it ran Tide's loop (drafts were made and verified)."""
    repo, folder = _repo(tmp_path, family)
    base = _base(folder)
    plain = base.generate(prompt_ids(), max_new_tokens=40, do_sample=False)
    out = _run(base, repo, return_dict_in_generate=True)
    wrapped = _wrapped(_base(folder), repo).generate(prompt_ids(), max_new_tokens=40, do_sample=False)
    assert torch.equal(out.sequences, wrapped) and torch.equal(wrapped, plain)
    stats = out["tide_stats"]
    assert stats.mode == "lossless" and stats.decode_tokens == 40 and 0 < stats.accepted <= stats.drafted
    assert stats.verify_passes < 40  # (drafts were accepted: fewer passes than tokens)


def test_exit_mode_and_a_calls_tide_config_match_the_wrapped_model(tmp_path):
    repo, folder = _repo(tmp_path)
    options = {"mode": "exit", "exit_threshold": 0.3}
    out = _run(_base(folder), repo, tide_config=options, return_dict_in_generate=True)
    wrapped = _wrapped(_base(folder), repo)
    assert torch.equal(out.sequences, wrapped.generate(prompt_ids(), max_new_tokens=40, do_sample=False,
                                                       tide_config=options))
    assert out["tide_stats"].mode == "exit" and sum(out["tide_stats"].exits.values()) > 0
    assert _run(_base(folder), repo, tide_config=False).shape == out.sequences.shape  # the plain base model


def test_the_routers_are_loaded_once_per_model(tmp_path, monkeypatch):
    repo, folder = _repo(tmp_path)
    loads = []
    real = runner.load_router_repo
    monkeypatch.setattr(runner, "load_router_repo", lambda *a, **k: loads.append(a[1]) or real(*a, **k))
    base = _base(folder)
    first = _run(base, repo)
    held = dict(_held(base))
    second = _run(base, tmp_path / "." / "routers")  # another spelling of the same folder
    assert torch.equal(first, second) and len(loads) == 1 and _held(base) == held
    _run(_base(folder), repo)  # another base model: its own routers
    assert len(loads) == 2
    (wrapped,) = (entry[1] for entry in held.values())
    wrapped.save_pretrained(repo)  # the repo saved again: loaded again
    _run(base, repo)
    assert len(loads) == 3


def test_the_pipeline_runs_the_repo(tmp_path):
    repo, folder = _repo(tmp_path)
    base = _base(folder)
    generator = pipeline("text-generation", model=base, tokenizer=tiny_tokenizer())
    greedy = dict(max_new_tokens=24, do_sample=False)
    text = generator("The assignment statement", custom_generate=str(repo), trust_remote_code=True, **greedy)
    assert len(_held(base)) == 1  # the repo's routers were loaded onto the pipeline's model
    (wrapped,) = (entry[1] for entry in _held(base).values())
    assert wrapped.last_stats.mode == "lossless" and wrapped.last_stats.drafted > 0
    assert text == generator("The assignment statement", **greedy)  # lossless: the base model's own text


@pytest.mark.parametrize("other", [dict(family="qwen3"), dict(family="llama", num_hidden_layers=8)])
def test_a_base_the_routers_do_not_fit_gets_from_pretrained_s_error(tmp_path, other):
    repo, _ = _repo(tmp_path)
    family = other.pop("family")
    with pytest.raises(ValueError, match="do not fit the base model") as expected:
        tide.TideForCausalLM.from_pretrained(repo, base_model=tiny_model(family, **other))
    base = tiny_model(family, **other)
    with pytest.raises(ValueError) as got:
        _run(base, repo)
    assert str(got.value) == str(expected.value) and not _held(base)


def test_a_hub_repo_id_from_the_offline_cache(tmp_path):
    """`custom_generate="user/name"` resolved from a local Hugging Face cache with HF_HUB_OFFLINE=1 (set before
    import, hence a fresh process, which never imports tide itself): the output is the base model's own (lossless),
    the routers loaded once."""
    cache = tmp_path / "hub"
    model, base = noisy_tide("llama", mode="lossless")
    model.config.base_model_name_or_path = "tide-test/tiny-llama"
    repos = (("tide-test/tiny-llama", base.save_pretrained), ("tide-test/tiny-llama-tide", model.save_pretrained))
    for repo, save in repos:
        snap = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / ("a" * 40)
        snap.mkdir(parents=True)
        (snap.parent.parent / "refs").mkdir()
        (snap.parent.parent / "refs" / "main").write_text("a" * 40)
        save(snap)
    script = textwrap.dedent("""
        import torch
        from transformers import AutoModelForCausalLM
        base = AutoModelForCausalLM.from_pretrained("tide-test/tiny-llama")
        ids = torch.randint(4, 100, (1, 9), generator=torch.Generator().manual_seed(0))
        plain = base.generate(ids, max_new_tokens=20, do_sample=False)
        for _ in range(2):
            out = base.generate(ids, max_new_tokens=20, do_sample=False, custom_generate="tide-test/tiny-llama-tide",
                                trust_remote_code=True, return_dict_in_generate=True)
            assert torch.equal(out.sequences, plain) and out["tide_stats"].drafted > 0
        assert list(base._tide_router_repos) == [("tide-test/tiny-llama-tide", None)]
        print("OK")
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_MODULES_CACHE=str(tmp_path / "modules"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_the_repo_files_and_model_card(tmp_path):
    repo, _ = _repo(tmp_path)
    assert sorted(os.listdir(repo)) == sorted(REPO_FILES + ("custom_generate",))
    assert sorted(os.listdir(repo / "custom_generate")) == ["generate.py", "requirements.txt"]
    assert (repo / "custom_generate" / "requirements.txt").read_text() == f"tide-transformers>={tide.__version__}\n"
    assert "tide.TideForCausalLM.generate_with_router_repo" in (repo / "custom_generate" / "generate.py").read_text()
    card = ModelCard.load(repo / "README.md")
    assert "custom_generate" in card.data.tags
    assert 'custom_generate="<this repo>", trust_remote_code=True' in card.text and "from_pretrained" in card.text


def test_the_flag_turns_the_custom_generate_files_off(tmp_path):
    repo, folder = _repo(tmp_path)
    _wrapped(_base(folder), repo).save_pretrained(repo, custom_generate=False)  # over a repo that had them
    assert sorted(os.listdir(repo)) == sorted(REPO_FILES)
    assert "custom_generate" not in ModelCard.load(repo / "README.md").data.tags
    with pytest.raises(OSError, match="does not contain a `custom_generate`"):
        _run(_base(folder), repo)


def test_push_to_hub_uploads_the_custom_generate_files_unless_turned_off(tmp_path, monkeypatch):
    uploads = []

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            pass

        def upload_folder(self, repo_id, folder_path, allow_patterns, commit_message):
            files = {str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*")}
            uploads.append((sorted(f for f in files if "." in os.path.basename(f)), sorted(allow_patterns)))

    monkeypatch.setattr(tide.hub.repos, "HfApi", FakeApi)
    model, _ = noisy_tide("llama")
    model.push_to_hub("user/llama-tide")
    model.save_pretrained(tmp_path / "out", push_to_hub=True, repo_id="user/llama-tide", custom_generate=False)
    assert uploads[0][0] == uploads[0][1] == sorted(REPO_FILES + CUSTOM_GENERATE_FILES)
    assert uploads[1][0] == uploads[1][1] == sorted(REPO_FILES)


def test_a_custom_generate_file_tide_did_not_write_is_never_replaced(tmp_path):
    (tmp_path / "custom_generate").mkdir()
    (tmp_path / "custom_generate" / "generate.py").write_text("def generate(model, **kwargs): ...\n")
    model, _ = noisy_tide("llama")
    with pytest.raises(ValueError, match="not written by Tide"):
        model.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_the_function_outside_a_generate_call_says_how_to_call_it():
    assert compat.custom_generate_repo() is None
    with pytest.raises(RuntimeError, match="custom_generate=<router repo>"):
        tide.TideForCausalLM.generate_with_router_repo(tiny_model("llama"), input_ids=prompt_ids())
