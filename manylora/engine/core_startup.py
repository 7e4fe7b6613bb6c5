"""What the engine core builds around its executor at start-up: the scheduler over the
executor's KV cache and adapter slots, the structured-output manager with its grammar
compiler, and the start-up heap taken out of the garbage collector's reach."""

from __future__ import annotations

import atexit
import gc
from functools import partial

from manylora.checkpoint.hub import resolve_model_path
from manylora.config import SchedulerConfig
from manylora.engine.arg_utils import EngineArgs
from manylora.executor.abstract import Executor
from manylora.model.layers.rotary import is_longrope, original_max_positions
from manylora.scheduler.kv_cache_manager import KVCacheManager
from manylora.scheduler.scheduler import Scheduler
from manylora.structured.compiler import GrammarCompileService, load_tokenizer_info
from manylora.structured.manager import StructuredOutputManager


def build_scheduler(args: EngineArgs, executor: Executor) -> Scheduler:
    """The ``Scheduler`` over a ``KVCacheManager`` of the executor's blocks (with its swap
    space and measured preemption cost) and its ``LoRAManager``; at most ``max_loras``
    adapters a step (at least one slot's worth when LoRA is off); a ``longrope`` model's
    original length (``Scheduler.long_rope_after``)."""
    hf_config = executor.model_config.hf_config
    cc = executor.cache_config
    kv_manager = KVCacheManager(cc.num_blocks, cc.block_size, cc.enable_prefix_caching,
                                cc.num_host_blocks, executor.preemption_cost)
    max_loras = executor.lora_config.max_loras if executor.lora_config else 0
    return Scheduler(
        SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max(max_loras, 1),
                        args.lora_aging_steps, scheduling_policy=args.scheduling_policy,
                        max_group_share=args.max_group_share),
        kv_manager, executor.lora_manager,
        original_max_positions(hf_config) if is_longrope(hf_config) else None)


def build_structured_outputs(args: EngineArgs, executor: Executor) -> StructuredOutputManager:
    """The ``StructuredOutputManager``, its grammar compiler over the tokenizer (none under
    ``skip_tokenizer_init``: structured outputs are then refused)."""
    vocab_size = executor.model_config.vocab_size
    return StructuredOutputManager(
        None if args.skip_tokenizer_init else GrammarCompileService(
            partial(_tokenizer_info, args, executor.model_dir, vocab_size),
            cache_bytes=args.grammar_cache_bytes,
            compile_seconds=args.max_grammar_compile_seconds),
        vocab_size, args.max_num_seqs, pin_memory=executor.device.type == "cuda")


def freeze_startup_heap() -> None:
    """Move every object alive now out of the collector's reach (vLLM's ``gc.freeze`` after
    start-up): the start-up heap (modules, configs, tokenizer) never becomes garbage, so
    generation-2 collections stop walking it. ``EngineCore.shutdown`` and interpreter exit
    give it back."""
    gc.collect()
    gc.freeze()
    global _unfreeze_at_exit
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)       # extension modules' leak checks run at exit
        _unfreeze_at_exit = True


_unfreeze_at_exit = False


def _tokenizer_info(args: EngineArgs, model_dir, vocab_size: int):
    """The grammar compiler's ``xgrammar.TokenizerInfo``: the front's tokenizer (``tokenizer``
    or the checkpoint's) over the model's ``vocab_size`` (read on the grammar thread)."""
    tok_dir = (resolve_model_path(args.tokenizer, args.revision, args.download_dir)
               if args.tokenizer else model_dir)
    return load_tokenizer_info(str(tok_dir), args.trust_remote_code, vocab_size)
