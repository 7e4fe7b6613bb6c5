"""Gemma 2 (``Gemma2ForCausalLM``) against transformers + peft on the same weights: greedy,
token for token, and the generated tokens' log-probabilities.

The tiny checkpoint is written by transformers' own ``save_pretrained`` (``make_checkpoint``)
with what sets Gemma 2 apart switched on where it shows: a sliding-window layer (window 4,
shorter than every prompt) before a global one, ``query_pre_attn_scalar`` 12 (not
``head_dim`` 16), an attention soft cap of 5 on logits that reach past it (the greedy tokens
change with it), a final-logit soft cap of 6 on logits that reach about 10, ``(1 + w)``
norms, GeGLU and the embedding scaled by sqrt(hidden). Adapters by peft: attention only,
every linear layer, and a DoRA one, of three ranks. manylora runs them as one mixed batch
with the base model through a single slot (fewer slots than adapters), twice so that the
second pass reads the prefix cache, and under tensor parallelism 2 (gloo, CPU) as the
piecewise CUDA graphs' pieces. The reference runs each prompt alone
(``hf_greedy_reference``; transformers' eager attention, the only one that caps).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config

from manylora import LLM, SamplingParams
from manylora.config import ModelConfig
from manylora.model.gemma2 import Gemma2ForCausalLM
from manylora.model.registry import model_class
from manylora.testing import (
    FAMILY_ADAPTER_NAMES,
    FAMILY_SPECS,
    FAMILY_TEXTS,
    assert_greedy_matches,
    generate_greedy,
    generate_twice_from_prefix_cache,
    make_checkpoint,
    make_family_case,
    shutting_down,
)

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, init_std=0.3,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=12)
ATTN_CAP, FINAL_CAP = 5.0, 6.0
ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, block_size=4, num_kv_blocks=64,
              max_model_len=128)
MAX_NEW = 6
# logprobs=0: each generated token's own log-probability
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0)


def assert_matches(outputs, case):
    """Greedy tokens equal to the reference's, each token's log-probability equal to
    ``log_softmax`` of transformers' (capped) logits."""
    assert_greedy_matches(outputs, case)
    for out, ref in zip(outputs, case.reference, strict=True):
        for tok, entry, logits in zip(out.token_ids, out.logprobs, ref.logits):
            want = torch.log_softmax(logits.double(), -1)[tok].item()
            assert entry[tok].logprob == pytest.approx(want, abs=1e-4)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2")
    base = make_checkpoint(root / "base", "gemma2", seed=0, **TINY,
                           attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP)
    return make_family_case(base, root, FAMILY_SPECS, FAMILY_TEXTS, FAMILY_ADAPTER_NAMES, MAX_NEW)


def test_gemma2_config_resolves_with_alternating_windows():
    hf = Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                      max_position_embeddings=64, sliding_window=16)
    cfg = ModelConfig.from_hf(hf, torch.float32)        # names only its model_type
    assert cfg.architecture == "Gemma2ForCausalLM"
    assert cfg.sliding_windows == (16, None, 16, None)   # transformers' default layer_types
    assert (cfg.head_dim, cfg.tie_word_embeddings) == (8, True)
    assert model_class(cfg.architecture) is Gemma2ForCausalLM


def test_gemma2_refuses_another_activation():
    hf = Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      vocab_size=64, max_position_embeddings=64,
                      hidden_activation="gelu")
    with pytest.raises(ValueError, match="hidden_activation 'gelu'"):
        Gemma2ForCausalLM(ModelConfig.from_hf(hf, torch.float32), torch.device("cpu"))


def test_gemma2_caps_bite(gemma2, tmp_path):
    """The caps are not idle: the reference's logits reach past half the final cap, and
    without the attention cap transformers' own greedy tokens differ."""
    from manylora.testing.hf import hf_causal_lm

    assert max(x.abs().max().item() for r in gemma2.reference for x in r.logits) > FINAL_CAP / 2
    uncapped = make_checkpoint(tmp_path / "uncapped", "gemma2", seed=0, **TINY,
                               attn_logit_softcapping=None, final_logit_softcapping=FINAL_CAP)
    models = [hf_causal_lm(path, attn_implementation="eager")
              for path in (gemma2.base_dir, uncapped)]
    tokens = [[m.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)[
        0, len(p):].tolist() for p in gemma2.prompts] for m in models]
    assert tokens[0] != tokens[1]


def test_gemma2_mixed_batch_one_slot_prefix_cache_matches_peft(gemma2):
    llm = LLM(str(gemma2.base_dir), **ENGINE, max_loras=1, enable_prefix_caching=True)
    with shutting_down(llm):
        _, misses = generate_twice_from_prefix_cache(llm, gemma2, GREEDY, assert_matches)
        assert misses >= len(gemma2.adapters)


def test_gemma2_tensor_parallel_2_piecewise_matches_peft(gemma2):
    """Each rank holds its heads; the steps run as the piecewise CUDA graphs' pieces (eager
    on CPU), cut between ``attend`` calls, with the Gemma residual convention."""
    llm = LLM(str(gemma2.base_dir), **ENGINE, max_loras=2, tensor_parallel_size=2,
              piecewise_cuda_graph_sizes=(8, 16, 32))
    with shutting_down(llm):
        assert_matches(generate_greedy(llm, gemma2, GREEDY), gemma2)


def test_gemma2_gguf_matches_transformers_peft(tmp_path):
    """A Gemma 2 GGUF (F32, llama.cpp's names, norms stored as ``1 + w``) against
    transformers' own GGUF loading + peft. transformers reads no soft caps or
    ``query_pre_attn_scalar`` from a GGUF (its ``Gemma2Config`` defaults hold: 50, 30,
    256), so the checkpoint has those."""
    from manylora.testing.gguf import write_gguf

    tiny = {k: v for k, v in TINY.items() if k != "query_pre_attn_scalar"}
    ckpt = make_checkpoint(tmp_path / "hf", "gemma2", seed=2, **tiny)
    path = write_gguf(ckpt, tmp_path / "gemma2.gguf")
    case = make_family_case(path, tmp_path, {"all": dict(r=4, target_modules="all-linear", seed=3)},
                            [[1, 40, 41, 42, 43, 44, 45], [1, 7, 9]], ["all", None], MAX_NEW)
    llm = LLM(str(path), **ENGINE, max_loras=1, skip_tokenizer_init=True)
    with shutting_down(llm):
        assert_greedy_matches(generate_greedy(llm, case, GREEDY), case)
