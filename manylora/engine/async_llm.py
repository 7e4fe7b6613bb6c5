"""``AsyncLLM``: the engine's front on its own thread, requests streamed to asyncio.

The server (``manylora serve``) and any asyncio caller share one ``LLMEngine`` (the front:
tokenizer, detokenizer, stop strings) through this class, as the offline ``LLM`` drives the
same front in a loop of its own (vLLM's ``AsyncLLM``). The engine core runs in a process of
its own (``engine/core_client.py``), so its busy loop never shares an interpreter with the
event loop; with ``MANYLORA_ENABLE_MULTIPROCESSING=0`` the front's thread steps it instead.

Every call into the front runs on the front's thread: callers put commands on a queue (add,
abort, load or remove an adapter) and wake it; the thread takes all pending commands, takes
what the core reported (its answers to adds, its steps' deltas), and hands each request's
outputs to that request's ``asyncio.Queue`` on the caller's event loop. A core that dies
ends every stream with ``EngineDeadError`` at once, ``is_running`` turns False (``errored``
True), the engine is shut down (the core process reaped, nothing of it left behind), and
the ``on_dead`` callbacks run (``manylora serve`` exits, as vLLM's server does).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from manylora.engine.arg_utils import EngineArgs
from manylora.engine.commands import Command, CommandQueue, Deferred
from manylora.engine.llm_engine import LLMEngine
from manylora.engine.output_streams import OutputStream, OutputStreams
from manylora.engine.outputs import RequestOutput
from manylora.engine.protocol import EngineDeadError
from manylora.engine.stats import EngineSnapshot, IterationStats
from manylora.lora_request import LoRARequest
from manylora.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """The waiting queue holds ``max_waiting_requests`` requests already (HTTP 503)."""


class StatLogger(Protocol):
    """Receives each step's ``IterationStats`` on the engine thread."""

    def record(self, stats: IterationStats) -> None: ...


