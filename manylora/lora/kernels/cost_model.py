"""A bandwidth/launch model of the LoRA kernel variants, to pick one per step.

Pure functions of host ints: the step's rows per active slot, the padded row count of a
CUDA-graph step, the LoRA projections' shapes and the GPU's figures. No timing happens here;
``benchmarks/bench_lora_decode.py`` measures the variants and the copy bandwidth the model
is checked against.

Model (per launch, summed over the projections of one layer; the choice does not depend on
the layer count):

* **bytes**: every variant reads each adapter (A ``[r, in]`` per slice, B ``[r, out_s]`` per
  slice, at the projection's rank ``r``) once per *adapter read*: once per row for BGMV
  (one program per row), once per row tile for the tiled variant (``ceil(n / BLOCK_M)``
  per slot of ``n`` rows) and SGMV (``ceil(n / BLOCK_M_sgmv)``). On top: ``x`` once per LoRA
  row and rank tile (shrink), ``y`` read and written once per LoRA row (expand), and the
  float32 ``[T, S, r]`` buffer written (split-K atomics) and read.
* **programs**: per *unit* (a padded row for BGMV, a tile for the tiled variant, the
  bound ``max_row_tiles`` of them in a graph, ``max_loras x ceil(longest segment /
  BLOCK_M)`` for SGMV, ``max_loras x ceil(T / BLOCK_M)`` in a padded one) and slice: the
  shrink's split-K programs (up to 1024 in all, ``in / 256`` per unit at most) and the
  expand's output tiles of 128 columns. A program costs at least
  ``program_s`` (its index loads and first memory round trip) and ``sms * programs_per_sm``
  of them run at once, so a launch takes at least ``waves * program_s``.
* **L2**: the first read of each adapter comes from HBM; a reread hits L2 in the share of
  the launch's distinct adapter bytes that fits ``l2_bytes`` (all of it below), and is then
  paid at ``l2_bandwidth``, otherwise at ``bandwidth``.
* **time** = ``launch_s + max(memory time, waves * program_s, flops / flop_rate)`` per
  launch, with BGMV's multiply-adds on the FP32 pipes and the others' dots on the tensor
  cores (padded to ``BLOCK_M`` rows, the dot's minimum of 16).

Assumptions: kernels are bandwidth-bound at decode sizes (true below ~64 rows per adapter at
rank 16 on an H100); reread adapters are spread over the launch (rows are in batch order for
BGMV), so L2 keeps them only as far as the launch's adapters fit it, and x / y / the buffer
stream from HBM; split-K reaches the target program count; every adapter in the step has the
projection's ``max_rank`` (the rank table is on the device and the choice is made on the
host: an upper bound on the bytes, the same for every variant, so the ranking holds). The
default figures (``H100_SXM``) are an H100 SXM's datasheet and microbenchmark values; the
engine takes the SM count and memory bus of its own device (``gpu_model``), and
``benchmarks/bench_lora_decode.py`` prints the model next to the measured times.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from manylora.lora.kernels.row_tiles import max_row_tiles
from manylora.lora.kernels.tiled_plans import TILE_BLOCK_MS

#: SGMV's row tile for the model (its kernels use 16/32/64 by the longest segment).
_SGMV_BLOCK_MS = ((16, 16), (32, 32), (1 << 62, 64))


class GPUModel(NamedTuple):
    """The figures of a GPU the variant model needs.

    Attributes:
        bandwidth: HBM bytes/s a streaming kernel reaches (a device copy's (read + write) /
            time; ``benchmarks/common.py`` measures it).
        sms: streaming multiprocessors.
        programs_per_sm: programs (CTAs of 4 warps) resident per SM at once.
        program_s: seconds a program takes at the least (index loads, one memory round trip).
        launch_s: seconds a launch costs on the GPU inside a CUDA graph.
        fma_rate: FP32 multiply-add FLOP/s (BGMV's broadcast-multiply + sum).
        dot_rate: 16-bit tensor-core FLOP/s (``tl.dot``).
        l2_bytes: L2 cache bytes.
        l2_bandwidth: L2 read bytes/s.
    """

    bandwidth: float
    sms: int
    programs_per_sm: int = 8
    program_s: float = 1.5e-6
    launch_s: float = 2e-6
    fma_rate: float = 50e12
    dot_rate: float = 600e12
    l2_bytes: float = 50e6
    l2_bandwidth: float = 7e12


#: An H100 SXM (132 SMs, HBM3 ~3.35 TB/s peak, ~2.9 TB/s reached by a copy, 50 MB L2).
H100_SXM = GPUModel(bandwidth=2.9e12, sms=132)


def gpu_model(device) -> GPUModel:
    """The ``GPUModel`` of a CUDA ``device`` from its properties: SM count, and peak HBM
    bandwidth (``2 x memory clock x bus width``, DDR) scaled by 0.87, the share a copy
    reaches on an H100; ``H100_SXM`` without CUDA or when the properties lack the memory
    figures."""
    import torch

    if not (torch.cuda.is_available() and torch.device(device).type == "cuda"):
        return H100_SXM
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return H100_SXM._replace(sms=props.multi_processor_count)
    peak = 2 * clock_khz * 1e3 * bus_bits / 8
    return H100_SXM._replace(bandwidth=0.87 * peak, sms=props.multi_processor_count)


class ProjectionShape(NamedTuple):
    """One LoRA projection of a layer: ``in`` features and the output width of each slice
    (e.g. q/k/v packed: ``(4096, (4096, 1024, 1024))``)."""

    in_features: int
    out_sizes: tuple[int, ...]


def llama3_8b_shapes() -> tuple[ProjectionShape, ...]:
    """Llama-3-8B's LoRA projections: q/k/v packed, o, gate/up packed, down."""
    return (ProjectionShape(4096, (4096, 1024, 1024)), ProjectionShape(4096, (4096,)),
            ProjectionShape(4096, (14336, 14336)), ProjectionShape(14336, (4096,)))


def _sgmv_block_m(longest: int) -> int:
    return next(b for bound, b in _SGMV_BLOCK_MS if longest <= bound)


def adapter_reads(seg_len: np.ndarray, variant: str, block_m: int = 16) -> int:
    """How many times the step reads each of its adapters, summed over adapters: rows for
    ``"bgmv"``, row tiles for ``"tiled"`` (``block_m``) and ``"sgmv"``.

    Raises:
        ValueError: an unknown variant.
    """
    lens = np.asarray(seg_len, dtype=np.int64)
    lens = lens[lens > 0]
    if variant == "bgmv":
        return int(lens.sum())
    if variant == "sgmv":
        block_m = _sgmv_block_m(int(lens.max(initial=0)))
    elif variant != "tiled":
        raise ValueError(f"unknown LoRA kernel variant {variant!r}")
    return int((-(-lens // block_m)).sum())


def variant_time(seg_len: np.ndarray, variant: str, shapes: Sequence[ProjectionShape],
                  max_rank: int, max_loras: int, gpu: GPUModel, *, element_size: int = 2,
                  block_m: int = 16, padded_rows: int | None = None) -> float:
    """Modelled seconds of one layer's LoRA shrink + expand launches (module docstring).

    Args:
        seg_len: rows per active slot (zeros allowed).
        variant: ``"bgmv"``, ``"tiled"`` or ``"sgmv"``.
        shapes: the layer's LoRA projections.
        max_rank: the rank assumed for every adapter.
        max_loras: slots.
        gpu: the GPU's figures.
        element_size: bytes per element of x, y, A and B.
        block_m: the tiled variant's row tile.
        padded_rows: a CUDA-graph step's padded row count (grids sized by it); None: eager.

    Raises:
        ValueError: an unknown variant.
    """
    lens = np.asarray(seg_len, dtype=np.int64)
    lens = lens[lens > 0]
    rows = int(lens.sum())
    grid_rows = rows if padded_rows is None else padded_rows
    reads = adapter_reads(lens, variant, block_m)
    if variant == "bgmv":
        units, dot_rows = grid_rows, rows
    elif variant == "tiled":
        units = reads if padded_rows is None else max_row_tiles(padded_rows, max_loras,
                                                                block_m)
        dot_rows = reads * block_m
    else:
        bm = _sgmv_block_m(int(lens.max(initial=0)) if padded_rows is None else padded_rows)
        units = max_loras * -(-(int(lens.max(initial=0)) if padded_rows is None
                                else padded_rows) // bm)
        dot_rows = reads * bm
    slots = gpu.sms * gpu.programs_per_sm
    total = 0.0
    for shape in shapes:
        k, outs = shape.in_features, shape.out_sizes
        s = len(outs)
        adapter_a = max_rank * k * s * element_size
        adapter_b = max_rank * sum(outs) * element_size
        x_bytes = rows * k * element_size + rows * s * max_rank * 4
        y_bytes = 2 * rows * sum(outs) * element_size + rows * s * max_rank * 4
        flops = 2 * dot_rows * max_rank * (k * s + sum(outs))
        rate = gpu.fma_rate if variant == "bgmv" else gpu.dot_rate
        shrink_programs = max(units * s, min(1024, units * s * -(-k // 256)))
        expand_programs = units * s * -(-max(outs) // 128)
        for programs, adapter, stream in ((shrink_programs, adapter_a, x_bytes),
                                          (expand_programs, adapter_b, y_bytes)):
            distinct = adapter * lens.size
            again = adapter * (reads - lens.size)
            hit = min(1.0, gpu.l2_bytes / distinct) if distinct else 0.0
            memory = ((distinct + stream) / gpu.bandwidth + again * hit / gpu.l2_bandwidth
                      + again * (1 - hit) / gpu.bandwidth)
            waves = -(-programs // slots)
            total += gpu.launch_s + max(memory, waves * gpu.program_s, flops / 2 / rate)
    return total


def choose_variant(seg_len: np.ndarray, shapes: Sequence[ProjectionShape], max_rank: int,
                    max_loras: int, gpu: GPUModel, *, element_size: int = 2,
                    padded_rows: int | None = None,
                    graph_block_m: int | None = None) -> tuple[str, int]:
    """``(variant, block_m)`` of least ``variant_time`` for the step: BGMV, the tiled
    variant (``block_m`` of ``TILE_BLOCK_MS``; in a graph step only ``graph_block_m``, the
    tile height the graph was captured with) and, in eager steps, SGMV (``block_m`` 0 for
    the variants without tiles). Ties go to the earlier of tiled, BGMV, SGMV."""
    options: list[tuple[str, int]] = []
    if padded_rows is None:
        options += [("tiled", b) for b in TILE_BLOCK_MS]
        options += [("bgmv", 0), ("sgmv", 0)]
    else:
        options += [("tiled", graph_block_m or TILE_BLOCK_MS[0]), ("bgmv", 0)]
    return min(options, key=lambda o: variant_time(
        seg_len, o[0], shapes, max_rank, max_loras, gpu, element_size=element_size,
        block_m=o[1] or 16, padded_rows=padded_rows))


def graph_block_m(num_rows: int, max_loras: int) -> int:
    """The tile height of a padded (CUDA-graph) mapping of ``num_rows`` rows: the smallest of
    ``TILE_BLOCK_MS`` that holds the rows per slot of an even spread over
    ``min(max_loras, num_rows)`` slots (64 at most). A function of the row count and the
    engine's ``max_loras`` only, so it is fixed per captured graph."""
    per_slot = -(-num_rows // max(1, min(max_loras, num_rows)))
    return next((b for b in TILE_BLOCK_MS if b >= per_slot), TILE_BLOCK_MS[-1])


class LoRAVariantModel(NamedTuple):
    """What ``choose_variant`` needs about an engine: its LoRA projections (one layer), the
    rank to assume, the element size and the GPU.

    Attributes:
        shapes: the LoRA projections of one layer.
        max_rank: the slot buffers' rank (every adapter is assumed at it).
        gpu: the GPU's figures.
        element_size: bytes per element of the model dtype.
    """

    shapes: tuple[ProjectionShape, ...]
    max_rank: int
    gpu: GPUModel
    element_size: int = 2

    @classmethod
    def default(cls) -> LoRAVariantModel:
        """Llama-3-8B's projections at rank 16, bf16, on an H100 (``H100_SXM``)."""
        return cls(llama3_8b_shapes(), 16, H100_SXM)

    def choose(self, seg_len: np.ndarray, max_loras: int, *, padded_rows: int | None = None,
               graph_block_m: int | None = None) -> tuple[str, int]:
        """``choose_variant`` for this engine (see there)."""
        return choose_variant(seg_len, self.shapes, self.max_rank, max_loras, self.gpu,
                               element_size=self.element_size, padded_rows=padded_rows,
                               graph_block_m=graph_block_m)
