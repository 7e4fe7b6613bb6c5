"""One-copy slot loads: slot contents, rank table, tensor-parallel cuts, device op count.

An adapter is pinned (``pin_adapter``) and loaded through ``SlotLayout`` into the slots of a
tiny llama, whole or as one rank of two (column-, row-parallel and fully sharded); the slot
buffers are then compared with the adapter's own tensors cut by the projections' own ranges
(``LoRALinear.output_ranges`` / ``in_range``), element by element. Every buffer starts
filled with a sentinel, so a write outside the adapter's rows shows up. Without a GPU the
scatter kernel runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig

from manylora.config import LoRAConfig, ModelConfig
from manylora.distributed.parallel_state import TPGroup
from manylora.lora.adapter import LoRAAdapter, LoRAWeights
from manylora.lora.formats.target import AdapterTarget
from manylora.lora.manager import LoRAManager
from manylora.lora.pinned import align, pin_adapter
from manylora.lora.slot_layout import SlotLayout
from manylora.lora_request import LoRARequest
from manylora.model.llama import LlamaForCausalLM
from manylora.model.loader import load_model
from manylora.testing import make_checkpoint, make_peft_adapter

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)
MAX_RANK = 8
SENTINEL = 7.0
#: (layer, module): (rank, DoRA); every other (layer, module) is untargeted.
TARGETS = {(0, "q_proj"): (4, False), (0, "v_proj"): (6, True), (0, "gate_proj"): (8, False),
           (0, "down_proj"): (3, True), (1, "o_proj"): (5, False), (1, "up_proj"): (2, True),
           (1, "k_proj"): (7, False)}


def _model(tp: TPGroup, dtype: torch.dtype, layers: int = 2,
           device: str = "cpu") -> LlamaForCausalLM:
    hf = LlamaConfig(**dict(TINY, num_hidden_layers=layers))
    return LlamaForCausalLM(ModelConfig.from_hf(hf, dtype), torch.device(device), tp)


def _adapter(cfg: ModelConfig, targets: dict, dtype: torch.dtype, seed: int = 0,
             lid: int = 1) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(seed)
    shapes = cfg.module_shapes()
    weights = {}
    for (layer, module), (r, dora) in targets.items():
        n_in, n_out = shapes[module]
        weights[(layer, module)] = LoRAWeights(
            torch.randn(r, n_in, generator=gen).to(dtype),
            torch.randn(n_out, r, generator=gen).to(dtype),
            torch.rand(n_out, generator=gen) + 0.5 if dora else None)
    return LoRAAdapter(lid, f"adapter{lid}", weights)


def _fill(slots) -> None:
    for lora in {id(s): s for s in slots.values()}.values():
        for buf in (*lora.lora_a_stacked, *lora.lora_b_stacked, *lora.dora_scale_stacked):
            buf.fill_(SENTINEL)


def _cuts(model, layer: int, module: str, r: int):
    """This rank's (A rows, A columns, B/scale output columns) of a rank-``r`` module, from
    the projection's own split."""
    proj = model._projection(layer, module)
    i = proj.module_names.index(module)
    full_in, full_out = proj.full_in_features, proj.full_output_sizes[i]
    rows = (0, r)
    out = (0, full_out)
    if proj.parallel == "column":
        out = proj.output_ranges[i]
        if proj.fully_sharded:
            lo, hi = proj.tp.even_range(MAX_RANK, "rank")
            rows = (lo, max(lo, min(r, hi)))
    elif proj.parallel == "row" and proj.fully_sharded:
        out = proj.tp.even_range(full_out, "out")
    cols = proj.in_range if proj.parallel == "row" else (0, full_in)
    return rows, cols, out


