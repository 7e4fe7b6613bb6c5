"""``Executor``: the engine core's one way to the model (vLLM v1's ``Executor``).

An executor is built once from the engine's settings and holds everything below the
scheduler: the model (and its adapter slots), the KV cache, the model runner with its
graphs, and, under tensor parallelism, the other ranks. Building it loads the model, sizes
the KV cache and the adapter slots, compiles the Triton specializations and captures the
CUDA graphs; the core then reads what it needs to plan (``cache_config``,
``max_model_len``, ``preemption_cost``, ``lora_manager``) and calls the step methods.

A step on an executor: ``apply_swaps`` and ``release`` (the plan's KV copies and finished
requests), ``execute_model`` (the plan's forward pass and logits, launched),
``sample_tokens`` (its sampling, launched; a grammar bitmask first), ``get_output`` (wait
for its tokens). Nothing here waits for the device before ``get_output``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch

from manylora.config import CacheConfig, LoRAConfig, ModelConfig
from manylora.lora.manager import LoRAManager
from manylora.sample.sampler import SampledTokens
from manylora.scheduler_output import PreemptionCost, SchedulerOutput, SwapOp
from manylora.worker.step_sampler import ForwardStep, LaunchedStep


class ExecutorArgs(Protocol):
    """The engine settings an executor reads (``EngineArgs`` has them all; see it for what
    each means)."""

    model: str
    revision: str | None
    download_dir: str | None
    trust_remote_code: bool
    load_format: str
    quantization: str | None
    key_dict: Mapping[str, str | list[str]]
    seed: int | None
    dtype: str
    device: str
    max_model_len: int | None
    tensor_parallel_size: int
    block_size: int
    num_kv_blocks: int | None
    gpu_memory_utilization: float
    kv_cache_dtype: str
    enable_prefix_caching: bool
    swap_space: float
    max_num_seqs: int
    max_num_batched_tokens: int
    enforce_eager: bool
    async_scheduling: bool
    piecewise_cuda_graph_sizes: tuple[int, ...] | None
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None
    max_cpu_lora_bytes: int | None
    lora_target_modules: tuple[str, ...] | None
    lora_device_cache_percent: float | None
    fully_sharded_loras: bool
    lora_load_timeout: float | None
    lora_dtype: str


class Executor(ABC):
    """What the engine core calls to run steps on the model.

    Attributes:
        model_dir: the checkpoint directory (resolved from a hub id).
        model_config: the whole model's ``ModelConfig`` (not one rank's shard).
        device: rank 0's device.
        cache_config: the KV cache's blocks (device and swap space).
        max_model_len: the context length, tokens: the model's, lowered to what the KV
            cache holds.
        preemption_cost: the measured cost of a swap against a recompute (None without
            swap space).
        lora_config: the adapter slots' config (None: LoRA off).
        lora_manager: the adapters' reader, host cache and slot pool (None: LoRA off).
    """

    model_dir: Path
    model_config: ModelConfig
    device: torch.device
    cache_config: CacheConfig
    max_model_len: int
    preemption_cost: PreemptionCost | None
    lora_config: LoRAConfig | None
    lora_manager: LoRAManager | None

    @abstractmethod
    def execute_model(self, out: SchedulerOutput, lora_slots: Mapping[int, int]
                      ) -> ForwardStep | None:
        """Apply a plan's deltas and launch its forward pass and the sampled rows' logits
        (``ModelRunner.execute_forward``); None when no row samples or computes prompt
        log-probabilities.

        Raises:
            WorkerDiedError: a tensor-parallel worker died.
            ValueError, KeyError: as ``ModelRunner.execute_forward``.
        """

    @abstractmethod
    def sample_tokens(self, forward: ForwardStep, bitmask: torch.Tensor | None
                      ) -> LaunchedStep:
        """Launch the sampling of a step whose forward pass ``execute_model`` launched,
        ``bitmask`` (int32 host tensor, ``StructuredOutputManager.fill``) masking its
        constrained rows first (``ModelRunner.sample``).

        Raises:
            WorkerDiedError: a tensor-parallel worker died.
        """

    @abstractmethod
    def get_output(self, launched: LaunchedStep | None) -> SampledTokens:
        """Wait for a launched step's tokens (``ModelRunner.get_output``; nothing for
        None)."""

    @abstractmethod
    def apply_swaps(self, swaps: Sequence[SwapOp]) -> None:
        """Copy KV blocks between the device and the swap space, in order."""

    @abstractmethod
    def release(self, request_ids: Sequence[str]) -> None:
        """Drop what the runner keeps of finished requests."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the adapter loader threads and any worker process (idempotent); no step
        may follow."""

    def guard(self) -> contextlib.AbstractContextManager:
        """A block whose failure, when a tensor-parallel worker has died, surfaces as
        ``WorkerDiedError`` (nothing on one process)."""
        return contextlib.nullcontext()
