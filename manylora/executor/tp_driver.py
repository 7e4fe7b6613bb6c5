"""Rank 0's end of tensor parallelism: ``TPDriver`` starts ranks 1..N-1 (``run_worker``),
joins their process group and sends them every message.

Before each step's forward pass rank 0 sends the step's inputs (``StepInputs``: one int32
buffer whose block-table part is the step's writes, not the tables) down each worker's
pipe; every rank keeps its own replica of the device block table and step buffers, applies
the same writes and runs the same forward pass on its shard, so the collectives inside the
model line up (Megatron-LM's tensor parallelism, as vLLM drives it: one driver, workers
that hold no scheduler state). The other messages are the KV cache's allocation (with the
capture of the decode CUDA graphs, whose all-reduces are captured too), an adapter entering
a slot (only the name of its pinned host buffer in shared memory and its plan), and a DoRA
adapter's row norms, which need every rank's part of the base weight. Every message is a
dict with an ``"op"`` encoded by ``encode_tensor_dict`` (whose tensors, for the DoRA norms'
``a`` and ``b``, follow by ``broadcast_tensor_dict``): no pickle travels.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections import deque

import torch
import torch.distributed as dist

from manylora.distributed.broadcast import encode_tensor_dict
from manylora.distributed.parallel_state import TPGroup
from manylora.distributed.process_group import (
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    destroy_process_group_within,
    end_startup,
    free_init_method,
)
from manylora.distributed.shared_host import Acks, SharedHostBuffers
from manylora.distributed.workers import WorkerGroup
from manylora.lora.pinned import PinnedAdapter
from manylora.worker.step_codec import encode_step
from manylora.worker.step_inputs import StepInputs
from manylora.worker.tp_worker import WorkerSpec, rank_device, run_worker

logger = logging.getLogger(__name__)

#: Seconds rank 0 gives ``destroy_process_group`` at shutdown before aborting the group.
DESTROY_TIMEOUT_S = 30.0


def slot_message(slot: int, pinned: PinnedAdapter, name: str, seq: int) -> dict:
    """The ``"slot"`` message of an adapter entering ``slot``: its shared buffer's file
    ``name``, size and plan, and the message's sequence number ``seq``."""
    return {"op": "slot", "slot": slot, "seq": seq, "name": name, "nbytes": pinned.buf.numel(),
            "plan": pinned.plan, "dtype": str(pinned.dtype).removeprefix("torch."),
            "lora_int_id": pinned.lora_int_id, "lora_name": pinned.name,
            "digest": pinned.digest, "rank": pinned.rank, "has_dora": pinned.has_dora}


