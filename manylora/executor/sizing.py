"""What an executor sizes from the engine's settings: the adapter slots' config (by count,
or from the GPU memory left free), the decode graphs' batch sizes and the piecewise graphs'
token buckets."""

from __future__ import annotations

import logging

import torch

from manylora.config import LoRAConfig, ModelConfig, resolve_lora_dtype
from manylora.executor.abstract import ExecutorArgs
from manylora.lora.sizing import slot_bytes, slots_for_memory
from manylora.worker.cuda_graph import DEFAULT_CAPTURE_SIZES
from manylora.worker.piecewise_graphs import DEFAULT_PIECE_SIZES

logger = logging.getLogger(__name__)


def lora_config(args: ExecutorArgs, max_loras: int, model_dtype: torch.dtype) -> LoRAConfig:
    """The slots' config for ``max_loras`` slots (the host cache holds at least as many
    adapters as there are slots when the slots are sized from memory), in
    ``args.lora_dtype`` resolved against ``model_dtype``."""
    max_cpu_loras = args.max_cpu_loras
    if args.lora_device_cache_percent is not None:
        max_cpu_loras = max(max_cpu_loras, max_loras)
    return LoRAConfig(max_loras, args.max_lora_rank, max_cpu_loras, args.lora_target_modules,
                      args.max_cpu_lora_bytes, args.fully_sharded_loras, args.lora_load_timeout,
                      resolve_lora_dtype(args.lora_dtype, model_dtype))


def slots_from_memory(args: ExecutorArgs, cfg: ModelConfig, device: torch.device) -> int:
    """Slots in ``lora_device_cache_percent`` of the GPU memory left free now (TensorRT-LLM's
    ``device_cache_percent``).

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """
    if device.type != "cuda":
        raise ValueError("lora_device_cache_percent sizes slots from free GPU memory; on "
                         f"{device} set max_loras instead")
    per_slot = slot_bytes(cfg.module_shapes(), cfg.module_copies(),
                          args.lora_target_modules, args.max_lora_rank,
                          resolve_lora_dtype(args.lora_dtype, cfg.dtype))
    free, _ = torch.cuda.mem_get_info(device)
    # the slot loads' staging buffer holds one adapter at max_lora_rank: about a slot
    slots = slots_for_memory(free, args.lora_device_cache_percent, per_slot,
                             reserved_bytes=per_slot)
    logger.info("LoRA device cache: %d slots of %.1f MiB (%.0f%% of %.1f GiB free)",
                slots, per_slot / 2**20, 100 * args.lora_device_cache_percent, free / 2**30)
    return slots


def graph_sizes(args: ExecutorArgs, device: torch.device) -> tuple[int, ...]:
    """The decode CUDA graphs' batch sizes: ``DEFAULT_CAPTURE_SIZES`` below
    ``max_num_seqs``, then ``max_num_seqs``; none under ``enforce_eager`` or off CUDA."""
    if args.enforce_eager or device.type != "cuda":
        return ()
    return tuple(n for n in DEFAULT_CAPTURE_SIZES if n < args.max_num_seqs) + (
        args.max_num_seqs,)


def piece_sizes(args: ExecutorArgs, device: torch.device) -> tuple[int, ...]:
    """The piecewise CUDA-graph token buckets of ``args`` (``piecewise_cuda_graph_sizes``):
    none under ``enforce_eager``; by default ``DEFAULT_PIECE_SIZES`` up to
    ``max_num_batched_tokens`` on one CUDA device, none on the CPU or under tensor
    parallelism (collectives inside piece graphs are not yet verified on several GPUs);
    explicit sizes as given. Sizes above the token budget become the budget itself (no step
    is larger), as the decode graphs' sizes end at ``max_num_seqs``."""
    if args.enforce_eager:
        return ()
    sizes = args.piecewise_cuda_graph_sizes
    if sizes is None:
        one_gpu = device.type == "cuda" and args.tensor_parallel_size == 1
        sizes = DEFAULT_PIECE_SIZES if one_gpu else ()
    budget = args.max_num_batched_tokens
    return tuple(sorted({min(n, budget) for n in sizes}))
