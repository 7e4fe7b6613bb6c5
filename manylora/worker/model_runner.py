"""Runs one scheduled step on the model: the persistent input batch, forward, logits,
then sampling and the sampled tokens' way back to the host (``StepSampler``,
``worker/step_sampler.py``).

The model runner never touches a queue: it reads a ``SchedulerOutput`` (deltas: new
requests once, then new block ids) and returns the sampled tokens. Its ``InputBatch`` keeps
a row per request and packs each step with numpy into one pinned buffer
(``worker/step_inputs.py``); one host → device copy moves it, block-table changes are one
scatter into the persistent device block table, and the attention and LoRA metadata are
computed on the device (``worker/step_metadata.py``). Decode steps (one token per request)
replay a CUDA graph captured on those persistent buffers when graphs are on (the graphs are
captured on all-padding steps, ``worker/padding_steps.py``; for a LoRA step, the graph of
the projection kinds its slots target: ``StepLayout.lora_mask``, ``worker/graph_masks.py``);
other steps of up to the largest piece bucket are padded to a token bucket and replay the
model's pieces between attention calls (``worker/piecewise_graphs.py``), attention running
eagerly; larger steps run eagerly.

``execute_async`` launches a step (``execute_forward``, then ``sample``) and returns at
once with its tokens still on their way to the host (``AsyncSampledOutput``); ``get_output``
waits for them. Between the two the engine may launch the next step (async scheduling): a
decode token that step n sampled is read by step n+1 from step n's sampled tokens on the
device (``InputBatch.pending``). A step with grammar rows is launched in its two halves, so
its bitmask can wait for the previous step's tokens (the matchers' state).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from manylora.lora.kernels.meta import LoRAKernelMeta
from manylora.model.llama import LlamaForCausalLM
from manylora.ops.attention_metadata import AttentionMetadata, prefill_block_q
from manylora.ops.paged_kv import KVCache
from manylora.sample.prompt_logprobs import compute_prompt_logprobs, prompt_logits_chunks
from manylora.sample.sampler import SampledTokens
from manylora.scheduler_output import SchedulerOutput
from manylora.worker.cuda_graph import DecodeGraphs
from manylora.worker.input_batch import InputBatch, SampleInfo
from manylora.worker.padding_steps import padding_decode_step, padding_piece_step
from manylora.worker.piecewise_graphs import PiecewiseGraphs
from manylora.worker.prepare_inputs import prepare_inputs
from manylora.worker.step_inputs import LORA_VARIANT_CODES, StepBuffers, StepInputs, StepLayout
from manylora.worker.step_metadata import (
    attention_metadata,
    logits_rows_meta,
    lora_kernel_meta,
    lora_variant_model,
    with_projection_mask,
)
from manylora.worker.step_sampler import ForwardStep, LaunchedStep, StepSampler

#: Rows of the input batch (and device block table) before it first grows, without graphs.
INITIAL_ROWS = 16


class ModelRunner:
    """Executes steps of a ``LlamaForCausalLM`` over a paged KV cache.

    Args:
        model: the loaded model (with slot buffers when LoRA is on).
        kv_caches: one ``KVCache`` per layer (``allocate_kv_caches``): ``data [2, num_blocks,
            block_size, num_kv_heads, head_dim]`` and, when quantized, float32 ``scale``.
        block_size: tokens per cache block.
        max_loras: number of adapter slots (0 when LoRA is off).
        max_model_len: the longest sequence, tokens (fixes the block table's width).
        cuda_graph_sizes: decode batch sizes to capture as CUDA graphs; empty: always eager.
            With graphs, the largest size bounds the requests of a step (the engine makes
            it ``max_num_seqs``).
        piece_sizes: token buckets of the steps that are not decode graph steps, run as
            piecewise CUDA graphs (``PiecewiseGraphs``); empty: those steps run eagerly.
            Graphs are captured by ``capture_graphs`` (CUDA only); until then, and on the
            CPU, such steps are still padded to their bucket and run the pieces eagerly.
        graph_masks: projection masks (besides all projections) whose decode graphs are
            kept (``GraphMaskPolicy.max_masks``; 0: LoRA decode graphs always launch every
            projection).

    Raises:
        ValueError: a piece size below 1.

    Attributes:
        buffers: the persistent ``StepBuffers`` (pinned host, device, block table).
        graphs: the ``DecodeGraphs`` (None: decode steps eager); pieces: the
            ``PiecewiseGraphs`` (None: no piecewise steps).
        on_step: called with each step's ``StepInputs`` before its forward pass (tensor
            parallelism sends them to the other ranks there); None by default.
        on_sampled: called with each step's sampled tokens (int64 ``[N]`` on the device)
            right after sampling (tensor parallelism under async scheduling broadcasts them
            to the other ranks, whose next step reads them); None by default.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache],
                 block_size: int, max_loras: int, max_model_len: int,
                 cuda_graph_sizes: Sequence[int] = (), piece_sizes: Sequence[int] = (),
                 graph_masks: int = 4) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_loras = max_loras
        self.device = kv_caches[0].data.device
        cfg = model.cfg
        self.vocab_size = cfg.vocab_size
        self.num_queries_per_kv = cfg.num_heads // cfg.num_kv_heads
        self.block_q = prefill_block_q(self.num_queries_per_kv)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.step_sampler = StepSampler(self.device, self.vocab_size)
        table = model.slot_table
        self.graphs = DecodeGraphs(cuda_graph_sizes,
                                   0 if table is None else table.full_mask,
                                   max_masks=graph_masks) if cuda_graph_sizes else None
        largest = max(cuda_graph_sizes, default=0)
        self.pieces = PiecewiseGraphs(model, piece_sizes, self.device) if piece_sizes else None
        rows = largest or INITIAL_ROWS
        self._batch_args = (rows, max_model_len, block_size, max_loras, self.vocab_size,
                            self.num_queries_per_kv, largest or None,
                            lora_variant_model(model, self.device))
        self._input_batch: InputBatch | None = None
        capacity = max(1 << 16, 32 * largest + 16 * max(piece_sizes, default=0)
                       + 8 * max_loras + 8192)
        self.buffers = StepBuffers(capacity, rows, self.max_blocks_per_seq, self.device,
                                   model.model.rotary.long_rows)
        self.on_step: Callable[[StepInputs], None] | None = None
        self.on_sampled: Callable[[torch.Tensor], None] | None = None

    @property
    def input_batch(self) -> InputBatch:
        """The persistent ``InputBatch`` (made on first use: tensor-parallel workers, which
        only replay rank 0's step buffers, never hold one)."""
        if self._input_batch is None:
            self._input_batch = InputBatch(*self._batch_args)
        return self._input_batch

    def execute(self, out: SchedulerOutput, lora_slots: dict[int, int]) -> SampledTokens:
        """``get_output(execute_async(...))``: run one step and wait for its tokens."""
        return self.get_output(self.execute_async(out, lora_slots))

    @torch.inference_mode()
    def execute_async(self, out: SchedulerOutput, lora_slots: dict[int, int]
                      ) -> LaunchedStep | None:
        """Apply the plan's deltas to the input batch, launch the step, sample, and start
        the copy of the tokens (and the log-probabilities asked for) to the host; nothing
        waits for the device: ``sample(execute_forward(out, lora_slots))``.

        The plan may be made before the previous step's tokens reached the host (async
        scheduling): a request whose last token that step sampled takes it from those
        samples on the device.

        Args:
            out: the scheduler's plan.
            lora_slots: ``{lora_int_id: slot}`` for the adapters of the step (their ranks
                and DoRA flags are in the model's ``SlotTable``, which the kernels read).

        Returns:
            The launched step (``get_output`` reads it), or None when no row samples.

        Raises:
            ValueError: a plan the input batch cannot follow (a cached request it does not
                hold, tokens a row does not hold).
            KeyError: a request's adapter has no slot in ``lora_slots``.
        """
        forward = self.execute_forward(out, lora_slots)
        return None if forward is None else self.sample(forward)

    @torch.inference_mode()
    def execute_forward(self, out: SchedulerOutput, lora_slots: dict[int, int]
                        ) -> ForwardStep | None:
        """The first half of ``execute_async``: the plan's deltas, the forward pass and the
        sampled rows' logits, launched; ``sample`` launches the rest. Between the two the
        engine may read the previous step's tokens and fill this step's grammar bitmask
        (structured output under async scheduling, vLLM v1's order).

        Returns:
            The step's ``ForwardStep``, or None when no row samples and none computes
            prompt log-probabilities. Raises as ``execute_async``.
        """
        batch = self.input_batch
        ids = batch.update_states(out)
        if not ids:
            return None
        bucket_of = self.graphs.bucket if self.graphs is not None else _no_bucket
        pieces_of = self.pieces.bucket if self.pieces is not None else None
        inputs, info = prepare_inputs(batch, out, ids, lora_slots, bucket_of, self.buffers,
                                      pieces_of)
        inputs = with_projection_mask(inputs, self.model.slot_table, self.max_loras)
        if self.on_step is not None:
            self.on_step(inputs)
        hidden, views = self.forward_step(inputs, self.step_sampler.prev_sampled)
        if not info.req_ids and info.prompt is None:
            return None
        # the order of the tensor-parallel all-gathers (tp_worker replays it): the sampled
        # rows' logits, then the prompt rows' chunks
        logits = (self.logits(hidden, inputs.layout, views, inputs.data) if info.req_ids
                  else None)
        prompt = None
        if info.prompt is not None:
            prompt = self.prompt_logprobs(hidden, inputs.layout, views, info, inputs.data)
        return ForwardStep(info, logits, views, prompt)

    @torch.inference_mode()
    def sample(self, step: ForwardStep, bitmask: torch.Tensor | None = None) -> LaunchedStep:
        """Sample a step whose logits ``execute_forward`` launched, and start the copy of
        its tokens (and log-probabilities) to the host.

        Order (vLLM v1's): the grammar bitmask (``-inf`` on the tokens a row's grammar
        forbids), then ``allowed_token_ids``, ``logit_bias`` and the penalties, then
        temperature and the filters. Log-probabilities are those of the masked logits.

        Args:
            step: the launched forward pass.
            bitmask: int32 ``[k, 1 + ceil(V / 32)]`` host tensor
                (``StructuredOutputManager.fill``: column 0 the sampled row, the rest its
                bitmask), copied to the device in one copy; None: no row is constrained.

        A row whose masks leave no token allowed is reported in ``get_output``'s
        ``no_token``, not as a token.
        """
        return self.step_sampler.sample(step, bitmask, self._seed_of, self.on_sampled)

    def prompt_logprobs(self, hidden: torch.Tensor, layout: StepLayout, views: dict,
                        info: SampleInfo | None = None, host: np.ndarray | None = None
                        ) -> torch.Tensor | None:
        """float64, the flattened prompt log-probabilities of the step's prompt rows
        (``sample.prompt_logprobs.compute_prompt_logprobs``; ``layout.num_prompt_lp``
        rows, K the largest ``prompt_logprobs`` of ``info.prompt``), each chunk's
        ``lm_head`` adapters applied (``host``: the step's host buffer, which holds the
        rows' slots). Tensor-parallel workers call it with ``info`` None: they only compute
        the same chunks of logits, so that their all-gathers line up with rank 0's, and
        return None."""
        rows = views["prompt_rows"]

        def chunk_logits(h: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
            return self.model.compute_logits(h, self._rows_meta(layout, host, "prompt_rows",
                                                                (lo, hi)))

        if info is None:
            for lo, hi in prompt_logits_chunks(rows.shape[0], self.vocab_size):
                chunk_logits(hidden.index_select(0, rows[lo:hi].long()), lo, hi)
            return None
        return compute_prompt_logprobs(hidden, rows, views["prompt_targets"],
                                       max(info.prompt.num_logprobs), chunk_logits,
                                       self.vocab_size)

    def _rows_meta(self, layout: StepLayout, host: np.ndarray | None, segment: str,
                   span: tuple[int, int] | None = None) -> LoRAKernelMeta | None:
        """The LoRA mapping of the logits rows ``segment`` lists (``logits_rows_meta``);
        None without ``lm_head`` slots or the step's host buffer."""
        if self.model.head_lora is None or host is None:
            return None
        return logits_rows_meta(host, layout, self.max_loras, self.model.slot_table,
                                self.device, segment, span)

    def get_output(self, step: LaunchedStep | None) -> SampledTokens:
        """Wait for a launched step's tokens, append them to the input batch, and return
        them (nothing for None).

        Returns:
            ``SampledTokens(tokens, logprobs)``: ``tokens`` is ``{request_id: token_id}``
            for each request whose last token was computed; ``logprobs`` is
            ``{request_id: TokenLogprobs}`` for those of them with ``SamplingParams.logprobs``
            set: the raw ``log_softmax`` of the logits, before temperature and the filters
            (vLLM v1's ``"raw_logprobs"``). Tokens and log-probabilities come to the host in
            one copy; a step where no request asks does no log-probability work.
            ``prompt_logprobs`` is ``{request_id: PromptLogprobs}`` of the requests with
            ``SamplingParams.prompt_logprobs`` whose step computed prompt positions (empty
            when none did), in the same copy. ``no_token`` names the masked rows' requests
            whose masks allowed no token (``flag_empty_rows``).
        """
        if step is None:
            return SampledTokens({}, {})
        tokens, sampled = self.step_sampler.read(step)
        self.input_batch.append_sampled(step.info, tokens)
        return sampled

    def forward_step(self, inputs: StepInputs, prev_sampled: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, dict]:
        """Hidden states ``[>= T, hidden]`` of the step's rows (padded rows past ``T``) and
        the device views of its buffer: one host → device copy, the block-table writes,
        the token ids still on the device gathered from ``prev_sampled`` (int64, the
        previous step's samples), then the forward pass (a graph replay for a decode step
        in a captured bucket; the pieces of a piecewise step, replayed when captured, with
        attention eager between them). Every tensor-parallel rank runs this on the same
        ``inputs``.
        """
        views = self.buffers.upload(inputs, self.max_loras, prev_sampled)
        layout = inputs.layout
        if layout.pieces >= 0 and self.pieces is not None:
            return self._forward_pieces(views, layout, inputs.data), views
        if layout.bucket < 0 or self.graphs is None:
            return self._forward(views, layout, inputs.data), views
        key = self.graphs.select(layout.bucket, LORA_VARIANT_CODES[layout.variant],
                                 layout.lora_mask)
        if not self.graphs.has(key):
            self.buffers.frozen = True
            self.graphs.capture(key, lambda: self._forward(views, layout, mask=key[2]))
        return self.graphs.replay(key), views

    def _forward(self, views: dict, layout: StepLayout,
                 host: np.ndarray | None = None, mask: int | None = None) -> torch.Tensor:
        """The model over the step's device views: slot lora_meta and the step's block table
        from the persistent device block table, then the layers (captured whole in a
        graph). ``host``: the step's host buffer (an eager step's LoRA launch skip
        reads its active slots); ``mask``: a graph step's projection mask (the LoRA
        projections of other kinds launch nothing; None: all)."""
        return self.model(views["ids"].long(), _rope_positions(views).long(), self.kv_caches,
                          self._attention_metadata(views, layout),
                          self._lora_mapping(views, layout, host, mask))

    def _forward_pieces(self, views: dict, layout: StepLayout,
                        host: np.ndarray | None = None) -> torch.Tensor:
        """A piecewise step: the pieces of ``(layout.pieces, variant)``, graph replays when
        captured (the LoRA lora_meta is then read from the buffer by the graphs, not built),
        attention eager between them → hidden ``[Tb, hidden]``."""
        key = (layout.pieces, LORA_VARIANT_CODES[layout.variant])
        lora = None if self.pieces.has(key) else self._lora_mapping(views, layout, host)
        return self.pieces.run(key, views["ids"], _rope_positions(views), lora,
                               self._attention_metadata(views, layout), self.kv_caches)

    def _lora_mapping(self, views: dict, layout: StepLayout,
                      host: np.ndarray | None = None,
                      mask: int | None = None) -> LoRAKernelMeta | None:
        return lora_kernel_meta(views, layout, self.max_loras, self.model.slot_table, host,
                                mask)

    def _attention_metadata(self, views: dict, layout: StepLayout) -> AttentionMetadata:
        return attention_metadata(views, layout, self.buffers.block_table, self.block_size,
                                  self.block_q, self.num_queries_per_kv)

    def logits(self, hidden: torch.Tensor, layout: StepLayout, views: dict,
               host: np.ndarray | None = None) -> torch.Tensor:
        """float32 ``[N, vocab]``: the logits of the sampled rows, each through its own
        ``lm_head`` adapter (their mapping built from ``host``, the step's host buffer;
        None: the base head).

        Nothing here waits for the GPU: a decode step samples rows ``0..N-1``, a slice of
        ``hidden``; other steps gather the rows listed in the step buffer (already on the
        device)."""
        rows = self._rows_meta(layout, host, "sample_rows")
        if layout.sample_prefix:
            return self.model.compute_logits(hidden[:layout.num_sampled], rows)
        return self.model.compute_logits(hidden.index_select(0, views["sample_rows"]), rows)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture every CUDA graph up front (vLLM captures at start-up too; CUDA only).

        Decode graphs: one per batch size, without LoRA and with each LoRA kernel variant a
        graph step may pick (BGMV and row tiles: a padded SGMV grid is ``max_loras`` times
        the rows' tiles) when LoRA is on, for every projection, on an all-padding step
        (nothing is written to the cache); the graphs of fewer projections are captured
        while serving (``DecodeGraphs.select``). Then the piecewise graphs: ``L + 1`` pieces
        per token bucket, without LoRA and with row tiles (a piecewise step with LoRA rows
        always runs them), largest bucket first. Ranks and DoRA flags are the
        ``SlotTable``'s, read as data at replay. Tensor-parallel ranks call this together
        (their collectives are captured in order).
        """
        if self.device.type != "cuda":
            return
        if self.graphs is not None:
            variants = (None, "bgmv", "tiled") if self.max_loras else (None,)
            for size in reversed(self.graphs.capture_sizes):  # largest first: the pool fits all
                for variant in variants:
                    self.forward_step(padding_decode_step(
                        self.buffers, size, LORA_VARIANT_CODES.index(variant), self.max_loras,
                        self.max_blocks_per_seq))
        if self.pieces is not None:
            variants = (None, "tiled") if self.max_loras else (None,)
            for size in reversed(self.pieces.sizes):
                for variant in variants:
                    inputs = padding_piece_step(self.buffers, size,
                                                LORA_VARIANT_CODES.index(variant), self.max_loras)
                    views = self.buffers.upload(inputs, self.max_loras)
                    self.pieces.capture((size, variant), views["ids"], _rope_positions(views),
                                        self._lora_mapping(views, inputs.layout))
        if self.graphs is not None:
            self.graphs.end_startup()

    def release_graphs(self) -> None:
        """Destroy the captured graphs (decode and piecewise); later steps run eagerly."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.pieces is not None:
            self.pieces.release()
            self.pieces = None

    def release(self, request_ids: list[str]) -> None:
        """Drop the per-request state of finished requests: their input-batch rows and
        seeded generators."""
        if self._input_batch is not None:
            self._input_batch.remove(request_ids)
        self.step_sampler.release(request_ids)

    def _seed_of(self, req_id: str) -> int | None:
        return self.input_batch.requests[req_id].sampling_params.seed


def _no_bucket(num_rows: int) -> None:
    return None


def _rope_positions(views: dict) -> torch.Tensor:
    """What the model's RoPE reads of a step: the ``rope_rows`` of a ``longrope`` model,
    else the positions."""
    return views.get("rope_rows", views["positions"])
