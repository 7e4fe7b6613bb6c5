"""KV cache memory: how many blocks fit, and the per-layer cache tensors."""

from __future__ import annotations

import logging
import os

import torch

from manylora.config import ModelConfig
from manylora.ops.paged_kv import KVCache, kv_storage_dtype

logger = logging.getLogger(__name__)

#: Share of host memory a CPU KV cache may take when num_kv_blocks is not given.
_CPU_MEMORY_FRACTION = 0.2
#: Bytes of one scale (float32) of a quantized cache, per (K/V, token, KV head).
_SCALE_BYTES = 4


def block_bytes(cfg: ModelConfig, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes one block takes over all layers: K and V, ``block_size`` tokens each.

    Per layer, token and KV head: ``2 × head_dim`` elements of the storage dtype
    (``kv_storage_dtype``), plus ``2 × 4`` bytes of float32 scales when quantized. A 16-bit
    model at head_dim 128 thus takes 512 bytes unquantized and 264 quantized (1.94× the
    tokens in the same memory).

    Raises:
        ValueError: ``kv_cache_dtype`` not one of ``KV_CACHE_DTYPES``.
    """
    storage = kv_storage_dtype(kv_cache_dtype, cfg.dtype)
    per_head = cfg.head_dim * torch.empty((), dtype=storage).element_size()
    if kv_cache_dtype != "auto":
        per_head += _SCALE_BYTES
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * per_head


def activation_bytes(cfg: ModelConfig, max_num_batched_tokens: int) -> int:
    """A generous bound on the activations of one step of ``max_num_batched_tokens`` tokens."""
    elem = torch.empty((), dtype=cfg.dtype).element_size()
    per_token = (4 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size)
    return max_num_batched_tokens * per_token * elem * 2 + 4 * cfg.vocab_size * 256


def auto_num_blocks(cfg: ModelConfig, block_size: int, device: torch.device,
                    memory_utilization: float, max_num_batched_tokens: int,
                    max_useful_blocks: int, *, kv_cache_dtype: str = "auto") -> int:
    """Blocks that fit in the memory left after weights and adapter slots are allocated.

    CUDA: ``memory_utilization`` × total memory, minus what is in use now and a bound on a
    step's activations. CPU: a fifth of the available host memory. Each block costs
    ``block_bytes(cfg, block_size, kv_cache_dtype)``. Never more than ``max_useful_blocks``
    (every sequence at max_model_len), never fewer than 1.

    Raises:
        RuntimeError: no memory is left for even one block.
        ValueError: ``kv_cache_dtype`` not one of ``KV_CACHE_DTYPES``.
    """
    per_block = block_bytes(cfg, block_size, kv_cache_dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = total * memory_utilization - used - activation_bytes(cfg, max_num_batched_tokens)
    else:
        budget = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * _CPU_MEMORY_FRACTION
    blocks = int(budget // per_block)
    if blocks < 1:
        raise RuntimeError(
            f"no memory is left for the KV cache on {device} (budget {budget / 2**30:.2f} GiB); "
            "lower max_num_batched_tokens or raise gpu_memory_utilization")
    return min(blocks, max_useful_blocks)


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int,
                       device: torch.device, kv_cache_dtype: str = "auto") -> list[KVCache]:
    """One zeroed ``KVCache`` per layer (vLLM's paged layout).

    ``data``: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype
    ("auto"), ``torch.int8`` ("int8") or ``torch.float8_e4m3fn`` ("fp8_e4m3"); ``scale``:
    float32 ``[2, num_blocks, block_size, num_kv_heads]`` when quantized, else None.

    Raises:
        ValueError: ``kv_cache_dtype`` not one of ``KV_CACHE_DTYPES``.
    """
    storage = kv_storage_dtype(kv_cache_dtype, cfg.dtype)
    quantized = kv_cache_dtype != "auto"
    logger.info("KV cache: %d blocks of %d tokens (%d tokens), %s, %.1f MiB", num_blocks,
                block_size, num_blocks * block_size,
                kv_cache_dtype if quantized else str(storage).removeprefix("torch."),
                num_blocks * block_bytes(cfg, block_size, kv_cache_dtype) / 2**20)
    shape = (2, num_blocks, block_size, cfg.num_kv_heads)
    return [KVCache(torch.zeros(*shape, cfg.head_dim, dtype=storage, device=device),
                    torch.zeros(shape, dtype=torch.float32, device=device) if quantized
                    else None)
            for _ in range(cfg.num_layers)]
