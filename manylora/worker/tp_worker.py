"""Tensor parallelism: the worker loop of ranks 1..N-1, and rank 0's driver of it.

Rank 0 is the engine's own process: it variants, and before each step's forward pass it
sends the step's inputs (``StepInputs``: one int32 buffer whose block-table part
is the step's writes, not the tables) down each worker's pipe; every rank keeps its own
replica of the device block table and step buffers, applies the same writes and runs the
same forward pass on its shard, so the collectives inside the model line up
(Megatron-LM's tensor parallelism, as vLLM drives it: one driver, workers that hold no
scheduler state). The other messages are the KV cache's allocation (with the capture of
the decode CUDA graphs, whose all-reduces are captured too), an adapter entering a slot
(only the name of its pinned host buffer in shared memory and its plan: each rank maps the
buffer, copies it to its GPU and scatters its own part, ``SlotLayout.load``), and a DoRA
adapter's row norms, which need every rank's part of the base weight. Every message is a
dict with an ``"op"`` encoded by ``encode_tensor_dict`` (whose tensors, for the DoRA norms'
``a`` and ``b``, follow by ``broadcast_tensor_dict``): no pickle travels.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from manylora.config import LoRAConfig, ModelConfig
from manylora.distributed.broadcast import (
    broadcast_tensor_dict,
    decode_tensor_dict,
    encode_tensor_dict,
)
from manylora.distributed.parallel_state import TPGroup
from manylora.distributed.shared_host import Acks, SharedHostBuffers, SharedHostCache
from manylora.distributed.workers import (
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    WorkerGroup,
    destroy_process_group_within,
    end_startup,
    free_init_method,
    init_distributed,
)
from manylora.lora.pinned import PinnedAdapter
from manylora.lora.slot_layout import SlotLayout
from manylora.model.loader import load_hf_config, load_model
from manylora.worker.kv_cache import allocate_kv_caches
from manylora.worker.model_runner import ModelRunner
from manylora.worker.step_codec import decode_step, encode_step
from manylora.worker.step_inputs import StepInputs
from manylora.worker.warmup import warm_up_triton

logger = logging.getLogger(__name__)

#: Seconds rank 0 gives ``destroy_process_group`` at shutdown before aborting the group.
DESTROY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its shard; given to it once, when it is started.

    Attributes:
        model_dir: the checkpoint directory (already resolved from a hub id).
        key_dict: extra checkpoint key translations.
        load_format: ``"auto"`` or ``"dummy"``.
        dtype: the model dtype's name, e.g. ``"bfloat16"``.
        device_type: ``"cuda"`` (rank r uses GPU r) or ``"cpu"``.
        max_model_len: the engine's context length, tokens.
        trust_remote_code: passed to transformers for the config.
        lora: the adapter slots' config (None: LoRA off).
        block_size: tokens per KV block.
        kv_cache_dtype: ``"auto"``, ``"int8"`` or ``"fp8_e4m3"``.
    """

    model_dir: str
    key_dict: dict
    load_format: str
    dtype: str
    device_type: str
    max_model_len: int
    trust_remote_code: bool
    lora: LoRAConfig | None
    block_size: int
    kv_cache_dtype: str


