"""Swap space: host copies of KV blocks, and the measured cost of swapping vs recomputing.

The KV cache manager decides which blocks move (``SwapOp``); this applies the copies to the
cache tensors before a step's forward pass (vLLM's ``swap_blocks``, with ``swap_space``
GiB of host memory, pinned on CUDA).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch

from manylora.config import ModelConfig
from manylora.ops.paged_kv import KVCache
from manylora.scheduler_output import PreemptionCost, SwapOp


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A byte view (``[..., last * itemsize]`` uint8): index ops work for every cache dtype."""
    return t.view(torch.uint8)


class KVSwapper:
    """Host blocks shaped like the device cache's, and the copies between them.

    Args:
        kv_caches: the device cache, one ``KVCache`` per layer (``data [2, num_blocks,
            block_size, num_kv_heads, head_dim]``, optional float32 ``scale [2, num_blocks,
            block_size, num_kv_heads]``).
        num_host_blocks: blocks of swap space (each the size of a device block, all layers).
    """

    def __init__(self, kv_caches: Sequence[KVCache], num_host_blocks: int) -> None:
        self.kv_caches = list(kv_caches)
        self.device = self.kv_caches[0].data.device
        pin = self.device.type == "cuda"

        def host_like(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.empty((2, num_host_blocks, *t.shape[2:]), dtype=t.dtype,
                               pin_memory=pin)

        self.host = [KVCache(host_like(c.data), host_like(c.scale)) for c in self.kv_caches]

    def apply(self, swaps: Sequence[SwapOp]) -> None:
        """Apply block copies in order (runs of one direction are batched per layer).

        Raises:
            IndexError: a block id outside the device cache or the swap space.
        """
        for to_host, run in itertools.groupby(swaps, key=lambda op: op.to_host):
            ops = list(run)
            dev_idx = torch.tensor([op.device_block for op in ops], dtype=torch.int64)
            host_idx = torch.tensor([op.host_block for op in ops], dtype=torch.int64)
            dev_idx_d = dev_idx.to(self.device)
            for cache, host in zip(self.kv_caches, self.host):
                for d, h in ((cache.data, host.data), (cache.scale, host.scale)):
                    if d is None:
                        continue
                    d, h = _as_bytes(d), _as_bytes(h)
                    if to_host:
                        h.index_copy_(1, host_idx, d.index_select(1, dev_idx_d).cpu())
                    else:
                        d.index_copy_(1, dev_idx_d, h.index_select(1, host_idx).to(
                            self.device, non_blocking=True))


def _timed(fn, device: torch.device, repeat: int = 3) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_preemption_cost(cfg: ModelConfig, swapper: KVSwapper,
                            num_device_blocks: int) -> PreemptionCost:
    """Measure, on this machine, what swapping a block out and back and recomputing a token
    cost (seconds), for the KV cache manager's per-request choice.

    Recompute: the model's matmul FLOPs per token (``2 × parameters`` of its layers) and per
    causal query-key pair (``2 × num_layers × q_size``: QKᵀ and PV) over the measured rate
    of a ``[2048, hidden] @ [hidden, hidden]`` matmul in the model dtype. Swap: a copy out
    and back of up to 8 blocks of the (empty) cache, timed. Runs at start-up, before any
    request, so the copies overwrite nothing.
    """
    device = swapper.device
    n = min(8, num_device_blocks, swapper.host[0].data.shape[1])
    ops_out = [SwapOp(True, i, i) for i in range(n)]
    ops_in = [SwapOp(False, i, i) for i in range(n)]
    per_block = _timed(lambda: (swapper.apply(ops_out), swapper.apply(ops_in)), device) / n
    h = cfg.hidden_size
    a = torch.randn(2048, h, dtype=cfg.dtype, device=device)
    b = torch.randn(h, h, dtype=cfg.dtype, device=device)
    rate = 2 * 2048 * h * h / _timed(lambda: a @ b, device)        # FLOP/s
    params = cfg.num_layers * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
                               + 3 * h * cfg.intermediate_size)
    return PreemptionCost(per_token=2 * params / rate,
                          per_token_pair=2 * cfg.num_layers * cfg.q_size / rate,
                          per_block=per_block)
