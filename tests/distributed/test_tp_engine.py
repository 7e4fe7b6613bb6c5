"""The engine with ``tensor_parallel_size`` 2 and 4 (gloo, CPU): greedy outputs of a mixed
batch of adapters and the base model equal those of one rank; a killed worker ends the
engine with an error within seconds and leaves the process that embeds it alone.

Reference: the same engine at ``tensor_parallel_size=1`` (itself checked token for token
against transformers + peft in tests/engine/test_peft_equivalence.py).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.distributed.shared_host import _SHM, file_prefix
from manylora.distributed.workers import WorkerDiedError
from manylora.engine.protocol import EngineDeadError
from manylora.executor.tp_driver import TPDriver
from manylora.testing import (
    compare_greedy,
    hf_greedy_reference,
    make_checkpoint,
    make_peft_adapter,
)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(max_lora_rank=8, block_size=4, max_model_len=128, device="cpu", dtype="float32",
              max_loras=2, num_kv_blocks=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["The quick brown fox", "SELECT name FROM users", "Low-rank adaptation",
           "A large language model", "def add(a, b):"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tp") / "base", "llama", seed=0, **TINY)


@pytest.fixture(scope="module")
def loras(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-loras")
    specs = [(4, ["q_proj", "k_proj", "v_proj", "o_proj"]),
             (8, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
             (2, ["o_proj", "down_proj"])]
    return [LoRARequest(f"a{i}", i + 1, str(make_peft_adapter(
        base_dir, root / f"a{i}", r=r, target_modules=t, seed=i + 1)))
        for i, (r, t) in enumerate(specs)]


def _generate(base_dir, loras, **kwargs):
    llm = LLM(str(base_dir), **ENGINE, **kwargs)
    try:
        adapters = [None, loras[0], loras[1], loras[2], loras[0]]
        outs = llm.generate(PROMPTS, GREEDY, adapters, use_tqdm=False)
        kv = llm.llm_engine.kv_cache_stats()
        assert kv.used_blocks == 0
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.llm_engine.shutdown()


# TP 2 with async scheduling (the default) is what every other test here runs
@pytest.mark.parametrize("tp, async_scheduling", [(2, False), (4, True)])
def test_tensor_parallel_equals_one_rank(base_dir, loras, tp, async_scheduling):
    """Against one rank without async scheduling: under it every rank gathers the decode
    tokens from rank 0's samples, broadcast to the workers."""
    assert _generate(base_dir, loras, tensor_parallel_size=tp,
                     async_scheduling=async_scheduling) == _generate(
        base_dir, loras, async_scheduling=False)


def test_piecewise_steps_under_tensor_parallelism(base_dir, loras):
    """Rank 0 pads its prefill and mixed steps to piece buckets; the workers, built with the
    same buckets, run the same pieces (and their collectives) on the same packed steps."""
    assert _generate(base_dir, loras, tensor_parallel_size=2,
                     piecewise_cuda_graph_sizes=(8, 16, 32)) == _generate(
        base_dir, loras, async_scheduling=False)


def test_idle_engine_outlives_the_collective_timeout(base_dir, loras, monkeypatch):
    """Workers wait for rank 0's next message on a pipe, with no time limit: an engine idle
    for longer than the collective timeout (3 s here, 300 s by default) still serves. The
    3 s bound only starts once every rank has finished starting (``end_startup``): start-up
    has its own, generous, timeout, so a slow machine's process start does not count."""
    import manylora.executor.tensor_parallel as tensor_parallel

    monkeypatch.setattr(tensor_parallel, "TPDriver", functools.partial(TPDriver, timeout_s=3.0))
    llm = LLM(str(base_dir), **ENGINE, tensor_parallel_size=2)
    try:
        first = llm.generate(PROMPTS[:2], GREEDY, [None, loras[0]], use_tqdm=False)
        time.sleep(5)
        second = llm.generate(PROMPTS[:2], GREEDY, [None, loras[0]], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in first] == \
            [o.outputs[0].token_ids for o in second]
    finally:
        llm.llm_engine.shutdown()


