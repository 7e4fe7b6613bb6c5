"""LoRA on ``lm_head`` and ``embed_tokens`` as peft writes it, against transformers + peft.

The adapters are written by peft's ``save_pretrained`` (which also saves the base tables of
both, ``save_embedding_layers``): one over q/v, the head and the embedding, one over the
head only (rsLoRA), one over the embedding only, and a plain one over q/v/o. manylora runs
them in one mixed batch with base rows through fewer slots than adapters, twice (the second
pass reads the prefix cache), under tensor parallelism 2 (gloo), on a tied-embedding
model, and on every other served family; greedy tokens must equal peft's
(``hf_greedy_reference``), prompt log-probabilities peft's ``log_softmax`` and a choice
request's first token peft's best allowed token. The
ops are checked against float64, and the adapters the engine cannot serve are refused with
an error naming the field.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from manylora import LLM, LoRARequest, SamplingParams
from manylora.config import LORA_ALL_MODULES, LoRAConfig, ModelConfig
from manylora.lora.adapter import LoRAAdapterError
from manylora.lora.formats.peft import load_peft_adapter
from manylora.lora.formats.target import AdapterTarget
from manylora.lora.kernels.meta import build_lora_kernel_meta
from manylora.lora.slot_table import SlotTable
from manylora.lora.vocab import EmbeddingLoRA, HeadLoRA
from manylora.structured_params import StructuredOutputsParams
from manylora.testing import (
    FAMILY_TEXTS,
    assert_greedy_matches,
    generate_greedy,
    generate_twice_from_prefix_cache,
    lora_requests,
    make_checkpoint,
    make_family_case,
    make_peft_adapter,
    shutting_down,
)

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
VOCAB = ("q_proj", "v_proj", "o_proj", "embed_tokens", "lm_head")
ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, block_size=4, num_kv_blocks=96,
              max_model_len=128, lora_target_modules=VOCAB)
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
SPECS = {"both": dict(r=4, target_modules=["q_proj", "v_proj", "lm_head", "embed_tokens"]),
         "head": dict(r=6, target_modules=["lm_head"], use_rslora=True),
         "embed": dict(r=2, target_modules=["embed_tokens"]),
         "plain": dict(r=8, target_modules=["q_proj", "v_proj", "o_proj"])}
TEXTS = [*FAMILY_TEXTS, "Once upon a time", "The quick brown fox jumps over"]
# every vocabulary adapter also on a prompt the base runs, so that it is seen to matter
ADAPTERS = ["both", None, "both", "head", "embed", "plain", None]


def _family(root, arch="llama", specs=SPECS, **checkpoint_kwargs):
    """The texts under ``ADAPTERS``, then the second one again under each vocabulary
    adapter."""
    base = make_checkpoint(root / "base", arch, seed=0, **{**TINY, **checkpoint_kwargs})
    return make_family_case(base, root, specs, TEXTS + [TEXTS[1]] * 3,
                            ADAPTERS + ["both", "head", "embed"], MAX_NEW)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return _family(tmp_path_factory.mktemp("head_untied"))


def test_peft_saves_lora_and_the_base_tables(untied):
    """What peft writes for the two modules (and what the reader must not drop): LoRA
    pairs, and a copy of each base table that equals the checkpoint's."""
    tensors = load_file(untied.adapters["both"] / "adapter_model.safetensors")
    base_state = load_file(untied.base_dir / "model.safetensors")
    prefix = "base_model.model."
    assert tensors[prefix + "model.embed_tokens.lora_embedding_A"].shape[1] == 512
    assert tensors[prefix + "lm_head.lora_B.weight"].shape[0] == 512
    assert torch.equal(tensors[prefix + "lm_head.base_layer.weight"],
                       base_state["lm_head.weight"])
    assert torch.equal(tensors[prefix + "model.embed_tokens.base_layer.weight"],
                       base_state["model.embed_tokens.weight"])


