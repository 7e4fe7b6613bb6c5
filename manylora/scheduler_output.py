"""What the scheduler hands the model runner each step (vLLM v1's ``SchedulerOutput``): the
plan of a step as deltas for the runner's persistent input batch, the KV block copies it
applies first, and the measured cost that decides between swapping and recomputing.

These are plain data; the scheduler writes them and the executor's workers read them, so
they live below both.
"""

from __future__ import annotations

from typing import NamedTuple

from manylora.request import Request
from manylora.sampling_params import SamplingParams


class PreemptionCost(NamedTuple):
    """What recomputing or swapping a preempted sequence of ``L`` tokens costs, in seconds.

    ``recompute(L) = per_token * L + per_token_pair * L**2`` (the linear layers, then
    attention's ``L**2 / 2`` causal query-key pairs), ``swap(n) = per_block * n`` for ``n``
    full blocks copied out and back. Measured by the engine at start-up
    (``worker.kv_swap.measure_preemption_cost``).
    """

    per_token: float
    per_token_pair: float
    per_block: float

    def prefer_swap(self, num_tokens: int, num_blocks: int) -> bool:
        recompute = self.per_token * num_tokens + self.per_token_pair * num_tokens ** 2
        return self.per_block * num_blocks < recompute


class SwapOp(NamedTuple):
    """One block copy for the step, applied in list order before the forward pass.

    Attributes:
        to_host: True: device block → host block (swap out); False: host → device (in).
        device_block: the device block id.
        host_block: the host block id.
    """

    to_host: bool
    device_block: int
    host_block: int


class ScheduledRequest(NamedTuple):
    """One request's share of a step.

    Attributes:
        request: the request (the engine reads its id and adapter; the runner its id).
        start: position of the first token computed this step (= tokens already cached).
        num_tokens: tokens computed this step, ``request.token_ids[start:start + num_tokens]``.
        sample: whether this step reaches the request's last token (counting an output
            placeholder: under async scheduling that token is still on the device), so a
            token is sampled.
    """

    request: Request
    start: int
    num_tokens: int
    sample: bool


class NewRequestData(NamedTuple):
    """A request the model runner has not seen (or must forget and see again, after a
    preemption): everything its persistent input-batch row needs, sent once (vLLM v1's
    ``NewRequestData``).

    Attributes:
        req_id: the request's id.
        all_token_ids: prompt then output tokens so far (the request's own list, read once
            by the runner; the runner then appends the tokens it samples itself).
        block_ids: the request's whole block table, physical block ids in token order.
        num_computed_tokens: tokens whose K/V the cache holds before this step.
        lora_int_id: the adapter's id, 0 for the base model.
        sampling_params: the request's ``SamplingParams``.
        num_prompt_tokens: how many of ``all_token_ids`` are the prompt (the rest were
            generated; the penalties count those); -1: all of them.
        lora_start: the first position the adapter applies to (``Request.lora_start``; an
            activated adapter's invocation start), earlier tokens running as the base model.
    """

    req_id: str
    all_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    lora_int_id: int
    sampling_params: SamplingParams
    num_prompt_tokens: int = -1
    lora_start: int = 0


class CachedRequestData(NamedTuple):
    """The scheduled requests the runner already holds, as parallel lists (vLLM v1's
    ``CachedRequestData``): only what changed since the runner last saw them.

    Attributes:
        req_ids: the requests' ids.
        new_block_ids: per request, the block ids appended to its table since the last step
            the runner ran for it (usually empty; one block every ``block_size`` tokens).
        num_computed_tokens: per request, tokens whose K/V the cache holds before this step.
        num_blocks: per request, the length of its whole block table (so the runner can
            apply ``new_block_ids`` idempotently: a plan sent again after one the engine
            ran only in part appends nothing twice).
    """

    req_ids: list[str]
    new_block_ids: list[list[int]]
    num_computed_tokens: list[int]
    num_blocks: list[int]


class SchedulerOutput(NamedTuple):
    """A step's plan, as deltas for the model runner's persistent input batch (vLLM v1's
    ``SchedulerOutput``).

    Attributes:
        scheduled: the requests computed this step, in batch order.
        preempted: ids of requests preempted while planning it (the runner drops their
            rows; they come back as new requests).
        finished_ids: ids of requests that finished since the last step (the runner drops
            their per-request state).
        swaps: block copies between device and swap space, to apply in order before the
            step's forward pass.
        scheduled_new_reqs: the scheduled requests the runner does not hold yet, in full.
        scheduled_cached_reqs: the other scheduled requests, as block-table deltas.

    A plan counts as run once ``Scheduler.schedule`` returns it (computed tokens advanced, output
    placeholders added, deltas delivered); a plan the engine drops without running it (an
    adapter that failed to load) is undone by ``Scheduler.revert`` and its deltas are sent
    again, in full, by the next one.
    """

    scheduled: list[ScheduledRequest]
    preempted: list[str]
    finished_ids: list[str]
    swaps: list[SwapOp] = []
    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = CachedRequestData([], [], [], [])

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)
