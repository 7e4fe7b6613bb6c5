"""The token-level stop rules the core applies after each sampled token (vLLM v1's
``check_stop``): ``min_tokens`` holds EOS and stop token ids off; then EOS (unless
``ignore_eos``), ``stop_token_ids``, and last the length cap (``max_tokens`` or the context).
Stop strings need text and are the front's (``engine.output_processor``)."""

from __future__ import annotations

from manylora.request import Request, RequestStatus


def check_stop(request: Request) -> RequestStatus | None:
    """Whether the request's newest token ends it.

    Sets ``request.stop_reason`` to the token when a stop token id ends it.

    Args:
        request: a request whose last entry of ``token_ids`` was just sampled.

    Returns:
        ``FINISHED_STOPPED`` (EOS or a stop token id), ``FINISHED_LENGTH`` (``num_tokens``
        reached ``max_total_tokens``), or None to go on.
    """
    params = request.sampling_params
    token = request.token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if request.num_tokens >= request.max_total_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