def test_killed_worker_raises_in_the_engine_and_spares_its_process(base_dir):
    """SIGKILL a worker: the engine's next ``generate`` raises ``WorkerDiedError`` within
    seconds (the window holds one step of a tiny model and the guard's wait of at most 2 s
    for the death to show; no process start), and so does every later call. The process
    that embeds the engine (this one) gets no SIGTERM and is not ended: once the worker
    monitor has finished with the death it is still here, and it starts a new engine."""
    sigterms = []
    previous = signal.signal(signal.SIGTERM, lambda *args: sigterms.append(args))
    try:
        llm = LLM(str(base_dir), **ENGINE, tensor_parallel_size=2, enable_lora=False)
        try:
            before = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            workers = llm.llm_engine.engine_core.executor.driver.workers
            os.kill(workers.pids[1], signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(WorkerDiedError, match="rank 1"):
                llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert time.monotonic() - start < 10
            with pytest.raises(WorkerDiedError, match="rank 1"):
                llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
            workers._monitor.join(60)     # the thread that used to signal this process
            assert not workers._monitor.is_alive()
        finally:
            llm.llm_engine.shutdown()
        assert sigterms == []
        llm = LLM(str(base_dir), **ENGINE, tensor_parallel_size=2, enable_lora=False)
        try:
            after = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        finally:
            llm.llm_engine.shutdown()
        assert after == before
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("async_scheduling, piece_sizes", [
    (True, None), (False, None), (True, (8, 16, 32))])
def test_cuda_tensor_parallel_matches_peft(base_dir, loras, async_scheduling, piece_sizes):
    """TP 2 on two GPUs (NCCL, decode steps replayed as CUDA graphs on both ranks, rank 0's
    samples broadcast under async scheduling; with piece sizes, prefill and mixed steps
    replayed piecewise on both ranks) against transformers + peft on the same weights,
    float32."""
    pieces = {} if piece_sizes is None else {"piecewise_cuda_graph_sizes": piece_sizes}
    llm = LLM(str(base_dir), **{**ENGINE, "device": "cuda", "max_num_seqs": 8}, **pieces,
              tensor_parallel_size=2, async_scheduling=async_scheduling)
    try:
        tok = llm.get_tokenizer()
        prompts = [tok(p).input_ids for p in PROMPTS]
        adapters = [None, loras[0], loras[1], loras[2], loras[0]]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, adapters,
                            use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    refs = hf_greedy_reference(base_dir, {lo.lora_name: lo.lora_path for lo in loras},
                               prompts, [a.lora_name if a else None for a in adapters],
                               GREEDY.max_tokens)
    for out, ref in zip(outs, refs):
        ok, where = compare_greedy(out.outputs[0].token_ids, ref)
        assert ok, where


def _twice(base_dir, loras, **kwargs):
    """The mixed batch twice on a cache too small for it: preemption, then prefix hits."""
    llm = LLM(str(base_dir), **{**ENGINE, "num_kv_blocks": 14}, **kwargs)
    try:
        adapters = [None, loras[0], loras[1], loras[2], loras[0]]
        outs = [llm.generate(PROMPTS, GREEDY, adapters, use_tqdm=False) for _ in range(2)]
        return [[o.outputs[0].token_ids for o in run] for run in outs], \
            llm.llm_engine.kv_cache_stats()
    finally:
        llm.llm_engine.shutdown()


def test_preemption_and_prefix_cache_under_tensor_parallelism(base_dir, loras):
    (tp_runs, tp_kv), (one_runs, _) = (_twice(base_dir, loras, tensor_parallel_size=2),
                                       _twice(base_dir, loras, async_scheduling=False))
    assert tp_runs == one_runs
    assert tp_runs[0] == tp_runs[1]
    assert tp_kv.preemptions > 0 and tp_kv.prefix_hits > 0
    assert tp_kv.used_blocks == 0


def test_server_under_tensor_parallelism(base_dir):
    import openai

    from manylora.entrypoints.openai.launcher import ServerThread, create_server
    from manylora.entrypoints.openai.serve_args import serve_parser

    texts = []
    for tp, variant in ((1, "--no-async-scheduling"), (2, "--async-scheduling")):
        args = serve_parser().parse_args(
            ["--model", str(base_dir), "--served-model-name", "base", "--device", "cpu",
             "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "4",
             "--tensor-parallel-size", str(tp), "--no-enable-lora", variant])
        server = create_server(args)
        try:
            with ServerThread(server.app) as http:
                client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="x", max_retries=0)
                streamed = "".join(c.choices[0].text for c in client.completions.create(
                    model="base", prompt=PROMPTS[0], max_tokens=8, temperature=0.0,
                    stream=True, extra_body={"ignore_eos": True}) if c.choices)
                texts.append(streamed)
        finally:
            server.shutdown()
    assert texts[0] == texts[1] and texts[0]


