"""A save never replaces, removes or half-writes what is not Tide's: the user's own files in the save folder, a
file where a folder was meant, and a repo whose save fails part-way."""

import os

import pytest

import tide
import tide.hub.folder
from tide.tools.cli import main
from tiny_models import llama_repo

REQUIREMENTS = "custom_generate/requirements.txt"


@pytest.fixture(scope="module")
def model():
    return llama_repo()


def _files(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_requirements_file_tide_did_not_write_is_never_replaced(model, tmp_path):
    (tmp_path / "custom_generate").mkdir()
    (tmp_path / REQUIREMENTS).write_text("numpy==1.26\n")
    with pytest.raises(ValueError, match="requirements.txt was not written by Tide"):
        model.save_pretrained(tmp_path)
    assert _files(tmp_path) == {REQUIREMENTS: b"numpy==1.26\n"}


def test_a_save_without_custom_generate_leaves_the_users_files_there(model, tmp_path):
    model.save_pretrained(tmp_path)  # Tide's own custom_generate/ files: replaced, then removed
    model.save_pretrained(tmp_path)
    (tmp_path / REQUIREMENTS).write_text("numpy==1.26\n")  # the user's own now
    model.save_pretrained(tmp_path, custom_generate=False)
    assert (tmp_path / REQUIREMENTS).read_text() == "numpy==1.26\n"
    assert not (tmp_path / "custom_generate" / "generate.py").exists()  # Tide's: removed
    (tmp_path / REQUIREMENTS).unlink()
    model.save_pretrained(tmp_path, custom_generate=False)
    assert not (tmp_path / "custom_generate").exists()


def test_a_routers_file_tide_did_not_write_is_never_replaced(model, tmp_path):
    (tmp_path / "routers.safetensors").write_bytes(b"not Tide's")
    with pytest.raises(ValueError, match="routers.safetensors was not written by Tide"):
        model.save_pretrained(tmp_path)
    assert _files(tmp_path) == {"routers.safetensors": b"not Tide's"}


def test_a_save_that_fails_in_custom_generate_puts_every_file_back(model, tmp_path, monkeypatch):
    """As where `custom_generate/` is read-only: its files cannot be moved, and the repo's other files, replaced
    first, are put back."""
    repo = tmp_path / "repo"
    model.save_pretrained(repo)
    before = _files(repo)
    model.config.label = "cosine"  # another config.json and card
    replace = os.replace

    def read_only(source, target):
        if os.path.dirname(source) == str(repo / "custom_generate"):
            raise PermissionError(13, "Permission denied (injected)", str(source))
        replace(source, target)

    monkeypatch.setattr(tide.hub.folder.os, "replace", read_only)
    try:
        with pytest.raises(PermissionError, match="injected"):
            model.save_pretrained(repo)
    finally:
        model.config.label = "top1"
    assert _files(repo) == before
    assert os.listdir(tmp_path) == ["repo"]  # no temporary folder left


def test_a_save_into_a_new_folder_that_fails_leaves_no_folder(model, tmp_path, monkeypatch):
    def failing(source, target):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(tide.hub.folder.os, "replace", failing)
    with pytest.raises(OSError, match="injected"):
        model.save_pretrained(tmp_path / "new")
    assert os.listdir(tmp_path) == []


def test_saving_to_a_file_says_to_pass_a_directory(model, tmp_path):
    path = tmp_path / "routers"
    path.write_text("mine")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        model.save_pretrained(path)
    assert path.read_text() == "mine"


def test_calibrate_to_an_existing_file_fails_before_calibrating(tmp_path, capsys, monkeypatch):
    def no_calibration(*args, **kwargs):
        raise AssertionError("calibration ran")

    monkeypatch.setattr(tide.tools.cli, "calibrate", no_calibration)
    (tmp_path / "out").write_text("mine")
    (tmp_path / "prompts.txt").write_text("a\nb\n")
    argv = ["calibrate", str(tmp_path / "model"), "--prompts", str(tmp_path / "prompts.txt"), "--out",
            str(tmp_path / "out")]
    assert main(argv) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert (tmp_path / "out").read_text() == "mine"


def test_the_demo_checks_its_folder_before_calibrating(tmp_path, capsys, monkeypatch):
    def no_calibration(*args, **kwargs):
        raise AssertionError("calibration ran")

    monkeypatch.setattr(tide.tools.demo, "_calibrate", no_calibration)
    (tmp_path / "out").write_text("mine")
    assert main(["demo", "--out", str(tmp_path / "out"), "--quick"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