def test_mixed_batch_fewer_slots_prefix_cache_prompt_logprobs_and_choice(untied, monkeypatch):
    base, adapters, reference = untied.base_dir, untied.adapters, untied.reference
    n = len(ADAPTERS)
    # each vocabulary adapter changes the base's output on the shared prompt
    for i, name in enumerate(untied.adapter_names[n:]):
        assert reference[n + i].token_ids != reference[1].token_ids, name
    head_rows = []
    head_add = HeadLoRA.add_

    def counting_add(self, hidden, logits, rows):
        head_rows.append(hidden.shape[0])
        head_add(self, hidden, logits, rows)

    monkeypatch.setattr(HeadLoRA, "add_", counting_add)
    llm = LLM(str(base), **ENGINE, max_loras=2, enable_prefix_caching=True)
    with shutting_down(llm):
        generate_twice_from_prefix_cache(llm, untied, GREEDY)
        # the head's delta ran on the sampled rows only: one per generated token, none for
        # the prompt tokens before each prompt's last
        assert sum(head_rows) == 2 * len(untied.prompts) * MAX_NEW
        _check_prompt_logprobs(llm, base, adapters, untied.prompts[:2])
        _check_choice(llm, base, adapters, untied.prompts[1])


def _peft_model(base, adapter):
    from peft import PeftModel

    from manylora.testing.hf import hf_causal_lm

    return PeftModel.from_pretrained(hf_causal_lm(base, attn_implementation="eager"),
                                     str(adapter)).eval()


def _check_prompt_logprobs(llm, base, adapters, prompts):
    """Prompt log-probabilities of a ``both`` row (embedding and head adapted) and a base row
    in one step equal peft's ``log_softmax`` of each position's logits."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    requests = lora_requests(adapters, ["both", None])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                        lora_request=requests, use_tqdm=False)
    peft = _peft_model(base, adapters["both"])
    for out, prompt, adapted in zip(outs, prompts, (True, False)):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            if adapted:
                logits = peft(input_ids=ids).logits[0]
            else:
                with peft.disable_adapter():
                    logits = peft(input_ids=ids).logits[0]
        ref = logits[:-1].float().log_softmax(-1)
        got = out.prompt_logprobs
        assert got[0] is None and len(got) == len(prompt)
        for j in range(1, len(prompt)):
            assert got[j][prompt[j]].logprob == pytest.approx(float(ref[j - 1, prompt[j]]),
                                                              abs=1e-4)


def _check_choice(llm, base, adapters, prompt):
    """A choice request under the head adapter: one of the choices, and its first token is
    the best token by peft's adapted logits among those the grammar allows (the bitmask
    applies after the head's delta)."""
    from transformers import AutoTokenizer

    choices = ["alpha", "beta", "gamma", "delta"]
    params = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    out = llm.generate([{"prompt_token_ids": prompt}], params,
                       lora_request=lora_requests(adapters, ["head"]), use_tqdm=False)[0]
    assert out.outputs[0].text in choices
    tok = AutoTokenizer.from_pretrained(base)
    allowed = [t for t in range(len(tok)) if (s := tok.decode([t])) and any(
        c.startswith(s) for c in choices)]
    with torch.no_grad():
        logits = _peft_model(base, adapters["head"])(input_ids=torch.tensor([prompt])).logits
    best = max(allowed, key=lambda t: float(logits[0, -1, t]))
    assert out.outputs[0].token_ids[0] == best


def test_tensor_parallel_2_matches_peft(untied):
    """The head's B split by vocabulary rows with the head, the embedding's delta added once
    after its all-reduce; the saved base tables compared by every rank."""
    llm = LLM(str(untied.base_dir), **ENGINE, max_loras=2, tensor_parallel_size=2,
              piecewise_cuda_graph_sizes=(8, 16, 32))
    with shutting_down(llm):
        assert_greedy_matches(generate_greedy(llm, untied, GREEDY), untied)


