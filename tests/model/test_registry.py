"""The model registry (architecture name → class): transformers' own names for the served
families resolve, others are refused by name, and a new registry line is all a family needs
to be checked and built."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from manylora.config import MODEL_ARCHITECTURES, ModelConfig
from manylora.model.llama import LlamaForCausalLM
from manylora.model.loader import load_model
from manylora.model.registry import model_class

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)


@pytest.mark.parametrize("config_cls", [LlamaConfig, MistralConfig, Qwen2Config])
def test_a_served_family_resolves_by_transformers_name(config_cls):
    # A config that names only its model_type gets the causal-LM class transformers maps it to.
    hf = config_cls(**TINY)
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf.model_type]
    assert ModelConfig.from_hf(hf, torch.float32).architecture == arch
    named = config_cls(architectures=["SomethingElse", arch], **TINY)
    assert ModelConfig.from_hf(named, torch.float32).architecture == arch
    assert model_class(arch) is LlamaForCausalLM


def test_every_registered_class_imports():
    for arch in MODEL_ARCHITECTURES:
        assert issubclass(model_class(arch), torch.nn.Module)


def test_an_unregistered_architecture_is_named():
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
        model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel.*"
                                         "LlamaForCausalLM"):
        ModelConfig.from_hf(GPT2Config(architectures=["GPT2LMHeadModel"]), torch.float32)


def test_a_registry_line_serves_a_new_architecture(monkeypatch):
    hf = LlamaConfig(architectures=["MyLlamaForCausalLM"], **TINY)
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf(hf, torch.float32)
    monkeypatch.setitem(MODEL_ARCHITECTURES, "MyLlamaForCausalLM", "llama:LlamaForCausalLM")
    cfg = ModelConfig.from_hf(hf, torch.float32)
    model = load_model(None, cfg, torch.device("cpu"), load_format="dummy")
    assert type(model) is LlamaForCausalLM and model.cfg.architecture == "MyLlamaForCausalLM"
