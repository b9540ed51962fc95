"""Calibration text, always through `datasets`: a Hub dataset name, local text/JSON/CSV files or a
directory of them, a `datasets.Dataset`, or a list of strings; or conversations (ShareGPT records, records with
"messages", or message lists, in a list or in a dataset's "conversations"/"messages" column), rendered through the
tokenizer's chat template with their answers marked (`chat`).

A dataset that cannot be loaded is an error that says what was tried and how to pass local text (a local file
that is not UTF-8: which file, the byte offset, how to convert it). There is no fallback text of any kind.
`take_samples` keeps the texts calibration asked for and says, in one warning, when there are fewer.
"""

from __future__ import annotations

import codecs
import os
import warnings
from pathlib import Path

from .chat import chat_texts, is_chat_record

__all__ = ["load_texts", "check_local_dataset", "take_samples", "DatasetLoadError"]

_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}


class DatasetLoadError(ValueError):
    pass


def _how_to() -> str:
    return (
        "Pass local text instead: dataset=['some text', ...], dataset='path/to/file.txt' (or .jsonl/.csv, or a "
        "directory of .txt files), a datasets.Dataset with a 'text' column, or conversations: ShareGPT records "
        "({'conversations': [{'from': 'human', 'value': ...}, ...]}) or lists of {'role', 'content'} messages."
    )


def load_texts(dataset, *, dataset_config: str | None = None, split: str = "train",
               text_column: str | None = None, tokenizer=None) -> list[str]:
    """Non-empty strings from `dataset`, in order (conversations as `chat.ChatText`s, through `tokenizer`)."""
    import datasets

    if isinstance(dataset, (list, tuple)):
        if dataset and all(is_chat_record(t) for t in dataset):
            return _conversations(tokenizer, dataset)
        if not all(isinstance(t, str) for t in dataset):
            raise DatasetLoadError("A dataset given as a list must be a list of strings, or of conversations "
                                   "(ShareGPT records, or lists of {'role', 'content'} messages).")
        ds = datasets.Dataset.from_dict({"text": list(dataset)})
    elif isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise DatasetLoadError(f"The DatasetDict has splits {list(dataset)}, not {split!r}; pass split=...")
        ds = dataset[split]
    elif isinstance(dataset, datasets.Dataset):
        ds = dataset
    elif isinstance(dataset, (str, os.PathLike)):
        ds = _load_named(str(dataset), dataset_config, split)
    else:
        raise DatasetLoadError(f"Unsupported dataset type {type(dataset).__name__}. {_how_to()}")
    chat = _CHAT_COLUMNS.intersection(ds.column_names)
    if text_column is None and "text" not in ds.column_names and chat:
        return _conversations(tokenizer, ({"messages": m} for m in ds[sorted(chat)[0]]))
    column = text_column or _text_column(ds)
    texts = [t for t in ds[column] if isinstance(t, str) and t.strip()]
    if not texts:
        raise DatasetLoadError(f"The dataset's column {column!r} holds no non-empty text. {_how_to()}")
    return texts


_CHAT_COLUMNS = {"conversations", "messages"}


def _conversations(tokenizer, records) -> list[str]:
    if tokenizer is None:
        raise DatasetLoadError("Conversations are rendered through the tokenizer's chat template: pass the tokenizer.")
    texts = chat_texts(tokenizer, records)
    if not texts:
        raise DatasetLoadError("No conversation in the dataset has an assistant answer to calibrate on.")
    return texts


def _load_named(name: str, dataset_config: str | None, split: str):
    import datasets

    files = check_local_dataset(name)
    if files:
        builder = _BUILDERS.get(files[0].suffix, "text")
        try:
            return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
        except Exception as err:  # noqa: BLE001
            raise DatasetLoadError(f"Could not read local files {name} with the '{builder}' builder: {err}. "
                                   f"{_how_to()}") from err
    try:
        return datasets.load_dataset(name, dataset_config, split=split)
    except Exception as err:  # noqa: BLE001
        raise DatasetLoadError(
            f"Could not load dataset {name!r} (config {dataset_config!r}, split {split!r}): it is not a local path, "
            f"and the Hub lookup failed ({type(err).__name__}: {err}). {_how_to()}"
        ) from err


def check_local_dataset(name) -> list[Path]:
    """The data files of a local dataset path, checked to exist and to hold text; [] where `name` is no local path
    (a Hub dataset name)."""
    path = Path(name)
    if not path.exists():
        return []
    files = sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS) if path.is_dir() else [path]
    if not files:
        raise DatasetLoadError(f"No .txt/.json/.jsonl/.csv files under {name}. {_how_to()}")
    if not any(_holds_text(f) for f in files):
        what = f"{name} is empty" if files == [path] else f"Every data file under {name} is empty"
        raise DatasetLoadError(f"{what}: calibration needs text. Pass a file or directory that holds text.")
    for f in files:
        _check_utf8(f)
    return files


def _check_utf8(path: Path) -> None:
    """Raise, naming the file and the byte offset, where `path` does not decode as UTF-8 (what `datasets` reads)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            pending = len(decoder.getstate()[0])  # bytes of a character the last chunk ended inside
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:  # err.object: the pending bytes, then the chunk
                _not_utf8(path, offset - pending + err.start, err.object[err.start:err.start + 1])
            offset += len(chunk)
        pending = len(decoder.getstate()[0])
        if pending:  # the file ends inside a multi-byte character
            _not_utf8(path, offset - pending, b"")


def _not_utf8(path: Path, offset: int, byte: bytes) -> None:
    what = f"byte 0x{byte[0]:02x} at offset {offset}" if byte else f"an incomplete character at offset {offset}"
    raise DatasetLoadError(
        f"{path} is not UTF-8 text: {what} does not decode. Convert it to UTF-8 first, e.g. "
        f"`iconv -f latin1 -t utf-8 {path} > {path.with_suffix('.utf8' + path.suffix)}` (name its real encoding after "
        "-f: latin1, cp1252, utf-16, ...), or in Python: Path(out).write_text(Path(src).read_text(encoding='latin-1'), "
        "encoding='utf-8').")


def take_samples(texts: list[str], num_samples: int) -> list[str]:
    """The first `num_samples` texts; one warning where the dataset has fewer."""
    if len(texts) < num_samples:
        warnings.warn(f"Calibration asked for {num_samples} texts (num_samples) and the dataset has {len(texts)}: "
                      f"calibrating on {len(texts)}.", stacklevel=3)
    return texts[:num_samples]


def _holds_text(path: Path) -> bool:
    """True where the file holds anything but whitespace (read until the first such byte)."""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            if chunk.strip():
                return True
    return False


def _text_column(ds) -> str:
    if "text" in ds.column_names:
        return "text"
    for name, feature in ds.features.items():
        if getattr(feature, "dtype", None) in ("string", "large_string"):
            return name
    raise DatasetLoadError(f"No text column among {ds.column_names}; pass text_column=... {_how_to()}")
