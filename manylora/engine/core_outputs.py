"""What a step reports: each request's new token, its log-probabilities and why it ended
(``EngineCoreOutput``), once the step's tokens reach the host (``EngineCore``'s step loop).
"""

from __future__ import annotations

import logging

from manylora.engine.protocol import EngineCoreOutput, FinishReason
from manylora.engine.serial import ErrorInfo
from manylora.lora.manager import LoRAManager
from manylora.request import Request, RequestStatus
from manylora.sample.sampler import SampledTokens
from manylora.scheduler.scheduler import Scheduler
from manylora.scheduler.stop import check_stop
from manylora.scheduler_output import SchedulerOutput
from manylora.structured.manager import StructuredOutputManager, no_token_error

logger = logging.getLogger(__name__)

#: The ``FinishReason`` of each finished ``RequestStatus``.
FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
                  RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
                  RequestStatus.FINISHED_ABORTED: FinishReason.ABORT}


def step_outputs(out: SchedulerOutput, sampled: SampledTokens, scheduler: Scheduler,
                 structured: StructuredOutputManager
                 ) -> tuple[list[EngineCoreOutput], dict[RequestStatus, list[str]]]:
    """A step's tokens recorded (``Scheduler.update``) and the token-level stops applied.


    Returns:
        ``(outputs, finished)``: an ``EngineCoreOutput`` per request that got a token (or
        only prompt log-probabilities, or an error: a mask that allowed no token, a token
        its grammar rejects), and ``{status: request ids}`` of the requests that end now
        (the caller ends them).
    """
    got = scheduler.update(out, sampled.tokens)
    prompt = _new_prompt_logprobs(scheduler, sampled.prompt_logprobs) \
        if sampled.prompt_logprobs else {}
    failed = _constraint_failures(structured, got, sampled.no_token)
    outputs = []
    finished: dict[RequestStatus, list[str]] = {}
    for req in got:
        rid = req.request_id
        if rid in failed:
            logger.info("request %s: %s", rid, failed[rid])
            finished.setdefault(RequestStatus.FINISHED_ABORTED, []).append(rid)
            outputs.append(EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR,
                                            error=ErrorInfo.of(failed[rid])))
            continue
        status = check_stop(req)
        if status is None and _grammar_ended(structured, req):
            status = RequestStatus.FINISHED_STOPPED
        lp = sampled.logprobs.get(rid)
        reason = None
        if status is not None:
            finished.setdefault(status, []).append(rid)
            reason = FINISH_REASONS[status]
        first = len(req.token_ids) - req.num_prompt_tokens == 1
        outputs.append(EngineCoreOutput(rid, [req.token_ids[-1]],
                                        None if lp is None else [lp], reason,
                                        req.stop_reason,
                                        new_prompt_logprobs=prompt.pop(rid, None),
                                        num_cached_tokens=max(req.num_cached_tokens, 0),
                                        scheduled_time=req.scheduled_time if first
                                        else None))
    outputs.extend(EngineCoreOutput(rid, [], new_prompt_logprobs=p)
                   for rid, p in prompt.items())
    return outputs, finished


def _constraint_failures(structured: StructuredOutputManager, got: list[Request],
                         no_token: frozenset[str]) -> dict[str, ValueError]:
    """The requests of ``got`` (each with its newest token appended) that must end with
    an error: their masks allowed no token (``no_token``), or their grammar rejects the
    token. The others' tokens advance their matchers."""
    failed = {}
    for req in got:
        rid = req.request_id
        if rid in no_token:
            failed[rid] = no_token_error(req, structured.has_matcher(rid),
                                         req.num_output_tokens - 1)
        elif structured.has_matchers and not structured.accept(rid, req.token_ids[-1]):
            failed[rid] = ValueError(f"structured_outputs: the grammar rejects token "
                                     f"{req.token_ids[-1]} sampled under its own mask")
    return failed


def _grammar_ended(structured: StructuredOutputManager, req: Request) -> bool:
    """Whether ``req`` ends because its grammar has (a stop token accepted), below its
    ``min_tokens`` too; with ``ignore_eos`` it goes on unconstrained."""
    return (structured.has_matchers and not req.sampling_params.ignore_eos
            and structured.terminated(req.request_id))


def _new_prompt_logprobs(scheduler: Scheduler, computed: dict) -> dict:
    """``{request_id: PromptLogprobs}`` of a step's prompt log-probabilities that are
    new: those of requests still unfinished, cut to the positions not reported yet (a
    preempted request computes its prompt again), each request's
    ``prompt_logprobs_next`` advanced past them."""
    new = {}
    requests = scheduler.requests
    for rid, chunk in computed.items():
        req = requests.get(rid)
        if req is None:
            continue
        chunk = chunk.drop_before(req.prompt_logprobs_next)
        if chunk is None or chunk.start != req.prompt_logprobs_next:
            continue
        req.prompt_logprobs_next = chunk.start + len(chunk)
        new[rid] = chunk
    return new


def grammar_outputs(structured: StructuredOutputManager, scheduler: Scheduler,
                    lora_manager: LoRAManager | None) -> list[EngineCoreOutput]:
    """Requests whose grammar compiled join the scheduler's queue; those whose grammar did
    not compile end with the error (``FinishReason.ERROR``; their adapter reference goes
    back): their outputs."""
    ready, failed = structured.poll()
    for req in ready:
        scheduler.add_request(req)
    outputs = []
    for req, error in failed:
        logger.info("request %s: %s", req.request_id, error)
        if req.lora_int_id and lora_manager is not None:
            lora_manager.release(req.lora_int_id)
        outputs.append(EngineCoreOutput(req.request_id, [], finish_reason=FinishReason.ERROR,
                                        error=ErrorInfo.of(error)))
    return outputs
