"""``TPExecutor``: the model split over ``tensor_parallel_size`` ranks of one host (vLLM v1's
``MultiprocExecutor``, with rank 0 in the engine's own process).

Rank 0 is built as ``UniProcExecutor`` builds its one rank, on its shard, and drives ranks
1..N-1 (``TPDriver``): they are started before the model loads, build their runners and
graphs when rank 0 does (``TPDriver.allocate_kv``), receive each step's inputs before rank
0's forward pass and, under async scheduling, its sampled tokens; an adapter entering a slot
travels to them as the name of its pinned buffer in shared memory, and a DoRA adapter's row
norms are a collective of every rank. A dead worker surfaces as ``WorkerDiedError`` from the
step that meets it.
"""

from __future__ import annotations

import contextlib

import torch

from manylora.distributed.parallel_state import TPGroup
from manylora.executor.abstract import ExecutorArgs
from manylora.executor.sizing import lora_config
from manylora.executor.tp_driver import TPDriver
from manylora.executor.uniproc import UniProcExecutor
from manylora.worker.tp_worker import WorkerSpec, rank_device


class TPExecutor(UniProcExecutor):
    """Rank 0 of a tensor-parallel model, and the driver of the other ranks.

    Args:
        args: the engine's settings (``tensor_parallel_size`` > 1).

    Raises:
        ValueError: a setting tensor parallelism does not support yet (``swap_space``,
            ``lora_device_cache_percent``), or a model whose heads do not split over the
            ranks.
        WorkerDiedError: a worker died while starting.

    Attributes:
        driver: the ``TPDriver`` of ranks 1..N-1.
    """

    def __init__(self, args: ExecutorArgs) -> None:
        try:
            super().__init__(args)
        except BaseException:
            # a start-up step after the workers joined raised (a model the ranks cannot
            # load): stop them and leave the process group, so that this process can
            # start another engine
            if getattr(self, "driver", None) is not None:
                self.driver.shutdown()
            raise

    def _start_workers(self, args: ExecutorArgs) -> TPGroup:
        """Check the settings, then start ranks 1..N-1 and join their process group."""
        if args.swap_space:
            raise ValueError("swap_space is not supported with tensor_parallel_size > 1 yet")
        if args.lora_device_cache_percent is not None:
            raise ValueError("lora_device_cache_percent is not supported with "
                             "tensor_parallel_size > 1 yet: set max_loras")
        cfg = self.model_config
        cfg.shard(args.tensor_parallel_size)       # ValueError if it won't split
        lora = lora_config(args, args.max_loras, cfg.dtype) if args.enable_lora else None
        spec = WorkerSpec(str(self.model_dir), dict(args.key_dict), args.load_format,
                          str(cfg.dtype).removeprefix("torch."), self.device.type,
                          cfg.max_model_len, args.trust_remote_code, lora,
                          args.block_size, args.kv_cache_dtype, args.quantization)
        if self.device.type == "cuda":
            self.device = rank_device("cuda", 0)
            torch.cuda.set_device(self.device)
        self.driver = TPDriver(spec, args.tensor_parallel_size)
        return self.driver.tp

    def _start_worker_runners(self, args: ExecutorArgs, graphs: tuple[int, ...],
                              pieces: tuple[int, ...]) -> None:
        self.driver.allocate_kv(self.cache_config.num_blocks, self.max_model_len, graphs,
                                args.max_num_batched_tokens, args.max_num_seqs, pieces)

    def _connect(self, args: ExecutorArgs) -> None:
        """Every step's inputs go to the workers before rank 0's forward pass; an adapter
        entering a slot goes to them through shared memory (DoRA adapters are read on the
        engine's thread: their norms are a collective); under async scheduling rank 0's
        samples are broadcast, for the next step's decode tokens."""
        self.runner.on_step = self.driver.step
        if self.lora_manager is not None:
            self.lora_manager.on_write_slot = self.driver.write_slot
            self.lora_manager.host_alloc = self.driver.host_buffers.alloc
            self.lora_manager.background_dora_reads = False
        if args.async_scheduling:
            self.driver.share_sampled = True
            self.runner.on_sampled = self.driver.broadcast_sampled

    def dora_norm(self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor
                  ) -> torch.Tensor:
        """The row norms as a collective: every worker enters it with the whole ``a`` and
        ``b`` (started here, on the engine's thread), then rank 0."""
        self.driver.dora_norm(layer, module, a, b)
        return self.model.lora_dora_norm(layer, module, a, b)

    def base_weight_equal(self, module: str, weight: torch.Tensor) -> bool:
        """The check of an adapter's ``embed_tokens`` / ``lm_head`` table as a collective:
        every worker compares its vocabulary rows, then rank 0 (``TPDriver``)."""
        self.driver.base_weight_equal(module, weight)
        return self.model.lora_base_weight_equal(module, weight)

    def guard(self) -> contextlib.AbstractContextManager:
        return self.driver.workers.guard()

    def shutdown(self) -> None:
        """Destroy the graphs first (their captured collectives hold the NCCL
        communicator), stop the workers, then the adapter loader threads."""
        if getattr(self, "runner", None) is not None:
            self.runner.release_graphs()
        self.driver.shutdown()
        super().shutdown()
