"""Turns sampled tokens into text and decides when a request stops (vLLM's rules).

Order of the checks for each new token: ``min_tokens`` holds every stop off; then EOS
(unless ``ignore_eos``), ``stop_token_ids``, stop strings (the text is cut before the stop
string unless ``include_stop_str_in_output``), and last the length caps (``max_tokens``,
the context length).

With ``SamplingParams.logprobs`` set, each token's :class:`TokenLogprobs` from the runner
becomes one ``{token_id: Logprob}`` dict (sampled token first, then the top N, as vLLM's
``LogprobsProcessor``), and the sampled log-probabilities add up in ``cumulative_logprob``.
"""

from __future__ import annotations

from collections.abc import Collection

from manylora.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from manylora.engine.outputs import CompletionOutput, Logprob, RequestOutput
from manylora.engine.request import Request, RequestStatus
from manylora.sample.sampler import TokenLogprobs


class RequestState:
    """Per-request output state: the detokenizer, the text as the user sees it and, when
    ``SamplingParams.logprobs`` is set, the per-token ``logprobs`` dicts and their
    ``cumulative_logprob`` (both None otherwise)."""

    def __init__(self, request: Request, tokenizer) -> None:
        self.request = request
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, request.token_ids, request.sampling_params.skip_special_tokens)
        self.text = ""
        wants = request.sampling_params.logprobs is not None
        self.logprobs: list[dict[int, Logprob]] | None = [] if wants else None
        self.cumulative_logprob: float | None = 0.0 if wants else None

    def to_output(self, status: RequestStatus | None) -> RequestOutput:
        req = self.request
        finish = status.value if status is not None and status.finished else None
        completion = CompletionOutput(
            0, self.text, list(req.output_token_ids), finish, req.stop_reason,
            req.lora_request, self.cumulative_logprob,
            None if self.logprobs is None else list(self.logprobs))
        return RequestOutput(req.request_id, req.prompt, req.token_ids[:req.num_prompt_tokens],
                             [completion], finish is not None, req.lora_request)


class OutputProcessor:
    """Applies each step's new tokens to request states and finds finished requests.

    Args:
        tokenizer: a ``transformers`` tokenizer (for detokenization), or None: token ids
            only, the text stays empty.
        eos_token_ids: the ids that end generation (generation config and tokenizer).
    """

    def __init__(self, tokenizer, eos_token_ids: Collection[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.states: dict[str, RequestState] = {}
        self._token_text: dict[int, str] = {}

    def add(self, request: Request) -> None:
        self.states[request.request_id] = RequestState(request, self.tokenizer)

    def remove(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    def process_token(self, request_id: str, token: int,
                      logprobs: TokenLogprobs | None = None) -> RequestStatus | None:
        """Detokenize the request's newest token; its finish status, or None to go on.

        A request that ends otherwise than on a stop string also gets the text its
        detokenizer held back (an incomplete UTF-8 tail).

        Args:
            request_id: a request added with :meth:`add`.
            token: its newly sampled token id.
            logprobs: that token's log-probabilities from the runner; recorded when the
                request's ``SamplingParams.logprobs`` is set, ignored otherwise.

        Raises:
            ValueError: the request asked for log-probabilities and ``logprobs`` is None.
        """
        state = self.states[request_id]
        if state.logprobs is not None:
            if logprobs is None:
                raise ValueError(f"request {request_id!r} asked for logprobs, but token "
                                 f"{token} came without them")
            self._append_logprobs(state, token, logprobs)
        status = self._check(state, token)
        if (status is not None and state.detokenizer is not None
                and not isinstance(state.request.stop_reason, str)):
            state.text += state.detokenizer.flush()
        return status

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

    def _check(self, state: RequestState, token: int) -> RequestStatus | None:
        req, params = state.request, state.request.sampling_params
        delta = "" if state.detokenizer is None else state.detokenizer.append(token)
        state.text += delta
        n_out = req.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if params.stop:
                hit = check_stop_strings(state.text, len(delta), params.stop,
                                         params.include_stop_str_in_output)
                if hit is not None:
                    state.text, index = hit
                    req.stop_reason = params.stop[index]
                    return RequestStatus.FINISHED_STOPPED
        if req.num_tokens >= req.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
