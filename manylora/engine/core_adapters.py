"""The engine core's adapter bookkeeping over ``LoRAManager``'s public methods: requests
whose adapter is still on disk, ``add_lora_async`` futures, ``remove_lora`` calls that wait
for the adapter's last request, the binding of a step's adapters to slots, and the end of
the requests of an adapter that failed to load."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from manylora.engine.protocol import EngineCoreOutput, FinishReason
from manylora.engine.serial import ErrorInfo
from manylora.lora.cache_report import AdapterLoadError
from manylora.lora.manager import LoRAManager
from manylora.lora_request import LoRARequest, alora_start
from manylora.request import Request, RequestStatus
from manylora.scheduler.scheduler import Scheduler
from manylora.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class CoreAdapters:
    """What the engine core keeps about adapters besides ``LoRAManager``.

    Args:
        manager: the adapters' ``LoRAManager``.
        scheduler, structured: the core's ``Scheduler`` and ``StructuredOutputManager``
            (the requests it holds).
        finish: ends requests (``EngineCore._finish``: their references, grammars and
            blocks go back).
    """

    def __init__(self, manager: LoRAManager, scheduler: Scheduler,
                 structured: StructuredOutputManager,
                 finish: Callable[[list[str], RequestStatus], None]) -> None:
        self.manager = manager
        self._scheduler = scheduler
        self._structured = structured
        self._finish = finish
        # adapters on disk only when requests for them arrived: {lora_int_id: {request id:
        # (request, arrival)}}, until the adapter is in host memory
        self._awaiting: dict[int, dict[str, tuple[Request, float]]] = {}
        self._futures: dict[int, list[Future]] = {}   # add_lora calls awaiting a read
        self.pending_removals: set[int] = set()

    def wait(self, req: Request) -> None:
        """Count ``req`` as waiting for its adapter's read from now on."""
        self._awaiting.setdefault(req.lora_int_id, {})[req.request_id] = (req, time.monotonic())

    def add_lora_async(self, lora_request: LoRARequest) -> Future:
        """Start reading an adapter into the host cache (``EngineCore.add_lora_async``); a
        future of True, answered by ``poll``."""
        lid = lora_request.lora_int_id
        digest = self.manager.add(lora_request)
        self.manager.release(lid)
        future: Future = Future()
        if digest is not None:
            future.set_result(True)
        else:
            self._futures.setdefault(lid, []).append(future)
        return future

    def poll(self) -> list[EngineCoreOutput]:
        """Take in the loader threads' work: adapters whose first read finished give their
        waiting requests the digest (before any of them is scheduled, so every block hash
        is rooted in it) and answer their futures; requests of adapters whose read failed
        end with the error; requests whose adapter reached host memory are counted as
        having waited for it."""
        outputs: list[EngineCoreOutput] = []
        events = self.manager.poll()
        for lid, digest in events.ready.items():
            invocation = self.manager.invocation_tokens(lid)
            for req, _ in self._awaiting.get(lid, {}).values():
                if self.is_live(req):
                    req.lora_digest, req.adapter_pending = digest, False
                    req.lora_start = alora_start(req.token_ids[:req.num_prompt_tokens],
                                                 invocation)
            for future in self._futures.pop(lid, []):
                future.set_result(True)
        for error in events.failed:
            outputs.extend(self.end_requests(error))
            self._awaiting.pop(error.lora_int_id, None)
            for future in self._futures.pop(error.lora_int_id, []):
                future.set_exception(error.cause or error)
        if self._awaiting:
            self._count_waits()
        return outputs

    def _count_waits(self) -> None:
        """Requests that waited for their adapter's read: counted once it is in host
        memory (or once they end)."""
        now = time.monotonic()
        manager = self.manager
        count, seconds = 0, 0.0
        for lid in [lid for lid in self._awaiting if manager.is_ready(lid)]:
            for req, since in self._awaiting.pop(lid).values():
                if self.is_live(req):
                    count += 1
                    seconds += now - since
        if count:
            manager.record_wait(count, seconds)

    def remove(self, lora_int_id: int) -> bool:
        """``EngineCore.remove_lora``: True when the adapter is gone now (its waiting
        futures fail), False while requests still use it (``remove_unused`` retries)."""
        if self.manager.remove(lora_int_id):
            self.pending_removals.discard(lora_int_id)
            self._awaiting.pop(lora_int_id, None)        # only ended requests were left
            for future in self._futures.pop(lora_int_id, []):
                future.set_exception(ValueError(
                    f"adapter {lora_int_id} was removed (remove_lora) before its read ended"))
            return True
        self.pending_removals.add(lora_int_id)
        return False

    def remove_unused(self) -> None:
        """Remove the adapters ``remove`` left pending whose last request has ended."""
        for lid in list(self.pending_removals):
            if self.manager.remove(lid):
                self.pending_removals.discard(lid)

    def activate(self) -> tuple[dict[int, int], list[EngineCoreOutput]]:
        """Bind the adapters of the running batch to slots (``LoRAManager.activate``):
        ``({lora_int_id: slot}, [])``; ``({}, outputs)`` when one that loaded once failed
        to reload (files removed or changed): its requests end, and the next step re-plans
        the others."""
        wanted = {r.lora_int_id: r.lora_request for r in self._scheduler.running
                  if r.lora_int_id}
        try:
            return self.manager.activate(wanted.values()), []
        except AdapterLoadError as e:
            return {}, self.end_requests(e)

    def end_requests(self, error: AdapterLoadError) -> list[EngineCoreOutput]:
        """End every request of an adapter that failed to load, with the error (its cause,
        e.g. ``LoRAAdapterError``, travels to the front as ``ErrorInfo``)."""
        logger.error("adapter %d: %s; its requests end with the error", error.lora_int_id,
                     error)
        ids = [r.request_id for r in self._scheduler.requests.values()
               if r.lora_int_id == error.lora_int_id]
        ids += [r.request_id for r in self._structured.held_requests()
                if r.lora_int_id == error.lora_int_id]
        self._finish(ids, RequestStatus.FINISHED_ABORTED)
        info = ErrorInfo.of(error.cause or error)
        return [EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error=info)
                for rid in ids]

    def is_live(self, req: Request) -> bool:
        """Whether ``req`` is still the core's (queued, running, or held for its grammar),
        not an ended request whose id came back."""
        rid = req.request_id
        return self._scheduler.requests.get(rid) is req or self._structured.held(rid) is req
