"""The `tide` command line on tiny local models."""

import json
import re

import pytest
import torch

import tide
from tide.tools.cli import main
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
    assert sorted(p.name for p in router_dir.iterdir()) == [
        "README.md", "config.json", "custom_generate", "routers.safetensors"]
    assert json.loads((router_dir / "config.json").read_text())["thresholds"]


@pytest.mark.parametrize("mode, flags", [("exit", ["--threshold", "-1"]), ("lossless", ["--max-draft", "2"]),
                                         ("lossless", ["--max-draft", "1", "--draft-topk", "3"])])
def test_generate_prints_text_and_stats(router_dir, capsys, mode, flags):
    assert main(["generate", str(router_dir), "Hello", "--max-new-tokens", "8", "--mode", mode, *flags]) == 0
    out = capsys.readouterr().out
    assert ("Hello" in out and "decode tokens" in out
            and ("mean layers per token" in out or "layer passes per token" in out))


def test_generate_streams(router_dir, capsys):
    assert main(["generate", str(router_dir), "Hello", "--max-new-tokens", "6", "--stream"]) == 0
    assert "Hello" in capsys.readouterr().out


def test_bench_writes_json_and_plot(router_dir, text_file, tmp_path, eager_compiled_baseline):
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
    assert variants["lossless"]["greedy_identical"] and variants["lossless compile=True"]["greedy_identical"]
    assert variants["lossless compile=True"]["ratio_to_compiled"] > 0 and results["tide_compile_s"] > 0
    assert results["tide_compiling"]["graphs_compiled"] >= 1 and results["tide_compiling"]["compile_s"] > 0
    assert {"checkpoint", "skipped_layer", "head", "layer_s"} <= set(results["costs"])
    assert results["oracle"]["exits"] > 0 and results["oracle"]["lens"] > 0
    trials = results["draft_selection"]["trials"]  # what calibration timed for lossless mode, chains and trees
    assert trials and all({"draft_layer", "max_draft", "draft_topk", "estimate", "measured"} <= set(t) for t in trials)
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_import_tide(base_dir, tmp_path, capsys):
    state = {"hidden_dim": 32, "bottleneck_dim": 8, "router_layers": {
        k: {"down.weight": torch.randn(8, 32), "up.weight": torch.randn(1, 8)} for k in (1, 3)}}
    torch.save(state, tmp_path / "router.pt")
    assert main(["import-tide", str(tmp_path / "router.pt"), "--base", str(base_dir),
                 "--out", str(tmp_path / "out")]) == 0
    assert isinstance(tide.TideForCausalLM.from_pretrained(tmp_path / "out"), tide.TideForCausalLM)


def test_errors_are_one_line_with_what_to_do(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "Hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tide generate: error:")


def test_demo_runs_end_to_end(tmp_path, capsys, monkeypatch, eager_compiled_baseline):
    """The README's demo command: the shipped model, calibrated, saved, reloaded, generating, measured.

    Made cheaper than `tide demo --quick` where the test reads nothing of it: calibration trains its exit and draft
    heads for 15 steps, not 60 (training them was most of the test's time), and the compiled baseline of the speed
    section is captured by dynamo as one graph without inductor's code generation (the eager backend, as
    tests/test_compile.py does; inductor is tested there: the `eager_compiled_baseline` fixture)."""
    import tide.tools.demo

    calibrate = tide.tools.demo.calibrate

    def fewer_head_steps(*args, **kwargs):
        return calibrate(*args, **{**kwargs, "head_steps": min(kwargs.get("head_steps", 15), 15)})

    monkeypatch.setattr(tide.tools.demo, "calibrate", fewer_head_steps)
    assert main(["demo", "--quick", "--out", str(tmp_path / "routers")]) == 0
    out = capsys.readouterr().out
    for section in ("1. The shipped model", "2. Calibrate", "3. Save", "mode='exit'", "mode='lossless'", "5. Speed"):
        assert section in out
    took = re.search(r"demo took ([0-9.]+) s: 1\. [0-9.]+ s, 2\. [0-9.]+ s, 3\. [0-9.]+ s, 4\. [0-9.]+ s, "
                     r"5\. ([0-9.]+) s", out)
    assert took and float(took.group(1)) >= float(took.group(2)), out[-300:]  # each section timed
    assert sorted(p.name for p in (tmp_path / "routers").iterdir()) == [
        "README.md", "config.json", "custom_generate", "routers.safetensors"]


