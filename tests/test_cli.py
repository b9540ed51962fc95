"""The `tide` command line on tiny local models."""

import json

import pytest
import torch

import tide
from tide.cli import main
from tiny_models import sample_texts, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text("\n\n".join(sample_texts(40)))
    return path


@pytest.fixture(scope="module")
def router_dir(base_dir, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("routers")
    assert main(["calibrate", str(base_dir), "--dataset", str(text_file), "--out", str(out), "--num-samples", "24",
                 "--max-length", "48", "--checkpoint-interval", "2", "--target-agreement", "0.6"]) == 0
    return out


def test_help_reads_well(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for command in ("calibrate", "generate", "bench", "import-tide", "demo"):
        assert command in text


def test_calibrate_writes_a_router_repo(router_dir):
    assert sorted(p.name for p in router_dir.iterdir()) == ["README.md", "config.json", "routers.safetensors"]
    assert json.loads((router_dir / "config.json").read_text())["thresholds"]


@pytest.mark.parametrize("mode, flags", [("exit", ["--threshold", "-1"]), ("lossless", ["--max-draft", "2"]),
                                         ("lossless", ["--max-draft", "1", "--draft-topk", "3"])])
def test_generate_prints_text_and_stats(router_dir, capsys, mode, flags):
    assert main(["generate", str(router_dir), "Hello", "--max-new-tokens", "8", "--mode", mode, *flags]) == 0
    out = capsys.readouterr().out
    assert "Hello" in out and "decode tokens" in out and ("mean layers per token" in out or "layer passes per token" in out)


def test_generate_streams(router_dir, capsys):
    assert main(["generate", str(router_dir), "Hello", "--max-new-tokens", "6", "--stream"]) == 0
    assert "Hello" in capsys.readouterr().out


def test_bench_writes_json_and_plot(router_dir, text_file, tmp_path):
    args = ["bench", str(router_dir), "--heldout", str(text_file), "--heldout-texts", "3", "--new-tokens", "4",
            "--repeats", "1", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]
    assert main(args) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    variants = results["variants"]
    assert variants["base"]["agreement"] == 1.0 and variants["base"]["greedy_identical"]  # the no-exit engine, measured
    for name, row in variants.items():
        low, high = row["ratio_range"]
        assert low <= row["ratio_to_base"] <= high, name
        assert 0.0 <= row["greedy_token_match"] <= 1.0
    if "lossless" in variants:
        assert variants["lossless"]["greedy_identical"]
    assert {"checkpoint", "skipped_layer", "head", "layer_s"} <= set(results["costs"])
    assert results["oracle"]["exits"] > 0 and results["oracle"]["lens"] > 0
    trials = results["draft_selection"]["trials"]  # what calibration timed for lossless mode, chains and trees
    assert trials and all({"draft_layer", "max_draft", "draft_topk", "estimate", "measured"} <= set(t) for t in trials)
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_import_tide(base_dir, tmp_path, capsys):
    state = {"hidden_dim": 32, "bottleneck_dim": 8, "router_layers": {
        k: {"down.weight": torch.randn(8, 32), "up.weight": torch.randn(1, 8)} for k in (1, 3)}}
    torch.save(state, tmp_path / "router.pt")
    assert main(["import-tide", str(tmp_path / "router.pt"), "--base", str(base_dir), "--out", str(tmp_path / "out")]) == 0
    assert isinstance(tide.TideForCausalLM.from_pretrained(tmp_path / "out"), tide.TideForCausalLM)


def test_errors_are_one_line_with_what_to_do(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "Hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tide generate: error:")


def test_demo_runs_end_to_end(tmp_path, capsys):
    """The README's demo command: the shipped model, calibrated, saved, reloaded, generating, measured."""
    assert main(["demo", "--quick", "--out", str(tmp_path / "routers")]) == 0
    out = capsys.readouterr().out
    for section in ("1. The shipped model", "2. Calibrate", "3. Save", "mode='exit'", "mode='lossless'", "5. Speed"):
        assert section in out
    assert sorted(p.name for p in (tmp_path / "routers").iterdir()) == ["README.md", "config.json", "routers.safetensors"]
