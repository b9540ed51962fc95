"""Offline stand-ins for the examples' `--tiny` mode: a small random-init causal LM saved to a directory
with a character tokenizer, and some English text to calibrate on. Nothing is downloaded.

The model has random weights, so its text is gibberish and its numbers mean nothing; it only makes every
example run anywhere in seconds. The residual writes of its upper layers are damped so that, as in
trained models, many tokens' top-1 prediction settles before the last layer and the routers have
something to learn.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

# Small configs per family: 6 layers, hidden 32, vocabulary 128 (the character tokenizer fits in it).
_SIZE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=6, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=256)
CONFIGS = {
    "llama": dict(_SIZE, num_key_value_heads=2),
    "qwen3": dict(_SIZE, num_key_value_heads=2, head_dim=8),
    "mistral": dict(_SIZE, num_key_value_heads=2, sliding_window=64),  # a sliding-window model
    "gpt2": dict(vocab_size=128, n_embd=32, n_layer=6, n_head=4, n_positions=256),
    "gpt_neox": dict(_SIZE),
    "falcon": dict(vocab_size=128, hidden_size=32, num_hidden_layers=6, num_attention_heads=4),
}
# Sub-modules that write into the residual stream, across the families above.
_RESIDUAL_WRITERS = ("o_proj", "down_proj", "dense", "dense_4h_to_h", "c_proj")


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus <pad>, <eos>, <bos>, <unk>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"])}
    for ch in [chr(c) for c in range(32, 127)] + ["\n"]:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


def build(path, model_type: str = "llama", seed: int = 0) -> str:
    """Write a tiny random-init `model_type` model and its tokenizer to `path`; return the path."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **CONFIGS[model_type], pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for depth, layer in enumerate(_decoder_layers(model)):
            for name, module in layer.named_modules():
                if name.rsplit(".", 1)[-1] in _RESIDUAL_WRITERS:
                    for param in module.parameters(recurse=False):
                        param.mul_(0.7**depth)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


def _decoder_layers(model):
    from tide.models.architectures import resolve

    return resolve(model).layers


def sample_texts(n: int = 48) -> list[str]:
    """English paragraphs every Python installation has: the language reference's help topics."""
    from pydoc_data.topics import topics

    paragraphs = [" ".join(p.split()) for key in sorted(topics) for p in topics[key].split("\n\n")]
    return [p[:300] for p in paragraphs if len(p) > 120][:n]


# A few hundred held-out tokens cannot certify 99% agreement (at 95% confidence that takes about 300
# exiting tokens with no error at all), so the tiny runs ask for less.
TARGET = 0.8


def calibration_data() -> dict:
    """`tide.calibrate` keyword arguments for the tiny model: a little text, trained a little harder."""
    return dict(dataset=sample_texts(48), num_samples=32, max_length=64, lr=1e-2, passes=4)


def model_dir(args, out_dir: str = "tiny-model", model_type: str = "llama") -> str:
    """`args.model`, or a freshly written tiny model when `--tiny` is set or no model is given."""
    if args.model and not args.tiny:
        return args.model
    path = build(Path(out_dir) / model_type, model_type)
    print(f"(--tiny: random-init {model_type} with 6 layers written to {path}; its numbers mean nothing)")
    return path
