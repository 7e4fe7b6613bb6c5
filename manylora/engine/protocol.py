"""What crosses between the engine's front (``LLMEngine``: tokenizer, detokenizer, stop
strings, ``RequestOutput``) and its core (``EngineCore``: scheduler, KV cache, adapters,
model runner), after vLLM v1's ``EngineCoreRequest`` / ``EngineCoreOutputs``.

Only token ids travel: text, cumulative token lists and ``RequestOutput`` never do. Each
step the core reports, per request that advanced, the token ids new this step (a delta, not
the whole output), their log-probabilities when asked, and whether the core ended the
request (EOS, a stop token id, the length cap, or an abort). Stop strings are the front's
business: it finds them in the text and aborts the request in the core.

When the core runs in its own process (``engine/core_proc.py``), each message is a ZMQ
multipart ``[type, msgpack body]`` (``engine/serial.py``): :class:`RequestType` front →
core, :class:`ReplyType` core → front, in order on one socket each way.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from manylora.engine.serial import ErrorInfo
from manylora.lora.cache_report import LoRACacheStats
from manylora.lora_request import LoRARequest
from manylora.sample.logprobs import TokenLogprobs
from manylora.sample.prompt_logprobs import PromptLogprobs
from manylora.sampling_params import SamplingParams
from manylora.scheduler.kv_cache_manager import KVCacheStats


class EngineDeadError(RuntimeError):
    """The engine core stopped (shut down, a failed step, or its process died); nothing
    more is served."""


class FinishReason(enum.Enum):
    """Why the core ended a request (the OpenAI ``finish_reason`` strings)."""

    STOP = "stop"          # EOS or a stop token id (the front adds stop strings)
    LENGTH = "length"      # max_tokens or the context length
    ABORT = "abort"        # aborted by the caller (or the front)
    ERROR = "error"        # the core could not serve it: ``EngineCoreOutput.error`` says why


@dataclass
class EngineCoreRequest:
    """A tokenized request for the core.

    Attributes:
        request_id: unique among live requests.
        prompt_token_ids: the prompt's ids (a session turn: only the turn's new tokens;
            the core prepends the session's history).
        sampling_params: validated ``SamplingParams``.
        lora_request: the adapter, None for the base model.
        eos_token_ids: the ids that end generation unless ``ignore_eos`` (the generation
            config's and the tokenizer's EOS, gathered by the front).
        session_id: the multi-turn session the request is a turn of, or None.
        arrival_time: ``time.monotonic()`` when the front accepted it, seconds.
        client_group: the fairness group the request belongs to: the id of the client
            call that fanned out to it (the server's HTTP request id for its prompts x n
            children, one ``LLM.generate`` call); None: a group of its own. The scheduler
            shares the running batch between groups (``SchedulerConfig.scheduling_policy``).
        cache_salt: salts the request's prefix-cache hashes, so that only requests with the
            same salt share cached blocks (vLLM's ``cache_salt``); None: unsalted.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    lora_request: LoRARequest | None = None
    eos_token_ids: frozenset[int] = frozenset()
    session_id: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    client_group: str | None = None
    cache_salt: str | None = None


@dataclass
class EngineCoreOutput:
    """One request's progress in one step.

    Attributes:
        request_id: the request.
        new_token_ids: the tokens sampled for it this step, in order (empty when the
            request was ended without a token, e.g. an adapter that failed to load).
        new_logprobs: one ``TokenLogprobs`` per new token when the request's
            ``SamplingParams.logprobs`` is set, else None.
        finish_reason: None while the core keeps running the request.
        stop_reason: the stop token id that ended it (``FinishReason.STOP`` on a stop token
            id), else None.
        error: with ``FinishReason.ERROR``, why the core could not serve the request (its
            adapter's read failed: ``LoRAAdapterError`` for bad weights,
            ``FileNotFoundError`` for files gone, ...), raised again by the front as that
            class; else None.
        new_prompt_logprobs: with ``SamplingParams.prompt_logprobs``, the prompt
            log-probabilities of the positions this step computed (numpy arrays,
            ``sample.prompt_logprobs.PromptLogprobs``; in position order over the steps,
            none twice), else None. A prefill chunk that samples nothing reports them with
            ``new_token_ids`` empty.
        num_cached_tokens: the prompt tokens the prefix cache held when the request was
            first scheduled (``Request.num_cached_tokens``; 0 on outputs without a token).
        scheduled_time: with the request's first token, when the scheduler first ran it
            (``Request.scheduled_time``, ``time.monotonic`` seconds of the core's host,
            which the front shares), else None.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    error: ErrorInfo | None = None
    new_prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    scheduled_time: float | None = None


@dataclass(frozen=True)
class SchedulerStats:
    """The core's state after a step: what the front's metrics and its waiting bound read.

    Attributes:
        num_running: requests in the running batch.
        num_waiting: requests waiting to join it (preempted ones included).
        running_lora_adapters: names of the adapters of running requests, sorted.
        waiting_lora_adapters: names of the adapters of waiting requests, sorted.
        kv: the KV cache's state and counters.
        lora: the adapter cache's counters.
    """

    num_running: int = 0
    num_waiting: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    kv: KVCacheStats = field(default_factory=KVCacheStats)
    lora: LoRACacheStats = field(default_factory=LoRACacheStats)


@dataclass
class EngineCoreOutputs:
    """Everything one core step reports.

    Attributes:
        outputs: one entry per request that got tokens or ended this step.
        scheduler_stats: the core's state after the step, when the core sends it (its own
            process does, every message); None otherwise.
    """

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None


class RequestType(bytes, enum.Enum):
    """The first frame of a front → core message; the body's type follows the name."""

    ADD = b"\x00"            # list[EngineCoreRequest]
    ABORT = b"\x01"          # AbortRequests
    UTILITY = b"\x02"        # UtilityCall
    SHUTDOWN = b"\x03"       # no body


