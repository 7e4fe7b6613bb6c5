"""What the model runner already holds of each request, so that a step's plan sends only
what changed (vLLM v1's ``NewRequestData`` / ``CachedRequestData`` bookkeeping): whole rows
for requests the runner does not hold, the blocks appended since for the others. No tensors
here.
"""

from __future__ import annotations

from manylora.request import Request
from manylora.scheduler.kv_cache_manager import KVCacheManager
from manylora.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)


class RunnerDeltas:
    """The number of blocks of each request's table the runner holds.

    Args:
        kv: the block allocator (its block tables are read).
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._sent_blocks: dict[str, int] = {}   # request id → blocks the runner holds

    def make(self, scheduled: list[ScheduledRequest]
             ) -> tuple[list[NewRequestData], CachedRequestData]:
        """What the runner must learn for this step. O(batch + new blocks): no table is
        copied."""
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData([], [], [], [])
        sent_blocks = self._sent_blocks
        for s in scheduled:
            req = s.request
            rid = req.request_id
            table = self.kv.block_table(rid)
            sent = sent_blocks.get(rid)
            if sent is None:
                new_reqs.append(NewRequestData(rid, req.token_ids, list(table), s.start,
                                               req.lora_int_id, req.sampling_params,
                                               req.num_prompt_tokens, req.lora_start))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(table[sent:] if len(table) > sent else [])
                cached.num_computed_tokens.append(s.start)
                cached.num_blocks.append(len(table))
        return new_reqs, cached

    def mark_sent(self, out: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Count ``out``'s deltas as delivered to the runner (requests no longer in
        ``requests``, the scheduler's unfinished ones, are skipped)."""
        self._apply(out, 1, requests)

    def unmark_sent(self, out: SchedulerOutput) -> None:
        """Undo ``mark_sent`` for a plan the engine dropped: its new requests go to the
        runner again, in full, and its appended blocks again."""
        self._apply(out, -1, None)

    def forget(self, request_id: str) -> None:
        """The runner no longer holds the request (preempted, finished): it returns as new."""
        self._sent_blocks.pop(request_id, None)

    def _apply(self, out: SchedulerOutput, sign: int,
               requests: dict[str, Request] | None) -> None:
        sent_blocks = self._sent_blocks
        for new in out.scheduled_new_reqs:
            if requests is None:
                sent_blocks.pop(new.req_id, None)
            elif new.req_id in requests:
                sent_blocks[new.req_id] = len(new.block_ids)
        cached = out.scheduled_cached_reqs
        for rid, blocks in zip(cached.req_ids, cached.new_block_ids):
            if blocks and rid in sent_blocks:
                sent_blocks[rid] += sign * len(blocks)
