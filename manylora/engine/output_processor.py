"""The front's side of every step: the core's per-request deltas (new token ids, their
log-probabilities, the core's finish reason) become text and ``RequestOutput`` (vLLM v1's
``OutputProcessor``).

The core has already applied the token-level rules (``min_tokens``, EOS, ``stop_token_ids``,
the length caps). Here each new token is detokenized incrementally (the stop token that
ended a request is not, as in vLLM, unless ``include_stop_str_in_output``: it stays in the
token ids and log-probabilities, never in the text) and, once ``min_tokens``
tokens exist, the text is searched for stop strings: a hit cuts the text before the stop
string (after it with ``include_stop_str_in_output``), ends the request with ``"stop"`` even
when the core had ended it on length, and the request is reported back so the core stops
it too. A request that ends otherwise also gets the text its detokenizer held back (an
incomplete UTF-8 tail).

With ``SamplingParams.logprobs`` set, each token's :class:`TokenLogprobs` becomes one
``{token_id: Logprob}`` dict (sampled token first, then the top N, as vLLM's
``LogprobsProcessor``), and the sampled log-probabilities add up in ``cumulative_logprob``.
With ``SamplingParams.prompt_logprobs`` the core's prompt chunks (arrays) become the same
dicts, the prompt token first, after a None for the first prompt token
(``RequestOutput.prompt_logprobs``); a chunk without a new token reports nothing yet.

Per step the work is O(new tokens) per request, except what the request's
``output_kind`` asks for: ``CUMULATIVE`` copies the whole output into each
``RequestOutput``; ``DELTA`` and ``FINAL_ONLY`` do not. A ``DELTA`` output never carries
text a stop string might still cut away: an unfinished request's last
``max(len(stop)) - 1`` characters wait for the next token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from manylora.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from manylora.engine.outputs import CompletionOutput, Logprob, RequestOutput
from manylora.engine.protocol import EngineCoreOutput, FinishReason
from manylora.engine.stats import FinishedRequestStats, IterationStats
from manylora.lora_request import LoRARequest
from manylora.sample.logprobs import TokenLogprobs
from manylora.sample.prompt_logprobs import PromptLogprobs
from manylora.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


def stop_holdback(stop: Sequence[str], include_stop_str_in_output: bool) -> int:
    """How many trailing characters of an unfinished request's text a ``DELTA`` output
    holds back (vLLM's stop-string buffer): ``max(len(s) for s in stop) - 1``, since the
    next token may complete a stop string that is then cut away; 0 without stop strings or
    when the stop string is kept in the output."""
    if not stop or include_stop_str_in_output:
        return 0
    return max(len(s) for s in stop) - 1


class RequestState:
    """One request's output state in the front.

    Attributes:
        prompt, prompt_token_ids: the prompt (text or None; ids, a session's history
            included).
        output_token_ids: every token the request generated so far.
        text: its text so far, as the user sees it (stop string cut off).
        logprobs, cumulative_logprob: the per-token dicts and their running sum when
            ``SamplingParams.logprobs`` is set, None otherwise.
        prompt_logprobs: ``[None, {token_id: Logprob}, ...]`` so far when
            ``SamplingParams.prompt_logprobs`` is set, None otherwise;
            prompt_logprobs_sent: whether a ``DELTA`` output carried them already.
        finish_reason, stop_reason: set when it ended.
        error: the core's error when it ended with ``"error"``, else None.
        arrival_time: when the front accepted it (``time.monotonic``, seconds).
        first_token_time, last_token_time: when its first and latest tokens were processed
            (``time.monotonic``, seconds).
        scheduled_time: when the core's scheduler first ran it (``time.monotonic``,
            seconds; from its first token's ``EngineCoreOutput``), None before.
        answered: the core took the request (its answer to the add came back).
        num_sent_tokens, num_sent_chars: how much of the output the ``DELTA`` outputs have
            reported already.
        holdback: trailing characters a ``DELTA`` output of the unfinished request keeps
            back (:func:`stop_holdback`), so that no part of a stop string is ever sent.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, lora_request: LoRARequest | None, tokenizer,
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.lora_request = lora_request
        self.arrival_time = arrival_time
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens,
            params.spaces_between_special_tokens)
        self.output_token_ids: list[int] = []
        self.text = ""
        wants = params.logprobs is not None
        self.logprobs: list[dict[int, Logprob]] | None = [] if wants else None
        self.cumulative_logprob: float | None = 0.0 if wants else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            None if params.prompt_logprobs is None else [None])
        self.prompt_logprobs_sent = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.holdback = stop_holdback(params.stop, params.include_stop_str_in_output)
        self.first_token_time: float | None = None
        self.scheduled_time: float | None = None
        self.error: Exception | None = None
        self.answered = False
        self.last_token_time = 0.0
        self.num_cached_tokens: int | None = None

    def make_output(self) -> RequestOutput | None:
        """The ``RequestOutput`` its ``output_kind`` reports now (None: nothing to report)."""
        kind = self.params.output_kind
        finished = self.finish_reason is not None
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        tokens, text, logprobs = self.output_token_ids, self.text, self.logprobs
        if kind is RequestOutputKind.DELTA:
            start, chars = self.num_sent_tokens, self.num_sent_chars
            end = len(text) if finished else max(chars, len(text) - self.holdback)
            tokens, text = tokens[start:], text[chars:end]
            logprobs = None if logprobs is None else logprobs[start:]
            self.num_sent_tokens, self.num_sent_chars = len(self.output_token_ids), end
        else:
            tokens = list(tokens)
            logprobs = None if logprobs is None else list(logprobs)
        prompt_logprobs = self.prompt_logprobs
        if kind is RequestOutputKind.DELTA and prompt_logprobs is not None:
            prompt_logprobs = None if self.prompt_logprobs_sent else prompt_logprobs
            self.prompt_logprobs_sent = True
        completion = CompletionOutput(0, text, tokens, self.finish_reason, self.stop_reason,
                                      self.lora_request, self.cumulative_logprob, logprobs)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             finished, self.lora_request, self.error,
                             None if prompt_logprobs is None else list(prompt_logprobs),
                             self.num_cached_tokens)


