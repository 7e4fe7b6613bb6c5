"""The front's handle on the engine core (vLLM v1's ``EngineCoreClient``): in this process
(``InprocClient``, for tests and debugging) or in a process of its own (``MPClient``, the
default), behind one interface.

Requests (a list per message: the core takes them all in before its next step) and aborts
are sent without waiting. What comes back is a stream of messages, in
the order the core produced them: an ``AddResult`` for every request sent (before any of
its outputs) and ``EngineCoreOutputs`` per step. ``call`` runs one of the core's utility
methods and waits for its answer; messages that arrive meanwhile are kept, in order, for
the next ``get_messages``. ``call_async`` does not wait: its future is answered by the
``get_messages`` that receives the answer (``add_lora`` reads on the core's loader threads
while the core keeps stepping).

``MANYLORA_ENABLE_MULTIPROCESSING=0`` keeps the core in the caller's process (as vLLM's
``VLLM_ENABLE_V1_MULTIPROCESSING``).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any, Protocol

from manylora.engine.arg_utils import EngineArgs
from manylora.engine.inproc_client import InprocClient
from manylora.engine.mp_client import MPClient
from manylora.engine.protocol import (
    AddDone,
    CoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)


class EngineCoreClient(Protocol):
    """What the front asks of the engine core, wherever it runs.

    Attributes:
        in_process: whether the core runs in this process.
        info: the started core's ``CoreInfo``.
    """

    in_process: bool
    info: CoreInfo

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Send requests; the core takes them all in before its next step."""

    def abort_requests(self, request_ids: list[str],
                       reason: FinishReason = FinishReason.ABORT) -> None:
        """End requests in the core; unknown ids are ignored."""

    def call(self, method: str, *args: Any) -> Any:
        """Run ``EngineCore.<method>(*args)`` and wait for its answer."""

    def call_async(self, method: str, *args: Any) -> Future:
        """Run ``EngineCore.<method>(*args)`` without waiting."""

    def has_pending_calls(self) -> bool:
        """Whether a call is still unanswered."""

    def get_messages(self, block: bool) -> list[AddDone | EngineCoreOutputs]:
        """The core's answers to adds and its steps' outputs, in order."""

    def wake(self) -> None:
        """End a blocked ``get_messages`` (any thread)."""

    def shutdown(self) -> None:
        """Stop the core (idempotent)."""


def multiprocessing_enabled() -> bool:
    """Whether the core runs in its own process (``MANYLORA_ENABLE_MULTIPROCESSING``,
    default on)."""
    return os.environ.get("MANYLORA_ENABLE_MULTIPROCESSING", "1") not in ("0", "false", "")


def make_client(args: EngineArgs, in_process: bool | None = None) -> EngineCoreClient:
    """The core for ``args``, started: in this process with ``in_process`` True (vLLM's
    ``--disable-frontend-multiprocessing``), in its own with False; None: in its own unless
    ``MANYLORA_ENABLE_MULTIPROCESSING`` turns multiprocessing off.

    Raises:
        CheckpointError, ValueError, FileNotFoundError: the core could not start (raised
            again here from the core process).
    """
    if in_process is None:
        in_process = not multiprocessing_enabled()
    return InprocClient(args) if in_process else MPClient(args)
