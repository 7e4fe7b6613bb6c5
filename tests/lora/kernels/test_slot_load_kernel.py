"""The slot-load scatter kernel and the packed host form, against plain PyTorch indexing.

Without a GPU the kernel runs under ``TRITON_INTERPRET=1`` (``tests/conftest.py``), with
host addresses as its destination pointers; the reference is each descriptor's strided copy
written out with tensor indexing, and ``scatter_slot_reference``.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from manylora.lora.adapter import LoRAAdapter, LoRAWeights
from manylora.lora.kernels.slot_load import (
    DESC_COLS,
    scatter_slot,
    scatter_slot_op,
    scatter_slot_reference,
)
from manylora.lora.pinned import ALIGN, P_A, P_B, P_SCALE, align, pin_adapter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _descriptors(dsts, src_words: int, gen) -> list[list[int]]:
    """Random in-bounds entries: a 2-D block of each destination's slot from a random
    strided block of the source."""
    rows = []
    for dst in dsts:
        n_rows, row_words = dst.shape[1], dst.shape[2] * dst.element_size() // 2
        n = int(torch.randint(1, n_rows + 1, (), generator=gen))
        n_len = int(torch.randint(1, row_words + 1, (), generator=gen))
        stride = n_len + int(torch.randint(0, 5, (), generator=gen))
        off = int(torch.randint(0, src_words - n * stride + 1, (), generator=gen))
        rows.append([off, stride, dst.data_ptr(), dst.stride(0) * dst.element_size(),
                     dst.stride(1) * dst.element_size() // 2, n, n_len, 0])
    return rows


@pytest.mark.parametrize("slot", [0, 2])
def test_scatter_writes_each_entry_as_the_formula_says(slot):
    gen = torch.Generator().manual_seed(slot)
    src = torch.randint(-2**15, 2**15, (6000,), dtype=torch.int16, generator=gen).to(DEVICE)
    dsts = [torch.zeros(3, 5, 37, dtype=torch.bfloat16, device=DEVICE),
            torch.zeros(3, 4, 1000, dtype=torch.float32, device=DEVICE),
            torch.zeros(3, 1, 3000, dtype=torch.float16, device=DEVICE)]
    desc = _descriptors(dsts, src.numel(), gen)
    scatter_slot(src, torch.tensor(desc, dtype=torch.int64, device=DEVICE), slot, dsts)
    for dst, (off, stride, _, _, _, n, n_len, _) in zip(dsts, desc):
        words = dst.view(torch.int16).reshape(3, dst.shape[1], -1)
        expected = torch.zeros_like(words)
        block = src[off: off + n * stride].view(n, stride)[:, :n_len]
        expected[slot, :n, :n_len] = block
        assert torch.equal(words, expected)


def test_reference_matches_the_kernel():
    gen = torch.Generator().manual_seed(7)
    src = torch.randint(-2**15, 2**15, (4000,), dtype=torch.int16, generator=gen)
    a = [torch.zeros(2, 6, 300, dtype=torch.bfloat16), torch.zeros(2, 3, 64)]
    b = [t.clone() for t in a]
    desc = _descriptors(a, src.numel(), gen)
    desc_b = [[*r[:2], t.data_ptr(), *r[3:]] for r, t in zip(desc, b)]
    scatter_slot_op(src, torch.tensor(desc, dtype=torch.int64), 1)
    scatter_slot_reference(src, torch.tensor(desc_b, dtype=torch.int64), 1, b)
    for x, y in zip(a, b):
        assert torch.equal(x, y) and x.abs().sum() > 0


def test_scatter_rejects_bad_descriptors():
    src = torch.zeros(16, dtype=torch.int16)
    with pytest.raises(ValueError, match="int16 expected"):
        scatter_slot_op(src.float(), torch.zeros(1, DESC_COLS, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=f"int64 \\[E, {DESC_COLS}\\]"):
        scatter_slot_op(src, torch.zeros(1, 3, dtype=torch.int64), 0)
    dst = torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match="outside every destination"):
        scatter_slot_reference(src, torch.tensor([[0, 0, 8, 0, 0, 1, 4, 0]]), 0, [dst])


def _adapter(dtype=torch.bfloat16) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(0)
    w = {}
    for (layer, module), (r, n_in, n_out, dora) in {
            (0, "q_proj"): (4, 32, 32, False), (0, "v_proj"): (3, 32, 16, True),
            (1, "down_proj"): (5, 64, 32, False)}.items():
        w[(layer, module)] = LoRAWeights(
            torch.randn(r, n_in, generator=gen).to(dtype),
            torch.randn(n_out, r, generator=gen).to(dtype),
            torch.rand(n_out, generator=gen) if dora else None)
    return LoRAAdapter(3, "packed", w)


def test_pack_holds_a_rank_major_b_and_the_scale_of_every_module():
    adapter = _adapter()
    packed = pin_adapter(adapter)
    assert (packed.lora_int_id, packed.name, packed.digest) == (3, "packed", adapter.digest)
    assert packed.rank == 5 and packed.has_dora and packed.dtype == torch.bfloat16
    assert packed.module_ranks() == {(0, "q_proj"): 4, (0, "v_proj"): 3, (1, "down_proj"): 5}
    for key, w in adapter.weights.items():
        a, bt, scale = packed.tensors(*key)
        assert torch.equal(a, w.a) and torch.equal(bt, w.b.t())
        assert (scale is None) == (w.dora_scale is None)
        if scale is not None:
            assert torch.equal(scale, w.dora_scale)
    offsets = packed.plan[:, [P_A, P_B, P_SCALE]]
    assert bool(((offsets % ALIGN == 0) | (offsets == -1)).all())
    expected = sum(align(w.a.numel() * 2) + align(w.b.numel() * 2)
                   + (0 if w.dora_scale is None else align(4 * w.b.shape[0]))
                   for w in adapter.weights.values())
    assert packed.buf.numel() == expected == packed.nbytes
    with pytest.raises(KeyError, match="does not target layer 1 q_proj"):
        packed.tensors(1, "q_proj")


def test_pack_refuses_mixed_dtypes():
    w = _adapter().weights
    key = (0, "q_proj")
    w[key] = LoRAWeights(w[key].a.float(), w[key].b)
    with pytest.raises(ValueError, match="several dtypes"):
        pin_adapter(LoRAAdapter(1, "mixed", w))


_COMPILE_FOR_H100 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from manylora.lora.kernels import slot_load as m

    sig = {"src_ptr": "*i16", "desc_ptr": "*i64", "slot": "i32", "BLOCK": "constexpr"}
    src = ASTSource(m._scatter_slot_kernel, sig, {"BLOCK": m.BLOCK}, {})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    assert "st.global.b16" in ptx and "ld.global.b64" in ptx, ptx[-2000:]
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernel itself")
def test_scatter_kernel_compiles_for_h100(compile_for_h100):
    """The int64 → pointer casts and the runtime-bounded loop also compile for sm_90 (the
    interpreter runs them as Python): 16-bit stores, 64-bit descriptor loads."""
    compile_for_h100(_COMPILE_FOR_H100,
                     TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