def _check_slot(model, slots, adapter: LoRAAdapter, slot: int) -> None:
    table = model.slot_table
    for (layer, module), lora in slots.items():
        s = lora.module_names.index(module)
        a_buf = lora.lora_a_stacked[s][slot].cpu()
        b_buf = lora.lora_b_stacked[s][slot].cpu()
        scale_buf = lora.dora_scale_stacked[s][slot].cpu()
        col = table.column(layer, module)
        w = adapter.weights.get((layer, module))
        if w is None:
            assert table.ranks[slot, col] == 0 and table.dora[slot, col] == 0
            for buf in (a_buf, b_buf, scale_buf):
                assert bool((buf == SENTINEL).all()), f"untargeted {layer} {module} written"
            continue
        r = w.rank
        (r0, r1), (i0, i1), (o0, o1) = _cuts(model, layer, module, r)
        assert torch.equal(a_buf[: r1 - r0], w.a[r0:r1, i0:i1]), (layer, module)
        assert bool((a_buf[r1 - r0:] == SENTINEL).all())
        assert torch.equal(b_buf[:r], w.b[o0:o1].t()), (layer, module)
        assert bool((b_buf[r:] == SENTINEL).all())
        if w.dora_scale is None:
            assert bool((scale_buf == SENTINEL).all())
        else:
            assert torch.equal(scale_buf, w.dora_scale[o0:o1])
        assert int(table.ranks[slot, col]) == r
        assert int(table.dora[slot, col]) == int(w.dora_scale is not None)
    assert np.array_equal(table.ranks_host, table.ranks.cpu().numpy())
    assert np.array_equal(table.dora_host, table.dora.cpu().numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp_rank,tp_size,fully_sharded", [
    (0, 1, False), (1, 2, False), (0, 2, True), (1, 2, True)])
def test_slot_holds_the_adapter_cut_to_this_rank(tp_rank, tp_size, fully_sharded, dtype):
    model = _model(TPGroup(tp_rank, tp_size), dtype)
    slots = model.create_lora_slots(LoRAConfig(max_loras=3, max_lora_rank=MAX_RANK,
                                               fully_sharded_loras=fully_sharded))
    _fill(slots)
    layout = SlotLayout(slots, model.cfg.module_shapes() if tp_size == 1 else
                        ModelConfig.from_hf(LlamaConfig(**TINY), dtype).module_shapes(),
                        MAX_RANK)
    adapter = _adapter(model.cfg, TARGETS, dtype)
    pinned = pin_adapter(adapter)
    layout.load(1, pinned, layout.prepare(pinned))
    _check_slot(model, slots, adapter, 1)
    for other in (0, 2):
        for lora in slots.values():
            for buf in (*lora.lora_a_stacked, *lora.lora_b_stacked):
                assert bool((buf[other] == SENTINEL).all())
        assert not model.slot_table.ranks[other].any()
    # a second adapter over the first: the whole row of the table is rewritten
    second = {(0, "q_proj"): (2, True), (1, "down_proj"): (8, False)}
    adapter2 = _adapter(model.cfg, second, dtype, seed=1, lid=2)
    _fill(slots)
    pinned2 = pin_adapter(adapter2)
    layout.load(1, pinned2, layout.prepare(pinned2))
    _check_slot(model, slots, adapter2, 1)


