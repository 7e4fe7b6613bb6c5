"""Runs one scheduled step on the model: flat inputs, forward, logits, sampling.

The model runner never touches a queue: it reads a ``SchedulerOutput`` and returns the
sampled tokens. Every per-step tensor (ids, positions, cache slots, attention and LoRA
metadata) is built once here and shared by all layers. Decode steps (one token per
request) replay a CUDA graph when graphs are on; other steps run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from manylora.core.scheduler import SchedulerOutput
from manylora.lora.punica import build_lora_mapping
from manylora.model.llama import LlamaForCausalLM
from manylora.ops.attention import KVCache, build_attention_metadata
from manylora.sample.sampler import (
    SampledTokens,
    Sampler,
    SamplingTensors,
    make_generator,
    tokens_and_logprobs_to_host,
)
from manylora.worker.cuda_graph import DecodeGraphs


@dataclass
class StepInputs:
    """One step's model inputs on the host: enough for any rank to build the same
    metadata and run the same forward pass.

    Attributes:
        ids, positions: the step's token ids and their positions, ``T`` each.
        query_lens: new tokens per scheduled sequence; context_lens: tokens in its cache
            after the step; block_tables: its physical blocks.
        token_slots: the adapter slot of each row, -1 for the base model.
        slot_ranks, slot_dora: each slot's true rank and DoRA flag (length max_loras).
        bucket: the CUDA-graph batch size a decode step is padded to, None: eager.
        sample_rows: the rows whose logits are sampled, in request order.
    """

    ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    token_slots: list[int]
    slot_ranks: list[int]
    slot_dora: list[int]
    bucket: int | None
    sample_rows: list[int]


class ModelRunner:
    """Executes steps of a ``LlamaForCausalLM`` over a paged KV cache.

    Args:
        model: the loaded model (with slot buffers when LoRA is on).
        kv_caches: one ``KVCache`` per layer (``allocate_kv_caches``): ``data [2, num_blocks,
            block_size, num_kv_heads, head_dim]`` and, when quantized, float32 ``scale``.
        block_size: tokens per cache block.
        max_loras: number of adapter slots (0 when LoRA is off).
        max_model_len: the longest sequence, tokens (fixes a graph's block-table width).
        cuda_graph_sizes: decode batch sizes to capture as CUDA graphs; empty: always eager.

    Attributes:
        on_step: called with each step's ``StepInputs`` before its forward pass (tensor
            parallelism sends them to the other ranks there); None by default.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache],
                 block_size: int, max_loras: int, max_model_len: int,
                 cuda_graph_sizes: Sequence[int] = ()) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_loras = max_loras
        self.device = kv_caches[0].data.device
        cfg = model.cfg
        self.vocab_size = cfg.vocab_size
        self.num_queries_per_kv = cfg.num_heads // cfg.num_kv_heads
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self.graphs = DecodeGraphs(self._forward, cuda_graph_sizes) if cuda_graph_sizes else None
        self.on_step: Callable[[StepInputs], None] | None = None

    def _forward(self, input_ids, positions, attn, lora) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, attn, lora)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, lora_slots: dict[int, int],
                slot_ranks: list[int], slot_dora: list[int] | None = None) -> SampledTokens:
        """Compute one step, sample, and gather the log-probabilities asked for.

        Args:
            out: the scheduler's plan.
            lora_slots: ``{lora_int_id: slot}`` for the adapters of the step.
            slot_ranks: the true rank of each slot (length max_loras).
            slot_dora: 1 where a slot's adapter has DoRA scales (length max_loras); None: no
                DoRA slot. Read by the kernels as data, so it never selects another graph.

        Returns:
            ``SampledTokens(tokens, logprobs)``: ``tokens`` is ``{request_id: token_id}`` for
            each request whose last token was computed; ``logprobs`` is
            ``{request_id: TokenLogprobs}`` for those of them with ``SamplingParams.logprobs``
            set: the raw ``log_softmax`` of the logits, before temperature and the filters
            (vLLM v1's ``"raw_logprobs"``). Tokens and log-probabilities come to the host in
            one copy; a step where no request asks does no log-probability work.
        """
        inputs, sample_reqs = self.prepare(out, lora_slots, slot_ranks, slot_dora)
        if self.on_step is not None:
            self.on_step(inputs)
        hidden = self.forward_step(inputs)
        if not sample_reqs:
            return SampledTokens({}, {})
        dev = self.device
        logits = self.logits(hidden, inputs.sample_rows)
        params = [r.sampling_params for r in sample_reqs]
        tensors = SamplingTensors.from_params(params, self.vocab_size, dev)
        generators = {row: self._generator(r) for row, r in enumerate(sample_reqs)
                      if r.sampling_params.seed is not None and not r.sampling_params.greedy}
        sampled = self.sampler.sample(logits, tensors, generators)
        lp_rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        tokens, logprobs = tokens_and_logprobs_to_host(
            logits, sampled, lp_rows, [params[row].logprobs for row in lp_rows])
        return SampledTokens({r.request_id: t for r, t in zip(sample_reqs, tokens)},
                             {sample_reqs[row].request_id: lp
                              for row, lp in zip(lp_rows, logprobs)})

    def prepare(self, out: SchedulerOutput, lora_slots: dict[int, int], slot_ranks: list[int],
                slot_dora: list[int] | None) -> tuple[StepInputs, list]:
        """The step's host inputs (what every tensor-parallel rank needs to run it) and the
        requests sampled, in ``sample_rows`` order."""
        ids: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        sample_rows: list[int] = []
        sample_reqs = []
        for s in out.scheduled:
            req, end = s.request, s.start + s.num_tokens
            ids.extend(req.token_ids[s.start:end])
            positions.extend(range(s.start, end))
            token_slots.extend([lora_slots[req.lora_int_id] if req.lora_int_id else -1]
                               * s.num_tokens)
            if s.sample:
                sample_rows.append(len(ids) - 1)
                sample_reqs.append(req)
        bucket = (self.graphs.bucket(len(ids))
                  if self.graphs is not None and len(ids) == len(out.scheduled) else None)
        inputs = StepInputs(
            ids, positions, [s.num_tokens for s in out.scheduled],
            [s.start + s.num_tokens for s in out.scheduled],
            [list(s.block_table) for s in out.scheduled], token_slots, list(slot_ranks),
            [0] * len(slot_ranks) if slot_dora is None else list(slot_dora), bucket,
            sample_rows)
        return inputs, sample_reqs

    def forward_step(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states ``[>= T, hidden]`` of the step's rows (padded rows past ``T``): the
        metadata built from ``inputs``, then the forward pass (a graph replay for a decode
        step in a captured bucket)."""
        dev = self.device
        num_rows = len(inputs.ids)
        bucket = inputs.bucket
        pad = bucket if bucket is not None else num_rows
        attn = build_attention_metadata(
            inputs.query_lens, inputs.context_lens, inputs.block_tables, self.block_size,
            self.num_queries_per_kv, dev, pad_to=bucket,
            max_blocks_per_seq=self.max_blocks_per_seq if bucket else None)
        lora = None
        if self.max_loras and any(t >= 0 for t in inputs.token_slots):
            lora = build_lora_mapping(inputs.token_slots, inputs.slot_ranks, dev,
                                      slot_dora=inputs.slot_dora, pad_to=bucket)
        host = torch.tensor(inputs.ids + [0] * (pad - num_rows) + inputs.positions
                            + [0] * (pad - num_rows), dtype=torch.int64,
                            pin_memory=dev.type == "cuda")
        input_ids, pos = host.to(dev, non_blocking=True).split((pad, pad))
        if bucket is None:
            return self._forward(input_ids, pos, attn, lora)
        key = (bucket, None if lora is None else lora.schedule)
        return self.graphs.run(key, (input_ids, pos, attn, lora))

    def logits(self, hidden: torch.Tensor, sample_rows: list[int]) -> torch.Tensor:
        """float32 ``[len(sample_rows), vocab]``: the logits of the sampled rows.

        Nothing here waits for the GPU: a decode step samples rows ``0..n-1``, a slice of
        ``hidden``; other row lists go from pinned memory in a non-blocking copy (a pageable
        one would first wait for the forward pass to end, leaving the GPU idle while the
        host then launches the LM head and the sampler)."""
        n = len(sample_rows)
        if sample_rows == list(range(n)):
            return self.model.compute_logits(hidden[:n])
        rows = torch.tensor(sample_rows, dtype=torch.int64,
                            pin_memory=self.device.type == "cuda")
        return self.model.compute_logits(
            hidden.index_select(0, rows.to(self.device, non_blocking=True)))

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture every decode graph up front (vLLM captures at start-up too): one per
        batch size, without LoRA and with each LoRA kernel schedule when LoRA is on. The
        mappings flag no slot as DoRA: the kernels read ``slot_dora`` as data at replay."""
        if self.graphs is None:
            return
        schedules = (None, "bgmv", "sgmv") if self.max_loras else (None,)
        for size in reversed(self.graphs.capture_sizes):     # largest first: the pool fits all
            attn = build_attention_metadata([], [], [], self.block_size, self.num_queries_per_kv,
                                            self.device, pad_to=size,
                                            max_blocks_per_seq=self.max_blocks_per_seq)
            for schedule in schedules:
                lora = None if schedule is None else build_lora_mapping(
                    [], [0] * self.max_loras, self.device, slot_dora=[0] * self.max_loras,
                    pad_to=size, schedule=schedule)
                input_ids, positions = torch.zeros(2, size, dtype=torch.int64,
                                                   device=self.device)
                self.graphs.run((size, schedule), (input_ids, positions, attn, lora))

    def release_graphs(self) -> None:
        """Destroy the captured decode graphs; later decode steps run eagerly."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def release(self, request_ids: list[str]) -> None:
        """Drop the per-request state (seeded generators) of finished requests."""
        for rid in request_ids:
            self._generators.pop(rid, None)

    def _generator(self, req) -> torch.Generator:
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = make_generator(req.sampling_params.seed, self.device)
            self._generators[req.request_id] = gen
        return gen
