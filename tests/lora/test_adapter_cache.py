"""The adapter cache under churn, TensorRT-LLM's task_id semantics and adapter identity.

A tiny llama checkpoint and peft adapters written by peft's own ``save_pretrained``; the
reference is transformers + peft (``hf_greedy_reference``), and an engine with a slot for
every adapter.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.lora.formats.trtllm_convert import peft_to_trtllm
from manylora.testing import compare_greedy, hf_greedy_reference, make_checkpoint, make_peft_adapter

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
ENGINE = dict(max_lora_rank=8, num_kv_blocks=128, block_size=4, max_model_len=64, device="cpu",
              skip_tokenizer_init=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
NUM_ADAPTERS = 8
TARGETS = (["q_proj", "v_proj"], ["k_proj", "o_proj", "down_proj"], ["gate_proj", "up_proj"],
           ["q_proj", "k_proj", "v_proj", "o_proj"])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("adapter_cache")


@pytest.fixture(scope="module")
def base_dir(root):
    return make_checkpoint(root / "base", "llama", seed=0, **TINY)


@pytest.fixture(scope="module")
def adapters(base_dir, root):
    return {f"a{i}": make_peft_adapter(base_dir, root / f"a{i}", r=(4, 8)[i % 2],
                                       target_modules=TARGETS[i % 4], seed=10 + i)
            for i in range(NUM_ADAPTERS)}


def _prompts(n):
    return [[1 + (7 * i + j) % 250 for j in range(3 + i % 5)] for i in range(n)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_reference(outs, base_dir, adapters, prompts, names):
    refs = hf_greedy_reference(base_dir, adapters, prompts, names, GREEDY.max_tokens)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        ok, pos = compare_greedy(out.outputs[0].token_ids, ref)
        assert ok, f"request {i} ({names[i]}): diverges at {pos}"


def test_working_set_four_times_max_loras_completes_unchanged(base_dir, adapters):
    names = [f"a{i % NUM_ADAPTERS}" if i % 5 else None for i in range(40)]
    prompts = _prompts(len(names))
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    loras = [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in names]
    inputs = [{"prompt_token_ids": p} for p in prompts]

    small = LLM(str(base_dir), **ENGINE, max_loras=2, max_cpu_loras=3, max_num_seqs=6)
    outs = small.generate(inputs, GREEDY, loras, use_tqdm=False)
    stats = small.llm_engine.lora_cache_stats()
    fit = LLM(str(base_dir), **ENGINE, max_loras=NUM_ADAPTERS, max_cpu_loras=NUM_ADAPTERS)
    assert _tokens(outs) == _tokens(fit.generate(inputs, GREEDY, loras, use_tqdm=False))
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert stats.device_evictions > 0 and stats.device_misses >= NUM_ADAPTERS
    assert stats.host_evictions > 0 and stats.host_misses > NUM_ADAPTERS   # re-read from disk
    assert stats.host_load_seconds > 0 and stats.device_load_bytes > 0
    _assert_reference(outs[:16], base_dir, adapters, prompts[:16], names[:16])


def _trtllm(adapter_dir):
    return peft_to_trtllm(adapter_dir, torch.float32)


def test_task_id_hit_miss_and_eviction(base_dir, adapters):
    llm = LLM(str(base_dir), **ENGINE, max_loras=1, max_cpu_loras=2)
    engine = llm.llm_engine
    prompt = [{"prompt_token_ids": _prompts(1)[0]}]
    by_path = llm.generate(prompt, GREEDY, LoRARequest("a0", 100, str(adapters["a0"])),
                           use_tqdm=False)
    w, c = _trtllm(adapters["a0"])
    first = llm.generate(prompt, GREEDY, LoRARequest(task_id=5, weights=w, config=c),
                         use_tqdm=False)
    again = llm.generate(prompt, GREEDY, LoRARequest(task_id=5), use_tqdm=False)
    assert _tokens(first) == _tokens(again) == _tokens(by_path)

    with pytest.raises(ValueError, match="task_id 99 .*not cached"):
        engine.add_request(None, prompt[0], GREEDY, LoRARequest(task_id=99))
    for task, name in ((6, "a1"), (7, "a2")):          # the host cache holds 2: task 5 goes
        w, c = _trtllm(adapters[name])
        llm.generate(prompt, GREEDY, LoRARequest(task_id=task, weights=w, config=c),
                     use_tqdm=False)
    assert engine.lora_cache_stats().host_evictions >= 1
    with pytest.raises(ValueError, match="task_id 5 .*not cached"):
        engine.add_request(None, prompt[0], GREEDY, LoRARequest(task_id=5))
    assert not engine.has_unfinished_requests()
    assert _tokens(llm.generate(prompt, GREEDY, LoRARequest(task_id=7), use_tqdm=False))


def test_task_id_reused_with_other_weights(base_dir, adapters):
    llm = LLM(str(base_dir), **ENGINE, max_loras=1, max_cpu_loras=4)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": _prompts(2)[1]}
    w0, c0 = _trtllm(adapters["a0"])
    w1, c1 = _trtllm(adapters["a1"])
    engine.add_request("r0", prompt, GREEDY, LoRARequest(task_id=3, weights=w0, config=c0))
    with pytest.raises(ValueError, match="task_id 3 is cached with other weights"):
        engine.add_request("r1", prompt, GREEDY, LoRARequest(task_id=3, weights=w1, config=c1))
    with pytest.raises(ValueError, match="still use"):
        engine.add_request("r1", prompt, GREEDY,
                           LoRARequest(task_id=3, weights=w1, config=c1, replace=True))
    old = _tokens(engine.generate_all())
    replaced = llm.generate([prompt], GREEDY,
                            LoRARequest(task_id=3, weights=w1, config=c1, replace=True),
                            use_tqdm=False)
    expect = llm.generate([prompt], GREEDY, LoRARequest("a1", 50, str(adapters["a1"])),
                          use_tqdm=False)
    assert _tokens(replaced) == _tokens(expect) != old


def test_adapters_sharing_a_name_keep_their_own_identity(base_dir, adapters):
    llm = LLM(str(base_dir), **ENGINE, max_loras=2)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": _prompts(3)[2]}
    one = LoRARequest("shared", 1, str(adapters["a3"]))
    two = LoRARequest("shared", 2, str(adapters["a7"]))
    engine.add_request("one", prompt, GREEDY, one)
    engine.add_request("two", prompt, GREEDY, two)
    reqs = dict(engine.engine_core.scheduler.requests)      # digests come with the reads
    outs = sorted(engine.generate_all(), key=lambda o: o.request_id)
    assert reqs["one"].lora_digest and reqs["one"].lora_digest != reqs["two"].lora_digest
    _assert_reference(outs, base_dir, {"one": adapters["a3"], "two": adapters["a7"]},
                      [prompt["prompt_token_ids"]] * 2, ["one", "two"])


def test_adapter_changed_on_disk_after_eviction_ends_only_its_requests(base_dir, adapters,
                                                                       root):
    path = root / "changing"
    shutil.copytree(adapters["a0"], path)
    llm = LLM(str(base_dir), **ENGINE, max_loras=1, max_cpu_loras=1)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": _prompts(1)[0]}
    changing = LoRARequest("changing", 1, str(path))
    llm.generate([prompt], GREEDY, changing, use_tqdm=False)
    llm.generate([prompt], GREEDY, LoRARequest("a1", 2, str(adapters["a1"])), use_tqdm=False)
    assert not engine.engine_core.lora_manager.is_ready(1)              # evicted from both tiers
    shutil.rmtree(path)
    shutil.copytree(adapters["a2"], path)                   # same path, other weights
    engine.add_request("victim", prompt, GREEDY, changing)
    engine.add_request("base", prompt, GREEDY)
    outs = {o.request_id: o for o in engine.generate_all()}
    assert outs["victim"].outputs[0].finish_reason == "error"
    assert "changed on disk" in str(outs["victim"].error)
    assert outs["base"].outputs[0].finish_reason == "length"


def test_host_tier_is_bounded_by_bytes(base_dir, adapters):
    llm = LLM(str(base_dir), **ENGINE, max_loras=1, max_cpu_loras=8)
    manager = llm.llm_engine.engine_core.lora_manager
    llm.llm_engine.add_lora(LoRARequest("a1", 1, str(adapters["a1"])))
    one = manager.host_bytes
    bound = int(1.5 * one)
    bounded = LLM(str(base_dir), **ENGINE, max_loras=1, max_cpu_loras=8,
                  max_cpu_lora_bytes=bound)
    for i, name in enumerate(("a1", "a5")):          # the same shapes: one fits at a time
        bounded.llm_engine.add_lora(LoRARequest(name, i + 1, str(adapters[name])))
        assert 0 < bounded.llm_engine.engine_core.lora_manager.host_bytes <= bound
    assert bounded.llm_engine.lora_cache_stats().host_evictions == 1


def test_device_cache_percent_needs_a_gpu(base_dir):
    if torch.cuda.is_available():
        pytest.skip("sizes slots from GPU memory on CUDA")
    with pytest.raises(ValueError, match="lora_device_cache_percent.*set max_loras"):
        LLM(str(base_dir), **ENGINE, lora_device_cache_percent=0.5)
