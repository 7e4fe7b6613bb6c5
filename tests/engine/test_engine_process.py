"""The engine core in a process of its own (``MANYLORA_ENABLE_MULTIPROCESSING=1``, the
default outside the tests): the front talks to it over ZMQ with msgpack messages.

References: the same engine with its core in this process (itself checked against
transformers + peft in test_peft_equivalence.py), on the same checkpoint and adapters;
the exception classes the in-process core raises for the same bad input.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.checkpoint.weights import CheckpointError
from manylora.engine.protocol import EngineDeadError
from manylora.lora.adapter import LoRAAdapterError
from manylora.lora.formats.trtllm_convert import peft_to_trtllm

PROMPTS = ["The quick brown fox", "SELECT name FROM users WHERE", "Hello", "def add(a, b):"]
ENGINE = dict(device="cpu", max_loras=2, max_lora_rank=32, num_kv_blocks=128, block_size=4)


def _engine(demo_set, in_process: bool, **kwargs) -> LLM:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MANYLORA_ENABLE_MULTIPROCESSING", "0" if in_process else "1")
        return LLM(str(demo_set.base_dir), **{**ENGINE, **kwargs})


@pytest.fixture(scope="module")
def both(demo_set):
    """(core in its own process, core in this process)."""
    separate, local = _engine(demo_set, False), _engine(demo_set, True)
    yield separate, local
    separate.llm_engine.shutdown()
    local.llm_engine.shutdown()


def _loras(demo_set):
    return [None, LoRARequest("sql", 1, str(demo_set.adapters["sql"])), None,
            LoRARequest("chat", 2, str(demo_set.adapters["chat"]))]


def _summary(outs):
    """What must be the same wherever the core runs: every token, text and finish field
    exactly; log-probabilities to float32 rounding (two processes may pick other CPU matmul
    paths for the same float32 logits)."""
    return [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text,
             o.outputs[0].finish_reason, o.outputs[0].stop_reason,
             None if o.outputs[0].logprobs is None else
             [{t: (pytest.approx(lp.logprob, rel=1e-5, abs=1e-6), lp.rank)
               for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def test_core_process_outputs_equal_the_in_process_core(both, demo_set):
    separate, local = both
    assert separate.llm_engine.engine_core is None
    assert separate.llm_engine.client.pid != os.getpid()
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10),
              SamplingParams(temperature=0.0, max_tokens=16, stop=["e"]),
              SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[5, 6, 7])]
    got = separate.generate(PROMPTS, params, _loras(demo_set), use_tqdm=False)
    want = local.generate(PROMPTS, params, _loras(demo_set), use_tqdm=False)
    assert _summary(got) == _summary(want)
    # every block back; the same prompt tokens looked up (a request a stop string ends may
    # run one step further in a core of its own before the front's abort reaches it)
    kv, kv_local = separate.llm_engine.kv_cache_stats(), local.llm_engine.kv_cache_stats()
    assert kv.used_blocks == kv_local.used_blocks == 0
    assert kv.prefix_queries == kv_local.prefix_queries


def test_sessions_and_adapter_calls_cross_the_boundary(both, demo_set):
    separate, local = both
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    turns = [PROMPTS[0], {"prompt_token_ids": [30, 31, 32]}]
    for llm in both:
        assert llm.llm_engine.add_lora(LoRARequest("math", 3, str(demo_set.adapters["math"])))
    got = [separate.generate(t, params, _loras(demo_set)[1], use_tqdm=False,
                             session_id="s")[0] for t in turns]
    want = [local.generate(t, params, _loras(demo_set)[1], use_tqdm=False,
                           session_id="s")[0] for t in turns]
    assert _summary(got) == _summary(want)
    assert got[1].prompt_token_ids[:len(got[0].prompt_token_ids)] == got[0].prompt_token_ids
    for llm in both:
        assert llm.end_session("s") and not llm.end_session("s")
        assert llm.llm_engine.remove_lora(3)
    counts = ("host_hits", "host_misses", "host_evictions", "device_misses",
              "device_evictions", "device_load_bytes")
    got, want = (llm.llm_engine.lora_cache_stats() for llm in both)
    assert [getattr(got, c) for c in counts] == [getattr(want, c) for c in counts]
    assert got.host_misses >= 1


def test_trtllm_tensors_cross_the_boundary(both, demo_set):
    weights, config = peft_to_trtllm(demo_set.adapters["sql"], torch.bfloat16,
                                     demo_set.base_dir)
    request = LoRARequest(task_id=9, weights=weights, config=config)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got, want = (llm.generate(PROMPTS[:2], params, request, use_tqdm=False) for llm in both)
    assert _summary(got) == _summary(want)


def test_core_errors_come_back_as_their_own_class(both, demo_set, tmp_path):
    separate, local = both
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text("[]")
    bad = [({"prompt_token_ids": []}, None, ValueError, "empty"),
           ("Hi", LoRARequest("gone", 11, str(tmp_path / "missing")), FileNotFoundError, None),
           ("Hi", LoRARequest("corrupt", 12, str(corrupt)), LoRAAdapterError, "PEFT"),
           ({"prompt_token_ids": [1] * 600}, None, ValueError, "max_model_len")]
    for prompt, lora, kind, match in bad:
        for llm in both:
            with pytest.raises(kind, match=match):
                llm.generate(prompt, SamplingParams(max_tokens=4), lora, use_tqdm=False)
            assert not llm.llm_engine.has_unfinished_requests()
    # a bad request among good ones: nothing of the call is left queued, others still serve
    with pytest.raises(ValueError, match="empty"):
        separate.generate([PROMPTS[0], {"prompt_token_ids": []}], SamplingParams(),
                          use_tqdm=False)
    assert separate.llm_engine.kv_cache_stats().used_blocks == 0
    assert separate.generate(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids


def test_start_up_errors_are_raised_in_the_caller(demo_set, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(demo_set.base_dir):
        if not name.endswith(".safetensors"):
            os.symlink(demo_set.base_dir / name, broken / name)
    for in_process in (True, False):
        with pytest.raises(CheckpointError):
            _engine(type(demo_set)(broken, demo_set.adapters), in_process)


def test_a_killed_core_process_fails_the_caller_not_hangs_it(demo_set):
    llm = _engine(demo_set, False)
    try:
        pid = llm.llm_engine.client.pid
        errors: list[BaseException] = []

        def generate():
            try:
                llm.generate(PROMPTS, SamplingParams(max_tokens=200, ignore_eos=True),
                             use_tqdm=False)
            except BaseException as e:
                errors.append(e)

        caller = threading.Thread(target=generate)
        os.kill(pid, signal.SIGKILL)
        caller.start()
        caller.join(120)
        assert not caller.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], EngineDeadError)
        assert "died" in str(errors[0])
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS[0], use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def test_dropping_the_engine_stops_its_process(demo_set):
    llm = _engine(demo_set, False)
    process = llm.llm_engine.client.process
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    del llm
    import gc

    gc.collect()
    assert process.wait(60) == 0
