"""The LoRA variant model (``lora/kernels/cost_model.py``) against counts made by hand: adapter
reads per variant, the bytes term it implies, and the choices that follow from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from manylora.lora.kernels.cost_model import (
    H100_SXM,
    LoRAVariantModel,
    adapter_reads,
    graph_block_m,
    llama3_8b_shapes,
    variant_time,
)
from manylora.lora.kernels.meta import build_lora_kernel_meta


def test_adapter_reads_count_rows_tiles_and_sgmv_tiles():
    seg = np.array([1, 4, 16, 17, 40, 0])
    assert adapter_reads(seg, "bgmv") == 78
    assert adapter_reads(seg, "tiled", 16) == 1 + 1 + 1 + 2 + 3
    assert adapter_reads(seg, "tiled", 64) == 5
    assert adapter_reads(seg, "sgmv") == 5           # longest 40: SGMV tiles of 64 rows
    with pytest.raises(ValueError, match="unknown"):
        adapter_reads(seg, "gemm")


def test_bandwidth_bound_decode_time_scales_with_adapter_reads():
    """64 rank-16 adapters at 4 rows each: BGMV reads every adapter 4 times, tiles once; with
    no program or launch cost and no L2, the model's times are in the ratio of the bytes."""
    gpu = H100_SXM._replace(program_s=0.0, launch_s=0.0, l2_bytes=0.0)
    seg = np.full(64, 4)
    shapes = llama3_8b_shapes()
    bgmv = variant_time(seg, "bgmv", shapes, 16, 64, gpu)
    tiled = variant_time(seg, "tiled", shapes, 16, 64, gpu)
    act = sum(256 * (s.in_features + 2 * sum(s.out_sizes)) * 2
              + 2 * 256 * len(s.out_sizes) * 16 * 4 for s in shapes)
    adapter = sum(16 * (s.in_features * len(s.out_sizes) + sum(s.out_sizes)) * 2
                  for s in shapes) * 64
    assert bgmv == pytest.approx((4 * adapter + act) / gpu.bandwidth)
    assert tiled == pytest.approx((adapter + act) / gpu.bandwidth)


def test_rereads_that_fit_l2_cost_l2_bandwidth():
    """One adapter read 4 times (BGMV, 4 rows): the first read from HBM, the other three
    from L2 (one adapter's projection fits an H100's L2); with 500 adapters the launch's
    adapter bytes exceed L2 and only its share of the rereads hits."""
    gpu = H100_SXM._replace(program_s=0.0, launch_s=0.0)
    shape = (llama3_8b_shapes()[1],)                       # o_proj: 4096 -> 4096
    a = b = 16 * 4096 * 2
    stream = 4 * 4096 * 2 + 4 * 16 * 4 + 2 * 4 * 4096 * 2 + 4 * 16 * 4
    got = variant_time(np.array([4]), "bgmv", shape, 16, 1, gpu)
    want = (a + b + stream) / gpu.bandwidth + 3 * (a + b) / gpu.l2_bandwidth
    assert got == pytest.approx(want)
    many = np.full(500, 4)
    hit = gpu.l2_bytes / (500 * a)
    got = variant_time(many, "bgmv", shape, 16, 500, gpu)
    again = 3 * 500 * (a + b)
    want = ((500 * (a + b) + 500 * stream) / gpu.bandwidth
            + again * hit / gpu.l2_bandwidth + again * (1 - hit) / gpu.bandwidth)
    assert got == pytest.approx(want)


def test_graph_steps_pay_for_their_padded_grid():
    """A padded SGMV grid is max_loras x ceil(T / BLOCK_M) programs; the tiled bound is
    max_row_tiles: with a high per-program cost the padded SGMV is the slower."""
    gpu = H100_SXM._replace(program_s=1e-4)
    seg = np.full(64, 4)
    shapes = llama3_8b_shapes()
    sgmv = variant_time(seg, "sgmv", shapes, 16, 64, gpu, padded_rows=256)
    tiled = variant_time(seg, "tiled", shapes, 16, 64, gpu, padded_rows=256)
    assert tiled < sgmv


@pytest.mark.parametrize("rows,slots,variant,block_m", [
    (256, 64, "tiled", 16),         # 4 rows per adapter: one tile each
    (4096, 3, "tiled", 64),         # long segments: the tallest tiles read least
    (8, 8, "tiled", 16),            # one row each: tiles and BGMV read the same (tie: tiles)
])
def test_eager_choice(rows, slots, variant, block_m):
    lora_meta = build_lora_kernel_meta([r % slots for r in range(rows)], 64, torch.device("cpu"),
                                     model=LoRAVariantModel.default())
    assert (lora_meta.variant, lora_meta.block_m) == (variant, block_m)


def test_graph_block_m_follows_the_even_spread():
    assert graph_block_m(256, 64) == 16
    assert graph_block_m(256, 8) == 32
    assert graph_block_m(2048, 16) == 64
    assert graph_block_m(1, 64) == 16
