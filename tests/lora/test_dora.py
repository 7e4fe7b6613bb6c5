"""DoRA adapters (peft's ``use_dora=True``) end to end against transformers + peft, greedy.

peft computes a DoRA module as ``m / ||W + BA|| * (x W^T + x A^T B^T) + bias``; manylora folds
``m / ||W + BA||`` into per-slot scales at load time and applies them in the batched expand,
for the rows of DoRA slots only. The reference runs every prompt alone through a
``PeftModel`` holding all adapters; manylora runs them as one batch mixing DoRA adapters,
plain LoRA adapters and base rows. Where the reference's two best logits tie within 1e-5,
either token counts (``compare_greedy``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.lora.slot_layout import SlotLayout
from manylora.testing import (
    compare_greedy,
    hf_greedy_reference,
    make_checkpoint,
    make_peft_adapter,
)

TEXTS = [
    "The quick brown fox",
    "Low-rank adaptation adds a small update to a frozen weight matrix, and",
    "SELECT name FROM users WHERE",
    "def add(a, b):",
    "Once",
    "Serving many adapters on one base model lets a single GPU answer requests",
    "Hello",
    "Paged attention splits the cache into blocks of",
]
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> make_peft_adapter arguments: two DoRA adapters and a plain one, different targets.
ADAPTER_SPECS = {
    "dora_attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                         "o_proj"], use_dora=True, seed=11),
    "dora_all": dict(r=8, lora_alpha=16, target_modules=ALL_MODULES, use_dora=True,
                     use_rslora=True, seed=12),
    "plain": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"],
                  seed=13),
}
# adapter per prompt: DoRA, plain and base rows in one batch.
NAMES = ["dora_attn", None, "plain", "dora_all", "dora_attn", "plain", None, "dora_all"]


def _adapters(base, root, specs):
    return {name: make_peft_adapter(base, root / name, **spec) for name, spec in specs.items()}


def _prompts(base):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    return [tok(t).input_ids for t in TEXTS]


def _generate(base, adapters, prompts, names, **engine_kwargs):
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    reqs = [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in names]
    llm = LLM(str(base), device="cpu", dtype="float32", num_kv_blocks=128, block_size=4,
              **engine_kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=reqs,
                        use_tqdm=False)
    return llm, outs


def _assert_matches(outs, refs, names):
    assert len(outs) == len(refs)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        ok, pos = compare_greedy(out.outputs[0].token_ids, ref)
        assert ok, (f"prompt {i} (adapter {names[i]}): diverges at token {pos}: "
                    f"ours {out.outputs[0].token_ids} ref {ref.token_ids}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny llama base, its DoRA and plain adapters, prompts and peft's greedy outputs."""
    root = tmp_path_factory.mktemp("dora-llama")
    base = make_checkpoint(root / "base", seed=7)
    adapters = _adapters(base, root, ADAPTER_SPECS)
    prompts = _prompts(base)
    refs = hf_greedy_reference(base, adapters, prompts, NAMES, MAX_NEW)
    return base, adapters, prompts, refs


def test_dora_plain_and_base_rows_in_one_batch_match_peft(llama):
    base, adapters, prompts, refs = llama
    llm, outs = _generate(base, adapters, prompts, NAMES, max_loras=3, max_lora_rank=8,
                          max_num_batched_tokens=32)
    _assert_matches(outs, refs, NAMES)
    core = llm.llm_engine.engine_core
    table = core.executor.model.slot_table
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    for slot, lid in enumerate(core.lora_manager.slot_to_id):
        if lid is not None:                      # DoRA flags only in the modules it targets
            flags = table.dora_host[slot]
            assert flags.any() == (lid != ids["plain"])
            assert not (flags & (table.ranks_host[slot] == 0)).any()


def test_dora_through_the_triton_kernels_matches_peft(llama, monkeypatch):
    """The same batch with the LoRA layers forced onto the Triton entry points (CPU: the
    interpreter): the tiled expand applies DoRA per (slot, slice) flag and still matches."""
    from manylora.lora import slots as lora_slots
    from manylora.lora.kernels import triton_lora

    monkeypatch.setattr(lora_slots, "lora_shrink", triton_lora.lora_shrink_triton)
    monkeypatch.setattr(lora_slots, "lora_expand", triton_lora.lora_expand_triton)
    flagged = []
    real = triton_lora.lora_expand_tiled

    def spy(y, buffer, b, ranks, rows, slot, start, length, block_m, offsets, dora=None,
            scales=None, bias=None):
        flagged.append(dora is not None and bool(dora.any()))
        return real(y, buffer, b, ranks, rows, slot, start, length, block_m, offsets, dora,
                    scales, bias)

    monkeypatch.setattr(triton_lora, "lora_expand_tiled", spy)
    base, adapters, prompts, refs = llama
    _, outs = _generate(base, adapters, prompts, NAMES, max_loras=3, max_lora_rank=8,
                        max_num_batched_tokens=32)
    _assert_matches(outs, refs, NAMES)
    assert any(flagged), "no tiled expand saw a DoRA slot"


