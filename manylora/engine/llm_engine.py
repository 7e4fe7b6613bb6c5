"""``LLMEngine``: the engine's front. Text in, ``RequestOutput`` out, over an engine core
that works on token ids (vLLM v1's ``LLMEngine`` over its ``EngineCoreClient``).

The front tokenizes and checks a request (``engine/input_processor.py``) and hands the core
an ``EngineCoreRequest``; the core, in its own process by default
(``engine/core_client.py``), schedules, runs the model and applies the token-level stop
rules, and sends back per-request deltas (new token ids, their log-probabilities, its
finish reason). The front's ``OutputProcessor`` turns them into text and
``RequestOutput``s: incremental detokenization, stop strings (a request that hits one is
ended in the core), per-token log-probability dicts.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from manylora.checkpoint.gguf import load_tokenizer
from manylora.checkpoint.hub import resolve_model_path
from manylora.engine.arg_utils import EngineArgs
from manylora.engine.core_client import make_client
from manylora.engine.input_processor import InputProcessor, eos_token_ids
from manylora.engine.output_processor import OutputProcessor
from manylora.engine.outputs import RequestOutput
from manylora.engine.protocol import (
    AddDone,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from manylora.engine.stats import IterationStats
from manylora.lora.cache_report import LoRACacheStats
from manylora.lora_request import LoRARequest
from manylora.sampling_params import SamplingParams
from manylora.scheduler.kv_cache_manager import KVCacheStats
from manylora.structured_params import StructuredOutputsConfig


@dataclass
class SubmittedRequest:
    """One request for ``LLMEngine.submit_requests`` (the arguments of ``add_request``)."""

    request_id: str | None
    prompt: str | dict
    params: SamplingParams | None = None
    lora_request: LoRARequest | None = None
    session_id: str | None = None
    arrival_time: float | None = None
    client_group: str | None = None


class LLMEngine:
    """The offline engine behind ``LLM``; build it with ``LLMEngine.from_engine_args``.

    Attributes:
        tokenizer: the ``transformers`` tokenizer, None with ``skip_tokenizer_init``.
        eos_token_ids: the ids that end generation (generation config and tokenizer).
        max_model_len: the context length in tokens (prompt + output).
        vocab_size: the model's vocabulary size.
        max_loras: adapter slots (0 when LoRA is off).
        num_gpu_blocks: the core's KV-cache blocks on the device.
        max_bad_words, max_structured_output_spec_bytes: the bounds of one request's
            ``bad_words`` and output constraint (``EngineArgs``'), checked before either is
            tokenized or sent to the core.
        structured_outputs_config: the server-wide ``StructuredOutputsConfig``
            (``EngineArgs.structured_outputs_config``), applied to each request's
            ``structured_outputs`` before it goes to the core.
        engine_core: the ``EngineCore`` itself when it runs in this process
            (``MANYLORA_ENABLE_MULTIPROCESSING=0``: its scheduler, runner and adapter cache
            are there for tests and debugging), else None.

    Bad requests (``add_request``) raise ``ValueError`` naming the problem and leave the
    engine serving every request it already accepted.

    Raises:
        CheckpointError, ValueError, FileNotFoundError: the model or a setting is bad.
    """

    def __init__(self, args: EngineArgs, in_process: bool | None = None) -> None:
        model_dir = resolve_model_path(args.model, args.revision, args.download_dir)
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            tok_dir = (resolve_model_path(args.tokenizer, args.revision, args.download_dir)
                       if args.tokenizer else model_dir)
            self.tokenizer = load_tokenizer(tok_dir, args.trust_remote_code,
                                            use_fast=args.tokenizer_mode != "slow")
        eos = frozenset(eos_token_ids(model_dir, self.tokenizer, args.trust_remote_code))
        self.max_bad_words = args.max_bad_words
        self.max_structured_output_spec_bytes = args.max_structured_output_spec_bytes
        self.structured_outputs_config = StructuredOutputsConfig.parse(
            args.structured_outputs_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client = make_client(args, in_process)
        info = self.client.info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.max_loras = info.max_loras
        self.num_gpu_blocks = info.num_gpu_blocks
        self.input_processor = InputProcessor(
            self.tokenizer, eos, self.vocab_size, self.max_bad_words,
            self.max_structured_output_spec_bytes, self.structured_outputs_config)
        self.engine_core = getattr(self.client, "engine_core", None)
        self._stats = SchedulerStats()
        self._outputs: deque[EngineCoreOutputs] = deque()
        self._added: dict[str, AddDone] = {}
        self._forget: set[str] = set()
        self._held: list[EngineCoreRequest] | None = None
        self._next_id = 0

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end generation: the generation config's and the tokenizer's (the
        input processor stamps them on every request)."""
        return self.input_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.input_processor.eos_token_ids = frozenset(ids)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, in_process: bool | None = None) -> LLMEngine:
        return cls(args, in_process)

    def shutdown(self) -> None:
        """Stop the core: its process, tensor-parallel workers and adapter loader threads
        (also when the engine is dropped)."""
        self.client.shutdown()

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown()

    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """A prompt (text or ``{"prompt_token_ids": [...]}``) → ``(text, token ids)``
        (``InputProcessor.tokenize``).

        Raises:
            ValueError: a text prompt without a tokenizer, ids that are not integers or lie
                outside the vocabulary, or a malformed prompt. (The core checks emptiness.)
        """
        return self.input_processor.tokenize(prompt)

    def add_request(self, request_id: str | None, prompt: str | dict,
                    params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None,
                    session_id: str | None = None, arrival_time: float | None = None,
                    client_group: str | None = None) -> str:
        """Queue a request; its id.

        With ``session_id``, the request is the next turn of that multi-turn session
        (TurboMind's interactive mode): ``prompt`` holds only the turn's new tokens, the
        session supplies its history (see ``EngineCore.add_request``); the outputs'
        ``prompt_token_ids`` include that history. ``arrival_time`` (``time.monotonic``,
        seconds; default now) is when the caller received the request, for its latencies.
        ``client_group`` names the client call the request is one of (the scheduler shares
        the batch between groups, ``SchedulerConfig.scheduling_policy``); None: a group of
        its own.

        Raises:
            ValueError: a bad prompt, a prompt (with its session's history) that leaves no
                room to generate within max_model_len, a duplicate id, stop strings without
                a tokenizer, a session with a turn still in flight, a LoRA request while
                LoRA is off, or an adapter that cannot be served (``LoRAAdapterError``,
                ``FileNotFoundError``).
            EngineDeadError: the core stopped.
        """
        rid = self.submit_request(request_id, prompt, params, lora_request, session_id,
                                  arrival_time, client_group)
        error = self.wait_added([rid])[rid]
        if error is not None:
            raise error
        return rid

    def submit_request(self, request_id: str | None, prompt: str | dict,
                       params: SamplingParams | None = None,
                       lora_request: LoRARequest | None = None,
                       session_id: str | None = None,
                       arrival_time: float | None = None,
                       client_group: str | None = None) -> str:
        """``add_request`` without waiting for the core's answer: the front's checks raise
        here; the core's answer comes later (``wait_added``, ``take_added``).

        Raises:
            ValueError: a bad prompt, a duplicate id, stop strings without a tokenizer.
            EngineDeadError: the core stopped.
        """
        return self.submit_requests([SubmittedRequest(
            request_id, prompt, params, lora_request, session_id, arrival_time,
            client_group)])[0]

    def submit_requests(self, requests: Sequence[SubmittedRequest]) -> list[str]:
        """Several ``submit_request`` in one message to the core, which takes them all in
        before its next step (a batch starts whole, as when ``LLM.generate`` submits).
        Either every request is sent or, when one fails the front's checks, none is.

        Raises:
            ValueError: as ``submit_request``, for the first bad request.
            EngineDeadError: the core stopped.
        """
        batch: list[EngineCoreRequest] = []
        try:
            for r in requests:
                batch.append(self._core_request(r))
        except BaseException:
            self._untrack(batch)
            raise
        if self._held is not None:
            self._held.extend(batch)
        else:
            self._send(batch)
        return [r.request_id for r in batch]

    @contextlib.contextmanager
    def one_message(self) -> Iterator[None]:
        """Requests submitted inside the block go to the core together, in one message at
        its end (the core takes them all in before its next step); each is still checked
        by the front on its own, and aborting one inside the block drops it.

        Raises:
            EngineDeadError: the core stopped (the held requests are dropped).
        """
        if self._held is not None:
            yield
            return
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if held:
                self._send(held)

    def _send(self, batch: list[EngineCoreRequest]) -> None:
        """One ADD message; the front stops tracking the batch when it cannot go."""
        try:
            self.client.add_requests(batch)
        except BaseException:
            self._untrack(batch)
            raise

    def _untrack(self, batch: list[EngineCoreRequest]) -> None:
        for core_request in batch:
            self.output_processor.abort(core_request.request_id)

    def _core_request(self, r: SubmittedRequest) -> EngineCoreRequest:
        """Check and tokenize one request, and start tracking it."""
        params = r.params or SamplingParams()
        request_id = r.request_id
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self.output_processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if r.arrival_time is None else r.arrival_time
        text, core_request = self.input_processor.process_inputs(
            request_id, r.prompt, params, r.lora_request, r.session_id, arrival,
            r.client_group)
        self.output_processor.add(request_id, text, core_request.prompt_token_ids,
                                  core_request.sampling_params, r.lora_request, arrival)
        return core_request

    def wait_added(self, request_ids: Sequence[str]) -> dict[str, Exception | None]:
        """Wait for the core's answers to submitted requests: ``{id: None}`` for each
        accepted, ``{id: the error}`` for each refused. Outputs that arrive meanwhile wait
        for the next ``step``.

        Raises:
            EngineDeadError: the core stopped.
        """
        while any(rid not in self._added for rid in request_ids):
            for message in self.client.get_messages(block=True):
                self._take(message)
        return {rid: self._added.pop(rid).error for rid in request_ids}

    def take_added(self) -> list[AddDone]:
        """The core's answers received so far to submitted requests, each once."""
        added, self._added = list(self._added.values()), {}
        return added

    def _take(self, message: AddDone | EngineCoreOutputs) -> None:
        if isinstance(message, EngineCoreOutputs):
            self._outputs.append(message)
            return
        if message.request_id in self._forget:      # aborted before the core answered
            self._forget.discard(message.request_id)
            return
        self._added[message.request_id] = message
        if message.error is not None:
            self.output_processor.abort(message.request_id)
        else:
            self.output_processor.answered(message.request_id, message.history)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the host cache ahead of its requests (vLLM's ``add_lora``),
        waiting until it is there (the core reads it on a loader thread and keeps stepping;
        outputs that arrive meanwhile wait for the next ``step``).

        Raises:
            ValueError, LoRAAdapterError, FileNotFoundError: as ``add_request``, or what
                the read met (bad weights).
        """
        return self.client.call("add_lora", lora_request)

    def add_lora_async(self, lora_request: LoRARequest) -> Future:
        """``add_lora`` without waiting: a ``concurrent.futures.Future`` answered (True, or
        the error) by the ``step`` that receives the core's answer, on its thread.

        Raises:
            EngineDeadError: the core is gone.
        """
        return self.client.call_async("add_lora", lora_request)

    def has_pending_calls(self) -> bool:
        """Whether a call sent with ``add_lora_async`` is still unanswered."""
        return self.client.has_pending_calls()

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host cache and its device slot (vLLM's ``remove_lora``)
        once no request uses it (``EngineCore.remove_lora``); True when it went now."""
        return self.client.call("remove_lora", lora_int_id)

    def end_session(self, session_id: str) -> bool:
        """End a multi-turn session (``EngineCore.end_session``); False when unknown."""
        return self.client.call("end_session", session_id)

    def kv_cache_stats(self) -> KVCacheStats:
        """The KV cache's state and counters: blocks total, used, cached and free; prefix
        queries and hits (tokens); preemptions, recomputed tokens, swapped blocks."""
        return self.client.call("kv_cache_stats")

    def lora_cache_stats(self) -> LoRACacheStats:
        """A copy of the adapter cache's counters (hits, misses, evictions, load times)."""
        return self.client.call("lora_cache_stats")

    def scheduler_stats(self) -> SchedulerStats:
        """The core's state: now when it runs in this process, else as of its latest
        message (it sends its state with every message)."""
        if self.client.in_process:
            return self.client.call("scheduler_stats")
        return self._stats

    def abort_request(self, request_ids: str | Sequence[str],
                      stats: IterationStats | None = None) -> None:
        """Stop requests now; their blocks go back. Unknown ids are ignored. With
        ``stats``, each one still running is counted there as finished with ``"abort"``."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        unsent: set[str] = set()
        if self._held:                 # not sent yet: it never reaches the core
            unsent = {r.request_id for r in self._held} & set(ids)
            self._held = [r for r in self._held if r.request_id not in unsent]
        for rid in ids:
            state = self.output_processor.states.get(rid)
            if state is not None and not state.answered and rid not in unsent:
                self._forget.add(rid)
            self._added.pop(rid, None)
            self.output_processor.abort(rid, stats)
        self.client.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        """Whether a request is still running (or waiting for the core's answer)."""
        return bool(self.output_processor.states)

    def step(self, stats: IterationStats | None = None,
             block: bool = True) -> list[RequestOutput]:
        """Advance the requests; an output for every request that reports one (see
        ``SamplingParams.output_kind``: every step that gave it a token, or only its end).

        In this process the core runs one step here; in its own process this takes the
        steps it reported since, waiting for one when ``block`` (a ``wake`` from another
        thread, or the core's answer to a submitted request, also ends the wait).

        Args:
            stats: when given, the tokens, latencies and finished requests are added to it.
            block: wait for the core when nothing has arrived yet.

        Raises:
            EngineDeadError: the core stopped.
        """
        if not self._outputs:
            for message in self.client.get_messages(block):
                self._take(message)
        outputs: list[RequestOutput] = []
        while self._outputs:
            core_outputs = self._outputs.popleft()
            if core_outputs.scheduler_stats is not None:
                self._stats = core_outputs.scheduler_stats
            done, stopped, failed = self.output_processor.process_outputs(
                core_outputs.outputs, stats)
            outputs.extend(done)
            if stopped:          # stop strings the front found: the core stops them too
                self.client.abort_requests(stopped, FinishReason.STOP)
            if failed:           # their outputs could not be processed: the core ends them
                self.client.abort_requests(failed)
        return outputs

    def wake(self) -> None:
        """End a ``step`` blocked in another thread (any thread)."""
        self.client.wake()

    @torch.inference_mode()
    def generate_all(self) -> list[RequestOutput]:
        """Step until every request has finished; the final output of each."""
        finished = []
        while self.has_unfinished_requests():
            finished.extend(o for o in self.step() if o.finished)
        return finished
