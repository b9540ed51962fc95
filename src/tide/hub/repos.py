"""All file and Hub I/O for router repos: save, load, push, and the model card.

A router repo holds three small files: `config.json` (the `TideConfig`), `routers.safetensors`
(router weights, fp32, with metadata) and `README.md` (the model card, `card.py`), and unless turned off
`custom_generate/generate.py` with `custom_generate/requirements.txt`, which let a plain transformers model run
the repo (`custom_generate.py` is what that file calls). Never base weights, never pickle. Loading resolves a
local directory or a Hub repo id (the local Hugging Face cache is used when `HF_HUB_OFFLINE=1`), loads or reuses
the base model, and checks that the routers fit it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub import HfApi, hf_hub_download
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from .. import __version__
from ..config import TideConfig
from ..models.architectures import resolve
from .card import model_card
from .folder import (
    CARD_NAME,
    CONFIG_NAME,
    CUSTOM_GENERATE_FILES,
    CUSTOM_GENERATE_NAME,
    CUSTOM_REQUIREMENTS_NAME,
    DISTRIBUTION,
    REPO_FILES,
    ROUTERS_NAME,
    check_save_directory,
    remove_custom_generate,
    replace_all,
)

__all__ = [
    "CONFIG_NAME",
    "REPO_KWARGS",
    "ROUTERS_NAME",
    "CARD_NAME",
    "REPO_FILES",
    "CUSTOM_GENERATE_FILES",
    "repo_files",
    "check_save_directory",
    "save_router_repo",
    "load_router_repo",
    "push_router_repo",
]

DRAFT_VOCABULARY_KEY = "draft_vocabulary"  # optional in routers.safetensors: int64 token ids, most predicted first
_TEMPLATE = Path(__file__).parent / "templates" / "generate.py"

# from_pretrained kwargs that address the router repo itself; everything else goes to the base model.
REPO_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "subfolder")


# ---------------------------------------------------------------------- saving
def router_state_dict(model) -> dict[str, torch.Tensor]:
    """Router weights as fp32 CPU tensors, keyed `<layer>.<param>` (e.g. `3.down.weight`)."""
    return {
        f"{layer}.{name}": tensor.detach().to("cpu", torch.float32).contiguous()
        for layer, router in model.routers.routers.items()
        for name, tensor in router.state_dict().items()
    }


def save_router_repo(model, save_directory, custom_generate: bool = True) -> Path:
    """Write the repo files into a temporary folder beside `save_directory`, then move them into place: a save
    that fails part-way leaves the repo that was there as it was. Files Tide did not write are never replaced or
    removed (`folder.check_save_directory`). `custom_generate=False`: without the `custom_generate/` files (those an
    earlier save wrote are removed)."""
    out = Path(save_directory)
    check_save_directory(out, custom_generate)
    parent = out.resolve().parent  # (beside the real folder where `out` is a link: the moves stay on one disk)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tide-save-", dir=parent))
    try:
        write_router_files(model, tmp, custom_generate)
        replace_all(tmp, out, repo_files(custom_generate), _created_mode(tmp))
        if not custom_generate:
            remove_custom_generate(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def repo_files(custom_generate: bool = True) -> tuple[str, ...]:
    """The files a router repo holds (relative paths), with or without its `custom_generate/` files."""
    return REPO_FILES + (CUSTOM_GENERATE_FILES if custom_generate else ())


def _created_mode(directory: Path) -> int:
    """The permissions `open` gives a new file here (0666 less the umask), read from one: the umask itself can only
    be read by setting it, which would race with other threads."""
    probe = directory / ".mode"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()


def write_router_files(model, out: Path, custom_generate: bool = True) -> None:
    """config.json, routers.safetensors, README.md and (with `custom_generate`) the `custom_generate/` files of
    `model` into the existing directory `out`."""
    config = model.config
    config.save_pretrained(out)  # writes config.json only
    metadata = {"format": "pt", "checkpoints": ",".join(map(str, model.checkpoints)),
                "tide_version": config.tide_version}
    tensors = router_state_dict(model)
    if model.draft_vocabulary is not None:
        tensors[DRAFT_VOCABULARY_KEY] = model.draft_vocabulary.detach().to("cpu", torch.int64).contiguous()
    save_file(tensors, out / ROUTERS_NAME, metadata=metadata)
    (out / CARD_NAME).write_text(model_card(config, custom_generate=custom_generate))
    if custom_generate:
        write_custom_generate(out)


def write_custom_generate(out: Path) -> None:
    """`custom_generate/generate.py` (Tide's template: load the repo's routers onto the model, run Tide's loop) and
    `custom_generate/requirements.txt` (this Tide version or a later one) into `out`."""
    (out / CUSTOM_GENERATE_NAME).parent.mkdir(exist_ok=True)
    (out / CUSTOM_GENERATE_NAME).write_text(_TEMPLATE.read_text())
    (out / CUSTOM_REQUIREMENTS_NAME).write_text(f"{DISTRIBUTION}>={__version__}\n")


def push_router_repo(model, repo_id: str, private: bool | None = None, token=None, commit_message=None,
                     custom_generate: bool = True, **_):
    """Create `repo_id` if needed and upload the router repo files through huggingface_hub (`custom_generate=False`:
    without the `custom_generate/` files; ones an earlier push uploaded stay)."""
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        save_router_repo(model, tmp, custom_generate)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=tmp,
            allow_patterns=list(repo_files(custom_generate)),
            commit_message=commit_message or "Upload Tide routers",
        )


# ---------------------------------------------------------------------- loading
def resolve_repo_file(name_or_path, filename: str, **repo_kwargs) -> str:
    """Path of `filename` in a local directory or a Hub repo (cache-aware, works offline)."""
    name = str(name_or_path)
    if not os.path.isdir(name) and (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1):
        raise FileNotFoundError(f"{name}: no such directory (a local router repo path; a Hub id looks like "
                                "'user/name').")
    if os.path.isdir(name_or_path):
        path = Path(name_or_path) / filename
        if not path.is_file():
            raise FileNotFoundError(f"{name_or_path} is not a Tide router repo: {filename} is missing.")
        return str(path)
    try:
        return hf_hub_download(str(name_or_path), filename, **repo_kwargs)
    except Exception as err:  # noqa: BLE001 - re-raised with what was tried
        raise OSError(
            f"Could not get {filename} of router repo {name_or_path!r}: there is no local directory of that name, "
            f"and the Hub lookup failed ({type(err).__name__}: {err}). Check the path, or the repo id (with "
            "HF_HUB_OFFLINE=1 only the local Hugging Face cache is searched)."
        ) from err


def load_router_repo(cls, name_or_path, base_model=None, config: TideConfig | None = None, **kwargs):
    repo_kwargs = {k: kwargs.pop(k) for k in REPO_KWARGS if k in kwargs}
    if not isinstance(config, TideConfig):
        config = read_config(resolve_repo_file(name_or_path, CONFIG_NAME, **repo_kwargs))
    weights = read_router_weights(resolve_repo_file(name_or_path, ROUTERS_NAME, **repo_kwargs))
    if base_model is None:
        base_model = load_base_model(config, **kwargs)
    check_base_matches(config, base_model)
    model = cls(config, base_model)
    load_router_weights(model, weights)
    model.name_or_path = str(name_or_path)
    return model


def load_base_model(config: TideConfig, **kwargs):
    if not config.base_model_name_or_path:
        raise ValueError(
            "This router repo's config has no base_model_name_or_path; pass the base model: "
            "TideForCausalLM.from_pretrained(repo, base_model=model)."
        )
    check_base_folder(config.base_model_name_or_path, "TideForCausalLM.from_pretrained(repo, base_model=model)")
    if config.base_model_revision is not None:
        kwargs.setdefault("revision", config.base_model_revision)
    return AutoModelForCausalLM.from_pretrained(config.base_model_name_or_path, **kwargs)


def check_base_folder(name: str, how: str) -> None:
    """Raise where the base model a router repo names is a local path (absolute, ./ or ~) that does not exist."""
    if (os.path.isabs(name) or name.startswith((".", "~"))) and not os.path.isdir(os.path.expanduser(name)):
        raise FileNotFoundError(f"This router repo's base model folder {name} was not found (the repo names it in "
                                f"config.json as base_model_name_or_path); load the base model yourself and pass it: "
                                f"{how}.")


def check_base_matches(config: TideConfig, base_model) -> None:
    """Raise naming every mismatch between what the routers were trained on and `base_model`."""
    text = base_model.config.get_text_config()
    actual = {
        "model type": text.model_type,
        "hidden size": text.hidden_size,
        "number of layers": len(resolve(base_model).layers),
    }
    expected = {
        "model type": config.base_model_type,
        "hidden size": config.base_hidden_size,
        "number of layers": config.base_num_layers,
    }
    mismatches = [f"{k}: routers expect {expected[k]!r}, base has {actual[k]!r}" for k in actual
                  if expected[k] not in (None, actual[k])]
    if mismatches:
        raise ValueError(
            f"These routers do not fit the base model ({config.base_model_name_or_path or 'unnamed'}): "
            + "; ".join(mismatches)
            + ". Load the base model they were calibrated on, or calibrate new routers with tide.calibrate."
        )


def _read_json(path, quiet: bool = False):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        if quiet:
            return None
        raise ValueError(f"{path} is not readable JSON ({err}).") from err


def read_config(config_file) -> TideConfig:
    """A router repo's config.json, checked to be a JSON object before transformers reads it."""
    data = _read_json(config_file)
    if not isinstance(data, dict):
        raise ValueError(f"{config_file} must hold a JSON object (a Tide config), got {type(data).__name__}.")
    config = TideConfig.from_pretrained(config_file)
    if "exit_head" not in data:
        config.exit_head = "lens"  # written before exit heads existed: its routers read the raw states
    if "draft_head" not in data:
        config.draft_head = "exit"  # written before draft heads existed: lossless drafts come from the exit heads
    if "draft_head_mlp" not in data:
        config.draft_head_mlp = 0  # written before draft heads had their two-layer term
    return config


def read_router_weights(path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except Exception as err:  # noqa: BLE001 - safetensors' own errors do not name the file
        raise ValueError(f"{path} is not a readable safetensors file ({type(err).__name__}: {err}); re-save or "
                         "re-download the router repo.") from err


def load_router_weights(model, weights: dict[str, torch.Tensor]) -> None:
    weights = dict(weights)
    vocabulary = weights.pop(DRAFT_VOCABULARY_KEY, None)
    if vocabulary is not None:
        model.draft_vocabulary = checked_draft_vocabulary(vocabulary, model.num_head_rows)
    expected = router_state_dict(model)
    if set(weights) != set(expected) and model.config.base_num_layers is None:
        raise ValueError(
            f"{ROUTERS_NAME} does not fit this base model's {model.parts.num_layers} layers: "
            f"it holds routers at layers {_layers(weights)} (draft heads at {_layers(weights, '.draft.')}), "
            f"but on {model.parts.num_layers} layers the config's checkpoints are {model.checkpoints} "
            f"(draft heads at {_layers(expected, '.draft.')}). The repo's "
            "config.json does not record its base model's layer count (base_num_layers): load the base model the "
            "routers were calibrated on, or recalibrate them with tide.calibrate."
        )
    if set(weights) != set(expected):
        raise ValueError(
            f"Router weights do not match the config's checkpoints {model.checkpoints}: "
            f"missing {sorted(set(expected) - set(weights))}, unexpected {sorted(set(weights) - set(expected))}."
        )
    for key, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ValueError(f"{ROUTERS_NAME}: {key} has shape {list(tensor.shape)} but this base model needs "
                             f"{list(expected[key].shape)}; these routers were trained on another base model.")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{ROUTERS_NAME}: {key} holds values that are not finite (NaN or inf); the router repo "
                             "is damaged: re-save or recalibrate it.")
    for layer, router in model.routers.routers.items():
        param = next(router.parameters())
        state = {name: weights[f"{layer}.{name}"].to(param.device, param.dtype) for name in router.state_dict()}
        router.load_state_dict(state)


def _layers(weights, part: str = ".") -> list[int]:
    """The layers of the router weights named `<layer>.<param>` whose name holds `part`."""
    return sorted({int(key.split(".")[0]) for key in weights if part in key and key.split(".")[0].isdigit()})


def checked_draft_vocabulary(ids: torch.Tensor, rows: int) -> torch.Tensor:
    """`ids` as a draft vocabulary of a head of `rows` rows: distinct int64 token ids below `rows`."""
    problem = None
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
        problem = f"must be a 1-D integer tensor, got {ids.dtype} of shape {list(ids.shape)}"
    elif ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        problem = f"holds token ids outside this base model's {rows} head rows"
    elif ids.unique().numel() != ids.numel():
        problem = "repeats token ids"
    if problem:
        raise ValueError(f"{ROUTERS_NAME}: {DRAFT_VOCABULARY_KEY} {problem}; the router repo was saved for another "
                         "base model or is damaged: recalibrate it.")
    return ids.to(torch.int64)


class BaseModelTokenizerLoader:
    """`AutoTokenizer` entry for router repos: a router repo holds no tokenizer, so its base model's is loaded.

    This is what lets `AutoTokenizer.from_pretrained(router_repo)` and
    `pipeline("text-generation", model=router_repo)` work after `import tide`.
    """

    @classmethod
    def from_pretrained(cls, name_or_path, *args, **kwargs):
        repo_kwargs = {k: kwargs.pop(k) for k in REPO_KWARGS if k in kwargs}
        config = read_config(resolve_repo_file(name_or_path, CONFIG_NAME, **repo_kwargs))
        if not config.base_model_name_or_path:
            raise ValueError(
                f"Router repo {name_or_path} names no base model, so it has no tokenizer to load; pass the base "
                "model's tokenizer explicitly."
            )
        check_base_folder(config.base_model_name_or_path, "AutoTokenizer.from_pretrained(<the base model's folder>)")
        if config.base_model_revision is not None:
            kwargs.setdefault("revision", config.base_model_revision)
        return AutoTokenizer.from_pretrained(config.base_model_name_or_path, *args, **kwargs)
