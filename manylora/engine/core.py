"""``EngineCore``: the scheduler, the KV cache, the adapter cache and the model runner,
stepped one batch at a time on token ids (vLLM v1's ``EngineCore``).

A step: ``Scheduler.schedule`` picks the requests and token counts (at most ``max_loras``
distinct adapters), ``LoRAManager.activate`` binds their adapters to device slots,
``ModelRunner.execute_forward`` launches the batch and ``sample`` samples it (the rows with a
grammar first masked by their bitmask, ``StructuredOutputManager``), ``Scheduler.update`` appends
the tokens once they reach the host, and the token-level stop rules (``core.stop``) end
requests, whose blocks go back. What the step reports is a delta per request
(``EngineCoreOutputs``): its new token ids and their log-probabilities, and why it ended.
Text, stop strings and ``RequestOutput`` belong to the front, ``LLMEngine``.

Async scheduling (on by default, vLLM v1's): step n+1 is planned and launched before step
n's tokens are read, so the host's planning, output handling and the GPU overlap. The
scheduler counts a planned step as run (an output placeholder per sampling request), the
runner takes a decode token from the previous step's samples on the device, and a request
that stops at step n computes one discarded token in step n+1.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from functools import partial

import torch

from manylora.checkpoint.gguf import gguf_model_names
from manylora.checkpoint.hub import resolve_model_path
from manylora.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    resolve_device,
    resolve_dtype,
    resolve_lora_dtype,
)
from manylora.engine.arg_utils import EngineArgs
from manylora.engine.protocol import (
    CoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from manylora.engine.serial import ErrorInfo
from manylora.lora.dora import dora_row_norm
from manylora.lora.formats.peft import AdapterTarget
from manylora.lora.manager import AdapterLoadError, LoRACacheStats, LoRAManager
from manylora.lora.sizing import slot_bytes, slots_for_memory
from manylora.lora_request import LoRARequest
from manylora.model.loader import load_hf_config, load_model
from manylora.ops.attention import KVCache
from manylora.request import Request, RequestStatus
from manylora.sample.generators import set_random_seed
from manylora.scheduler.kv_cache_manager import KVCacheManager, KVCacheStats
from manylora.scheduler.scheduler import Scheduler
from manylora.scheduler.stop import check_stop
from manylora.scheduler_output import SchedulerOutput
from manylora.structured.compiler import GrammarCompileService, load_tokenizer_info
from manylora.structured.manager import StructuredOutputManager, no_token_error
from manylora.worker.cuda_graph import DEFAULT_CAPTURE_SIZES
from manylora.worker.kv_cache import allocate_kv_caches, auto_num_blocks, block_bytes
from manylora.worker.kv_swap import KVSwapper, measure_preemption_cost
from manylora.worker.model_runner import ForwardStep, LaunchedStep, ModelRunner
from manylora.worker.piecewise_graphs import DEFAULT_PIECE_SIZES
from manylora.worker.tp_worker import TPDriver, WorkerSpec, rank_device
from manylora.worker.warmup import warm_up_triton

logger = logging.getLogger(__name__)

_FINISH = {RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
           RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
           RequestStatus.FINISHED_ABORTED: FinishReason.ABORT}
_STATUS = {reason: status for status, reason in _FINISH.items()}


class EngineCore:
    """The engine on token ids: requests in, one scheduled and executed step at a time,
    per-request deltas out.

    Args:
        args: every engine setting (the tokenizer ones are the front's and unused here).

    Raises:
        CheckpointError, ValueError, FileNotFoundError: a bad checkpoint or setting.

    Bad requests (``add_request``) raise ``ValueError`` naming the problem and leave the
    core serving every request it already accepted.
    """

    def __init__(self, args: EngineArgs) -> None:
        model_dir = resolve_model_path(args.model, args.revision, args.download_dir)
        if args.seed is not None:
            set_random_seed(args.seed)
        hf_config = load_hf_config(model_dir, args.trust_remote_code)
        self.device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, self.device, hf_config)
        self.model_config = ModelConfig.from_hf(hf_config, dtype, args.max_model_len)
        cfg = self.model_config
        self.tp_driver = self._start_tensor_parallel(args, model_dir, dtype)
        tp = self.tp_driver.tp if self.tp_driver is not None else None
        self.model = load_model(model_dir, cfg, self.device, args.key_dict, args.load_format, tp)

        self.lora_config: LoRAConfig | None = None
        self.lora_manager: LoRAManager | None = None
        max_useful = -(-cfg.max_model_len // args.block_size) * args.max_num_seqs
        slots_first = args.enable_lora and args.lora_device_cache_percent is None
        if slots_first:
            self._create_lora(args, model_dir, args.max_loras)
        # this rank's heads under tensor parallelism; rank 0 sizes the cache for every rank:
        # it holds the most KV heads (ModelConfig.shard), so its blocks are the largest, and
        # each worker allocates as many blocks of its own heads on the same kind of GPU
        rank_cfg = self.model.cfg
        num_blocks = args.num_kv_blocks or auto_num_blocks(
            rank_cfg, args.block_size, self.device, args.gpu_memory_utilization,
            args.max_num_batched_tokens, max_useful, kv_cache_dtype=args.kv_cache_dtype)
        self.cache_config = CacheConfig(
            args.block_size, num_blocks, args.kv_cache_dtype, args.enable_prefix_caching,
            int(args.swap_space * 2**30 // block_bytes(rank_cfg, args.block_size,
                                                       args.kv_cache_dtype)))
        self.max_model_len = min(cfg.max_model_len, num_blocks * args.block_size)
        if self.max_model_len < cfg.max_model_len:
            logger.warning("max_model_len lowered from %d to %d tokens: the KV cache holds no "
                           "more", cfg.max_model_len, self.max_model_len)
        kv_caches = allocate_kv_caches(rank_cfg, num_blocks, args.block_size, self.device,
                                       args.kv_cache_dtype)
        kv_manager = self._create_kv_manager(kv_caches)
        if args.enable_lora and not slots_first:
            self._create_lora(args, model_dir, self._slots_from_memory(args))
        max_loras = self.lora_config.max_loras if self.lora_config else 0
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max(max_loras, 1),
                            args.lora_aging_steps, scheduling_policy=args.scheduling_policy,
                            max_group_share=args.max_group_share),
            kv_manager, self.lora_manager)
        graph_sizes = () if args.enforce_eager or self.device.type != "cuda" else tuple(
            n for n in DEFAULT_CAPTURE_SIZES if n < args.max_num_seqs) + (args.max_num_seqs,)
        piece_sizes = _piece_sizes(args, self.device)
        self.runner = ModelRunner(self.model, kv_caches, args.block_size, max_loras,
                                  self.max_model_len, graph_sizes, piece_sizes)
        warm_up_triton(self.model, kv_caches, args.block_size, args.max_num_batched_tokens,
                       args.max_num_seqs, self.max_model_len)
        if self.tp_driver is not None:
            self.tp_driver.allocate_kv(num_blocks, self.max_model_len, graph_sizes,
                                       args.max_num_batched_tokens, args.max_num_seqs,
                                       piece_sizes)
        self.runner.capture_graphs()
        if self.tp_driver is not None:
            self.runner.on_step = self.tp_driver.step
            if self.lora_manager is not None:
                self.lora_manager.on_write_slot = self.tp_driver.write_slot
                self.lora_manager.host_alloc = self.tp_driver.host_buffers.alloc
                self.lora_manager.background_dora_reads = False
        self._pending_removals: set[int] = set()
        # adapters on disk only when requests for them arrived: {lora_int_id: {request id:
        # (request, arrival)}}, until the adapter is in host memory
        self._awaiting: dict[int, dict[str, tuple[Request, float]]] = {}
        self._lora_waiters: dict[int, list[Future]] = {}   # add_lora calls awaiting a read
        self._late_outputs: list[EngineCoreOutput] = []    # adapter failures met off-step
        self.async_scheduling = args.async_scheduling
        self._in_flight: tuple[SchedulerOutput, LaunchedStep | None] | None = None
        self.structured = StructuredOutputManager(
            None if args.skip_tokenizer_init else GrammarCompileService(
                partial(_tokenizer_info, args, model_dir, cfg.vocab_size),
                cache_bytes=args.grammar_cache_bytes,
                compile_seconds=args.max_grammar_compile_seconds),
            cfg.vocab_size, args.max_num_seqs, pin_memory=self.device.type == "cuda")
        if self.tp_driver is not None and self.async_scheduling:
            self.tp_driver.share_sampled = True
            self.runner.on_sampled = self.tp_driver.broadcast_sampled
        _freeze_startup_heap()

    def _start_tensor_parallel(self, args: EngineArgs, model_dir, dtype: torch.dtype
                               ) -> TPDriver | None:
        """Start ranks 1..N-1 and join their process group (None at one rank)."""
        if args.tensor_parallel_size == 1:
            return None
        if args.swap_space:
            raise ValueError("swap_space is not supported with tensor_parallel_size > 1 yet")
        if args.lora_device_cache_percent is not None:
            raise ValueError("lora_device_cache_percent is not supported with "
                             "tensor_parallel_size > 1 yet: set max_loras")
        self.model_config.shard(args.tensor_parallel_size)       # ValueError if it won't split
        lora = _lora_config(args, args.max_loras, dtype) if args.enable_lora else None
        spec = WorkerSpec(str(model_dir), dict(args.key_dict), args.load_format,
                          str(dtype).removeprefix("torch."), self.device.type,
                          self.model_config.max_model_len, args.trust_remote_code, lora,
                          args.block_size, args.kv_cache_dtype)
        if self.device.type == "cuda":
            self.device = rank_device("cuda", 0)
            torch.cuda.set_device(self.device)
        return TPDriver(spec, args.tensor_parallel_size)

    def _create_kv_manager(self, kv_caches: list[KVCache]) -> KVCacheManager:
        """The block allocator, with swap space (and its measured cost) when configured."""
        cc = self.cache_config
        self.swapper = None
        cost = None
        if cc.num_host_blocks:
            self.swapper = KVSwapper(kv_caches, cc.num_host_blocks)
            cost = measure_preemption_cost(self.model_config, self.swapper, cc.num_blocks)
            logger.info("swap space: %d blocks; per block %.1f us, recompute %.2f us per token",
                        cc.num_host_blocks, cost.per_block * 1e6, cost.per_token * 1e6)
        return KVCacheManager(cc.num_blocks, cc.block_size, cc.enable_prefix_caching,
                              cc.num_host_blocks, cost)

    def _create_lora(self, args: EngineArgs, model_dir, max_loras: int) -> None:
        cfg = self.model_config
        self.lora_config = _lora_config(args, max_loras, cfg.dtype)
        slots = self.model.create_lora_slots(self.lora_config)
        model = self.model

        def dora_norm(layer: int, module: str, a: torch.Tensor, b: torch.Tensor):
            if self.tp_driver is None:
                return dora_row_norm(model.lora_module_weight(layer, module), a, b)
            # every rank holds part of the base weight: the norm is a collective, started
            # here on the engine's thread (DoRA adapters are never read on loader threads)
            self.tp_driver.dora_norm(layer, module, a, b)
            return model.lora_dora_norm(layer, module, a, b)

        target = AdapterTarget(
            cfg.module_shapes(), cfg.num_layers, args.max_lora_rank,
            self.lora_config.target_modules, self.lora_config.dtype,
            (args.model, str(model_dir), *gguf_model_names(model_dir)),
            dora_norm=dora_norm)
        self.lora_manager = LoRAManager(self.lora_config, target, slots)

    def _slots_from_memory(self, args: EngineArgs) -> int:
        """Slots in ``lora_device_cache_percent`` of the GPU memory left free now."""
        if self.device.type != "cuda":
            raise ValueError("lora_device_cache_percent sizes slots from free GPU memory; on "
                             f"{self.device} set max_loras instead")
        cfg = self.model_config
        per_slot = slot_bytes(cfg.module_shapes(), cfg.num_layers,
                              args.lora_target_modules, args.max_lora_rank,
                              resolve_lora_dtype(args.lora_dtype, cfg.dtype))
        free, _ = torch.cuda.mem_get_info(self.device)
        # the slot loads' staging buffer holds one adapter at max_lora_rank: about a slot
        slots = slots_for_memory(free, args.lora_device_cache_percent, per_slot,
                                 reserved_bytes=per_slot)
        logger.info("LoRA device cache: %d slots of %.1f MiB (%.0f%% of %.1f GiB free)",
                    slots, per_slot / 2**20, 100 * args.lora_device_cache_percent, free / 2**30)
        return slots


    def add_request(self, request: EngineCoreRequest) -> list[int]:
        """Queue a request; the session history prepended to its prompt (empty without
        ``session_id``).

        With ``session_id``, the request is the next turn of that multi-turn session
        (TurboMind's interactive mode): ``prompt_token_ids`` holds only the turn's new
        tokens, the session supplies its history (earlier prompts and outputs), and the KV
        of that history, kept since the last turn or found in the prefix cache, is not
        prefilled again. A session whose turns change adapter recomputes its history under
        the new one. ``end_session`` frees what the session holds.

        Raises:
            ValueError: an empty prompt, ids outside the vocabulary (prompt, logit_bias,
                allowed_token_ids), a prompt (with its
                session's history) that leaves no room to generate within max_model_len, a
                duplicate id, a session with a turn still in flight, a LoRA request while
                LoRA is off, or an adapter that cannot be served as far as its config shows
                (``LoRAAdapterError``, ``FileNotFoundError``).

        An adapter path seen for the first time is read on a loader thread: the request
        waits in the queue meanwhile (other requests keep running), takes the adapter's
        digest when the read is in, and ends with ``FinishReason.ERROR`` and the error when
        the read fails (bad weights). A request with ``structured_outputs`` waits likewise
        while its grammar compiles on the grammar thread (``StructuredOutputManager``), and
        ends with ``FinishReason.ERROR`` when it does not compile (``ValueError`` naming
        the field); without a tokenizer (``skip_tokenizer_init``) it is refused here.
        """
        rid, params, session_id = request.request_id, request.sampling_params, request.session_id
        if rid in self.scheduler.requests or self.structured.is_held(rid):
            raise ValueError(f"request id {rid!r} is already in use")
        ids = request.prompt_token_ids
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = [t for t in ids if not 0 <= t < vocab]
            raise ValueError(f"prompt_token_ids {bad[:5]} are outside the vocabulary "
                             f"[0, {vocab})")
        if params is not None:
            params.verify_token_ids(vocab)
            if params.structured_outputs is not None:
                self.structured.check(rid)
        history: list[int] = []
        if session_id is not None:
            if not isinstance(session_id, str) or not session_id:
                raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
            history = self.scheduler.sessions.history(session_id)
            ids = history + ids
        if len(ids) >= self.max_model_len:
            where = f" ({len(history)} of them the session's history)" if history else ""
            raise ValueError(f"the prompt has {len(ids)} tokens{where}, but the context holds "
                             f"{self.max_model_len} (max_model_len) with room for at least one "
                             "generated token")
        lora_request = request.lora_request
        digest = None
        ready = True
        if lora_request is not None:
            manager = self._lora_manager(lora_request)
            digest = manager.add(lora_request)
            ready = manager.is_ready(lora_request.lora_int_id)
        limit = len(ids) + (params.max_tokens or self.max_model_len)
        req = Request(rid, None, list(ids), params, lora_request,
                      min(limit, self.max_model_len), arrival_time=request.arrival_time,
                      lora_digest=digest, session_id=session_id,
                      eos_token_ids=request.eos_token_ids,
                      adapter_pending=lora_request is not None and digest is None,
                      client_group=request.client_group, cache_salt=request.cache_salt)
        if params is not None and params.structured_outputs is not None:
            self.structured.hold(req)          # queued once its grammar compiles
        else:
            self.scheduler.add_request(req)
        if not ready:
            self._awaiting.setdefault(req.lora_int_id, {})[rid] = (req, time.monotonic())
        return history

    def _lora_manager(self, lora_request: LoRARequest) -> LoRAManager:
        if self.lora_manager is None:
            raise ValueError(f"LoRA request {lora_request.lora_name!r}: LoRA is disabled "
                             "(enable_lora=False)")
        return self.lora_manager

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the host tier ahead of its requests (vLLM's ``add_lora``),
        waiting for its read on this thread (``add_lora_async`` does not wait).

        Raises:
            ValueError, LoRAAdapterError, FileNotFoundError: as ``add_request``, or what
                the read met (bad weights).
        """
        future = self.add_lora_async(lora_request)
        if not future.done():
            self.lora_manager.wait_first_read(lora_request.lora_int_id)
            self._late_outputs.extend(self._poll_adapters())
        return future.result()

    def add_lora_async(self, lora_request: LoRARequest) -> Future:
        """Start loading an adapter into the host tier (``add_lora``) without waiting: a
        new path is read on a loader thread while steps go on.

        Returns:
            A ``concurrent.futures.Future`` of True, done once the adapter is in the host
            tier (set by the step, or ``poll_adapters``, that takes the read in), or
            holding what the read met (``LoRAAdapterError``, ``FileNotFoundError``,
            ``ValueError``), or a ``ValueError`` when the adapter is removed meanwhile.

        Raises:
            ValueError, LoRAAdapterError, FileNotFoundError: the checks that read no tensor
                (as ``add_request``).
        """
        manager = self._lora_manager(lora_request)
        lid = lora_request.lora_int_id
        digest = manager.add(lora_request)
        manager.release(lid)
        future: Future = Future()
        if digest is not None:
            future.set_result(True)
        else:
            self._lora_waiters.setdefault(lid, []).append(future)
        return future

    def has_pending_loads(self) -> bool:
        """Whether an adapter's first read is in flight (``poll_adapters`` takes it in;
        ``set_load_notify`` tells when)."""
        return self.lora_manager is not None and self.lora_manager.has_pending_reads

    def has_finished_reads(self) -> bool:
        """Whether an adapter read or a grammar compile has ended that no step or
        ``poll_adapters`` has taken in yet (then a loop must not wait for
        ``set_load_notify``'s call: it came already)."""
        return ((self.lora_manager is not None and self.lora_manager.has_finished_reads())
                or self.structured.has_compiled())

    def set_load_notify(self, notify: Callable[[], None] | None) -> None:
        """Have ``notify()`` called (on a loader thread) whenever an adapter's first read
        finishes, so a loop waiting for messages wakes to ``poll_adapters``."""
        if self.lora_manager is not None:
            self.lora_manager.notify = notify
        if self.structured.compiler is not None:
            self.structured.compiler.notify = notify

    def poll_adapters(self) -> EngineCoreOutputs:
        """Take in finished adapter reads without stepping (``step`` does it too): their
        requests become schedulable, ``add_lora_async`` futures are answered, requests of
        adapters that failed end (their outputs are returned)."""
        return EngineCoreOutputs(self._poll_adapters())

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host tier and its device slot (vLLM's ``remove_lora``)
        once no request uses it: requests already accepted finish with it first.

        Returns:
            True when it is gone now (or was never loaded); False while requests still use
            it: it goes at the end of the step in which the last of them finishes (before
            that step's outputs are reported).
        """
        if self.lora_manager is None or self.lora_manager.remove(lora_int_id):
            self._pending_removals.discard(lora_int_id)
            self._awaiting.pop(lora_int_id, None)        # only ended requests were left
            for future in self._lora_waiters.pop(lora_int_id, []):
                future.set_exception(ValueError(
                    f"adapter {lora_int_id} was removed (remove_lora) before its read ended"))
            return True
        self._pending_removals.add(lora_int_id)
        return False

    def _remove_unused_adapters(self) -> None:
        for lid in list(self._pending_removals):
            if self.lora_manager.remove(lid):
                self._pending_removals.discard(lid)

    def end_session(self, session_id: str) -> bool:
        """End a multi-turn session: blocks only it held are freed (its full blocks stay in
        the prefix cache for other requests). A turn in flight finishes first. False when
        the session is unknown."""
        return self.scheduler.end_session(session_id)

    def kv_cache_stats(self) -> KVCacheStats:
        """The KV cache's state and counters: blocks total, used, cached and free; prefix
        queries and hits (tokens); preemptions, recomputed tokens, swapped blocks."""
        return self.scheduler.kv.snapshot()

    def lora_cache_stats(self) -> LoRACacheStats:
        """A copy of the adapter cache's counters (hits, misses, evictions, load times)."""
        if self.lora_manager is None:
            return LoRACacheStats()
        return self.lora_manager.snapshot()

    def scheduler_stats(self) -> SchedulerStats:
        """The core's state now: running and waiting requests and their adapters, the KV
        cache's and the adapter cache's counters."""
        sched = self.scheduler
        return SchedulerStats(
            len(sched.running), sched.num_waiting,
            _names(r.lora_request for r in sched.running),
            _names(sched.waiting_lora_requests()),
            self.kv_cache_stats(), self.lora_cache_stats())

    def _finish(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        request_ids = list(request_ids)
        structured = self.structured.active
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is None and structured:
                req = self.structured.release(rid)        # held for its grammar
            if req is not None and req.lora_int_id and self.lora_manager is not None:
                self.lora_manager.release(req.lora_int_id)
        if structured:
            self.structured.remove(request_ids)
        self.scheduler.finish_requests(request_ids, status)

    def abort_requests(self, request_ids: Sequence[str],
                       reason: FinishReason = FinishReason.ABORT) -> None:
        """End requests now; their blocks and adapter references go back. Unknown or
        finished ids are ignored.

        Args:
            request_ids: the requests.
            reason: ``ABORT`` (the caller gave up on them), or ``STOP`` when the front found
                a stop string: a session's turn that stops so keeps its KV for the next turn.
        """
        self._finish(request_ids, _STATUS[reason])
        self._drain_if_idle()
        if self._pending_removals:
            self._remove_unused_adapters()

    def has_unfinished_requests(self) -> bool:
        """Whether a request is unfinished or a step is still in flight (async scheduling:
        ``step`` must run once more to read it)."""
        return (self._in_flight is not None or bool(self._late_outputs)
                or self.scheduler.has_unfinished_requests() or self.structured.num_held > 0)

    def waiting_on_reads(self) -> bool:
        """Whether no step can make progress until an adapter read or a grammar compile
        finishes: nothing runs or is in flight, and every waiting request's adapter is
        being read or its grammar compiled. A loop should then wait for a message or
        ``set_load_notify``'s call rather than step."""
        sched = self.scheduler
        if (self._in_flight is not None or self._late_outputs or sched.running
                or self.structured.has_compiled()):
            return False
        if not sched.requests:
            return self.structured.num_held > 0
        if self.lora_manager is None:
            return False
        manager = self.lora_manager
        return all(r is not None and manager.is_loading(r.lora_int_id)
                   and not manager.is_ready(r.lora_int_id)
                   for r in sched.waiting_lora_requests())

    def info(self) -> CoreInfo:
        """What the front needs to know of this core."""
        return CoreInfo(self.max_model_len, self.model_config.vocab_size,
                        self.lora_config.max_loras if self.lora_config else 0,
                        self.cache_config.num_blocks)

    def step(self) -> EngineCoreOutputs:
        """Run one step; an ``EngineCoreOutput`` for every request that got a token or
        ended.

        With async scheduling the step planned and launched here is not waited for: what
        is reported is the previous step's tokens, read while this one runs on the device
        (vLLM v1's batch queue of depth 2). A step whose plan computes nothing (every
        request waits) only reads the step in flight."""
        outputs = self._poll_adapters()
        if self.structured.num_held:
            outputs.extend(self._poll_grammars())
        planned = self._schedule_and_forward(outputs)
        done = self._in_flight if self.async_scheduling else None
        self._in_flight = None
        launched = None
        if planned is not None:
            out, forward = planned
            bitmask = None
            if forward is not None and forward.info.masked is not None:
                # the masks (grammar, bad_words) need the tokens of the step in flight: read
                # it first, then sample this one (vLLM v1's order under async scheduling)
                if done is not None:
                    outputs.extend(self._process(*done))
                    done = None
                bitmask = self.structured.fill(forward.info.req_ids, forward.info.masked,
                                               self.scheduler.requests)
            with self._workers_guard():
                launched = out, (None if forward is None
                                 else self.runner.sample(forward, bitmask))
        if self.async_scheduling:
            self._in_flight = launched
        else:
            done = launched
        if done is not None:
            outputs.extend(self._process(*done))
        self._drain_if_idle()
        if self._pending_removals:
            self._remove_unused_adapters()
        return EngineCoreOutputs(outputs)

    def _drain_if_idle(self) -> None:
        """Once every request has ended, read the step still in flight (its tokens all
        belong to ended requests and are dropped), so an idle core holds nothing."""
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            last, self._in_flight = self._in_flight, None
            self._process(*last)

    def _schedule_and_forward(self, outputs: list[EngineCoreOutput]
                              ) -> tuple[SchedulerOutput, ForwardStep | None] | None:
        """Plan a step, bind its adapters and launch its forward pass (``step`` launches
        its sampling); None when nothing is computed."""
        out = self.scheduler.schedule()
        if out.swaps:
            self.swapper.apply(out.swaps)
        self.runner.release(out.finished_ids)
        lora_slots, failed = self._activate_adapters()
        outputs.extend(failed)
        if failed:
            self.scheduler.revert(out)
            return None
        if self.lora_manager is not None:
            self.lora_manager.prefetch(
                self.scheduler.wanted_adapters(self.lora_config.max_loras), lora_slots)
        if not out.scheduled:
            return None
        with self._workers_guard():
            forward = self.runner.execute_forward(out, lora_slots)
        return out, forward

    def _workers_guard(self) -> contextlib.AbstractContextManager:
        """Under tensor parallelism, a dead worker raises ``WorkerDiedError`` here."""
        return (self.tp_driver.workers.guard() if self.tp_driver is not None
                else contextlib.nullcontext())

    def _poll_grammars(self) -> list[EngineCoreOutput]:
        """Requests whose grammar compiled join the scheduler's queue; those whose grammar
        did not compile end with the error (``FinishReason.ERROR``)."""
        ready, failed = self.structured.poll()
        for req in ready:
            self.scheduler.add_request(req)
        outputs = []
        for req, error in failed:
            logger.info("request %s: %s", req.request_id, error)
            if req.lora_int_id and self.lora_manager is not None:
                self.lora_manager.release(req.lora_int_id)
            outputs.append(EngineCoreOutput(req.request_id, [],
                                            finish_reason=FinishReason.ERROR,
                                            error=ErrorInfo.of(error)))
        return outputs

    def _process(self, out: SchedulerOutput, launched: LaunchedStep | None
                 ) -> list[EngineCoreOutput]:
        """Read a launched step's tokens, record them and apply the token-level stops."""
        sampled = self.runner.get_output(launched)
        got = self.scheduler.update(out, sampled.tokens)
        prompt = self._new_prompt_logprobs(sampled.prompt_logprobs) \
            if sampled.prompt_logprobs else {}
        failed = self._constraint_failures(got, sampled.no_token)
        outputs = []
        finished: dict[RequestStatus, list[str]] = {}
        for req in got:
            rid = req.request_id
            if rid in failed:
                logger.info("request %s: %s", rid, failed[rid])
                finished.setdefault(RequestStatus.FINISHED_ABORTED, []).append(rid)
                outputs.append(EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR,
                                                error=ErrorInfo.of(failed[rid])))
                continue
            status = check_stop(req)
            if status is None and self._grammar_ended(req):
                status = RequestStatus.FINISHED_STOPPED
            lp = sampled.logprobs.get(rid)
            reason = None
            if status is not None:
                finished.setdefault(status, []).append(rid)
                reason = _FINISH[status]
            first = len(req.token_ids) - req.num_prompt_tokens == 1
            outputs.append(EngineCoreOutput(rid, [req.token_ids[-1]],
                                            None if lp is None else [lp], reason,
                                            req.stop_reason,
                                            new_prompt_logprobs=prompt.pop(rid, None),
                                            num_cached_tokens=max(req.num_cached_tokens, 0),
                                            scheduled_time=req.scheduled_time if first
                                            else None))
        outputs.extend(EngineCoreOutput(rid, [], new_prompt_logprobs=p)
                       for rid, p in prompt.items())
        for status, ids in finished.items():
            self._finish(ids, status)
        return outputs

    def _constraint_failures(self, got: list[Request], no_token: frozenset[str]
                             ) -> dict[str, ValueError]:
        """The requests of ``got`` (each with its newest token appended) that must end with
        an error: their masks allowed no token (``no_token``), or their grammar rejects the
        token. The others' tokens advance their matchers."""
        failed = {}
        structured = self.structured
        for req in got:
            rid = req.request_id
            if rid in no_token:
                failed[rid] = no_token_error(req, structured.has_matcher(rid),
                                             req.num_output_tokens - 1)
            elif structured.has_matchers and not structured.accept(rid, req.token_ids[-1]):
                failed[rid] = ValueError(f"structured_outputs: the grammar rejects token "
                                         f"{req.token_ids[-1]} sampled under its own mask")
        return failed

    def _grammar_ended(self, req: Request) -> bool:
        """Whether ``req`` ends because its grammar has (a stop token accepted), below its
        ``min_tokens`` too; with ``ignore_eos`` it goes on unconstrained."""
        return (self.structured.has_matchers and not req.sampling_params.ignore_eos
                and self.structured.terminated(req.request_id))

    def _new_prompt_logprobs(self, computed: dict) -> dict:
        """``{request_id: PromptLogprobs}`` of a step's prompt log-probabilities that are
        new: those of requests still unfinished, cut to the positions not reported yet (a
        preempted request computes its prompt again), each request's
        ``prompt_logprobs_next`` advanced past them."""
        new = {}
        requests = self.scheduler.requests
        for rid, chunk in computed.items():
            req = requests.get(rid)
            if req is None:
                continue
            chunk = chunk.drop_before(req.prompt_logprobs_next)
            if chunk is None or chunk.start != req.prompt_logprobs_next:
                continue
            req.prompt_logprobs_next = chunk.start + len(chunk)
            new[rid] = chunk
        return new

    def _poll_adapters(self) -> list[EngineCoreOutput]:
        """Take in the loader threads' work: adapters whose first read finished give their
        waiting requests the digest (before any of them is scheduled, so every block hash
        is rooted in it) and answer ``add_lora_async``; requests of adapters whose read
        failed end with the error; requests whose adapter reached host memory are counted
        as having waited for it."""
        outputs, self._late_outputs = self._late_outputs, []
        if self.lora_manager is None:
            return outputs
        events = self.lora_manager.poll()
        for lid, digest in events.ready.items():
            for req, _ in self._awaiting.get(lid, {}).values():
                if self._is_live(req):
                    req.lora_digest, req.adapter_pending = digest, False
            for future in self._lora_waiters.pop(lid, []):
                future.set_result(True)
        for error in events.failed:
            outputs.extend(self._end_adapter_requests(error))
            self._awaiting.pop(error.lora_int_id, None)
            for future in self._lora_waiters.pop(error.lora_int_id, []):
                future.set_exception(error.cause or error)
        if self._awaiting:
            self._count_adapter_waits()
        return outputs

    def _count_adapter_waits(self) -> None:
        """Requests that waited for their adapter's read: counted once it is in host
        memory (or once they end)."""
        now = time.monotonic()
        manager = self.lora_manager
        count, seconds = 0, 0.0
        for lid in [lid for lid in self._awaiting if manager.is_ready(lid)]:
            for req, since in self._awaiting.pop(lid).values():
                if self._is_live(req):
                    count += 1
                    seconds += now - since
        if count:
            manager.record_wait(count, seconds)

    def _end_adapter_requests(self, error: AdapterLoadError) -> list[EngineCoreOutput]:
        """End every request of an adapter that failed to load, with the error (its cause,
        e.g. ``LoRAAdapterError``, travels to the front as ``ErrorInfo``)."""
        logger.error("adapter %d: %s; its requests end with the error", error.lora_int_id,
                     error)
        ids = [r.request_id for r in self.scheduler.requests.values()
               if r.lora_int_id == error.lora_int_id]
        ids += [r.request_id for r in self.structured.held_requests()
                if r.lora_int_id == error.lora_int_id]
        self._finish(ids, RequestStatus.FINISHED_ABORTED)
        info = ErrorInfo.of(error.cause or error)
        return [EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error=info)
                for rid in ids]

    def _is_live(self, req: Request) -> bool:
        """Whether ``req`` is still this core's (queued, running, or held for its
        grammar), not an ended request whose id came back."""
        rid = req.request_id
        return self.scheduler.requests.get(rid) is req or self.structured.held(rid) is req

    def _activate_adapters(self) -> tuple[dict[int, int], list[EngineCoreOutput]]:
        if self.lora_manager is None:
            return {}, []
        wanted = {r.lora_int_id: r.lora_request for r in self.scheduler.running if r.lora_int_id}
        try:
            return self.lora_manager.activate(wanted.values()), []
        except AdapterLoadError as e:
            # An adapter that loaded once failed to reload (files removed or changed): end
            # its requests; the next step re-plans the others.
            return {}, self._end_adapter_requests(e)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the adapter loader threads, and give the
        start-up heap back to the garbage collector. Under tensor parallelism the decode
        graphs are destroyed first (their captured collectives hold the NCCL communicator)
        and the core cannot step again."""
        if self.tp_driver is not None:
            if getattr(self, "runner", None) is not None:
                self.runner.release_graphs()
            self.tp_driver.shutdown()
        if self.lora_manager is not None:
            self.lora_manager.shutdown()
        if self.structured.compiler is not None:
            self.structured.compiler.shutdown()
        gc.unfreeze()


def _piece_sizes(args: EngineArgs, device: torch.device) -> tuple[int, ...]:
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


def _freeze_startup_heap() -> None:
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


def _lora_config(args: EngineArgs, max_loras: int, model_dtype: torch.dtype) -> LoRAConfig:
    """The slots' config for ``max_loras`` slots (the host tier holds at least as many
    adapters as there are slots when the slots are sized from memory), in
    ``args.lora_dtype`` resolved against ``model_dtype``."""
    max_cpu_loras = args.max_cpu_loras
    if args.lora_device_cache_percent is not None:
        max_cpu_loras = max(max_cpu_loras, max_loras)
    return LoRAConfig(max_loras, args.max_lora_rank, max_cpu_loras, args.lora_target_modules,
                      args.max_cpu_lora_bytes, args.fully_sharded_loras, args.lora_load_timeout,
                      resolve_lora_dtype(args.lora_dtype, model_dtype))


def _tokenizer_info(args: EngineArgs, model_dir, vocab_size: int):
    """The grammar compiler's ``xgrammar.TokenizerInfo``: the front's tokenizer (``tokenizer``
    or the checkpoint's) over the model's ``vocab_size`` (read on the grammar thread)."""
    tok_dir = (resolve_model_path(args.tokenizer, args.revision, args.download_dir)
               if args.tokenizer else model_dir)
    return load_tokenizer_info(str(tok_dir), args.trust_remote_code, vocab_size)


def _names(requests: Iterable[LoRARequest | None]) -> tuple[str, ...]:
    return tuple(sorted({r.lora_name for r in requests if r is not None}))
