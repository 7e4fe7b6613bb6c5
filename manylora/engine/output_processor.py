"""Turns sampled tokens into text and decides when a request stops (vLLM's rules).

Order of the checks for each new token: ``min_tokens`` holds every stop off; then EOS
(unless ``ignore_eos``), ``stop_token_ids``, stop strings (the text is cut before the stop
string unless ``include_stop_str_in_output``), and last the length caps (``max_tokens``,
the context length).
"""

from __future__ import annotations

from collections.abc import Collection

from manylora.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from manylora.engine.outputs import CompletionOutput, RequestOutput
from manylora.engine.request import Request, RequestStatus


class RequestState:
    """Per-request output state: the detokenizer and the text as the user sees it."""

    def __init__(self, request: Request, tokenizer) -> None:
        self.request = request
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, request.token_ids, request.sampling_params.skip_special_tokens)
        self.text = ""

    def to_output(self, status: RequestStatus | None) -> RequestOutput:
        req = self.request
        finish = status.value if status is not None and status.finished else None
        completion = CompletionOutput(0, self.text, list(req.output_token_ids), finish,
                                      req.stop_reason, req.lora_request)
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

    def add(self, request: Request) -> None:
        self.states[request.request_id] = RequestState(request, self.tokenizer)

    def remove(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    def process_token(self, request_id: str, token: int) -> RequestStatus | None:
        """Detokenize the request's newest token; its finish status, or None to go on.

        A request that ends otherwise than on a stop string also gets the text its
        detokenizer held back (an incomplete UTF-8 tail).
        """
        state = self.states[request_id]
        status = self._check(state, token)
        if (status is not None and state.detokenizer is not None
                and not isinstance(state.request.stop_reason, str)):
            state.text += state.detokenizer.flush()
        return status

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
