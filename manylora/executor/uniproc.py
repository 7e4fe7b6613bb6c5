"""``UniProcExecutor``: the model on one device of this process (vLLM v1's
``UniProcExecutor``).

Built in this order (each step sizes what the next one may use): the checkpoint's config
and the model; the adapter slots when their count is given (``max_loras``), so that the KV
cache is sized around them; the KV cache (``num_kv_blocks``, or what fits in
``gpu_memory_utilization``), with ``max_model_len`` lowered to what it holds; the swap
space and its measured preemption cost; the slots sized from the memory left
(``lora_device_cache_percent``); the model runner; every Triton specialization compiled
(``warm_up_triton``); the CUDA graphs captured. ``TPExecutor`` builds rank 0 the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from manylora.checkpoint.gguf import gguf_model_names
from manylora.checkpoint.hub import resolve_model_path
from manylora.config import CacheConfig, ModelConfig, resolve_device, resolve_dtype
from manylora.distributed.parallel_state import TPGroup
from manylora.executor.abstract import Executor, ExecutorArgs
from manylora.executor.sizing import graph_sizes, lora_config, piece_sizes, slots_from_memory
from manylora.lora.dora import dora_row_norm
from manylora.lora.formats.target import AdapterTarget
from manylora.lora.manager import LoRAManager
from manylora.model.loader import load_hf_config, load_model
from manylora.ops.paged_kv import KVCache
from manylora.sample.generators import set_random_seed
from manylora.sample.sampler import SampledTokens
from manylora.scheduler_output import SchedulerOutput, SwapOp
from manylora.worker.kv_cache import allocate_kv_caches, auto_num_blocks, block_bytes
from manylora.worker.kv_swap import KVSwapper, measure_preemption_cost
from manylora.worker.model_runner import ModelRunner
from manylora.worker.step_sampler import ForwardStep, LaunchedStep
from manylora.worker.warmup import warm_up_triton

logger = logging.getLogger(__name__)


class UniProcExecutor(Executor):
    """The model, its KV cache and its runner on one device.

    Args:
        args: the engine's settings.

    Raises:
        CheckpointError, ValueError, FileNotFoundError: a bad checkpoint or setting.
        RuntimeError: no memory is left for the KV cache.

    Attributes:
        model: the loaded model (the registry's class for the checkpoint; this rank's shard).
        runner: its ``ModelRunner``.
        swapper: the ``KVSwapper`` of the swap space (None without one).
    """

    def __init__(self, args: ExecutorArgs) -> None:
        self.model_dir = resolve_model_path(args.model, args.revision, args.download_dir)
        if args.seed is not None:
            set_random_seed(args.seed)
        hf_config = load_hf_config(self.model_dir, args.trust_remote_code)
        self.device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, self.device, hf_config)
        self.model_config = ModelConfig.from_hf(hf_config, dtype, args.max_model_len,
                                                args.quantization)
        tp = self._start_workers(args)
        self.model = load_model(self.model_dir, self.model_config, self.device,
                                args.key_dict, args.load_format, tp)
        self.lora_config = None
        self.lora_manager: LoRAManager | None = None
        slots_first = args.enable_lora and args.lora_device_cache_percent is None
        if slots_first:
            self._create_lora(args, args.max_loras)
        kv_caches = self._create_kv_cache(args)
        if args.enable_lora and not slots_first:
            self._create_lora(args, slots_from_memory(args, self.model_config, self.device))
        max_loras = self.lora_config.max_loras if self.lora_config else 0
        graphs, pieces = graph_sizes(args, self.device), piece_sizes(args, self.device)
        self.runner = ModelRunner(self.model, kv_caches, args.block_size, max_loras,
                                  self.max_model_len, graphs, pieces)
        warm_up_triton(self.model, kv_caches, args.block_size, args.max_num_batched_tokens,
                       args.max_num_seqs, self.max_model_len)
        self._start_worker_runners(args, graphs, pieces)
        self.runner.capture_graphs()
        self._connect(args)

    # ------------------------------------------------------------------ start-up steps

    def _start_workers(self, args: ExecutorArgs) -> TPGroup | None:
        """Start the other ranks before the model loads; their group (None here)."""
        return None

    def _start_worker_runners(self, args: ExecutorArgs, graphs: tuple[int, ...],
                              pieces: tuple[int, ...]) -> None:
        """Have the other ranks build their runners (nothing here)."""

    def _connect(self, args: ExecutorArgs) -> None:
        """Connect the runner and the adapter slots to the other ranks (nothing here)."""

    def _create_kv_cache(self, args: ExecutorArgs) -> list[KVCache]:
        """Size and allocate the KV cache, and the swap space with its measured cost.

        Under tensor parallelism this rank's config has this rank's heads: rank 0 sizes the
        cache for every rank, since it holds the most KV heads (``ModelConfig.shard``), so
        its blocks are the largest, and each worker allocates as many blocks of its own
        heads on the same kind of GPU."""
        cfg, rank_cfg = self.model_config, self.model.cfg
        max_useful = -(-cfg.max_model_len // args.block_size) * args.max_num_seqs
        num_blocks = args.num_kv_blocks or auto_num_blocks(
            rank_cfg, args.block_size, self.device, args.gpu_memory_utilization,
            args.max_num_batched_tokens, max_useful, kv_cache_dtype=args.kv_cache_dtype)
        per_block = block_bytes(rank_cfg, args.block_size, args.kv_cache_dtype)
        self.cache_config = cc = CacheConfig(
            args.block_size, num_blocks, args.kv_cache_dtype, args.enable_prefix_caching,
            int(args.swap_space * 2**30 // per_block))
        self.max_model_len = min(cfg.max_model_len, num_blocks * args.block_size)
        if self.max_model_len < cfg.max_model_len:
            logger.warning("max_model_len lowered from %d to %d tokens: the KV cache holds no "
                           "more", cfg.max_model_len, self.max_model_len)
        kv_caches = allocate_kv_caches(rank_cfg, num_blocks, args.block_size, self.device,
                                       args.kv_cache_dtype)
        self.swapper = None
        self.preemption_cost = None
        if cc.num_host_blocks:
            self.swapper = KVSwapper(kv_caches, cc.num_host_blocks)
            cost = measure_preemption_cost(cfg, self.swapper, cc.num_blocks)
            logger.info("swap space: %d blocks; per block %.1f us, recompute %.2f us per token",
                        cc.num_host_blocks, cost.per_block * 1e6, cost.per_token * 1e6)
            self.preemption_cost = cost
        return kv_caches

    def _create_lora(self, args: ExecutorArgs, max_loras: int) -> None:
        """The model's adapter slots and the ``LoRAManager`` over them."""
        cfg = self.model_config
        self.lora_config = lora_config(args, max_loras, cfg.dtype)
        slots = self.model.create_lora_slots(self.lora_config)
        target = AdapterTarget(
            cfg.module_shapes(), cfg.num_layers, args.max_lora_rank,
            self.lora_config.target_modules, self.lora_config.dtype,
            (args.model, str(self.model_dir), *gguf_model_names(self.model_dir)),
            dora_norm=self.dora_norm, base_weight_equal=self.base_weight_equal,
            num_experts=0 if cfg.moe is None else cfg.moe.num_experts,
            layer_modules=cfg.layer_modules())
        self.lora_manager = LoRAManager(self.lora_config, target, slots)

    def dora_norm(self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor
                  ) -> torch.Tensor:
        """A DoRA adapter's row norms ``||W + scale · B A||`` over the rows of ``(layer,
        module)``'s base weight (``a [r, in]``, ``b [out, r]``; ``AdapterTarget.dora_norm``)."""
        return dora_row_norm(self.model.lora_module_weight(layer, module), a, b)

    def base_weight_equal(self, module: str, weight: torch.Tensor) -> bool:
        """Whether an adapter's copy of the base ``embed_tokens`` / ``lm_head`` table equals
        the model's (``AdapterTarget.base_weight_equal``)."""
        return self.model.lora_base_weight_equal(module, weight)

    # ------------------------------------------------------------------------- steps

    def execute_model(self, out: SchedulerOutput, lora_slots: Mapping[int, int]
                      ) -> ForwardStep | None:
        with self.guard():
            return self.runner.execute_forward(out, lora_slots)

    def sample_tokens(self, forward: ForwardStep, bitmask: torch.Tensor | None
                      ) -> LaunchedStep:
        with self.guard():
            return self.runner.sample(forward, bitmask)

    def get_output(self, launched: LaunchedStep | None) -> SampledTokens:
        return self.runner.get_output(launched)

    def apply_swaps(self, swaps: Sequence[SwapOp]) -> None:
        self.swapper.apply(swaps)

    def release(self, request_ids: Sequence[str]) -> None:
        self.runner.release(request_ids)

    def shutdown(self) -> None:
        if self.lora_manager is not None:
            self.lora_manager.shutdown()
