"""The engine core in the front's process, called directly (vLLM v1's ``InprocClient``):
for tests and debugging, or with ``MANYLORA_ENABLE_MULTIPROCESSING=0``. Same interface as
``MPClient`` (``engine/core_client.py``)."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

from manylora.engine.arg_utils import EngineArgs
from manylora.engine.core import EngineCore
from manylora.engine.protocol import (
    DEFERRED_UTILITY_METHODS,
    UTILITY_METHODS,
    AddDone,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)


class InprocClient:
    """The core in this process, called directly.

    Attributes:
        engine_core: the ``EngineCore`` (its scheduler, runner and adapter cache are there
            for tests and debugging).
        info: its ``CoreInfo``.
    """

    in_process = True

    def __init__(self, args: EngineArgs) -> None:
        self.engine_core = EngineCore(args)
        self.info = self.engine_core.info()
        self._results: deque[AddDone | EngineCoreOutputs] = deque()
        self._wakeup = threading.Event()
        self.engine_core.set_load_notify(self._wakeup.set)
        self._calls: list[Future] = []
        self._closed = False

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            try:
                history = self.engine_core.add_request(request)
            except Exception as e:
                self._results.append(AddDone(request.request_id, error=e))
            else:
                self._results.append(AddDone(request.request_id, history))

    def abort_requests(self, request_ids: list[str],
                       reason: FinishReason = FinishReason.ABORT) -> None:
        self.engine_core.abort_requests(request_ids, reason)

    def call(self, method: str, *args: Any) -> Any:
        """``EngineCore.<method>(*args)``, for the methods its own process offers too (a
        deferred one, ``add_lora``, steps the core until it is answered; the steps'
        outputs are kept for ``get_messages``).

        Raises:
            ValueError: ``method`` is not in ``UTILITY_METHODS``.
            Exception: what the method raised.
        """
        future = self.call_async(method, *args)
        while not future.done():
            self._results.extend(self._step(block=True))
        return future.result()

    def call_async(self, method: str, *args: Any) -> Future:
        """``EngineCore.<method>(*args)`` as a ``concurrent.futures.Future``: a deferred
        method's (``DEFERRED_UTILITY_METHODS``) is answered by a later ``get_messages``
        (the step that takes its work in), any other's at once.

        Raises:
            ValueError: ``method`` is not in ``UTILITY_METHODS``.
        """
        if method not in UTILITY_METHODS:
            raise ValueError(f"the engine core has no method {method!r} to call")
        deferred = DEFERRED_UTILITY_METHODS.get(method)
        future: Future = Future()
        try:
            if deferred is not None:
                future = getattr(self.engine_core, deferred)(*args)
                if not future.done():
                    self._calls.append(future)
            else:
                future.set_result(getattr(self.engine_core, method)(*args))
        except Exception as e:
            future.set_exception(e)
        return future

    def has_pending_calls(self) -> bool:
        """Whether a deferred utility call is still unanswered."""
        self._calls = [f for f in self._calls if not f.done()]
        return bool(self._calls)

    def get_messages(self, block: bool) -> list[AddDone | EngineCoreOutputs]:
        """Pending add results, else one step's outputs when the core has work. A step
        always runs to its end; ``block`` waits only while nothing can run before an
        adapter read ends (for that read, or a ``wake``)."""
        if self._results:
            results = list(self._results)
            self._results.clear()
            return results
        return self._step(block)

    def _step(self, block: bool) -> list[EngineCoreOutputs]:
        core = self.engine_core
        self._wakeup.clear()       # set again by every read that ends, or a wake(), from now
        if block and not core.has_finished_reads() and (core.waiting_on_reads() or (
                not core.has_unfinished_requests() and self.has_pending_calls())):
            self._wakeup.wait()
        if core.has_unfinished_requests():
            return [core.step()]
        if core.has_pending_loads() or self._calls:
            outputs = core.poll_adapters()
            return [outputs] if outputs.outputs else []
        return []

    def wake(self) -> None:
        """End a ``get_messages`` waiting for an adapter read (any thread)."""
        self._wakeup.set()

    def shutdown(self) -> None:
        """Stop the core's workers and loader threads (idempotent)."""
        if not self._closed:
            self._closed = True
            self.engine_core.shutdown()