class TPDriver:
    """Rank 0's end: starts ranks 1..N-1, joins the process group with them, and sends
    them every message.

    Args:
        spec: what the workers build.
        tp_size: ranks in all.
        timeout_s: the collective timeout, seconds: every collective's bound once start-up
            is over (``allocate_kv``).
        startup_timeout_s: seconds the workers may take to start, join the process group
            and load their shards (every wait until ``allocate_kv``).

    Attributes:
        tp: rank 0's ``TPGroup``.
        share_sampled: steps tell the workers to receive rank 0's sampled tokens
            (``broadcast_sampled``); set by the executor under async scheduling.

    Raises:
        WorkerDiedError: a worker died while starting (or later, from any method).
    """

    def __init__(self, spec: WorkerSpec, tp_size: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        backend = "nccl" if spec.device_type == "cuda" else "gloo"
        pipes = [multiprocessing.get_context("spawn").Pipe(duplex=False)
                 for _ in range(tp_size - 1)]
        self._writers = [w for _, w in pipes]
        self.timeout_s = timeout_s
        self.host_buffers = SharedHostBuffers()
        self._acks = Acks(self.host_buffers.prefix + "-acks", tp_size, create=True)
        self._sent: deque[tuple[int, PinnedAdapter]] = deque()
        self._seq = 0
        self.device = rank_device(spec.device_type, 0)
        self.workers = WorkerGroup(run_worker, tp_size, backend=backend,
                                   init_method=free_init_method(),
                                   args=(spec, backend, (startup_timeout_s, timeout_s),
                                         tuple(r for r, _ in pipes), self._acks.name),
                                   timeout_s=startup_timeout_s)
        # the workers hold the read ends now; with rank 0's copies closed, a write to a dead
        # worker's pipe fails (EPIPE) instead of blocking on a full pipe
        for reader, _ in pipes:
            reader.close()
        try:
            self.workers.join_process_group()
        except BaseException:
            self.workers.shutdown()
            raise
        self.tp = TPGroup.from_process_group()
        self.share_sampled = False
        self._stopped = False

    def send(self, msg: dict, tensors: dict | None = None) -> None:
        """Send one message to the workers: ``msg`` (plain values and small host tensors)
        down every worker's pipe, then ``tensors``, if any, by ``WorkerGroup.broadcast``.

        Raises:
            WorkerDiedError: a worker has died.
        """
        data = encode_tensor_dict({**msg, "then_broadcast": tensors is not None})
        with self.workers.guard():
            try:
                for writer in self._writers:
                    writer.send_bytes(data)
            except OSError as exc:
                raise RuntimeError(f"a tensor-parallel worker's pipe failed: {exc}") from exc
        if tensors is not None:
            self.workers.broadcast(tensors)

    def allocate_kv(self, num_blocks: int, max_model_len: int,
                    graph_sizes: tuple[int, ...], max_num_batched_tokens: int,
                    max_num_seqs: int, piece_sizes: tuple[int, ...] = ()) -> None:
        """Every worker allocates ``num_blocks`` KV blocks, compiles (or loads) its Triton
        specializations for steps of up to ``max_num_batched_tokens`` tokens and
        ``max_num_seqs`` sequences (``warm_up_triton``, which runs no collective), and
        captures the decode graphs of ``graph_sizes`` (for sequences up to ``max_model_len``
        tokens) and the piecewise graphs of ``piece_sizes`` (token buckets; rank 0's runner
        has the same, so the workers replay its padded piecewise steps); rank 0 must then
        capture its own (the captures' collectives pair up). Start-up ends here: every rank
        waits for the others (``end_startup``), and from then on every collective is bounded
        by ``timeout_s``.

        Raises:
            WorkerDiedError: a worker has died.
        """
        self.send({"op": "kv", "num_blocks": num_blocks, "max_model_len": max_model_len,
                   "graph_sizes": list(graph_sizes), "piece_sizes": list(piece_sizes),
                   "max_num_batched_tokens": max_num_batched_tokens,
                   "max_num_seqs": max_num_seqs})
        with self.workers.guard():
            end_startup(self.device, self.timeout_s)

    def step(self, inputs: StepInputs) -> None:
        """Send a step's inputs to the workers (before rank 0's forward pass)."""
        self.send({"op": "step", "share_sampled": self.share_sampled, **encode_step(inputs)})

    def broadcast_sampled(self, tokens: torch.Tensor) -> None:
        """Broadcast rank 0's sampled tokens (int64 ``[N]``) of the step just sent, which
        every worker receives after its logits (``share_sampled``): under async scheduling
        the next step reads decode tokens from them on each rank's device. Enqueued on the
        stream; nothing waits on the host."""
        with self.workers.guard():
            dist.broadcast(tokens, src=0)

    def write_slot(self, slot: int, pinned: PinnedAdapter) -> None:
        """Have every worker load ``pinned`` (whose buffer ``host_buffers`` allocated) into
        ``slot`` from shared memory (``LoRAManager.on_write_slot``); the buffer is kept
        alive until every worker has mapped it.

        Raises:
            KeyError: a buffer not in shared memory.
            WorkerDiedError: a worker has died.
        """
        self._seq += 1
        self.send(slot_message(slot, pinned, self.host_buffers.name_of(pinned.buf), self._seq))
        self._sent.append((self._seq, pinned))
        handled = self._acks.handled()
        while self._sent and self._sent[0][0] <= handled:
            self._sent.popleft()

    def dora_norm(self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Have every worker enter the DoRA row-norm collective of ``(layer, module)`` with
        the adapter's whole ``a [r, in]`` and ``b [out, r]``; rank 0 then enters it too
        (``LlamaForCausalLM.lora_dora_norm``)."""
        self.send({"op": "dora_norm", "layer": layer, "module": module}, {"a": a, "b": b})

    def base_weight_equal(self, module: str, weight: torch.Tensor) -> None:
        """Have every worker enter the comparison of an adapter's copy of the base
        ``embed_tokens`` / ``lm_head`` table ``weight [vocab, hidden]`` with its rows of the
        model's; rank 0 then enters it too (``LlamaForCausalLM.lora_base_weight_equal``)."""
        self.send({"op": "base_weight_equal", "module": module}, {"weight": weight})

    def shutdown(self) -> None:
        """Tell the workers to stop, reap them, and leave the process group (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.workers.error is None:
                self.send({"op": "stop"})
        except Exception:
            logger.exception("telling the tensor-parallel workers to stop failed")
        self.workers.shutdown()
        for writer in self._writers:
            writer.close()
        destroy_process_group_within(DESTROY_TIMEOUT_S)
