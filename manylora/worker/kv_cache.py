"""KV cache memory: how many blocks fit, and the per-layer cache tensors."""

from __future__ import annotations

import logging
import os

import torch

from manylora.config import ModelConfig

logger = logging.getLogger(__name__)

#: Share of host memory a CPU KV cache may take when num_kv_blocks is not given.
_CPU_MEMORY_FRACTION = 0.2


def block_bytes(cfg: ModelConfig, block_size: int) -> int:
    """Bytes one block takes over all layers: K and V, ``block_size`` tokens each."""
    elem = torch.empty((), dtype=cfg.dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def activation_bytes(cfg: ModelConfig, max_num_batched_tokens: int) -> int:
    """A generous bound on the activations of one step of ``max_num_batched_tokens`` tokens."""
    elem = torch.empty((), dtype=cfg.dtype).element_size()
    per_token = (4 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size)
    return max_num_batched_tokens * per_token * elem * 2 + 4 * cfg.vocab_size * 256


def auto_num_blocks(cfg: ModelConfig, block_size: int, device: torch.device,
                    memory_utilization: float, max_num_batched_tokens: int,
                    max_useful_blocks: int) -> int:
    """Blocks that fit in the memory left after weights and adapter slots are allocated.

    CUDA: ``memory_utilization`` × total memory, minus what is in use now and a bound on a
    step's activations. CPU: a fifth of the available host memory. Never more than
    ``max_useful_blocks`` (every sequence at max_model_len), never fewer than 1.

    Raises:
        RuntimeError: no memory is left for even one block.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = total * memory_utilization - used - activation_bytes(cfg, max_num_batched_tokens)
    else:
        budget = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * _CPU_MEMORY_FRACTION
    blocks = int(budget // block_bytes(cfg, block_size))
    if blocks < 1:
        raise RuntimeError(
            f"no memory is left for the KV cache on {device} (budget {budget / 2**30:.2f} GiB); "
            "lower max_num_batched_tokens or raise gpu_memory_utilization")
    return min(blocks, max_useful_blocks)


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed tensor per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
    logger.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, block_size,
                num_blocks * block_bytes(cfg, block_size) / 2**20)
    return [torch.zeros(2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                        dtype=cfg.dtype, device=device) for _ in range(cfg.num_layers)]
