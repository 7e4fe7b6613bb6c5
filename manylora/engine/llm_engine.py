"""``LLMEngine``: the engine's front. Text in, ``RequestOutput`` out, over an ``EngineCore``
that works on token ids (vLLM v1's ``LLMEngine`` over its engine core).

The front tokenizes and checks a request, hands the core an ``EngineCoreRequest``, and
turns each step's per-request deltas (new token ids, their log-probabilities, the core's
finish reason) into text and ``RequestOutput``s in its ``OutputProcessor``: incremental
detokenization, stop strings (a request that hits one is aborted in the core), per-token
log-probability dicts. The core (``engine/core.py``) schedules, runs the model and applies
the token-level stop rules.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence

import torch
from transformers import AutoTokenizer, GenerationConfig

from manylora.core.kv_cache_manager import KVCacheStats
from manylora.engine.arg_utils import EngineArgs
from manylora.engine.core import EngineCore
from manylora.engine.output_processor import OutputProcessor
from manylora.engine.outputs import RequestOutput
from manylora.engine.protocol import EngineCoreRequest, FinishReason, SchedulerStats
from manylora.engine.stats import IterationStats
from manylora.lora.manager import LoRACacheStats
from manylora.lora.request import LoRARequest
from manylora.model.hub import resolve_model_path
from manylora.sampling_params import SamplingParams


class LLMEngine:
    """The offline engine behind ``LLM``; build it with ``LLMEngine.from_engine_args``.

    Attributes:
        engine_core: the ``EngineCore`` this front drives, in this process (its scheduler,
            runner and adapter cache are there for tests and debugging).
        tokenizer: the ``transformers`` tokenizer, None with ``skip_tokenizer_init``.
        max_model_len: the context length in tokens (prompt + output).

    Bad requests (``add_request``) raise ``ValueError`` naming the problem and leave the
    engine serving every request it already accepted.
    """

    def __init__(self, args: EngineArgs) -> None:
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            tok_dir = resolve_model_path(args.tokenizer or args.model, args.revision)
            self.tokenizer = AutoTokenizer.from_pretrained(
                tok_dir, trust_remote_code=args.trust_remote_code)
        self.engine_core = EngineCore(args)
        core = self.engine_core
        self.model_config = core.model_config
        self.lora_config = core.lora_config
        self.max_model_len = core.max_model_len
        self.eos_token_ids = frozenset(self._eos_ids(core.model_dir))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._next_id = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def shutdown(self) -> None:
        """Stop the core: its tensor-parallel workers and adapter loader threads (also when
        the engine is dropped)."""
        self.engine_core.shutdown()

    def __del__(self) -> None:
        core = getattr(self, "engine_core", None)
        if core is not None:
            core.shutdown()

    def _eos_ids(self, model_dir) -> set[int]:
        ids: set[int] = set()
        try:
            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        except OSError:
            eos = getattr(self.model_config.hf_config, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """A prompt (text or ``{"prompt_token_ids": [...]}``) → ``(text, token ids)``.

        Raises:
            ValueError: a text prompt without a tokenizer, ids that are not integers, or a
                malformed prompt. (The core checks emptiness and the vocabulary.)
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer, but the engine was started "
                                 "with skip_tokenizer_init: pass {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            raw = list(prompt["prompt_token_ids"])
            not_ints = [t for t in raw if isinstance(t, bool) or not hasattr(t, "__index__")]
            if not_ints:
                raise ValueError(f"prompt_token_ids must be integers, got {not_ints[:5]}")
            return prompt.get("prompt"), [operator.index(t) for t in raw]
        raise ValueError("a prompt must be a string or {'prompt_token_ids': [...]}, got "
                         f"{type(prompt).__name__}")

    def add_request(self, request_id: str | None, prompt: str | dict,
                    params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None,
                    session_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; its id.

        With ``session_id``, the request is the next turn of that multi-turn session
        (TurboMind's interactive mode): ``prompt`` holds only the turn's new tokens, the
        session supplies its history (see ``EngineCore.add_request``); the outputs'
        ``prompt_token_ids`` include that history. ``arrival_time`` (``time.monotonic``,
        seconds; default now) is when the caller received the request, for its latencies.

        Raises:
            ValueError: a bad prompt, a prompt (with its session's history) that leaves no
                room to generate within max_model_len, a duplicate id, stop strings without
                a tokenizer, a session with a turn still in flight, a LoRA request while
                LoRA is off, or an adapter that cannot be served (``LoRAAdapterError``,
                ``FileNotFoundError``).
        """
        params = params or SamplingParams()
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self.output_processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer, but the engine was started with "
                             "skip_tokenizer_init")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        history = self.engine_core.add_request(EngineCoreRequest(
            request_id, ids, params, lora_request, self.eos_token_ids, session_id, arrival))
        self.output_processor.add(request_id, text, history + ids if history else ids,
                                  params, lora_request, arrival)
        return request_id

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the host tier ahead of its requests (vLLM's ``add_lora``).

        Raises:
            ValueError, LoRAAdapterError, FileNotFoundError: as ``add_request``.
        """
        return self.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host tier and its device slot (vLLM's ``remove_lora``).

        Returns:
            True when it is gone (or was never loaded); False while requests still use it,
            in which case nothing changes: call again when they have finished.
        """
        return self.engine_core.remove_lora(lora_int_id)

    def end_session(self, session_id: str) -> bool:
        """End a multi-turn session (``EngineCore.end_session``); False when unknown."""
        return self.engine_core.end_session(session_id)

    def kv_cache_stats(self) -> KVCacheStats:
        """The KV cache's state and counters: blocks total, used, cached and free; prefix
        queries and hits (tokens); preemptions, recomputed tokens, swapped blocks."""
        return self.engine_core.kv_cache_stats()

    def lora_cache_stats(self) -> LoRACacheStats:
        """A copy of the adapter cache's counters (hits, misses, evictions, load times)."""
        return self.engine_core.lora_cache_stats()

    def abort_request(self, request_ids: str | Sequence[str],
                      stats: IterationStats | None = None) -> None:
        """Stop requests now; their blocks go back. Unknown ids are ignored. With
        ``stats``, each one still running is counted there as finished with ``"abort"``."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self.output_processor.abort(rid, stats)
        self.engine_core.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self, stats: IterationStats | None = None) -> list[RequestOutput]:
        """Run one step; an output for every request that reports one this step (see
        ``SamplingParams.output_kind``: every step that gave it a token, or only its end).

        Args:
            stats: when given, the step's tokens, latencies and finished requests are
                added to it.
        """
        core_outputs = self.engine_core.step()
        outputs, stopped = self.output_processor.process_outputs(core_outputs.outputs, stats)
        if stopped:          # stop strings the front found: the core stops them too
            self.engine_core.abort_requests(stopped, FinishReason.STOP)
        return outputs

    def scheduler_stats(self) -> SchedulerStats:
        """The core's state now (``EngineCore.scheduler_stats``)."""
        return self.engine_core.scheduler_stats()

    @torch.inference_mode()
    def generate_all(self) -> list[RequestOutput]:
        """Step until every request has finished; the final output of each."""
        finished = []
        while self.has_unfinished_requests():
            finished.extend(o for o in self.step() if o.finished)
        return finished