def _one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"tide {command}: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, option", [
    (["bench", "--new-tokens", "0"], "--new-tokens"),
    (["bench", "--new-tokens", "-5"], "--new-tokens"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--heldout-texts", "-1"], "--heldout-texts"),
    (["generate", "m", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "m", "hi", "--threshold", "nan"], "--threshold"),
    (["generate", "m", "hi", "--threshold", "1.5"], "--threshold"),
    (["generate", "m", "hi", "--max-draft", "-1"], "--max-draft"),
    (["generate", "m", "hi", "--draft-layer", "-2"], "--draft-layer"),
    (["generate", "m", "hi", "--draft-topk", "0"], "--draft-topk"),
    (["generate", "m", "hi", "--draft-topk", "9"], "--draft-topk"),
    (["generate", "m", "hi", "--draft-vocab-size", "3"], "--draft-vocab-size"),
    (["calibrate", "m", "--dataset", "d", "--out", "o", "--num-samples", "1"], "--num-samples"),
    (["calibrate", "m", "--dataset", "d", "--out", "o", "--max-length", "0"], "--max-length"),
    (["calibrate", "m", "--dataset", "d", "--out", "o", "--batch-size", "0"], "--batch-size"),
    (["calibrate", "m", "--dataset", "d", "--out", "o", "--checkpoint-interval", "0"], "--checkpoint-interval"),
    (["calibrate", "m", "--dataset", "d", "--out", "o", "--checkpoint-layers", "1", "-3"], "--checkpoint-layers"),
    (["calibrate", "m", "--dataset", "d", "--out", "o", "--target-agreement", "0"], "--target-agreement"),
    (["calibrate", "m", "--dataset", "d", "--out", "o", "--target-agreement", "1.5"], "--target-agreement"),
    (["calibrate", "m", "--dataset", "d", "--out", "o", "--dtype", "float17"], "--dtype"),
])
def test_out_of_range_options_are_one_line_errors_before_any_work(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_:  # argument parsing stops it: nothing is loaded
        main(argv)
    assert exit_.value.code == 2
    line = _one_error_line(capsys.readouterr().err, argv[0])
    assert f"argument {option}: must be" in line


def test_bench_times_exit_mode_only_where_calibration_kept_exits():
    """With every threshold at 1.0 (calibration turned exits off) exit mode runs the base model, which the bench's
    first row already times: no exit rows then."""
    from types import SimpleNamespace

    from tide.tools.bench import _variants

    def names(thresholds):
        config = tide.TideConfig(checkpoint_interval=2, thresholds=thresholds)
        model = SimpleNamespace(config=config, heldout_selection=None)
        return [name for name in _variants(model, ())[0] if name.startswith("exit")]

    assert names({"1": 1.0, "3": 1.0}) == [] and names(None) == []
    assert names({"1": 0.7, "3": 1.0}) == ["exit calibrated (propagate)", "exit calibrated (recompute)"]


def test_bench_refuses_an_empty_heldout_file(router_dir, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n\n  \n\n")
    assert main(["bench", str(router_dir), "--heldout", str(tmp_path / "empty.txt"), "--repeats", "1"]) == 2
    assert "empty.txt holds no text" in _one_error_line(capsys.readouterr().err, "bench")


def _no_calibration(*args, **kwargs):
    raise AssertionError("calibration ran")


def test_calibrate_refuses_the_base_models_folder_before_calibrating(base_dir, text_file, capsys, monkeypatch):
    monkeypatch.setattr(tide.tools.cli, "calibrate", _no_calibration)
    before = sorted(p.name for p in base_dir.iterdir())
    assert main(["calibrate", str(base_dir), "--dataset", str(text_file), "--out", str(base_dir)]) == 2
    assert "model weights" in _one_error_line(capsys.readouterr().err, "calibrate")
    assert sorted(p.name for p in base_dir.iterdir()) == before


def test_calibrate_refuses_an_empty_dataset_up_front(base_dir, tmp_path, capsys, monkeypatch):
    from tide.calibration.data import DatasetLoadError, load_texts

    (tmp_path / "empty.txt").write_text("")
    monkeypatch.setattr(tide.tools.cli, "calibrate", _no_calibration)
    assert main(["calibrate", str(base_dir), "--dataset", str(tmp_path / "empty.txt"),
                 "--out", str(tmp_path / "o")]) == 2
    assert f"{tmp_path / 'empty.txt'} is empty" in _one_error_line(capsys.readouterr().err, "calibrate")
    with pytest.raises(DatasetLoadError, match="empty.txt is empty"):
        load_texts(str(tmp_path / "empty.txt"))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("\n \n")
    with pytest.raises(DatasetLoadError, match="Every data file under .*texts is empty"):
        load_texts(str(tmp_path / "texts"))


def test_generate_stream_hides_special_tokens_like_the_plain_output(tmp_path, capsys):
    """A base model whose first greedy token is the end-of-text token: neither output shows it."""
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama")
    ids = tokenizer("Hello", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        first = int(model(ids).logits[0, -1].argmax())
        weight = model.lm_head.weight
        weight[[first, tokenizer.eos_token_id]] = weight[[tokenizer.eos_token_id, first]]
        assert int(model(ids).logits[0, -1].argmax()) == tokenizer.eos_token_id
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    outputs = []
    for stream in ([], ["--stream"]):
        assert main(["generate", str(tmp_path), "Hello", "--max-new-tokens", "4", *stream]) == 0
        outputs.append(capsys.readouterr().out)
    for out in outputs:
        assert "Hello" in out and tokenizer.eos_token not in out, out


def test_calibrate_from_a_prompts_file(base_dir, tmp_path, capsys, monkeypatch):
    """--prompts FILE: one prompt a line (blank and '#' lines skipped) reach calibrate as prompts=; neither
    --dataset nor --prompts, or a file with one prompt, is a one-line error before anything loads."""
    seen = {}

    def fake_calibrate(base, tokenizer, dataset=None, prompts=None, **kwargs):
        seen.update(dataset=dataset, prompts=prompts)
        raise ValueError("stop here")

    monkeypatch.setattr(tide.tools.cli, "calibrate", fake_calibrate)
    (tmp_path / "p.txt").write_text("# questions\nWhat is a cat?\n\nWhy is the sky blue?\n")
    assert main(["calibrate", str(base_dir), "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "o")]) == 2
    assert seen == {"dataset": None, "prompts": ["What is a cat?", "Why is the sky blue?"]}
    capsys.readouterr()
    assert main(["calibrate", str(base_dir), "--out", str(tmp_path / "o")]) == 2
    assert "--prompts" in _one_error_line(capsys.readouterr().err, "calibrate")
    (tmp_path / "one.txt").write_text("Only one\n")
    assert main(["calibrate", str(base_dir), "--prompts", str(tmp_path / "one.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "at least 2" in _one_error_line(capsys.readouterr().err, "calibrate")