def test_without_the_scales_the_dora_rows_differ(llama, monkeypatch):
    """The DoRA scales matter here: with every scale forced to one (what a kernel ignoring
    the DoRA flag would compute) the DoRA rows no longer match peft."""
    base, adapters, prompts, refs = llama
    original = SlotLayout.prepare

    def without_scale(self, packed):
        load = original(self, packed)
        load.dora[:] = 0            # the slot load's DoRA flags (a view of what it copies)
        return load

    monkeypatch.setattr(SlotLayout, "prepare", without_scale)
    rows = [i for i, n in enumerate(NAMES) if n is not None and n.startswith("dora")]
    _, outs = _generate(base, adapters, [prompts[i] for i in rows], [NAMES[i] for i in rows],
                        max_loras=3, max_lora_rank=8)
    assert not all(compare_greedy(o.outputs[0].token_ids, refs[i])[0]
                   for o, i in zip(outs, rows))


def test_dora_through_fewer_slots_than_adapters(llama, monkeypatch):
    """One slot cycles the three adapters: DoRA and plain adapters replace each other in the
    same slot buffers (scales rewritten, flags follow) and the outputs still match peft."""
    base, adapters, prompts, refs = llama
    kinds: list[bool] = []
    original = SlotLayout.load

    def recording(self, slot, packed, load):
        kinds.append(bool(load.dora.any()))
        original(self, slot, packed, load)

    monkeypatch.setattr(SlotLayout, "load", recording)
    # One request at a time, in NAMES' order: the slot loads follow that order, whatever
    # order the loader threads finish their first reads in.
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    llm = LLM(str(base), device="cpu", dtype="float32", num_kv_blocks=128, block_size=4,
              max_loras=1, max_lora_rank=8)
    outs = [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False, lora_request=[
        None if n is None else LoRARequest(n, ids[n], str(adapters[n]))])[0]
        for p, n in zip(prompts, NAMES)]
    _assert_matches(outs, refs, NAMES)
    switches = sum(k1 != k2 for k1, k2 in zip(kinds, kinds[1:]))
    assert switches >= 2, f"slot 0 was not swapped between DoRA and plain adapters: {kinds}"


def _rewrite_safetensors(path: Path, fn) -> None:
    """Replace every tensor ``t`` named ``k`` in the safetensors file by ``fn(k, t)``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    save_file({k: fn(k, t).contiguous() for k, t in tensors.items()}, path,
              metadata={"format": "pt"})


def test_qwen2_qkv_bias_with_dora_matches_peft(tmp_path):
    """q/k/v carry a bias: DoRA scales ``x W^T + delta`` but not the bias (peft subtracts it
    before scaling), which the slots' shifts ``(1 - scale) * bias`` reproduce. The biases
    are made large and the magnitudes far from the norms, so that scaling the bias too
    would change the greedy tokens."""
    base = make_checkpoint(tmp_path / "base", "qwen2", seed=5)
    _rewrite_safetensors(base / "model.safetensors",
                         lambda k, t: t * 10 if k.endswith("_proj.bias") else t)
    adapters = _adapters(base, tmp_path, {
        "dora_qkv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                         use_dora=True, seed=21),
        "plain": dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=22),
    })
    gen = torch.Generator().manual_seed(23)
    _rewrite_safetensors(
        adapters["dora_qkv"] / "adapter_model.safetensors",
        lambda k, t: (t * (1 + 0.5 * torch.randn(t.shape, generator=gen)).abs()
                      if "lora_magnitude_vector" in k else t))
    prompts = _prompts(base)[:5]
    names = ["dora_qkv", None, "plain", "dora_qkv", "dora_qkv"]
    refs = hf_greedy_reference(base, adapters, prompts, names, MAX_NEW)
    llm, outs = _generate(base, adapters, prompts, names, max_loras=2, max_lora_rank=4)
    _assert_matches(outs, refs, names)
    qkv = llm.llm_engine.engine_core.executor.model.model.layers[0].self_attn.qkv_proj
    assert qkv.bias is not None and qkv.lora.bias is not None


@pytest.mark.gpu
def test_cuda_graphs_with_dora_swaps_match_peft(llama):
    """float32 on CUDA with decode graphs: DoRA and plain adapters cycle through two slots
    between replays (the DoRA flag is graph input data) and the outputs still match peft;
    no all-projection graph is captured after start-up."""
    base, adapters, prompts, refs = llama
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    reqs = [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in NAMES]
    llm = LLM(str(base), device="cuda", dtype="float32", max_loras=2, max_lora_rank=8,
              num_kv_blocks=128, block_size=4)
    graphs = llm.llm_engine.engine_core.executor.runner.graphs
    full = graphs.policy.full_mask
    captured = [k for k in graphs.keys if k[2] == full]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                        lora_request=reqs, use_tqdm=False)
    _assert_matches(outs, refs, NAMES)
    assert [k for k in graphs.keys if k[2] == full] == captured
