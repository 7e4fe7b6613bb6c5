"""Tensor parallelism's workers: the loop of ranks 1..N-1 (rank 0's end, ``TPDriver``, is
the tensor-parallel executor's).

A worker builds its shard of the model once (``WorkerSpec``), then serves rank 0's
messages, each a dict with an ``"op"`` encoded by ``encode_tensor_dict``: ``"kv"`` (allocate
the KV cache, build the runner, compile the Triton specializations, capture the same graphs
as rank 0), ``"step"`` (the step's packed inputs: the same forward pass as rank 0 on this
shard, so the collectives inside the model line up), ``"slot"`` (an adapter entering a
slot: the name of its pinned host buffer in shared memory and its plan; each rank maps the
buffer, copies it to its GPU and scatters its own part, ``SlotLayout.load``),
``"dora_norm"`` (a DoRA adapter's row norms, a collective whose tensors follow by
``broadcast_tensor_dict``), ``"base_weight_equal"`` (the same for the check of an
``embed_tokens`` / ``lm_head`` table an adapter carries) and ``"stop"``. No pickle travels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from manylora.config import LoRAConfig, ModelConfig
from manylora.distributed.broadcast import broadcast_tensor_dict, decode_tensor_dict
from manylora.distributed.parallel_state import TPGroup
from manylora.distributed.process_group import end_startup, init_distributed
from manylora.distributed.shared_host import Acks, SharedHostCache
from manylora.lora.pinned import PinnedAdapter
from manylora.lora.slot_layout import SlotLayout
from manylora.model.loader import load_hf_config, load_model
from manylora.worker.kv_cache import allocate_kv_caches
from manylora.worker.model_runner import ModelRunner
from manylora.worker.step_codec import decode_step
from manylora.worker.warmup import warm_up_triton


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its shard; given to it once, when it is started.

    Attributes:
        model_dir: the checkpoint directory (already resolved from a hub id).
        key_dict: extra checkpoint key translations.
        load_format: ``"auto"`` or ``"dummy"``.
        quantization: the engine's ``quantization`` setting (None: the checkpoint's).
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
    quantization: str | None = None


def rank_device(device_type: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: GPU ``rank`` on CUDA, else the CPU."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


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
    message, in ``end_startup`` (rank 0 enters it when it sends ``"kv"``).

    Messages arrive on this rank's pipe (``readers[rank - 1]``, encoded by
    ``encode_tensor_dict``), where waiting has no time limit: an idle engine never times a
    collective out. Only the tensors of ``"dora_norm"`` and ``"base_weight_equal"`` follow through a
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
    cfg = ModelConfig.from_hf(hf_config, getattr(torch, spec.dtype), spec.max_model_len,
                              spec.quantization)
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
                    runner.logits(hidden, inputs.layout, views, inputs.data)
                if inputs.layout.num_prompt_lp:
                    runner.prompt_logprobs(hidden, inputs.layout, views, host=inputs.data)
                if num_sampled and msg["share_sampled"]:
                    prev_sampled = torch.empty(num_sampled, dtype=torch.int64, device=device)
                    dist.broadcast(prev_sampled, src=0)
            elif op == "slot":
                load_slot_message(msg, layout, shared)
                acks.values[rank] = int(msg["seq"])
            elif op == "dora_norm":
                model.lora_dora_norm(int(msg["layer"]), msg["module"], msg["a"], msg["b"])
            elif op == "base_weight_equal":
                model.lora_base_weight_equal(msg["module"], msg["weight"])
            else:
                raise RuntimeError(f"tensor-parallel worker {rank}: unknown message {op!r}")