class ReplyType(bytes, enum.Enum):
    """The first frame of a core → front message."""

    READY = b"\x10"          # CoreInfo, once, after start-up
    ADD_RESULT = b"\x11"     # list[AddResult], per ADD, before any output of its requests
    UTILITY_RESULT = b"\x12"  # UtilityResult
    OUTPUTS = b"\x13"        # EngineCoreOutputs
    DEAD = b"\x14"           # ErrorInfo: start-up or a step failed; the process exits


@dataclass
class AbortRequests:
    """End requests (``EngineCore.abort_requests``)."""

    request_ids: list[str]
    reason: FinishReason = FinishReason.ABORT


@dataclass
class UtilityCall:
    """Call ``EngineCore.<method>(*args)``; the answer comes as a ``UtilityResult`` with
    the same ``call_id``: at once, or, for the methods in ``DEFERRED_UTILITY_METHODS``,
    when the work it started ends (steps go on meanwhile; answers may come out of order)."""

    call_id: int
    method: str
    args: list[Any] = field(default_factory=list)


@dataclass
class UtilityResult:
    call_id: int
    result: Any = None
    error: ErrorInfo | None = None


@dataclass
class AddResult:
    """The core's answer to an ``EngineCoreRequest``: the session history it prepended
    (empty without a session), or why it refused the request."""

    request_id: str
    history: list[int] = field(default_factory=list)
    error: ErrorInfo | None = None


@dataclass
class AddDone:
    """The front-side form of an ``AddResult``: the exception itself, not its record."""

    request_id: str
    history: list[int] = field(default_factory=list)
    error: Exception | None = None


@dataclass
class CoreInfo:
    """What the front needs to know of a core that started.

    Attributes:
        max_model_len: the context length in tokens (the KV cache may have lowered it).
        vocab_size: the model's vocabulary.
        max_loras: adapter slots (0 when LoRA is off).
        num_gpu_blocks: KV-cache blocks on the device.
    """

    max_model_len: int
    vocab_size: int
    max_loras: int
    num_gpu_blocks: int = 0


#: The ``EngineCore`` methods the front may call: the types of their arguments and of
#: their result.
UTILITY_METHODS: dict[str, tuple[tuple[type, ...], type]] = {
    "add_lora": ((LoRARequest,), bool),
    "remove_lora": ((int,), bool),
    "end_session": ((str,), bool),
    "kv_cache_stats": ((), KVCacheStats),
    "lora_cache_stats": ((), LoRACacheStats),
    "scheduler_stats": ((), SchedulerStats),
}

#: Utility methods answered when their work ends, not when called: the core calls
#: ``EngineCore.<name>`` (which returns a ``concurrent.futures.Future``) and keeps stepping.
DEFERRED_UTILITY_METHODS: dict[str, str] = {"add_lora": "add_lora_async"}
