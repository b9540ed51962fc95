import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tide
from tide.models.architectures import ARCHITECTURES, resolve
from tiny_models import FAMILIES, TINY_CONFIGS, tiny_model


def test_every_registered_family_has_a_tiny_model():
    assert set(ARCHITECTURES) <= set(TINY_CONFIGS)


@pytest.mark.parametrize("family", FAMILIES)
def test_parts_reproduce_the_models_logits(family):
    model = tiny_model(family)
    parts = resolve(model)
    assert parts.num_layers == 6
    captured = {}
    parts.layers[-1].register_forward_hook(lambda _m, _a, out: captured.update(h=parts.layer_output(out)))
    ids = torch.randint(4, 100, (2, 7))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
        mine = parts.logits_from_normed(parts.final_norm(captured["h"]))
    torch.testing.assert_close(mine, logits, atol=1e-5, rtol=1e-5)
    assert (parts.softcap is not None) == (family in ("gemma2", "gemma3_text"))


class MysteryConfig(LlamaConfig):
    model_type = "tide_test_mystery"


class MysteryForCausalLM(LlamaForCausalLM):
    config_class = MysteryConfig


def _mystery():
    torch.manual_seed(0)
    cfg = MysteryConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=64)
    return MysteryForCausalLM(cfg).eval()


def test_unknown_type_is_probed():
    model = _mystery()
    parts = resolve(model)
    assert parts.layers is model.model.layers and parts.norm is model.model.norm


def test_failed_probe_lists_supported_types_and_how_to_register():
    model = _mystery()
    model.model.norm = torch.nn.Identity()
    del model.model.norm  # no final norm to find
    with pytest.raises(ValueError) as err:
        resolve(model)
    assert "llama" in str(err.value) and "tide.register" in str(err.value)


def test_register_a_family():
    model = _mystery()
    tide.register("tide_test_mystery", tide.ArchSpec(backbone="model", layers="model.layers", norm="model.norm"))
    try:
        assert resolve(model).norm is model.model.norm
    finally:
        del ARCHITECTURES["tide_test_mystery"]


def test_a_transformers_that_renamed_the_cache_argument_gets_an_install_hint():
    # transformers 5.24 passes the KV cache as `cache`; Tide follows 5.23's `past_key_values`.
    from tide.models.architectures import refusal_reason

    class Renamed(torch.nn.Module):
        config = LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=8,
                             vocab_size=8)

        def forward(self, input_ids=None, cache=None):
            return input_ids

    reason = refusal_reason(Renamed())
    assert "`cache`" in reason and "transformers>=5.23,<5.24" in reason
