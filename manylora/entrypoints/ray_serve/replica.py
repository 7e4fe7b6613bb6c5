"""An engine replica of ``manylora serve-ray``: one whole ``manylora serve`` server (engine,
tokenizer, routes) inside a Ray Serve replica.

The ingress forwards each HTTP request here through a streaming deployment handle whose
``multiplexed_model_id`` is the request's adapter (:meth:`EngineReplica.forward`). Ray Serve's
model multiplexing then routes by what each replica reports holding: the replica marks an
adapter in its ``@serve.multiplexed`` cache each time it serves one, and that cache is as large
as the engine's host cache (``max_cpu_loras``, which holds every adapter in a GPU slot too), so
the ids a replica reports are the adapters most likely still in its slots or host memory.
The cache entries are markers only: the engine's own LoRA cache decides residency, as on a
single server.

A background task long-polls the control replica (``control.py``): it reports this replica's
metrics and applies the run-time adapter loads and unloads every replica must make.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from prometheus_client import generate_latest
from ray import serve

from manylora.engine.arg_utils import EngineArgs
from manylora.entrypoints.openai.errors import OpenAIError
from manylora.entrypoints.openai.launcher import Server, create_server
from manylora.entrypoints.ray_serve.args import serve_ray_parser
from manylora.entrypoints.ray_serve.bridge import (
    REPLICA_HEADER,
    HTTPRequest,
    ResponseHead,
    call_asgi,
)
from manylora.entrypoints.ray_serve.control import POLL_S, AdapterEntry, DesiredAdapters

logger = logging.getLogger(__name__)


class _AdapterMarker:
    """What the ``@serve.multiplexed`` cache holds for an adapter: its name only."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class EngineReplica:
    """A Ray Serve deployment class: one engine and its OpenAI-compatible app.

    Args:
        argv: ``manylora serve-ray``'s flags (the same list every replica gets; the Ray
            ones are not the engine's concern).
        control: a handle to the :class:`~manylora.entrypoints.ray_serve.control.
            AdapterControl` deployment.

    Raises:
        ValueError: a bad flag (as ``manylora serve`` refuses it); Ray Serve reports the
            deployment as failed.
    """

    async def __init__(self, argv: list[str], control) -> None:
        args = serve_ray_parser().parse_args(argv)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._header = ((REPLICA_HEADER.encode(), self.replica_id.encode()),)
        self.server: Server = await asyncio.to_thread(create_server, args)
        self._static = {m.name: m.path for m in self.server.models.static_loras}
        held = EngineArgs.from_cli_args(args).max_cpu_loras

        async def mark(name: str) -> _AdapterMarker:
            return _AdapterMarker(name)

        self._mark = serve.multiplexed(max_num_models_per_replica=held)(mark)
        self._control = control
        self._desired: DesiredAdapters | None = None
        self._wake = asyncio.Event()
        self._received: tuple[str, int] = ("", -1)        # (epoch, version) given to us
        self._applied: dict[str, tuple[str, int]] = {}     # name → (epoch, version)
        self._applied_version = ("", -1)
        self._errors: dict[int, tuple[int, str]] = {}
        self._tasks = [asyncio.ensure_future(self._follow_control()),
                       asyncio.ensure_future(self._apply_changes())]

    async def forward(self, request: HTTPRequest, adapter: str
                      ) -> AsyncIterator[ResponseHead | bytes]:
        """Serve one HTTP request with this replica's app: yield the response head (with
        the ``x-manylora-replica`` header), then its body chunks.

        Args:
            request: the request as the ingress received it.
            adapter: the adapter the body's ``model`` names ("" for the base model or no
                model); it is marked in the multiplexed cache once this replica serves it.
        """
        known = adapter and adapter in self.server.models.loras
        if known:
            await self._mark(adapter)
        async for part in call_asgi(self.server.app, request, self._header):
            if (isinstance(part, ResponseHead) and adapter and not known
                    and part.status < 400 and adapter in self.server.models.loras):
                await self._mark(adapter)       # loaded by the resolver for this request
            yield part

    def check_health(self) -> None:
        """Ray Serve's health check: the replica is unhealthy once its engine has stopped
        (its core died); Ray Serve then replaces it.

        Raises:
            RuntimeError: the engine is not running.
        """
        if not self.server.engine.is_running:
            raise RuntimeError(f"replica {self.replica_id}: the engine has stopped")

    def __del__(self) -> None:
        for task in getattr(self, "_tasks", ()):
            task.cancel()
        server = getattr(self, "server", None)
        if server is not None:
            server.shutdown()

    def _runtime_adapters(self) -> dict[str, str]:
        """The adapters this replica serves that its flags did not give it (name → path)."""
        return {name: s.shown_path for name, s in self.server.models.loras.items()
                if self._static.get(name) != s.shown_path}

    async def _poll(self, wait: bool) -> None:
        """One call of the control replica's ``poll``: report, then take what it returns."""
        epoch, received = self._received
        applied_epoch, applied = self._applied_version
        errors = dict(self._errors)
        desired: DesiredAdapters = await self._control.poll.remote(
            self.replica_id, epoch, received, applied if applied_epoch == epoch else -1,
            generate_latest(self.server.registry).decode(), errors,
            self._runtime_adapters() if not epoch else None,
            list(self.server.models.loras), wait)
        for version in errors:              # the control replica has them now
            self._errors.pop(version, None)
        epoch, received = self._received    # a concurrent call may have moved them on
        if desired.epoch != epoch:
            epoch, received = desired.epoch, -1
            self._errors.clear()
        if desired.version > received:
            received = desired.version
            self._desired = desired
            self._wake.set()
        self._received = (epoch, received)

    async def _follow_control(self) -> None:
        while True:
            try:
                await self._poll(wait=True)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the control replica restarting
                logger.warning("replica %s: the control replica did not answer: %s",
                               self.replica_id, e)
                await asyncio.sleep(POLL_S)

    async def _apply_changes(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            desired = self._desired
            for name, entry in sorted(desired.adapters.items(), key=lambda e: e[1].version):
                if self._applied.get(name) == (desired.epoch, entry.version):
                    continue
                error = await self._apply(name, entry)
                if error is not None:
                    self._errors[entry.version] = error
                self._applied[name] = (desired.epoch, entry.version)
            self._applied_version = (desired.epoch, desired.version)
            try:                # say so now: the long poll waits for the next change
                await self._poll(wait=False)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the next long poll reports it
                logger.warning("replica %s: the control replica did not answer: %s",
                               self.replica_id, e)

    async def _apply(self, name: str, entry: AdapterEntry) -> tuple[int, str] | None:
        """Bring ``name`` to ``entry`` on this replica: (status, message) when it cannot."""
        models = self.server.models
        if entry.origin == self.replica_id:
            return None
        try:
            if entry.path is None:
                if name in models.loras:
                    await models.unload_lora_adapter(name)
            else:
                await models.load_lora_adapter(name, entry.path,
                                               load_inplace=name in models.loras)
        except OpenAIError as e:
            logger.warning("replica %s: adapter %r: %s", self.replica_id, name, e.message)
            return e.status, e.message
        except Exception as e:  # noqa: BLE001 - reported to the caller, the loop goes on
            logger.exception("replica %s: adapter %r", self.replica_id, name)
            return 500, f"{type(e).__name__}: {e}"
        return None