def test_tied_embeddings_keep_the_base_tied_and_the_adapter_its_own(tmp_path):
    case = _family(tmp_path, tie_word_embeddings=True)
    llm = LLM(str(case.base_dir), **ENGINE, max_loras=3)
    with shutting_down(llm):
        model = llm.llm_engine.engine_core.executor.model
        assert model.lm_head is None and model.head_lora is not None
        assert_greedy_matches(generate_greedy(llm, case, GREEDY), case)


#: Phi-3's projections are fused in the model: its adapters target ``qkv_proj`` (split onto
#: the q, k and v slots) where the others target q and v.
PHI3_SPECS = {name: {**spec, "target_modules": [
    "qkv_proj" if m == "q_proj" else m for m in spec["target_modules"] if m != "v_proj"]}
    for name, spec in SPECS.items()}


@pytest.mark.parametrize("arch, kwargs", [
    ("gemma2", dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=12,
                    layer_types=["sliding_attention", "full_attention"])),
    ("gemma3", dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=12,
                    layer_types=["sliding_attention", "full_attention"])),
    ("granite", {}),
    ("qwen3", dict(head_dim=24)),
    ("olmo2", {}),
    ("phi3", dict(specs=PHI3_SPECS)),
])
def test_each_family_with_vocabulary_adapters_matches_peft(tmp_path, arch, kwargs):
    """Every served family with the ``embed_tokens`` / ``lm_head`` adapters in one mixed
    batch through fewer slots than adapters, twice (the second pass reads the prefix
    cache); Gemma 2 under tensor parallelism 2 as well. Gemma 2 and 3 (the embedding times
    sqrt(hidden), soft-capped logits, tied) and Granite (embedding multiplier, logits
    divided, tied) scale what the adapters add too, as transformers scales the adapted
    modules' outputs; Phi-3's adapters target its fused ``qkv_proj``."""
    case = _family(tmp_path, arch, **kwargs)
    engine = dict(ENGINE, lora_target_modules=VOCAB + ("k_proj",)) if arch == "phi3" \
        else ENGINE
    llm = LLM(str(case.base_dir), **engine, max_loras=2, enable_prefix_caching=True)
    with shutting_down(llm):
        generate_twice_from_prefix_cache(llm, case, GREEDY)
    if arch == "gemma2":
        llm = LLM(str(case.base_dir), **engine, max_loras=2, tensor_parallel_size=2)
        with shutting_down(llm):
            assert_greedy_matches(generate_greedy(llm, case, GREEDY), case)


# ---------------------------------------------------------------------------------- the ops

def _table(*slots):
    table = SlotTable({(-1, s.module_names[0]): s for s in slots}, slots[0].max_loras,
                      torch.device("cpu"))
    return table


@pytest.mark.parametrize("vocab_range", [(0, 40), (20, 40)], ids=["whole", "rank1-of-2"])
def test_head_lora_adds_each_rows_own_delta_vs_float64(vocab_range):
    g = torch.Generator().manual_seed(0)
    hidden, vocab, max_loras, max_rank = 16, 40, 3, 8
    head = HeadLoRA(hidden, vocab, vocab_range, max_loras, max_rank, torch.float32,
                    torch.device("cpu"))
    _table(head.slots)
    ranks = {0: 3, 2: 8}                                   # slot 1 empty
    ab = {s: (torch.randn(r, hidden, generator=g), torch.randn(vocab, r, generator=g))
          for s, r in ranks.items()}
    for s, (a, b) in ab.items():
        head.slots.set_slot(s, "lm_head", a, b)
    rows = [2, -1, 0, 2, 1, 0]                             # base, empty slot, repeats
    x = torch.randn(len(rows), hidden, generator=g)
    lo, hi = vocab_range
    logits = torch.randn(len(rows), hi - lo, generator=g)
    want = logits.double().clone()
    for i, s in enumerate(rows):
        if s in ab:
            a, b = ab[s]
            want[i] += (x[i].double() @ a.double().T @ b.double().T)[lo:hi]
    head.add_(x, logits, build_lora_kernel_meta(rows, max_loras, torch.device("cpu")))
    torch.testing.assert_close(logits.double(), want, atol=1e-4, rtol=1e-5)


