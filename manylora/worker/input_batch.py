"""The persistent input batch (vLLM v1's ``InputBatch`` and ``_update_states``): every
request the step computes keeps a row of numpy columns, updated in place from the
scheduler's deltas; a step's inputs are numpy vector ops over them
(``worker/prepare_inputs.py``).

A row holds a request's tokens (``token_ids[row, :num_tokens[row]]``, its prompt once and
then the tokens the runner samples for it), its adapter, its sampling columns and its
block-table row (``BlockTable``). Rows belong to the requests scheduled in the current
step: a request left out of a step (the token budget ran out) gives its row back and keeps
its tokens and blocks in a ``CachedRequestState`` until it is scheduled again; a preempted
request is forgotten and comes back as a new request (its blocks were freed). No row moves:
a step's batch order is the scheduler's, gathered through ``seq_rows``, so nothing is
condensed.

O(context) work happens once per request, when it joins.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from manylora.lora.kernels.cost_model import LoRAVariantModel
from manylora.ops.attention_metadata import prefill_block_q
from manylora.sample.penalties import PenaltyInputs
from manylora.sample.prompt_logprobs import PromptLogprobsPlan
from manylora.sampling_params import SamplingParams
from manylora.scheduler_output import NewRequestData, SchedulerOutput
from manylora.worker.block_table import BlockTable


@dataclass
class CachedRequestState:
    """What the runner keeps of a request between its steps.

    Attributes:
        req_id: the request's id.
        block_ids: its whole block table (the runner's own list, extended by the deltas).
        lora_int_id: its adapter (0: the base model).
        sampling_params: its ``SamplingParams``.
        token_ids: its tokens while it holds no row (int32 numpy), None while it does.
        uid: a number no other state of this batch has (a request id can come back, as a
            new request, while a step sampled for the old one is in flight).
        num_prompt_tokens: how many of its tokens are the prompt.
        lora_start: the first position its adapter applies to (``NewRequestData``'s).
    """

    req_id: str
    block_ids: list[int]
    lora_int_id: int
    sampling_params: SamplingParams
    token_ids: np.ndarray | None = None
    uid: int = 0
    num_prompt_tokens: int = 0
    lora_start: int = 0


@dataclass
class SampleInfo:
    """Host facts of a step's sampled rows, for rank 0's sampler.

    Attributes:
        req_ids: the sampled requests, in sampled-row order.
        rows: int64 ``[N]``, their input-batch rows.
        uids: int64 ``[N]``, their states' ``CachedRequestState.uid``.
        step: the step's number (``InputBatch.append_sampled`` takes it back).
        all_greedy, all_random, do_top_k, do_top_p, do_min_p: ``SamplingTensors`` flags.
        seeded: indices (into the sampled rows) of seeded random rows.
        logprobs: ``(index, k)`` of the sampled rows that asked for ``k`` log-probs.
        penalties: the logits processors' inputs of the sampled rows that use one
            (``sample.penalties``); None when none does.
        prompt: the step's prompt log-probability rows (``sample.prompt_logprobs``); None
            when no row computes any.
        masked: int64 indices (into the sampled rows) of the rows whose logits get a
            host-built token mask before sampling (``structured_outputs`` or
            ``bad_words``, ``SamplingParams.uses_host_mask``); None when none has.
    """

    req_ids: list[str]
    rows: np.ndarray
    uids: np.ndarray
    step: int
    all_greedy: bool
    all_random: bool
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool
    seeded: list[int]
    logprobs: list[tuple[int, int]]
    penalties: PenaltyInputs | None = None
    prompt: PromptLogprobsPlan | None = None
    masked: np.ndarray | None = None


class InputBatch:
    """Rows of the requests in the step, as numpy columns (rank 0's host state).

    Args:
        num_rows: initial rows; the batch grows (doubling) when more requests are
            scheduled at once, unless ``max_rows`` forbids it.
        max_model_len: the longest sequence, tokens (the token columns' width).
        block_size: tokens per KV block.
        max_loras: adapter slots (0: LoRA off).
        vocab_size: V; a top-k of V or more is off.
        num_queries_per_kv: G, query heads per KV head (sizes prefill tiles).
        max_rows: rows the batch may never exceed (CUDA graphs hold the block table's
            address), None: no bound.
        lora_variant: the projections, rank and GPU the LoRA kernel variant of each step
            is modelled for (``lora.punica.default_variant``); None: its default.

    Attributes:
        token_ids: int32 ``[rows, max_model_len]``.
        num_tokens: int64 ``[rows]``, tokens each row holds.
        lora_id: int64 ``[rows]``, each row's adapter id (0: base).
        temperature, top_p, min_p: float32 ``[rows]``; top_k: int32 ``[rows]``; greedy,
            seeded: bool ``[rows]``; logprobs: int32 ``[rows]`` (-1: none);
            processed: bool ``[rows]``, the row uses a penalty, ``logit_bias`` or
            ``allowed_token_ids``; masked: bool ``[rows]``, the row gets a host-built
            token mask (``SamplingParams.uses_host_mask``); num_prompt: int64 ``[rows]``,
            prompt tokens; prompt_lp: int32 ``[rows]``, ``SamplingParams.prompt_logprobs``
            (-1: none).
        block_table: the rows' ``BlockTable``.
        requests: ``{req_id: CachedRequestState}`` of every request the runner holds.
        row_of: ``{req_id: row}`` of the requests that hold a row.
        row_uid: int64 ``[rows]``, the ``uid`` of each row's state (-1: free).
        pending: ``{req_id: index}`` of the requests the last prepared step samples whose
            token has not reached the host (``append_sampled``): the next step takes such a
            token from that step's sampled tokens on the device (async scheduling).
    """

    def __init__(self, num_rows: int, max_model_len: int, block_size: int, max_loras: int,
                 vocab_size: int, num_queries_per_kv: int, max_rows: int | None = None,
                 lora_variant: LoRAVariantModel | None = None) -> None:
        self.max_model_len = max_model_len
        self.lora_variant = lora_variant
        self.block_size = block_size
        self.max_loras = max_loras
        self.vocab_size = vocab_size
        self.block_q = prefill_block_q(num_queries_per_kv)
        self.max_rows = max_rows
        self.width = -(-max_model_len // block_size)
        self.block_table = BlockTable(num_rows, self.width)
        self.requests: dict[str, CachedRequestState] = {}
        self.row_of: dict[str, int] = {}
        self.pending: dict[str, int] = {}
        self._step = 0                                         # steps prepared
        self._uids = itertools.count(1)
        self._free_rows = list(range(num_rows))                # a heap: the lowest first
        self._alloc(num_rows)

    def _alloc(self, num_rows: int) -> None:
        def grow(old, dtype, fill=0, shape=()):
            new = np.full((num_rows, *shape), fill, dtype=dtype)
            if old is not None:
                new[:old.shape[0]] = old
            return new

        g = self.__dict__.get
        self.token_ids = grow(g("token_ids"), np.int32, 0, (self.max_model_len,))
        self.num_tokens = grow(g("num_tokens"), np.int64)
        self.row_uid = grow(g("row_uid"), np.int64, -1)
        self.lora_id = grow(g("lora_id"), np.int64)
        self.lora_start = grow(g("lora_start"), np.int64)
        self.temperature = grow(g("temperature"), np.float32)
        self.top_k = grow(g("top_k"), np.int32)
        self.top_p = grow(g("top_p"), np.float32, 1.0)
        self.min_p = grow(g("min_p"), np.float32)
        self.greedy = grow(g("greedy"), bool, True)
        self.seeded = grow(g("seeded"), bool, False)
        self.logprobs = grow(g("logprobs"), np.int32, -1)
        self.processed = grow(g("processed"), bool, False)
        self.masked = grow(g("masked"), bool, False)
        self.num_prompt = grow(g("num_prompt"), np.int64)
        self.prompt_lp = grow(g("prompt_lp"), np.int32, -1)
        self.block_table.grow(num_rows)

    @property
    def num_rows(self) -> int:
        return self.num_tokens.shape[0]

    # ------------------------------------------------------------------ rows

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.num_rows
            new = old * 2 if self.max_rows is None else min(old * 2, self.max_rows)
            if new <= old:
                raise RuntimeError(f"the input batch holds {old} rows, the most CUDA graphs "
                                   "allow, and a step variants more requests")
            self._alloc(new)
            self._free_rows = list(range(old, new))
        return heapq.heappop(self._free_rows)

    def _give_row(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.block_table.clear_row(row)
            self.num_tokens[row] = 0
            self.row_uid[row] = -1
            heapq.heappush(self._free_rows, row)

    def _fill_row(self, row: int, state: CachedRequestState, token_ids) -> None:
        tokens = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        n = tokens.size
        self.token_ids[row, :n] = tokens
        self.num_tokens[row] = n
        self.row_uid[row] = state.uid
        self.lora_id[row] = state.lora_int_id
        self.lora_start[row] = state.lora_start
        p = state.sampling_params
        greedy = p.greedy
        self.greedy[row] = greedy
        self.temperature[row] = 0.0 if greedy else p.temperature
        self.top_k[row] = 0 if greedy or not 0 < p.top_k < self.vocab_size else p.top_k
        self.top_p[row] = 1.0 if greedy else p.top_p
        self.min_p[row] = 0.0 if greedy else p.min_p
        self.seeded[row] = p.seed is not None and not greedy
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.processed[row] = p.uses_logits_processors
        self.masked[row] = p.uses_host_mask
        self.num_prompt[row] = state.num_prompt_tokens
        self.prompt_lp[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.block_table.set_row(row, state.block_ids)
        self.row_of[state.req_id] = row

    def _add_new(self, new: NewRequestData) -> None:
        n_prompt = new.num_prompt_tokens
        state = CachedRequestState(new.req_id, list(new.block_ids), new.lora_int_id,
                                   new.sampling_params, uid=next(self._uids),
                                   num_prompt_tokens=(len(new.all_token_ids) if n_prompt < 0
                                                      else n_prompt),
                                   lora_start=new.lora_start)
        self.requests[new.req_id] = state
        self.pending.pop(new.req_id, None)
        row = self.row_of.get(new.req_id)
        self._fill_row(self._take_row() if row is None else row, state, new.all_token_ids)

    def _park(self, req_id: str) -> None:
        """Give back the row of a request left out of this step; keep its tokens."""
        row = self.row_of[req_id]
        self.requests[req_id].token_ids = self.token_ids[row, :self.num_tokens[row]].copy()
        self._give_row(req_id)

    def _unpark(self, req_id: str) -> None:
        state = self.requests[req_id]
        tokens, state.token_ids = state.token_ids, None
        self._fill_row(self._take_row(), state, tokens)

    def remove(self, req_ids: Sequence[str]) -> None:
        """Forget requests (finished or preempted): their rows and states. Unknown ids are
        ignored."""
        for rid in req_ids:
            self._give_row(rid)
            self.requests.pop(rid, None)
            self.pending.pop(rid, None)

    def update_states(self, out: SchedulerOutput) -> list[str]:
        """Apply a plan's deltas (vLLM v1's ``_update_states``): forget the preempted,
        park the rows of requests the plan leaves out, add the new requests, append the
        new blocks, and give parked requests scheduled again their row back.

        Returns:
            The scheduled request ids, in batch order.

        New block ids are applied idempotently (``CachedRequestData.num_blocks``): a plan
        sent again after a step that failed part-way appends nothing twice.

        Raises:
            ValueError: (nothing changed) the plan names as cached, or variants, a request
                the batch does not hold, gives a cached request's table a length its new
                blocks cannot reach, or sends a request longer than ``max_model_len``.
        """
        cached = out.scheduled_cached_reqs
        new_ids = {new.req_id for new in out.scheduled_new_reqs}
        appended = []                                   # refuse before changing anything
        for rid, blocks, total in zip(cached.req_ids, cached.new_block_ids, cached.num_blocks):
            state = self.requests.get(rid)
            if state is None or rid in out.preempted:
                raise ValueError(f"the plan names request {rid!r} as cached, but the input "
                                 "batch does not hold it (it was never sent as new)")
            missing = total - len(state.block_ids)
            if not 0 <= missing <= len(blocks):
                raise ValueError(f"request {rid!r}: the plan's table has {total} blocks, "
                                 f"{len(blocks)} of them new, but the batch holds "
                                 f"{len(state.block_ids)}")
            if missing:
                appended.append((rid, blocks[len(blocks) - missing:]))
        for new in out.scheduled_new_reqs:
            if len(new.all_token_ids) > self.max_model_len:
                raise ValueError(f"request {new.req_id!r} has {len(new.all_token_ids)} "
                                 f"tokens, more than max_model_len={self.max_model_len}")
        ids = [s.request.request_id for s in out.scheduled]
        for rid in ids:
            if rid not in self.requests and rid not in new_ids:
                raise ValueError(f"request {rid!r} is scheduled but the input batch does "
                                 "not hold it and the plan does not send it as new")
        self.remove(out.preempted)
        if len(self.row_of) != len(ids) or not all(rid in self.row_of for rid in ids):
            scheduled = set(ids)
            for rid in [r for r in self.row_of if r not in scheduled]:
                self._park(rid)
        for new in out.scheduled_new_reqs:
            self._add_new(new)
        for rid, blocks in appended:
            self.requests[rid].block_ids.extend(blocks)
            row = self.row_of.get(rid)
            if row is not None:
                self.block_table.append(row, blocks)
        for rid in ids:
            if rid not in self.row_of:
                self._unpark(rid)
        return ids

    def begin_step(self, req_ids: list[str]) -> int:
        """Record a prepared step that samples ``req_ids`` (in sampled-row order): their
        tokens are ``pending`` until ``append_sampled``. Returns the step's number."""
        self._step += 1
        self.pending = dict(zip(req_ids, range(len(req_ids))))
        return self._step

    def append_sampled(self, info: SampleInfo, tokens: Sequence[int]) -> None:
        """Append a step's sampled tokens (``tokens[i]`` for ``info.req_ids[i]``) once they
        reach the host, to the row or, for a request the batch parked since, to its kept
        tokens. Under async scheduling the next step was prepared before this: a request
        finished or preempted since (its state is gone or new) gets nothing, and a row
        already at ``max_model_len`` keeps its tokens (its request ends with this step).
        """
        if info.step == self._step:
            self.pending = {}                      # nothing prepared since: all on the host
        if not len(info.rows):
            return
        toks = np.asarray(tokens, dtype=np.int32)
        rows = info.rows
        here = self.row_uid[rows] == info.uids
        r, t = rows[here], toks[here]
        lens = self.num_tokens[r]
        room = lens < self.max_model_len
        self.token_ids[r[room], lens[room]] = t[room]
        self.num_tokens[r[room]] += 1
        for i in np.nonzero(~here)[0].tolist():       # parked since the step was prepared
            state = self.requests.get(info.req_ids[i])
            if (state is not None and state.uid == info.uids[i] and state.token_ids is not None
                    and state.token_ids.size < self.max_model_len):
                state.token_ids = np.append(state.token_ids, toks[i])
