"""A request's life in the engine: its tokens, its progress and its state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from manylora.lora_request import LoRARequest
from manylora.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(eq=False)
class Request:
    """One generation request.

    Attributes:
        token_ids: prompt then output tokens; ``token_ids[:num_computed_tokens]`` have their
            K/V in the cache.
        num_prompt_tokens: the prompt's length in tokens.
        num_computed_tokens: tokens whose K/V the cache holds (reset to 0 on preemption: the
            request keeps its tokens and is re-prefilled, TurboMind's eviction to token ids).
        num_cached_tokens: prompt tokens whose K/V the prefix cache held when the request
            was first scheduled (vLLM's ``num_cached_tokens``); -1 until then.
        max_total_tokens: prompt + output cap in tokens (max_tokens and max_model_len).
        lora_digest: the digest of the adapter's weights (None for the base model): with
            the adapter's id, what its cached state is keyed by, KV blocks included.
        session_id: the multi-turn session the request is a turn of, or None. A turn's
            ``token_ids`` start with the session's history (every earlier prompt and
            output), so ``num_prompt_tokens`` counts the history too.
        block_hashes: the prefix-cache hashes of the full blocks of ``token_ids`` so far
            (filled by the KV cache manager, ``core.block_pool.extend_block_hashes``).
        eos_token_ids: the ids that end generation unless ``ignore_eos``.
        num_output_placeholders: tokens scheduled steps will sample for the request that
            have not reached the host yet (async scheduling: at most 2 between a step's
            launch and the previous step's outputs, else 0 or 1).
        adapter_pending: its adapter's first read is in flight: ``lora_digest`` is not
            known yet, so the request is neither scheduled nor hashed into the prefix cache
            until the engine sets both (``EngineCore._poll_adapters``).
        client_group: the fairness group: the requests one client call fanned out to (the
            server: the HTTP request's id, shared by its prompts x n children; one
            ``LLM.generate`` call); None: the request is a group of its own.
        prompt_logprobs_next: the next prompt position whose prompt log-probability the
            core reports (``SamplingParams.prompt_logprobs``; starts at 1, the first
            position has none): entries of positions below it, computed again after a
            preemption, are dropped.
        cache_salt: salts the request's prefix-cache hashes (vLLM's ``cache_salt``), or
            None.
        long_rope: the model's RoPE is ``longrope`` and the request holds more tokens than
            its ``original_max_position_embeddings``, so every key of the request rotates
            with the long factors (``model.layers.rotary.rope_rows``; set when it is built
            or when it grows past that length, ``Scheduler``): its prefix-cache hashes are
            kept apart from those of shorter sequences, whose keys rotate the short way.
        lora_start: the first position the adapter's weights apply to (``alora_start``): 0
            for a plain adapter and the base model; an activated adapter's (aLoRA) is the
            start of the last invocation sequence in the prompt, set with ``lora_digest``;
            earlier tokens run as the base model.
        group_key: what the scheduler groups by (set from ``client_group``, or the request
            id when it is None; a group name never merges with a lone request's id).
        scheduled_time: when the scheduler first took it into the running batch
            (``time.monotonic``, seconds; a preemption does not reset it), None before
            (vLLM's ``scheduled_ts``: where queue time ends and prefill time starts).
    """

    request_id: str
    prompt: str | None
    token_ids: list[int]
    sampling_params: SamplingParams
    lora_request: LoRARequest | None
    max_total_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    lora_digest: str | None = None
    session_id: str | None = None
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    eos_token_ids: frozenset[int] = frozenset()
    num_output_placeholders: int = 0
    adapter_pending: bool = False
    scheduled_time: float | None = None
    client_group: str | None = None
    prompt_logprobs_next: int = 1
    cache_salt: str | None = None
    long_rope: bool = False
    lora_start: int = 0

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        self.group_key: tuple[bool, str] = (
            (True, self.client_group) if self.client_group is not None
            else (False, self.request_id))

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request else 0

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt positions whose log-probabilities were not reported yet remain
        (then its prompt must be computed, not taken from the prefix cache)."""
        return (self.sampling_params.prompt_logprobs is not None
                and self.prompt_logprobs_next < self.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