def test_embedding_lora_gathers_each_tokens_column_vs_float64():
    g = torch.Generator().manual_seed(1)
    hidden, vocab, max_loras, max_rank = 16, 40, 2, 4
    emb = EmbeddingLoRA(vocab, hidden, max_loras, max_rank, torch.float32, torch.device("cpu"))
    _table(emb.slots)
    a, b = torch.randn(3, vocab, generator=g), torch.randn(hidden, 3, generator=g)
    emb.slots.set_slot(1, "embed_tokens", a, b)
    ids = torch.tensor([5, 39, 0, 5, 7])
    slots = [1, -1, 1, 0, 1]                               # slot 0: empty
    x = torch.randn(len(ids), hidden, generator=g)
    want = x.double().clone()
    for i, (t, s) in enumerate(zip(ids.tolist(), slots)):
        if s == 1:
            want[i] += b.double() @ a.double()[:, t]
    emb.add_(ids, x, build_lora_kernel_meta(slots, max_loras, torch.device("cpu")))
    torch.testing.assert_close(x.double(), want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ refusals

@pytest.fixture(scope="module")
def target(untied):
    base = untied.base_dir
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(base), torch.float32)
    state = load_file(base / "model.safetensors")
    return AdapterTarget(cfg.module_shapes(), cfg.num_layers, 8, LORA_ALL_MODULES,
                         torch.float32,
                         dora_norm=lambda layer, module, a, b: torch.ones(b.shape[0]),
                         base_weight_equal=lambda module, w: torch.equal(
                             w, state["model.embed_tokens.weight" if module == "embed_tokens"
                                      else "lm_head.weight"]))


def _edited(src, dst, tensors=None, config=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        state = load_file(dst / "adapter_model.safetensors")
        tensors(state)
        save_file(state, dst / "adapter_model.safetensors")
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg.update(config)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def _read(path, target):
    return load_peft_adapter(LoRARequest("x", 1, str(path)), path, target)


PREFIX = "base_model.model."


def _widen_embedding(state):
    key = PREFIX + "model.embed_tokens.lora_embedding_A"
    state[key] = torch.cat([state[key], torch.zeros(state[key].shape[0], 8)], dim=1)


def _taller_head(state):
    key = PREFIX + "lm_head.lora_B.weight"
    state[key] = torch.cat([state[key], torch.zeros(8, state[key].shape[1])])


def _changed_table(state):
    state[PREFIX + "lm_head.base_layer.weight"][3, 0] += 1.0


@pytest.mark.parametrize("tensors, config, pattern", [
    (None, {"trainable_token_indices": [5, 6]}, r"trainable_token_indices"),
    (None, {"modules_to_save": ["lm_head"]}, r"modules_to_save"),
    (_widen_embedding, None, r"lora_embedding_A \(4, 520\) covers a vocabulary of 520 tokens"
                             r", more than the base model's 512"),
    (_taller_head, None, r"lora_B \(520, 4\) covers a vocabulary of 520"),
    (_changed_table, None, r"lm_head\.base_layer\.weight differs from the base model's"),
], ids=["trainable_tokens", "modules_to_save", "wider_embedding", "taller_head",
        "trained_table"])
def test_adapters_the_engine_cannot_serve_name_the_field(untied, target, tmp_path, tensors,
                                                         config, pattern):
    bad = _edited(untied.adapters["both"], tmp_path / "bad", tensors, config)
    with pytest.raises(LoRAAdapterError, match=pattern):
        _read(bad, target)


def test_dora_on_the_head_is_refused(untied, target, tmp_path):
    dora = make_peft_adapter(untied.base_dir, tmp_path / "dora", r=2, use_dora=True,
                             target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoRAAdapterError, match=r"DoRA \(use_dora\) on lm_head"):
        _read(dora, target)


def test_adapter_without_sized_slots_fails_only_its_requests(untied):
    """Slots for the seven projections only (the default): a head adapter's requests end
    with an error naming the module and the flag; the others are served."""
    llm = LLM(str(untied.base_dir), **{**ENGINE, "lora_target_modules": None}, max_loras=2)
    with shutting_down(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in untied.prompts[:2]], GREEDY,
                            lora_request=lora_requests(untied.adapters, ["head", "plain"]),
                            use_tqdm=False)
    assert isinstance(outs[0].error, LoRAAdapterError)
    assert "lm_head" in str(outs[0].error) and "--lora-target-modules" in str(outs[0].error)
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == MAX_NEW


