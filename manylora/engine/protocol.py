"""What crosses between the engine's front (``LLMEngine``: tokenizer, detokenizer, stop
strings, ``RequestOutput``) and its core (``EngineCore``: scheduler, KV cache, adapters,
model runner), after vLLM v1's ``EngineCoreRequest`` / ``EngineCoreOutputs``.

Only token ids travel: text, cumulative token lists and ``RequestOutput`` never do. Each
step the core reports, per request that advanced, the token ids new this step (a delta, not
the whole output), their log-probabilities when asked, and whether the core ended the
request (EOS, a stop token id, the length cap, or an abort). Stop strings are the front's
business: it finds them in the text and aborts the request in the core.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from manylora.core.kv_cache_manager import KVCacheStats
from manylora.lora.manager import LoRACacheStats
from manylora.lora.request import LoRARequest
from manylora.sample.sampler import TokenLogprobs
from manylora.sampling_params import SamplingParams


class FinishReason(enum.Enum):
    """Why the core ended a request (the OpenAI ``finish_reason`` strings)."""

    STOP = "stop"          # EOS or a stop token id (the front adds stop strings)
    LENGTH = "length"      # max_tokens or the context length
    ABORT = "abort"        # aborted, or its adapter could not be reloaded


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
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    lora_request: LoRARequest | None = None
    eos_token_ids: frozenset[int] = frozenset()
    session_id: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass
class EngineCoreOutput:
    """One request's progress in one step.

    Attributes:
        request_id: the request.
        new_token_ids: the tokens sampled for it this step, in order (empty when the
            request was ended without a token, e.g. an adapter that failed to reload).
        new_logprobs: one ``TokenLogprobs`` per new token when the request's
            ``SamplingParams.logprobs`` is set, else None.
        finish_reason: None while the core keeps running the request.
        stop_reason: the stop token id that ended it (``FinishReason.STOP`` on a stop token
            id), else None.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    """

    outputs: list[EngineCoreOutput] = field(default_factory=list)