class OutputProcessor:
    """Applies the core's deltas to the front's request states.

    Args:
        tokenizer: a ``transformers`` tokenizer (for detokenization), or None: token ids
            only, the text stays empty.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self._token_text: dict[int, str] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, lora_request: LoRARequest | None,
            arrival_time: float) -> None:
        """Start tracking a request the core accepted."""
        self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, params,
                                               lora_request, self.tokenizer, arrival_time)

    def answered(self, request_id: str, history: list[int]) -> None:
        """The core took the request. A session turn's history, known only now, heads the
        prompt ids (and the detokenizer's context). Call before any output of it."""
        state = self.states[request_id]
        state.answered = True
        if not history:
            return
        state.prompt_token_ids = history + state.prompt_token_ids
        if state.detokenizer is not None:
            state.detokenizer = IncrementalDetokenizer(
                self.tokenizer, state.prompt_token_ids, state.params.skip_special_tokens,
                state.params.spaces_between_special_tokens)

    def abort(self, request_id: str, stats: IterationStats | None = None) -> None:
        """Stop tracking a request the caller gave up on (unknown ids are ignored); with
        ``stats``, it is counted as finished with ``"abort"``."""
        state = self.states.pop(request_id, None)
        if state is not None and stats is not None:
            _finished(stats, state, FinishReason.ABORT.value, time.monotonic())

    def process_outputs(self, outputs: Iterable[EngineCoreOutput],
                        stats: IterationStats | None = None
                        ) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Apply one step's deltas. A delta that cannot be applied (its detokenization or
        log-probabilities raise) ends its request alone, with the error and finish reason
        ``"error"``; the others' deltas are applied as usual.

        Args:
            outputs: the core's ``EngineCoreOutput``s of the step; those of requests the
                front no longer tracks (aborted) are skipped.
            stats: when given, the step's tokens and latencies are added to it (vLLM's
                ``IterationStats``: timed here, per token, whatever the output kinds).

        Returns:
            ``(request_outputs, stopped, failed)``: the ``RequestOutput``s the requests'
            output kinds report, the ids of requests that a stop string ended while the
            core still runs them (the caller ends them in the core with
            ``FinishReason.STOP``), and the ids of requests whose delta failed (the caller
            aborts them in the core; a request that asked for log-probabilities and got a
            token without them is one). Finished requests are no longer tracked.
        """
        request_outputs: list[RequestOutput] = []
        stopped: list[str] = []
        failed: list[str] = []
        now = time.monotonic()
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            try:
                self._apply(state, out, stats, now, request_outputs, stopped)
            except Exception as e:         # this request's alone: the others go on
                logger.exception("request %s: its output could not be processed",
                                 out.request_id)
                failed.append(out.request_id)
                request_outputs.append(self._fail(state, e, stats, now))
        return request_outputs, stopped, failed

    def _fail(self, state: RequestState, error: Exception, stats: IterationStats | None,
              now: float) -> RequestOutput:
        """End ``state``'s request with ``error`` (finish reason ``"error"``)."""
        state.finish_reason, state.error = FinishReason.ERROR.value, error
        self.states.pop(state.request_id, None)
        if stats is not None:
            _finished(stats, state, state.finish_reason, now)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             [CompletionOutput(0, "", [], state.finish_reason, None,
                                               state.lora_request)],
                             True, state.lora_request, error)

    def _apply(self, state: RequestState, out: EngineCoreOutput,
               stats: IterationStats | None, now: float,
               request_outputs: list[RequestOutput], stopped: list[str]) -> None:
        """One request's delta: tokens, text, log-probabilities, its end."""
        if out.scheduled_time is not None:
            state.scheduled_time = out.scheduled_time
        if stats is not None and out.new_token_ids:
            _count_tokens(stats, state, len(out.new_token_ids), now)
        lps = out.new_logprobs
        if state.logprobs is not None and lps is None and out.new_token_ids:
            raise ValueError(f"request {out.request_id!r} asked for logprobs, but tokens "
                             f"{out.new_token_ids} came without them")
        if out.new_token_ids:
            state.num_cached_tokens = max(state.num_cached_tokens or 0, out.num_cached_tokens)
        if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
            self._append_prompt_logprobs(state, out.new_prompt_logprobs)
            if not out.new_token_ids and out.finish_reason is None:
                return                     # a prefill chunk: nothing to report yet
        hit = False
        last = len(out.new_token_ids) - 1
        core_stop = out.finish_reason is FinishReason.STOP
        for i, token in enumerate(out.new_token_ids):
            state.output_token_ids.append(token)
            if state.logprobs is not None:
                self._append_logprobs(state, token, lps[i])
            if self._add_text(state, token, not (core_stop and i == last)):
                hit = True
                break
        if hit:
            state.finish_reason = FinishReason.STOP.value
            if out.finish_reason is None:
                stopped.append(out.request_id)
        elif out.finish_reason is not None:
            state.finish_reason = out.finish_reason.value
            state.stop_reason = out.stop_reason
            if out.error is not None:
                state.error = out.error.to_exception()
            if state.detokenizer is not None:
                state.text += state.detokenizer.flush()
        output = state.make_output()
        if output is not None:
            request_outputs.append(output)
        if state.finish_reason is not None:
            del self.states[out.request_id]
            if stats is not None:
                _finished(stats, state, state.finish_reason, now)

    def _add_text(self, state: RequestState, token: int, check_stop: bool) -> bool:
        """Detokenize one new token; True when it completed a stop string (the text is cut
        and ``stop_reason`` set). ``check_stop`` False: the core ended the request on this
        token (EOS or a stop token id), which no stop string overrides; the token then adds
        no text unless ``include_stop_str_in_output`` (vLLM's detokenizer: the stop token
        stays in ``token_ids`` and the log-probabilities, never in the text)."""
        if state.detokenizer is None:
            return False
        params = state.params
        if not check_stop and not params.include_stop_str_in_output:
            state.detokenizer.skip(token)
            return False
        delta = state.detokenizer.append(token)
        state.text += delta
        if not (check_stop and delta and params.stop
                and len(state.output_token_ids) >= params.min_tokens):
            return False
        found = check_stop_strings(state.text, len(delta), params.stop,
                                   params.include_stop_str_in_output)
        if found is None:
            return False
        state.text, index = found
        state.stop_reason = params.stop[index]
        return True

    def _append_logprobs(self, state: RequestState, token: int, lp: TokenLogprobs) -> None:
        """Add one position's ``{token_id: Logprob}`` dict and the sampled log-probability.

        The sampled token goes first, then the top N in order (vLLM's order; a sampled token
        among the top N keeps its first place). A top-N token's rank is 1 + the number of
        entries before it with a strictly larger log-probability, which is its rank in the
        whole vocabulary since the top N hold every larger one.
        """
        entries = {token: Logprob(lp.logprob, lp.rank, self._decode(token))}
        rank = 1
        for i, (tid, value) in enumerate(zip(lp.topk_ids, lp.topk_logprobs)):
            if i and value < lp.topk_logprobs[i - 1]:
                rank = i + 1
            if tid not in entries:
                entries[tid] = Logprob(value, rank, self._decode(tid))
        state.logprobs.append(entries)
        state.cumulative_logprob += lp.logprob

    def _append_prompt_logprobs(self, state: RequestState, chunk: PromptLogprobs) -> None:
        """Add a prompt chunk's positions as ``{token_id: Logprob}`` dicts: the prompt
        token first (its rank from the core), then the top K in order (ranks as
        :meth:`_append_logprobs`).

        Raises:
            ValueError: the chunk does not continue the positions received so far.
        """
        have = len(state.prompt_logprobs)
        if chunk.start != have:
            raise ValueError(f"request {state.request_id!r}: prompt log-probabilities of "
                             f"position {chunk.start} came after {have} positions")
        ids = state.prompt_token_ids[chunk.start:chunk.start + len(chunk)]
        for token, value, rank, top_ids, top_lps in zip(
                ids, chunk.logprobs.tolist(), chunk.ranks.tolist(), chunk.topk_ids.tolist(),
                chunk.topk_logprobs.tolist()):
            state.prompt_logprobs.append(self._entries(token, value, rank, top_ids, top_lps))

    def _entries(self, token: int, value: float, token_rank: int, top_ids: list[int],
                 top_lps: list[float]) -> dict[int, Logprob]:
        """One position's ``{token_id: Logprob}``: ``token`` first, then the top K."""
        entries = {token: Logprob(value, token_rank, self._decode(token))}
        rank = 1
        for i, (tid, lp) in enumerate(zip(top_ids, top_lps)):
            if i and lp < top_lps[i - 1]:
                rank = i + 1
            if tid not in entries:
                entries[tid] = Logprob(lp, rank, self._decode(tid))
        return entries

    def _decode(self, token_id: int) -> str | None:
        """One token's text alone, cached per id; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            text = "" if piece is None else self.tokenizer.convert_tokens_to_string([piece])
            self._token_text[token_id] = text
        return text


def _count_tokens(stats: IterationStats, state: RequestState, num_new: int,
                  now: float) -> None:
    stats.num_generation_tokens += num_new
    if state.first_token_time is None:
        state.first_token_time = now
        stats.num_prompt_tokens += len(state.prompt_token_ids)
        stats.time_to_first_tokens.append(now - state.arrival_time)
    else:
        stats.inter_token_latencies.append(now - state.last_token_time)
    state.last_token_time = now


def _finished(stats: IterationStats, state: RequestState, reason: str, now: float) -> None:
    """Add ``state``'s request, ended at ``now``, to ``stats.finished``: its phases split
    at the times the scheduler first ran it and its first and last tokens came (vLLM's
    ``FinishedRequestStats``; a request that never ran queued until its end)."""
    first, scheduled = state.first_token_time, state.scheduled_time
    if scheduled is None:
        scheduled = first if first is not None else now
    scheduled = min(max(scheduled, state.arrival_time), now)
    last = state.last_token_time if first is not None else scheduled
    stats.finished.append(FinishedRequestStats(
        reason, now - state.arrival_time, len(state.prompt_token_ids),
        len(state.output_token_ids),
        state.lora_request.lora_name if state.lora_request is not None else None,
        first_token_latency=None if first is None else first - state.arrival_time,
        queue_time=scheduled - state.arrival_time,
        prefill_time=0.0 if first is None else max(first - scheduled, 0.0),
        decode_time=0.0 if first is None else last - first,
        inference_time=max(last - scheduled, 0.0),
        max_tokens=state.params.max_tokens))