def test_trtllm_conversion_names_the_module_it_has_no_id_for(untied):
    """TensorRT-LLM's LoRA module ids (0..18) have none for the embedding or the LM head."""
    from manylora.lora.formats.trtllm_convert import peft_to_trtllm

    with pytest.raises(LoRAAdapterError, match=r"targets embed_tokens, for which TensorRT-LLM"):
        peft_to_trtllm(untied.adapters["embed"], torch.float32)


def test_slot_bytes_count_the_vocabulary_modules_once(untied):
    """``slot_bytes`` (what ``lora_device_cache_percent`` divides free memory by) equals the
    bytes ``create_lora_slots`` allocates per slot: the projections' per layer, the
    vocabulary modules' once."""
    from manylora.lora.sizing import slot_bytes
    from manylora.model.loader import load_hf_config, load_model

    base = untied.base_dir
    cfg = ModelConfig.from_hf(load_hf_config(base), torch.float32)
    model = load_model(base, cfg, torch.device("cpu"))
    targets = ("q_proj", "down_proj", "embed_tokens", "lm_head")
    slots = model.create_lora_slots(LoRAConfig(3, 8, 3, targets))
    allocated = sum(b.numel() * b.element_size() for s in {id(s): s for s in slots.values()}
                    .values() for b in s.buffers())
    table = model.slot_table
    allocated += table.ranks.numel() * 4 + table.dora.numel() * 4
    assert slot_bytes(cfg.module_shapes(), cfg.module_copies(), targets, 8,
                      torch.float32) * 3 == allocated


@pytest.mark.parametrize("targets", [".*(q_proj|v_proj)", ".*(q_proj|lm_head)", ".*embed_tokens",
                                     ["q_proj", "v_proj"], ["q_proj", "lm_head"],
                                     ["embed_tokens"]])
def test_which_configs_may_reach_the_vocabulary_modules_as_peft_matches(targets):
    """Under tensor parallelism these adapters are read on the engine's thread (the check
    of a saved table is a collective): exactly those whose targets peft would match to
    ``lm_head`` or ``model.embed_tokens``."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    from manylora.lora.formats.peft_config import may_target_vocab

    config = LoraConfig(target_modules=targets)
    expected = any(bool(check_target_module_exists(config, name))
                   for name in ("lm_head", "model.embed_tokens"))
    assert may_target_vocab({"target_modules": targets}) is expected


def test_whole_table_without_lora_is_refused_as_such(untied, target, tmp_path):
    """peft's ``save_pretrained(save_embedding_layers=True)`` on an adapter with no LoRA on
    the embedding writes the whole ``embed_tokens`` and ``lm_head`` tables (trained or
    resized ones in practice): refused by name, never read as LoRA nor dropped."""
    from peft import LoraConfig, get_peft_model

    from manylora.testing.hf import hf_causal_lm

    model = get_peft_model(hf_causal_lm(untied.base_dir),
                           LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "tables", save_embedding_layers=True)
    saved = load_file(tmp_path / "tables" / "adapter_model.safetensors")
    assert PREFIX + "model.embed_tokens.weight" in saved
    with pytest.raises(LoRAAdapterError,
                       match=r"whole (embed_tokens|lm_head) table, not LoRA weights"):
        _read(tmp_path / "tables", target)
