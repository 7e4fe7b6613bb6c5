"""Slot-load time per adapter against the bytes over the measured pinned H2D bandwidth.

Slot buffers of Llama-3-8B's shape (32 layers; slots on all seven projections, bf16,
``max_lora_rank`` 64, 2 slots) and random adapters:

* rank 16 on q/k/v/o, rank 16 on all seven, rank 64 on all seven.

For each adapter, medians over ``--reps`` loads into alternating slots (wall time from
the call to the end of its copies, ``torch.cuda.synchronize`` after each):

* ``one-copy``: ``SlotLayout.load`` (one H2D of the packed buffer, one of its descriptors,
  one scatter kernel), what ``LoRAManager`` does;
* ``H2D floor``: one pinned host → device copy of the same number of bytes into a device
  buffer (the measured bandwidth is bytes / this time);
* ``per-module``: ``LoRASlots.set_slot`` for every (layer, module) from per-tensor pinned
  copies, the slot writer before issue 17 (kept as the tests' reference writer).

The target (issue 17) is a slot load within 1.5x of the H2D floor.

    python -m benchmarks.bench_slot_load
    python -m benchmarks.bench_slot_load --quick     # tiny shapes on CPU, a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import record
from benchmarks.llama3_8b import LLAMA3_8B, TINY, module_dims
from manylora.lora.adapter import LoRAAdapter, LoRAWeights
from manylora.lora.pinned import pin_adapter
from manylora.lora.slot_layout import SlotLayout
from manylora.lora.slot_table import SlotTable
from manylora.lora.slots import LoRASlots

PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
               ("down_proj",))
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL7 = QKVO + ("gate_proj", "up_proj", "down_proj")


def build_slots(config: dict, max_loras: int, max_rank: int, dtype: torch.dtype,
                device: torch.device) -> dict[tuple[int, str], LoRASlots]:
    """Slot buffers on all seven projections of every layer, bound to one ``SlotTable``."""
    dims = module_dims(config)
    slots = {}
    for layer in range(config["num_hidden_layers"]):
        for names in PROJECTIONS:
            modules, offset = [], 0
            for name in names:
                modules.append((name, offset, dims[name][1]))
                offset += dims[name][1]
            lora = LoRASlots(dims[names[0]][0], modules, max_loras, max_rank, dtype, device)
            slots.update({(layer, name): lora for name in names})
    SlotTable(slots, max_loras, device)
    return slots


def random_adapter(config: dict, rank: int, targets: tuple[str, ...], dtype: torch.dtype,
                   seed: int) -> LoRAAdapter:
    """Host tensors A ``[r, in]``, B ``[out, r]`` for every layer and target."""
    gen = torch.Generator().manual_seed(seed)
    dims = module_dims(config)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for module in targets:
            n_in, n_out = dims[module]
            weights[(layer, module)] = LoRAWeights(
                torch.randn(rank, n_in, generator=gen).to(dtype),
                (torch.randn(n_out, rank, generator=gen) * 0.01).to(dtype))
    return LoRAAdapter(seed, f"r{rank}-{len(targets)}", weights)


def _median_wall(fn, reps: int, cuda: bool) -> float:
    """Median seconds from calling ``fn`` to the end of its device work."""
    fn()
    times = []
    for i in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(i)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(layout: SlotLayout, slots: dict, adapter: LoRAAdapter, reps: int, cuda: bool,
            device: torch.device) -> list[str]:
    """One row: MiB, one-copy ms, H2D floor ms, GB/s, ratio, per-module ms, ratio."""
    packed = pin_adapter(adapter)
    load = layout.prepare(packed)
    one_copy = _median_wall(lambda i=0: layout.load(i % 2, packed, load), reps, cuda)
    dst = torch.empty(packed.buf.numel(), dtype=torch.uint8, device=device)
    floor = _median_wall(lambda i=0: dst.copy_(packed.buf, non_blocking=True), reps, cuda)
    pinned = {key: LoRAWeights(*(t if t is None or not cuda else t.pin_memory()
                                 for t in (w.a, w.b, w.dora_scale)))
              for key, w in adapter.weights.items()}

    def per_module(i=0):
        for (layer, module), lora in slots.items():
            w = pinned.get((layer, module))
            lora.set_slot(i % 2, module, None if w is None else w.a,
                          None if w is None else w.b)

    old = _median_wall(per_module, max(3, reps // 5), cuda)
    nbytes = packed.buf.numel()
    return [f"{nbytes / 2**20:.1f}", f"{one_copy * 1e3:.3f}", f"{floor * 1e3:.3f}",
            f"{nbytes / floor / 1e9:.1f}", f"{one_copy / floor:.2f}", f"{old * 1e3:.2f}",
            f"{old / one_copy:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--no-write", action="store_true", help="do not append BENCHMARKS.md")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    config = TINY if args.quick else LLAMA3_8B
    dtype = torch.float32 if args.quick else torch.bfloat16
    reps = 3 if args.quick else args.reps
    dims = module_dims(config)
    slots = build_slots(config, 2, 64, dtype, device)
    layout = SlotLayout(slots, dims, 64)
    rows = []
    for rank, targets in ((16, QKVO), (16, ALL7), (64, ALL7)):
        adapter = random_adapter(config, rank, targets, dtype, seed=rank + len(targets))
        name = f"r{rank} {'q/k/v/o' if targets == QKVO else 'all seven'}"
        rows.append([name, *measure(layout, slots, adapter, reps, cuda, device)])
    record("Slot load per adapter vs pinned H2D (issue 17)",
           "python -m benchmarks.bench_slot_load" + (" --quick" if args.quick else ""),
           ["adapter", "MiB", "one-copy ms", "H2D floor ms", "H2D GB/s", "one-copy / floor",
            "per-module ms", "per-module / one-copy"], rows,
           notes=("Llama-3-8B shapes, slots on all seven projections (max_lora_rank 64, bf16); "
                  "medians of wall time to the end of the copies. 'one-copy' = "
                  "SlotLayout.load (2 H2D copies + 1 scatter kernel); 'H2D floor' = one "
                  "pinned copy of the packed bytes; 'per-module' = LoRASlots.set_slot per "
                  "(layer, module). Target: one-copy / floor ≤ 1.5."),
           write=not args.no_write and not args.quick, device=device if cuda else None)


if __name__ == "__main__":
    main()