def test_dora_under_tensor_parallelism(base_dir, loras, tmp_path_factory):
    """DoRA's row norms are a collective under TP (row-parallel projections hold part of
    every row): outputs equal one rank's, with one slot for three adapters so the DoRA ones
    are evicted and read again (on the engine's thread)."""
    root = tmp_path_factory.mktemp("tp-dora")
    dora = [LoRARequest(f"d{i}", 10 + i, str(make_peft_adapter(
        base_dir, root / f"d{i}", r=4, target_modules=["q_proj", "o_proj", "down_proj"],
        seed=20 + i, use_dora=True))) for i in range(2)]
    adapters = [dora[0], loras[0], dora[1], None, dora[0]]

    def run(**kwargs):
        llm = LLM(str(base_dir), **{**ENGINE, "max_loras": 1, "max_cpu_loras": 1}, **kwargs)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, adapters,
                                                                 use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()

    assert run(tensor_parallel_size=2) == run()


def test_prompt_logprobs_under_tensor_parallelism(base_dir, loras):
    """Rank 0's prompt logits are all-gathered from every rank (the workers run the same
    chunks of prompt rows), in chunked prefill steps with and without a sampled row: the
    values equal one rank's."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)

    def run(**kwargs):
        llm = LLM(str(base_dir), **ENGINE, max_num_batched_tokens=8, **kwargs)
        try:
            outs = llm.generate(PROMPTS, params, [None, loras[0], loras[1], None, loras[2]],
                                use_tqdm=False)
            return [(o.prompt_logprobs, o.outputs[0].token_ids) for o in outs]
        finally:
            llm.llm_engine.shutdown()

    two, one = run(tensor_parallel_size=2), run(async_scheduling=False)
    for (lp2, ids2), (lp1, ids1) in zip(two, one):
        assert ids2 == ids1 and len(lp2) == len(lp1) and lp2[0] is lp1[0] is None
        for d2, d1 in zip(lp2[1:], lp1[1:]):
            token = next(iter(d1))
            assert next(iter(d2)) == token
            assert d2[token].logprob == pytest.approx(d1[token].logprob, abs=1e-5)
            assert sorted(v.logprob for v in d2.values()) == pytest.approx(
                sorted(v.logprob for v in d1.values()), abs=1e-5)


def _shared_files(pid: int) -> list[str]:
    return sorted(p.name for p in _SHM.glob(file_prefix(pid) + "*"))


def test_core_process_leaves_no_shared_files(base_dir, loras, monkeypatch):
    """The engine core in a process of its own (as ``manylora serve`` runs it) at TP 2 keeps
    its adapters in ``/dev/shm``. That process ends by ``os._exit`` (no finalizer runs):
    after a shutdown, and after the core is killed, none of its files is left; the killed
    core's death reaches ``generate`` as ``EngineDeadError`` and the process is reaped."""
    monkeypatch.setenv("MANYLORA_ENABLE_MULTIPROCESSING", "1")
    for kill in (False, True):
        llm = LLM(str(base_dir), **ENGINE, tensor_parallel_size=2)
        client = llm.llm_engine.client
        pid = client.pid
        try:
            assert pid != os.getpid()
            llm.generate(PROMPTS[:2], GREEDY, [loras[0], loras[1]], use_tqdm=False)
            assert len(_shared_files(pid)) >= 3        # two adapters, the acks
            if kill:
                os.kill(pid, signal.SIGKILL)
                with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
                    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
                assert client.process.returncode == -signal.SIGKILL      # reaped
        finally:
            llm.llm_engine.shutdown()
        assert _shared_files(pid) == []
        assert not Path(client._dir).exists()
