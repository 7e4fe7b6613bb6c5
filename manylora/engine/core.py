"""``EngineCore``: the scheduler, the structured-output manager and the executor, stepped
one batch at a time on token ids (vLLM v1's ``EngineCore``).

A step: ``Scheduler.schedule`` picks the requests and token counts (at most ``max_loras``
distinct adapters), ``LoRAManager.activate`` binds their adapters to device slots, the
executor launches the batch (``Executor.execute_model``) and samples it
(``Executor.sample_tokens``; the rows with a grammar first masked by their bitmask,
``StructuredOutputManager``), ``Scheduler.update`` appends the tokens once they reach the
host (``Executor.get_output``), and the token-level stop rules (``scheduler.stop``) end
requests, whose blocks go back. What the step reports is a delta per request
(``EngineCoreOutputs``): its new token ids and their log-probabilities, and why it ended.
Text, stop strings and ``RequestOutput`` belong to the front, ``LLMEngine``. The model, the
KV cache, the adapter slots, warm-up and graphs are the executor's (``manylora.executor``).

Async scheduling (on by default, vLLM v1's): step n+1 is planned and launched before step
n's tokens are read, so the host's planning, output handling and the GPU overlap. The
scheduler counts a planned step as run (an output placeholder per sampling request), the
runner takes a decode token from the previous step's samples on the device, and a request
that stops at step n computes one discarded token in step n+1.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

from manylora.engine.arg_utils import EngineArgs
from manylora.engine.core_adapters import CoreAdapters
from manylora.engine.core_outputs import FINISH_REASONS, grammar_outputs, step_outputs
from manylora.engine.core_requests import build_request, require_lora
from manylora.engine.core_startup import (
    build_scheduler,
    build_structured_outputs,
    freeze_startup_heap,
)
from manylora.engine.protocol import (
    CoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from manylora.executor.factory import create_executor
from manylora.lora.cache_report import LoRACacheStats
from manylora.lora_request import LoRARequest
from manylora.request import RequestStatus
from manylora.scheduler.kv_cache_manager import KVCacheStats
from manylora.scheduler_output import SchedulerOutput
from manylora.worker.step_sampler import ForwardStep, LaunchedStep

logger = logging.getLogger(__name__)

_STATUS = {reason: status for status, reason in FINISH_REASONS.items()}


class EngineCore:
    """The engine on token ids: requests in, one scheduled and executed step at a time,
    per-request deltas out.

    Args:
        args: every engine setting (the tokenizer ones are the front's and unused here).

    Raises:
        CheckpointError, ValueError, FileNotFoundError: a bad checkpoint or setting.

    Bad requests (``add_request``) raise ``ValueError`` naming the problem and leave the
    core serving every request it already accepted.

    Attributes:
        executor: the ``Executor`` that runs the steps (the model, KV cache, adapter slots).
        scheduler: the ``Scheduler``; structured: the ``StructuredOutputManager``.
        lora_manager: the executor's ``LoRAManager`` (None: LoRA off).
    """

    def __init__(self, args: EngineArgs) -> None:
        self.executor = executor = create_executor(args)
        self.model_config = executor.model_config
        self.max_model_len = executor.max_model_len
        self.cache_config = executor.cache_config
        self.lora_config = executor.lora_config
        self.lora_manager = manager = executor.lora_manager
        self.scheduler = build_scheduler(args, executor)
        self.structured = build_structured_outputs(args, executor)
        self._late_outputs: list[EngineCoreOutput] = []    # adapter failures met off-step
        self.async_scheduling = args.async_scheduling
        self._in_flight: tuple[SchedulerOutput, LaunchedStep | None] | None = None
        self._adapters = None if manager is None else CoreAdapters(
            manager, self.scheduler, self.structured, self._finish)
        freeze_startup_heap()

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
                (``LoRAAdapterError``, ``FileNotFoundError``); see ``build_request``.

        An adapter path seen for the first time is read on a loader thread: the request
        waits in the queue meanwhile (other requests keep running), takes the adapter's
        digest when the read is in, and ends with ``FinishReason.ERROR`` and the error when
        the read fails (bad weights). A request with ``structured_outputs`` waits likewise
        while its grammar compiles on the grammar thread (``StructuredOutputManager``), and
        ends with ``FinishReason.ERROR`` when it does not compile (``ValueError`` naming
        the field); without a tokenizer (``skip_tokenizer_init``) it is refused here.
        """
        req, history, ready = build_request(request, self.scheduler, self.structured,
                                            self.model_config.vocab_size, self.max_model_len,
                                            self.lora_manager)
        params = request.sampling_params
        if params is not None and params.structured_outputs is not None:
            self.structured.hold(req)          # queued once its grammar compiles
        else:
            self.scheduler.add_request(req)
        if not ready:
            self._adapters.wait(req)
        return history

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the host cache ahead of its requests (vLLM's ``add_lora``),
        waiting for its read on this thread (``add_lora_async`` does not wait).

        Raises:
            ValueError, LoRAAdapterError, FileNotFoundError: as ``add_request``, or what
                the read met (bad weights).
        """
        future = self.add_lora_async(lora_request)
        if not future.done():
            self.lora_manager.wait_first_read(lora_request.lora_int_id)
            self._late_outputs.extend(self._adapters.poll())
        return future.result()

    def add_lora_async(self, lora_request: LoRARequest) -> Future:
        """Start loading an adapter into the host cache (``add_lora``) without waiting: a
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
        require_lora(self.lora_manager, lora_request)
        return self._adapters.add_lora_async(lora_request)

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
        """Drop an adapter from the host cache and its device slot (vLLM's ``remove_lora``)
        once no request uses it: requests already accepted finish with it first.

        Returns:
            True when it is gone now (or was never loaded); False while requests still use
            it: it goes at the end of the step in which the last of them finishes (before
            that step's outputs are reported).
        """
        return self._adapters is None or self._adapters.remove(lora_int_id)

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
            outputs.extend(grammar_outputs(self.structured, self.scheduler,
                                           self.lora_manager))
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
            launched = out, (None if forward is None
                             else self.executor.sample_tokens(forward, bitmask))
        if self.async_scheduling:
            self._in_flight = launched
        else:
            done = launched
        if done is not None:
            outputs.extend(self._process(*done))
        self._drain_if_idle()
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
            self.executor.apply_swaps(out.swaps)
        self.executor.release(out.finished_ids)
        lora_slots, failed = self._adapters.activate() if self._adapters else ({}, [])
        outputs.extend(failed)
        if failed:
            self.scheduler.revert(out)
            return None
        if self.lora_manager is not None:
            self.lora_manager.prefetch(
                self.scheduler.wanted_adapters(self.lora_config.max_loras), lora_slots)
        if not out.scheduled:
            return None
        return out, self.executor.execute_model(out, lora_slots)

    def _process(self, out: SchedulerOutput, launched: LaunchedStep | None
                 ) -> list[EngineCoreOutput]:
        """Read a launched step's tokens, record them and apply the token-level stops."""
        outputs, finished = step_outputs(out, self.executor.get_output(launched),
                                         self.scheduler, self.structured)
        for status, ids in finished.items():
            self._finish(ids, status)
        return outputs

    def _poll_adapters(self) -> list[EngineCoreOutput]:
        """The outputs met off-step, and those of the adapter reads taken in now
        (``CoreAdapters.poll``)."""
        outputs, self._late_outputs = self._late_outputs, []
        if self._adapters is not None:
            outputs.extend(self._adapters.poll())
        return outputs

    def _remove_unused_adapters(self) -> None:
        if self._adapters is not None and self._adapters.pending_removals:
            self._adapters.remove_unused()

    def shutdown(self) -> None:
        """Stop the executor (its tensor-parallel workers and the adapter loader threads;
        the core cannot step again), the grammar threads, and give the start-up heap back
        to the garbage collector."""
        self.executor.shutdown()
        if self.structured.compiler is not None:
            self.structured.compiler.shutdown()
        gc.unfreeze()


def _names(requests: Iterable[LoRARequest | None]) -> tuple[str, ...]:
    return tuple(sorted({r.lora_name for r in requests if r is not None}))