class _CountOps(TorchDispatchMode):
    """Counts the operators that touch data (views and other metadata ops left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layers", [2, 4])
def test_a_slot_load_is_three_device_operations_whatever_the_model(layers, tmp_path):
    """Through the manager (``activate`` of a PEFT adapter read into the host cache): two
    copies and one scatter, for a model of 2 or 4 layers with slots on all seven
    projections."""
    shape = {k: v for k, v in TINY.items() if k != "vocab_size"}
    base = make_checkpoint(tmp_path / "base", "llama", **dict(shape, num_hidden_layers=layers))
    path = make_peft_adapter(base, tmp_path / "qkvo", r=4,
                             target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    cfg = ModelConfig.from_hf(LlamaConfig.from_pretrained(base), torch.float32)
    model = load_model(base, cfg, torch.device("cpu"))
    config = LoRAConfig(max_loras=2, max_lora_rank=MAX_RANK)
    target = AdapterTarget(cfg.module_shapes(), cfg.num_layers, MAX_RANK,
                           config.target_modules, cfg.dtype)
    manager = LoRAManager(config, target, model.create_lora_slots(config))
    request = LoRARequest("qkvo", 1, str(path))
    manager.add(request)                       # read on a loader thread
    manager.wait_first_read(request.lora_int_id)
    assert manager.poll().ready.keys() == {1}
    with _CountOps() as counted:
        assert manager.activate([request]) == {1: 0}
    manager.shutdown()
    assert sorted(counted.ops) == ["aten.copy_", "aten.copy_", "manylora.scatter_slot"]
    ranks = model.slot_table.ranks[0]
    assert int((ranks == 4).sum()) == 4 * layers and int(ranks.sum()) == 16 * layers


def test_host_cache_counts_the_pinned_bytes():
    model = _model(TPGroup.single(), torch.bfloat16)
    config = LoRAConfig(max_loras=2, max_lora_rank=MAX_RANK)
    slots = model.create_lora_slots(config)
    cfg = model.cfg
    target = AdapterTarget(cfg.module_shapes(), cfg.num_layers, MAX_RANK,
                           config.target_modules, cfg.dtype)
    manager = LoRAManager(config, target, slots)
    adapter = _adapter(cfg, TARGETS, torch.bfloat16)
    pinned = manager.reader.pin(adapter)
    expected = sum(align(w.a.numel() * 2) + align(w.b.numel() * 2)
                   + (0 if w.dora_scale is None else align(4 * w.b.shape[0]))
                   for w in adapter.weights.values())
    assert pinned.buf.numel() == expected
    assert pinned.nbytes == expected + pinned.slot_load.blob.numel()
    manager.host_cache.insert(pinned, must_fit=True)
    assert manager.host_bytes == pinned.nbytes
    manager.shutdown()


def test_prepare_refuses_what_the_slots_cannot_hold():
    model = _model(TPGroup.single(), torch.float32)
    slots = model.create_lora_slots(LoRAConfig(max_loras=2, max_lora_rank=4,
                                               target_modules=("q_proj", "v_proj")))
    layout = SlotLayout(slots, model.cfg.module_shapes(), 4)
    with pytest.raises(ValueError, match="o_proj, which has no slot buffers"):
        layout.prepare(pin_adapter(_adapter(model.cfg, {(0, "o_proj"): (2, False)},
                                             torch.float32)))
    with pytest.raises(ValueError, match="≤4"):
        layout.prepare(pin_adapter(_adapter(model.cfg, {(0, "q_proj"): (6, False)},
                                             torch.float32)))
    with pytest.raises(ValueError, match="bfloat16"):
        layout.prepare(pin_adapter(_adapter(model.cfg, {(0, "q_proj"): (2, False)},
                                             torch.bfloat16)))
    with pytest.raises(ValueError, match="slot 2 outside"):
        pinned = pin_adapter(_adapter(model.cfg, {(0, "q_proj"): (2, False)}, torch.float32))
        layout.load(2, pinned, layout.prepare(pinned))


@pytest.mark.gpu
def test_cuda_slot_load_runs_on_the_side_stream_from_pinned_memory():
    """On the GPU: the buffer and its descriptors are page-locked, the load is enqueued on
    the manager's copy stream, and after the compute stream waits for the slot's event the
    slot holds the adapter."""
    model = _model(TPGroup.single(), torch.bfloat16, device="cuda")
    config = LoRAConfig(max_loras=2, max_lora_rank=MAX_RANK)
    slots = model.create_lora_slots(config)
    _fill(slots)
    cfg = model.cfg
    target = AdapterTarget(cfg.module_shapes(), cfg.num_layers, MAX_RANK,
                           config.target_modules, cfg.dtype)
    manager = LoRAManager(config, target, slots)
    adapter = _adapter(cfg, TARGETS, torch.bfloat16)
    pinned = manager.reader.pin(adapter)
    assert pinned.buf.is_pinned() and pinned.slot_load.blob.is_pinned()
    manager.slot_pool.load(1, pinned)
    assert 1 in manager.slot_pool._slot_events
    manager.slot_pool.wait_for([1])
    torch.cuda.synchronize()
    _check_slot(model, slots, adapter, 1)
    manager.shutdown()
