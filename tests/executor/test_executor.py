"""The executor: what it sizes from the engine's settings (decode graph sizes and piecewise
token buckets, KV cache blocks and the context length they hold, adapter slots), checked
against the rules the flags document (README, ``EngineArgs``)."""

from __future__ import annotations

import argparse

import pytest
import torch

from manylora.engine.arg_utils import EngineArgs
from manylora.executor.factory import create_executor
from manylora.executor.sizing import graph_sizes, piece_sizes
from manylora.executor.uniproc import UniProcExecutor
from manylora.testing import make_checkpoint

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("executor") / "base", "llama", seed=0,
                           **TINY)


def test_piece_buckets_from_engine_args_and_flags():
    """Default buckets on one GPU only (not on the CPU, not under tensor parallelism), capped
    by the token budget; explicit ones anywhere; none under enforce_eager; the flag with no
    value turns them off; bad sizes named."""
    def sizes(device, **kw):
        return piece_sizes(EngineArgs(model="m", max_num_batched_tokens=300, **kw),
                           torch.device(device))

    assert sizes("cuda") == (16, 32, 64, 96, 128, 160, 192, 256, 300)
    assert sizes("cpu") == ()
    assert sizes("cuda", tensor_parallel_size=2) == ()
    assert sizes("cuda", tensor_parallel_size=2, piecewise_cuda_graph_sizes=(64,)) == (64,)
    assert sizes("cpu", piecewise_cuda_graph_sizes=(8, 1000)) == (8, 300)
    assert sizes("cuda", piecewise_cuda_graph_sizes=()) == ()
    assert sizes("cuda", enforce_eager=True, piecewise_cuda_graph_sizes=(8,)) == ()
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    flag = "--piecewise-cuda-graph-sizes"
    for argv, want in (([], None), ([flag], ()), ([flag, "16", "64"], (16, 64))):
        args = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", *argv]))
        assert args.piecewise_cuda_graph_sizes == want
    with pytest.raises(ValueError, match="piecewise_cuda_graph_sizes"):
        EngineArgs(model="m", piecewise_cuda_graph_sizes=(0, 16))


def test_decode_graph_sizes_end_at_max_num_seqs():
    """The capture sizes below ``max_num_seqs``, then ``max_num_seqs`` itself; none on the
    CPU or under ``enforce_eager``."""
    def sizes(device, **kw):
        return graph_sizes(EngineArgs(model="m", **kw), torch.device(device))

    got = sizes("cuda", max_num_seqs=20)
    assert got[-1] == 20 and all(n < 20 for n in got[:-1]) and list(got) == sorted(got)
    assert sizes("cpu", max_num_seqs=20) == ()
    assert sizes("cuda", max_num_seqs=20, enforce_eager=True) == ()


def test_one_process_executor_sizes_cache_and_slots(base_dir, caplog):
    """A KV cache of 8 blocks of 4 tokens holds 32 tokens: the context length is lowered
    from the checkpoint's 256 to that, with a warning; the adapter slots are the model's,
    managed by the executor's ``LoRAManager``; LoRA off builds none."""
    args = EngineArgs(model=str(base_dir), device="cpu", dtype="float32", block_size=4,
                      num_kv_blocks=8, max_loras=2, max_lora_rank=8)
    with caplog.at_level("WARNING"):
        executor = create_executor(args)
    try:
        assert isinstance(executor, UniProcExecutor)
        assert executor.model_config.max_model_len == 256
        assert executor.max_model_len == 32
        assert "max_model_len lowered from 256 to 32" in caplog.text
        assert executor.cache_config.num_blocks == 8
        assert executor.preemption_cost is None
        assert executor.lora_config.max_loras == 2
        assert executor.lora_manager is not None
        assert executor.model.slot_table is not None
    finally:
        executor.shutdown()
    off = create_executor(EngineArgs(model=str(base_dir), device="cpu", dtype="float32",
                                     block_size=4, num_kv_blocks=8, enable_lora=False))
    try:
        assert off.lora_manager is None and off.lora_config is None
        assert off.model.slot_table is None
    finally:
        off.shutdown()