class AsyncLLM:
    """An ``LLMEngine`` driven by a background thread, with per-request output streams.

    Args:
        engine: the engine; only the front's thread calls it from now on.
        max_waiting_requests: bound on requests accepted but not running (the scheduler's
            waiting queue plus those not yet taken in); None: unbounded.
        stat_loggers: called with each step's ``IterationStats`` on the loop thread.

    Attributes:
        tokenizer: the engine's tokenizer (None with ``skip_tokenizer_init``).
        max_model_len: the context length in tokens (prompt + output).
        max_loras: device adapter slots (0 when LoRA is off).
        num_gpu_blocks: the core's KV-cache blocks on the device.
        max_bad_words, max_structured_output_spec_bytes: the engine's bounds of one
            request's ``bad_words`` and output constraint (``EngineArgs``').
    """

    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 stat_loggers: Iterable[StatLogger] = ()) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be ≥ 1, got {max_waiting_requests}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_loras = engine.max_loras
        self.num_gpu_blocks = engine.num_gpu_blocks
        self.max_bad_words = engine.max_bad_words
        self.max_structured_output_spec_bytes = engine.max_structured_output_spec_bytes
        self.max_waiting_requests = max_waiting_requests
        self.stat_loggers = list(stat_loggers)
        self._commands = CommandQueue()
        self._streams = OutputStreams()
        self._pending_adds = 0
        self._adding: dict[str, Command] = {}
        self._pending_lock = threading.Lock()
        self._snapshot = EngineSnapshot(max_loras=self.max_loras)
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._commands_ran = False        # a command ran since the last publish
        self._stopped = False
        self._dead = False                # the loop ended on an error, its callbacks ran
        self._drained: BaseException | None = None   # set when the loop takes no more commands
        self._dead_callbacks: list[Callable[[BaseException], None]] = []
        self._dead_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="manylora-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, in_process: bool | None = None,
                         **kwargs: Any) -> AsyncLLM:
        """Build the engine from ``args`` and start its loop; ``in_process`` as
        ``core_client.make_client``'s; ``kwargs`` go to ``__init__``."""
        return cls(LLMEngine.from_engine_args(args, in_process), **kwargs)

    # ------------------------------------------------------------------ caller side

    @property
    def is_running(self) -> bool:
        """True while the loop thread serves requests."""
        return self._thread.is_alive() and self._error is None and not self._stopped

    @property
    def errored(self) -> bool:
        """True once the loop stopped on an error (the core died), not by ``shutdown``
        (vLLM's ``AsyncLLM.errored``)."""
        return self._error is not None

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` once the engine has died and been shut down (its
        streams ended with ``EngineDeadError``): on the engine's thread, or at once on this
        one if it is dead already. Not called after ``shutdown``. What it raises is logged."""
        with self._dead_lock:
            if not self._dead:
                self._dead_callbacks.append(callback)
                return
        self._call_dead(callback)

    def _call_dead(self, callback: Callable[[BaseException], None]) -> None:
        try:
            callback(self._error)
        except Exception:
            logger.exception("on_dead callback %r failed", callback)

    def snapshot(self) -> EngineSnapshot:
        """The engine's state after its last step (any thread; no waiting)."""
        return self._snapshot

    def _check_alive(self) -> None:
        if not self.is_running:
            raise EngineDeadError("the engine is not running" + (
                f": {self._error!r}" if self._error is not None else ""))

    async def _call(self, name: str, *args: Any) -> Any:
        self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(Command(name, args, loop, future))
        self.engine.wake()
        if self._drained is not None:   # the loop ended after the check: nobody takes it
            self._commands.fail_all(self._drained)
        return await future

    async def generate(self, prompt: str | dict, sampling_params: SamplingParams,
                       request_id: str | None = None,
                       lora_request: LoRARequest | None = None,
                       client_group: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its ``RequestOutput`` after every step that gave it a
        token, the last one with ``finished`` True.

        Each output holds what ``sampling_params.output_kind`` asks for: the whole text
        and token ids so far (``CUMULATIVE``, the default), only what is new since the
        previous output (``DELTA``), or everything once at the end (``FINAL_ONLY``).
        Closing the iterator, or cancelling the task iterating it, aborts the request and
        frees its KV blocks and adapter reference.

        Args:
            prompt: text, or ``{"prompt_token_ids": [...]}`` (optionally with ``"prompt"``
                and ``"cache_salt"``).
            sampling_params: how to sample; ``n`` must be 1 (fan out at the caller).
            request_id: unique among live requests; None picks one.
            lora_request: the adapter, None for the base model.
            client_group: the client call the request is one of (the server's HTTP
                request id, shared by its prompts x n children): the scheduler shares the
                running batch between groups; None: a group of its own.

        Raises:
            ValueError: a bad prompt, parameters, id or adapter (``LLMEngine.add_request``),
                before anything is yielded.
            LoRAAdapterError, FileNotFoundError, ValueError: the request's adapter could not
                be read (its first read runs while the request waits; the output would
                have had ``finish_reason`` ``"error"``), before anything is yielded.
            EngineOverloadedError: ``max_waiting_requests`` requests are waiting already.
            EngineDeadError: the engine stopped, before or while the request ran.
        """
        self._check_alive()
        with self._pending_lock:
            waiting = self._snapshot.num_waiting + self._pending_adds
            if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                raise EngineOverloadedError(
                    f"{waiting} requests are waiting (max_waiting_requests="
                    f"{self.max_waiting_requests}); retry later")
            self._pending_adds += 1
        request_id = f"async-{next(self._ids)}" if request_id is None else request_id
        loop = asyncio.get_running_loop()
        stream = OutputStream(loop, asyncio.Queue(), time.monotonic())
        added = finished = False
        try:
            try:
                await self._call("add", request_id, prompt, sampling_params, lora_request,
                                 stream, client_group)
            except asyncio.CancelledError:
                added = True         # the add may still run: abort whatever it added
                raise
            added = True
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if added and not finished and self._thread.is_alive():
                self._commands.put(Command("abort", ([request_id], stream)))
                self.engine.wake()

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (any thread, no waiting): their streams end, their blocks and
        adapter references are freed. Unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids and self._thread.is_alive():
            self._commands.put(Command("abort", (ids,)))
            self.engine.wake()

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read an adapter into the host cache now (``LLMEngine.add_lora``); the engine's
        steps go on while the core reads it, and this returns once it is in.

        Raises:
            LoRAAdapterError, FileNotFoundError, ValueError: as ``LLMEngine.add_lora``.
            EngineDeadError: the engine stopped.
        """
        await self._call("add_lora", lora_request)

    async def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter from both tiers once no request uses it: requests already
        accepted finish with it first; returns without waiting for them.

        Raises:
            EngineDeadError: the engine stopped.
        """
        await self._call("remove_lora", lora_int_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (running requests end with ``EngineDeadError``), join it, then
        stop the engine's workers and loader threads."""
        self._stopped = True
        self._commands.put(Command("stop", ()))
        self.engine.wake()
        self._thread.join(timeout)
        self.engine.shutdown()

    # ------------------------------------------------------------------ loop thread

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                in_process = self.engine.client.in_process
                while not self._stopped:
                    # in this process, wait on the queue while idle; otherwise the wait is
                    # in step(), which a command's wake() ends
                    idle = (in_process and not self.engine.has_unfinished_requests()
                            and not self.engine.has_pending_calls())
                    if not self._take_commands(idle):
                        break
                    if in_process and self._commands_ran:
                        # the step may now wait for an adapter read: publish what the
                        # commands changed (a read pending) first
                        self._commands_ran = False
                        self._publish()
                    stats = IterationStats()
                    outputs = self.engine.step(stats)
                    self._settle_adds()
                    self._publish()
                    self._dispatch(outputs, stats)
        except Exception as e:       # a failed step: every stream learns why
            logger.exception("the engine loop stopped")
            self._error = e
        finally:
            self._fail_all(EngineDeadError(
                "the engine stopped" + (f": {self._error!r}" if self._error else "")))
        if self._error is not None:
            self._die()

    def _die(self) -> None:
        """After the loop's error: stop the engine (reap the core, remove its files), then
        run the ``on_dead`` callbacks."""
        try:
            self.engine.shutdown()
        except Exception:
            logger.exception("shutting the dead engine down failed")
        with self._dead_lock:
            self._dead = True
            callbacks, self._dead_callbacks = self._dead_callbacks, []
        for callback in callbacks:
            self._call_dead(callback)

    def _take_commands(self, block: bool) -> bool:
        """Run every queued command (waiting for one when ``block``); False on stop."""
        cmd = self._commands.get(timeout=0.5 if block else None)
        # the requests added now reach the core in one message, so a burst starts whole
        with self.engine.one_message():
            while cmd is not None:
                if cmd.name == "stop":
                    return False
                self._execute(cmd)
                cmd = self._commands.get()
        return True

    def _execute(self, cmd: Command) -> None:
        self._commands_ran = True
        result: Any = None
        error: BaseException | None = None
        try:
            result = getattr(self, f"_do_{cmd.name}")(*cmd.args)
        except Exception as e:
            error = e
        if isinstance(result, Deferred):        # answered when the core's answer comes
            self._adding[result.request_id] = cmd
            return
        if isinstance(result, Future):          # answered by the step that receives it
            result.add_done_callback(lambda f: cmd.answer(
                None if f.exception() else f.result(), f.exception()))
            return
        cmd.answer(result, error)

    def _do_add(self, request_id: str, prompt, params, lora_request,
                stream: OutputStream, client_group: str | None) -> Deferred:
        with self._pending_lock:
            self._pending_adds -= 1
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.engine.submit_request(request_id, prompt, params, lora_request,
                                   arrival_time=stream.arrival, client_group=client_group)
        self._streams.add(request_id, stream)
        return Deferred(request_id)

    def _settle_adds(self) -> None:
        """Answer each ``generate`` whose request the core took or refused."""
        for done in self.engine.take_added():
            cmd = self._adding.pop(done.request_id, None)
            if done.error is not None:
                self._streams.discard(done.request_id)
            if cmd is not None:
                cmd.answer(None, done.error)

    def _do_abort(self, ids: list[str], only: OutputStream | None = None) -> None:
        live = self._streams.live(ids, only)
        if not live:
            return
        stats = IterationStats()
        self.engine.abort_request(live, stats)
        for rid in live:
            self._streams.discard(rid)
            self._adding.pop(rid, None)
        self._log(stats)

    def _do_add_lora(self, lora_request: LoRARequest) -> Future:
        return self.engine.add_lora_async(lora_request)

    def _do_remove_lora(self, lora_int_id: int) -> None:
        self.engine.remove_lora(lora_int_id)     # at once, or when its requests are done

    def _dispatch(self, outputs: list[RequestOutput], stats: IterationStats) -> None:
        self._log(stats)
        gone = self._streams.dispatch(outputs)
        if gone:
            self._do_abort(gone)     # their callers' event loops have closed

    def _log(self, stats: IterationStats) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(stats)
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)

    def _publish(self) -> None:
        stats = self.engine.scheduler_stats()
        with self._pending_lock:
            pending = self._pending_adds
        self._snapshot = EngineSnapshot(
            num_running=stats.num_running, num_waiting=stats.num_waiting + pending,
            max_loras=self.max_loras, running_lora_adapters=stats.running_lora_adapters,
            waiting_lora_adapters=stats.waiting_lora_adapters, kv=stats.kv, lora=stats.lora)

    def _fail_all(self, error: BaseException) -> None:
        adding, self._adding = self._adding, {}
        for cmd in adding.values():
            cmd.answer(None, error)
        self._streams.fail_all(error)
        self._drained = error
        self._commands.fail_all(error)
