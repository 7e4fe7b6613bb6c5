"""Runs one scheduled step on the model: flat inputs, forward, logits, sampling.

The model runner never touches a queue: it reads a ``SchedulerOutput`` and returns the
sampled tokens. Every per-step tensor (ids, positions, cache slots, attention and LoRA
metadata) is built once here and shared by all layers.
"""

from __future__ import annotations

import torch

from manylora.core.scheduler import SchedulerOutput
from manylora.lora.punica import build_lora_mapping
from manylora.model.llama import LlamaForCausalLM
from manylora.ops.attention import AttentionMetadata, SeqAttention
from manylora.sample.sampler import Sampler, SamplingTensors, make_generator


class ModelRunner:
    """Executes steps of a ``LlamaForCausalLM`` over a paged KV cache.

    Args:
        model: the loaded model (with slot buffers when LoRA is on).
        kv_caches: one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer.
        block_size: tokens per cache block.
        max_loras: number of adapter slots (0 when LoRA is off).
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor],
                 block_size: int, max_loras: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_loras = max_loras
        self.device = kv_caches[0].device
        self.vocab_size = model.cfg.vocab_size
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self._block_offsets = torch.arange(block_size, dtype=torch.int64)

    def _kv_slots(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """Flat cache slots of positions ``0..num_tokens-1``: int64 ``[num_tokens]``, host."""
        bs = self.block_size
        blocks = torch.tensor(block_table[: -(-num_tokens // bs)], dtype=torch.int64)
        return (blocks[:, None] * bs + self._block_offsets).flatten()[:num_tokens]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, lora_slots: dict[int, int],
                slot_ranks: list[int]) -> dict[str, int]:
        """Compute one step and sample.

        Args:
            out: the scheduler's plan.
            lora_slots: ``{lora_int_id: slot}`` for the adapters of the step.
            slot_ranks: the true rank of each slot (length max_loras).

        Returns:
            ``{request_id: token_id}`` for each request whose last token was computed.
        """
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[torch.Tensor] = []
        token_slots: list[int] = []
        seqs: list[tuple[int, int, int, torch.Tensor]] = []
        sample_rows: list[int] = []
        sample_reqs = []
        for s in out.scheduled:
            req, end = s.request, s.start + s.num_tokens
            query_start = len(ids)
            ids.extend(req.token_ids[s.start:end])
            positions.extend(range(s.start, end))
            kv_slots = self._kv_slots(s.block_table, end)
            slot_mapping.append(kv_slots[s.start:])
            token_slots.extend([lora_slots[req.lora_int_id] if req.lora_int_id else -1]
                               * s.num_tokens)
            seqs.append((query_start, s.num_tokens, end, kv_slots))
            if s.sample:
                sample_rows.append(len(ids) - 1)
                sample_reqs.append(req)
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.cat(slot_mapping).to(dev),
            seqs=tuple(SeqAttention(qs, ql, cl, kv.to(dev))
                       for qs, ql, cl, kv in seqs))
        lora = (build_lora_mapping(token_slots, slot_ranks, dev)
                if self.max_loras and any(t >= 0 for t in token_slots) else None)
        hidden = self.model(torch.tensor(ids, dtype=torch.int64).to(dev),
                            torch.tensor(positions, dtype=torch.int64).to(dev),
                            self.kv_caches, attn, lora)
        if not sample_reqs:
            return {}
        logits = self.model.compute_logits(
            hidden.index_select(0, torch.tensor(sample_rows, dtype=torch.int64).to(dev)))
        params = [r.sampling_params for r in sample_reqs]
        tensors = SamplingTensors.from_params(params, self.vocab_size, dev)
        generators = {row: self._generator(r) for row, r in enumerate(sample_reqs)
                      if r.sampling_params.seed is not None and not r.sampling_params.greedy}
        tokens = self.sampler.sample(logits, tensors, generators).tolist()
        return {r.request_id: t for r, t in zip(sample_reqs, tokens)}

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
