"""What the async engine front reports to its stat loggers (vLLM v1's ``IterationStats``).

``IterationStats`` is built once per engine step from the outputs of that step, with
wall-clock times taken by the front (``time.monotonic``, seconds); ``EngineSnapshot`` is
the engine's state after the step. Both are plain values: a stat logger never reaches into
the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from manylora.lora.cache_report import LoRACacheStats
from manylora.scheduler.kv_cache_manager import KVCacheStats


@dataclass(frozen=True)
class FinishedRequestStats:
    """One request that ended during the step.

    Attributes:
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"``.
        e2e_latency: seconds from arrival (``AsyncLLM.generate`` called) to its end.
        num_prompt_tokens: tokens of its prompt.
        num_generation_tokens: tokens it generated.
        lora_name: its adapter's name, None for the base model.
        first_token_latency: seconds from arrival to its first token, None when it got none.
        queue_time: seconds from arrival to the scheduler first running it (vLLM's
            ``queued_time``); to its end when it never ran.
        prefill_time: seconds from the scheduler first running it to its first token
            (vLLM's ``prefill_time``); 0 when it got no token.
        decode_time: seconds from its first token to its last (vLLM's ``decode_time``).
        inference_time: seconds from the scheduler first running it to its last token
            (vLLM's ``inference_time``, prefill + decode).
        max_tokens: its ``SamplingParams.max_tokens``, None when unset.
    """

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    lora_name: str | None = None
    first_token_latency: float | None = None
    queue_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    inference_time: float = 0.0
    max_tokens: int | None = None


@dataclass
class IterationStats:
    """Tokens and latencies of one engine step.

    Attributes:
        num_prompt_tokens: prompt tokens of the requests that got their first token.
        num_generation_tokens: tokens generated in the step, over all requests.
        time_to_first_tokens: seconds from arrival to the first token, one per request that
            got its first token.
        inter_token_latencies: seconds between a request's previous token and this one, one
            per request that got a second or later token.
        finished: the requests that ended (finished, stopped or aborted).
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state, published after every step.

    Attributes:
        num_running: requests in the running batch.
        num_waiting: requests waiting to join it (preempted ones included), plus requests
            accepted by the front that the engine has not taken in yet.
        max_loras: device adapter slots (0 when LoRA is off).
        running_lora_adapters: names of the adapters of running requests, sorted.
        waiting_lora_adapters: names of the adapters of waiting requests, sorted.
        kv: the KV cache's state and counters (``LLMEngine.kv_cache_stats``).
        lora: the adapter cache's counters (``LLMEngine.lora_cache_stats``).
    """

    num_running: int = 0
    num_waiting: int = 0
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    kv: KVCacheStats = field(default_factory=KVCacheStats)
    lora: LoRACacheStats = field(default_factory=LoRACacheStats)