def rank_device(device_type: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: GPU ``rank`` on CUDA, else the CPU."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def slot_message(slot: int, pinned: PinnedAdapter, name: str, seq: int) -> dict:
    """The ``"slot"`` message of an adapter entering ``slot``: its shared buffer's file
    ``name``, size and plan, and the message's sequence number ``seq``."""
    return {"op": "slot", "slot": slot, "seq": seq, "name": name, "nbytes": pinned.buf.numel(),
            "plan": pinned.plan, "dtype": str(pinned.dtype).removeprefix("torch."),
            "lora_int_id": pinned.lora_int_id, "lora_name": pinned.name,
            "digest": pinned.digest, "rank": pinned.rank, "has_dora": pinned.has_dora}


def load_slot_message(msg: dict, layout: SlotLayout, cache: SharedHostCache) -> None:
    """Load the adapter of a ``"slot"`` message into this rank's slot: map its shared buffer
    (``cache``), prepare this rank's scatter once per buffer, and ``layout.load`` it."""
    buf, load = cache.get(msg["name"], int(msg["nbytes"]))
    pinned = PinnedAdapter(int(msg["lora_int_id"]), msg["lora_name"], msg["digest"], buf,
                           msg["plan"], getattr(torch, msg["dtype"]), int(msg["rank"]),
                           bool(msg["has_dora"]))
    if load is None:
        load = layout.prepare(pinned)
        cache.put(msg["name"], load)
    layout.load(int(msg["slot"]), pinned, load)


def run_worker(rank: int, tp_size: int, init_method: str, spec: WorkerSpec, backend: str,
               timeouts: tuple[float, float], readers: tuple, acks_name: str) -> None:
    """A worker process's life (``WorkerGroup``'s target): join the group, load the shard,
    then serve rank 0's messages until ``"stop"``. The process group is left to rank 0 to
    destroy (``WorkerGroup`` ends the worker with ``os._exit``). ``timeouts`` is
    ``(startup_s, collective_s)``: start-up (``init_distributed``) ends with the ``"kv"``
    message, in ``end_startup`` (rank 0 enters it in ``TPDriver.allocate_kv``).

    Messages arrive on this rank's pipe (``readers[rank - 1]``, encoded by
    ``encode_tensor_dict``), where waiting has no time limit: an idle engine never times a
    collective out. Only the tensors of ``"dora_norm"`` follow through a
    ``broadcast_tensor_dict`` on the process group. EOF (rank 0 is gone) ends the worker. After each
    ``"slot"`` message the worker records its sequence number in the shared ``acks_name``
    array (rank 0 keeps the adapter's buffer alive until every worker has)."""
    reader = readers[rank - 1]
    device = rank_device(spec.device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    startup_s, collective_s = timeouts
    init_distributed(rank, tp_size, backend, init_method, startup_s)
    tp = TPGroup.from_process_group()
    hf_config = load_hf_config(Path(spec.model_dir), spec.trust_remote_code)
    cfg = ModelConfig.from_hf(hf_config, getattr(torch, spec.dtype), spec.max_model_len)
    model = load_model(Path(spec.model_dir), cfg, device, spec.key_dict, spec.load_format, tp)
    slots = model.create_lora_slots(spec.lora) if spec.lora is not None else {}
    max_loras = spec.lora.max_loras if spec.lora is not None else 0
    layout = (SlotLayout(slots, cfg.module_shapes(), spec.lora.max_lora_rank)
              if spec.lora is not None else None)
    shared = SharedHostCache(spec.lora.max_cpu_loras if spec.lora is not None else 1)
    acks = Acks(acks_name, tp_size)
    runner: ModelRunner | None = None
    prev_sampled: torch.Tensor | None = None
    with torch.inference_mode():
        while True:
            msg = decode_tensor_dict(reader.recv_bytes())
            if msg.pop("then_broadcast"):
                msg.update(broadcast_tensor_dict(None, src=0))
            op = msg.pop("op")
            if op == "stop":
                break
            if op == "kv":
                kv_caches = allocate_kv_caches(model.cfg, int(msg["num_blocks"]),
                                               spec.block_size, device, spec.kv_cache_dtype)
                runner = ModelRunner(model, kv_caches, spec.block_size, max_loras,
                                     int(msg["max_model_len"]), tuple(msg["graph_sizes"]),
                                     tuple(msg["piece_sizes"]))
                # this rank's Triton specializations (loaded from the disk cache rank 0 just
                # filled), so no eager step compiles a kernel here while serving
                warm_up_triton(model, kv_caches, spec.block_size,
                               int(msg["max_num_batched_tokens"]), int(msg["max_num_seqs"]),
                               int(msg["max_model_len"]))
                end_startup(device, collective_s)
                runner.capture_graphs()   # rank 0 captures the same graphs, in the same order
            elif op == "step":
                inputs = decode_step(msg)
                hidden, views = runner.forward_step(inputs, prev_sampled)
                # rank 0's collectives in its order: the logits' all-gather, the prompt
                # logits' all-gathers, then (async scheduling) the broadcast of its samples
                num_sampled = inputs.layout.num_sampled
                if num_sampled:
                    runner.logits(hidden, inputs.layout, views)
                if inputs.layout.num_prompt_lp:
                    runner.prompt_logprobs(hidden, inputs.layout, views)
                if num_sampled and msg["share_sampled"]:
                    prev_sampled = torch.empty(num_sampled, dtype=torch.int64, device=device)
                    dist.broadcast(prev_sampled, src=0)
            elif op == "slot":
                load_slot_message(msg, layout, shared)
                acks.values[rank] = int(msg["seq"])
            elif op == "dora_norm":
                model.lora_dora_norm(int(msg["layer"]), msg["module"], msg["a"], msg["b"])
            else:
                raise RuntimeError(f"tensor-parallel worker {rank}: unknown message {op!r}")


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
            (``broadcast_sampled``); set by the engine under async scheduling.

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
