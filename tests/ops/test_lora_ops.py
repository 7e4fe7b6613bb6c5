"""lora_shrink / lora_expand and LoRALinear against an independent float64 reference.

The reference is a plain per-row loop::

    y[t, off:off+n] += x[t] @ A[slot].T @ B[slot].T        (slot[t] >= 0)

over slot buffers laid out as the engine lays them out: ``A [max_loras, max_lora_rank, in]``
and ``B [max_loras, out, max_lora_rank]`` with the rows of A / columns of B past each slot's
rank zero. Adapter popularity follows Punica's tests: distinct, uniform, zipf, identical,
all base (-1) and base rows mixed in. DoRA rows get ``(y + delta) * scale (+ shift)``, and
through ``LoRALinear`` peft's ``scale * (x W^T + delta) + bias``.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from manylora.lora.dora import dora_row_norm
from manylora.lora.linear import LoRALinear
from manylora.lora.punica import build_lora_mapping
from manylora.ops.lora_expand import lora_expand
from manylora.ops.lora_shrink import lora_shrink

MAX_LORAS = 4
MAX_RANK = 16
IN = 32
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# (output_slices, out_total): 1-3 slices of different widths; the last one leaves a gap
# (only q and v of a packed qkv enabled), as LoRALinear does for restricted target modules.
SLICES = {
    "one": ([(0, 24)], 24),
    "two": ([(0, 32), (32, 16)], 48),
    "three": ([(0, 32), (32, 16), (48, 8)], 56),
    "gap": ([(0, 32), (48, 16)], 64),
}
RANKS = {
    "mixed": (1, MAX_RANK, 7, 3),
    "all_max": (MAX_RANK,) * MAX_LORAS,
    "all_one": (1,) * MAX_LORAS,
}
QKV_NAMES = ("q_proj", "k_proj", "v_proj")
QKV_WIDTH = {"q_proj": 32, "k_proj": 16, "v_proj": 16}
QKV_OFFSET = {"q_proj": 0, "k_proj": 32, "v_proj": 48}
POPULARITY = ("distinct", "uniform", "zipf", "identical", "all_base", "base_mixed")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def make_seq_slots(popularity: str, gen: torch.Generator) -> list[int]:
    """One slot per sequence (-1 = base model), drawn the way Punica's tests draw them."""
    num_seqs = MAX_LORAS if popularity == "distinct" else 9
    if popularity == "distinct":
        return torch.randperm(MAX_LORAS, generator=gen).tolist()
    if popularity == "uniform":
        return torch.randint(0, MAX_LORAS, (num_seqs,), generator=gen).tolist()
    if popularity == "zipf":
        w = 1.0 / torch.arange(1, MAX_LORAS + 1, dtype=torch.float64) ** 1.5
        perm = torch.randperm(MAX_LORAS, generator=gen)
        draws = torch.multinomial(w, num_seqs, replacement=True, generator=gen)
        return perm[draws].tolist()
    if popularity == "identical":
        return [int(torch.randint(0, MAX_LORAS, (1,), generator=gen))] * num_seqs
    if popularity == "all_base":
        return [-1] * num_seqs
    if popularity == "base_mixed":
        slots = torch.randint(-1, MAX_LORAS, (num_seqs,), generator=gen).tolist()
        slots[0], slots[-1] = -1, 0          # at least one of each
        return slots
    raise AssertionError(popularity)


def make_token_slots(popularity: str, gen: torch.Generator) -> list[int]:
    """Sequences of 1-6 tokens (decode rows and prefill chunks), flattened to rows."""
    token_slots: list[int] = []
    for slot in make_seq_slots(popularity, gen):
        token_slots.extend([slot] * int(torch.randint(1, 7, (1,), generator=gen)))
    return token_slots


def make_stacks(ranks, slices, dtype, gen):
    """Slot buffers as LoRASlots holds them: zero past each slot's rank."""
    a_stacked, b_stacked = [], []
    for _, size in slices:
        a = torch.randn(MAX_LORAS, MAX_RANK, IN, generator=gen, dtype=torch.float64) / IN ** 0.5
        b = torch.randn(MAX_LORAS, size, MAX_RANK, generator=gen, dtype=torch.float64)
        for slot, r in enumerate(ranks):
            a[slot, r:] = 0
            b[slot, :, r:] = 0
            b[slot, :, :r] /= r ** 0.5
        a_stacked.append(a.to(dtype))
        b_stacked.append(b.to(dtype))
    return a_stacked, b_stacked


def reference_delta(x, token_slots, a_stacked, b_stacked, slices, out_total):
    """float64 per-row loop, independent of the Punica mapping."""
    delta = torch.zeros(x.shape[0], out_total, dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for a, b, (off, n) in zip(a_stacked, b_stacked, slices, strict=True):
            delta[t, off:off + n] += x[t].double() @ a[slot].double().T @ b[slot].double().T
    return delta


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("ranks", list(RANKS.values()), ids=list(RANKS))
@pytest.mark.parametrize("slices_key", list(SLICES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shrink_expand_match_reference(dtype, slices_key, ranks, popularity):
    seed = zlib.crc32(f"{dtype}-{slices_key}-{ranks}-{popularity}".encode())
    gen = torch.Generator().manual_seed(seed)
    slices, out_total = SLICES[slices_key]
    token_slots = make_token_slots(popularity, gen)
    num_rows = len(token_slots)
    x = torch.randn(num_rows, IN, generator=gen).to(dtype)
    y0 = torch.randn(num_rows, out_total, generator=gen).to(dtype)
    a_stacked, b_stacked = make_stacks(ranks, slices, dtype, gen)
    mapping = build_lora_mapping(token_slots, list(ranks), torch.device("cpu"))
    assert mapping.has_lora == any(s >= 0 for s in token_slots)
    assert mapping.token_lora_indices.tolist() == token_slots

    buffer = lora_shrink(x, a_stacked, mapping)
    assert buffer.dtype == torch.float32
    assert buffer.shape == (num_rows, len(slices), MAX_RANK)
    ref_buffer = torch.zeros(num_rows, len(slices), MAX_RANK, dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            for s, a in enumerate(a_stacked):
                ref_buffer[t, s] = x[t].double() @ a[slot].double().T
    base = torch.tensor([s < 0 for s in token_slots])
    assert torch.all(buffer[base] == 0), "base rows must shrink to zero"
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            assert torch.all(buffer[t, :, ranks[slot]:] == 0), "padded ranks must stay zero"
    if mapping.has_lora:
        assert rel_err(buffer, ref_buffer) < TOL[dtype]

    y = y0.clone()
    lora_expand(y, buffer, b_stacked, mapping, slices)
    want = y0.double() + reference_delta(x, token_slots, a_stacked, b_stacked, slices,
                                         out_total)
    assert y.dtype == dtype and y.shape == y0.shape
    assert torch.equal(y[base], y0[base]), "base rows must be left untouched"
    lora_rows = ~base
    if lora_rows.any():
        assert rel_err(y[lora_rows], want[lora_rows]) < TOL[dtype]
        if dtype == torch.float32:
            # the delta itself (not only the sum with y0) is accurate
            assert rel_err((y - y0)[lora_rows], (want - y0.double())[lora_rows]) < 1e-5
        covered = torch.zeros(out_total, dtype=torch.bool)
        for off, n in slices:
            covered[off:off + n] = True
        assert torch.equal(y[:, ~covered], y0[:, ~covered]), "columns of no slice changed"


def test_expand_rejects_mismatched_slices():
    mapping = build_lora_mapping([0], [4], torch.device("cpu"))
    with pytest.raises(ValueError, match="output slices"):
        lora_expand(torch.zeros(1, 8), torch.zeros(1, 1, 4), [torch.zeros(1, 8, 4)] * 2,
                    mapping, [(0, 8)])


def test_build_lora_mapping_segments_and_bad_slot():
    mapping = build_lora_mapping([2, -1, 0, 2, 2, -1], [3, 5, 7], torch.device("cpu"))
    assert [(s.slot, s.rank, s.rows.tolist()) for s in mapping.segments] == [
        (0, 3, [2]), (2, 7, [0, 3, 4])]
    assert not build_lora_mapping([-1, -1], [3], torch.device("cpu")).has_lora
    with pytest.raises(IndexError, match="slot 3"):
        build_lora_mapping([0, 3], [1, 2, 3], torch.device("cpu"))


# ---------------------------------------------------------------------------------------------
# LoRALinear with slots filled through LoRASlots.set_slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("enabled", [("q_proj", "k_proj", "v_proj"), ("q_proj", "v_proj"),
                                     ("k_proj",)], ids=["qkv", "qv", "k"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_lora_linear_equals_base_plus_per_row_delta(dtype, enabled, bias):
    gen = torch.Generator().manual_seed(len(enabled) * 10 + bias)
    names, sizes = QKV_NAMES, tuple(QKV_WIDTH.values())
    layer = LoRALinear(IN, sizes, names, bias=bias, dtype=dtype, device=torch.device("cpu"))
    with torch.no_grad():
        layer.weight.copy_(torch.randn(sum(sizes), IN, generator=gen) / IN ** 0.5)
        if bias:
            layer.bias.copy_(torch.randn(sum(sizes), generator=gen))
    slots = layer.create_lora_slots(enabled, MAX_LORAS, MAX_RANK)
    assert slots is not None and slots.module_names == enabled
    assert slots.output_slices == tuple((QKV_OFFSET[m], QKV_WIDTH[m]) for m in enabled)

    # slot 1 is first filled with a rank-16 adapter, then overwritten by a rank-2 one: the
    # padding left behind must be zeroed by set_slot.
    ranks = {0: 5, 1: 2, 2: MAX_RANK}
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None] = {}
    for m in enabled:
        slots.set_slot(1, m, torch.randn(MAX_RANK, IN, generator=gen).to(dtype),
                       torch.randn(QKV_WIDTH[m], MAX_RANK,
                                   generator=gen).to(dtype))
    for slot, r in ranks.items():
        for i, m in enumerate(enabled):
            if slot == 2 and i == 0:
                weights[(slot, m)] = None            # this adapter does not target m
                slots.set_slot(slot, m, None, None)
                continue
            out = QKV_WIDTH[m]
            a = (torch.randn(r, IN, generator=gen) / IN ** 0.5).to(dtype)
            b = (torch.randn(out, r, generator=gen) / r ** 0.5).to(dtype)
            weights[(slot, m)] = (a, b)
            slots.set_slot(slot, m, a, b)
    slot_ranks = [ranks.get(s, 0) for s in range(MAX_LORAS)]

    token_slots = [0, -1, 1, 1, 2, -1, 0, 2, 2, 1]
    x = torch.randn(len(token_slots), IN, generator=gen).to(dtype)
    mapping = build_lora_mapping(token_slots, slot_ranks, torch.device("cpu"))
    with torch.no_grad():
        got = layer(x, mapping)
        base_only = layer(x, None)

    want = x.double() @ layer.weight.double().T
    if bias:
        want += layer.bias.double()
    assert rel_err(base_only, want) < TOL[dtype]
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for m in enabled:
            w = weights[(slot, m)]
            if w is None:
                continue
            a, b = w
            off, n = QKV_OFFSET[m], QKV_WIDTH[m]
            want[t, off:off + n] += x[t].double() @ a.double().T @ b.double().T
    base = torch.tensor([s < 0 for s in token_slots])
    assert torch.equal(got[base], base_only[base])
    assert rel_err(got, want) < TOL[dtype]
    if dtype == torch.float32:
        assert rel_err(got - base_only, want - base_only.double()) < 1e-5
    # an all-base mapping gives the base output exactly
    with torch.no_grad():
        all_base = layer(x, build_lora_mapping([-1] * len(token_slots), slot_ranks,
                                               torch.device("cpu")))
    assert torch.equal(all_base, base_only)


def test_create_lora_slots_none_when_nothing_enabled():
    layer = LoRALinear(IN, (32,), ("o_proj",), bias=False, dtype=torch.float32,
                       device=torch.device("cpu"))
    assert layer.create_lora_slots(("q_proj",), MAX_LORAS, MAX_RANK) is None
    assert layer.lora is None


# ---------------------------------------------------------------------------------------------
# DoRA: (y + delta) * scale (+ shift) for the rows of the slots flagged in slot_dora

DORA_FLAGS = [1, 0, 1, 0]


def test_build_lora_mapping_carries_slot_dora_in_the_one_copy():
    cpu = torch.device("cpu")
    mapping = build_lora_mapping([2, -1, 0, 1, 2], [3, 5, 7, 2], cpu, slot_dora=[0, 1, 5, 0])
    assert mapping.slot_dora.dtype == torch.int32
    assert mapping.slot_dora.tolist() == [0, 1, 1, 0]
    assert [(s.slot, s.dora) for s in mapping.segments] == [(0, False), (1, True), (2, True)]
    storages = {t.untyped_storage().data_ptr() for t in mapping if isinstance(t, torch.Tensor)}
    assert len(storages) == 1, "every index tensor must come from one host → device copy"
    assert build_lora_mapping([0], [3, 5], cpu).slot_dora.tolist() == [0, 0]
    padded = build_lora_mapping([], [3, 5], cpu, slot_dora=[0, 0], pad_to=4, schedule="bgmv")
    assert padded.slot_dora.tolist() == [0, 0] and padded.segments == ()
    with pytest.raises(ValueError, match="slot_dora"):
        build_lora_mapping([0], [3, 5], cpu, slot_dora=[1])


@pytest.mark.parametrize("shift", [False, True], ids=["noshift", "shift"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dora_expand_reference(dtype, shift):
    gen = torch.Generator().manual_seed(31 + shift)
    slices, out_total = SLICES["gap"]
    ranks = RANKS["mixed"]
    token_slots = [0, -1, 1, 2, 2, 3, 0, -1, 1, 2]
    x = torch.randn(len(token_slots), IN, generator=gen).to(dtype)
    y0 = torch.randn(len(token_slots), out_total, generator=gen).to(dtype)
    a_stacked, b_stacked = make_stacks(ranks, slices, dtype, gen)
    scales = [1 + 0.2 * torch.randn(MAX_LORAS, n, generator=gen) for _, n in slices]
    shifts = [torch.randn(MAX_LORAS, n, generator=gen) for _, n in slices] if shift else None
    mapping = build_lora_mapping(token_slots, list(ranks), torch.device("cpu"),
                                 slot_dora=DORA_FLAGS)
    buffer = lora_shrink(x, a_stacked, mapping)

    y = y0.clone()
    lora_expand(y, buffer, b_stacked, mapping, slices, scales, shifts)
    plain = y0.clone()
    lora_expand(plain, buffer, b_stacked, mapping, slices)
    want = y0.double() + reference_delta(x, token_slots, a_stacked, b_stacked, slices,
                                         out_total)
    dora_rows = torch.tensor([s >= 0 and DORA_FLAGS[s] == 1 for s in token_slots])
    for t in dora_rows.nonzero().flatten().tolist():
        for s, (off, n) in enumerate(slices):
            want[t, off:off + n] *= scales[s][token_slots[t]].double()
            if shifts is not None:
                want[t, off:off + n] += shifts[s][token_slots[t]].double()
    assert torch.equal(y[~dora_rows], plain[~dora_rows]), "non-DoRA rows must not change"
    assert rel_err(y[dora_rows], want[dora_rows]) < TOL[dtype]
    assert torch.equal(y[:, 32:48], y0[:, 32:48]), "columns of no slice changed"


def test_dora_expand_rejects_bad_stacks():
    mapping = build_lora_mapping([0], [4], torch.device("cpu"), slot_dora=[1])
    y, buffer, b = torch.zeros(1, 8), torch.zeros(1, 1, 4), torch.zeros(1, 8, 4)
    with pytest.raises(ValueError, match="without DoRA scales"):
        lora_expand(y, buffer, [b], mapping, [(0, 8)], None, [torch.zeros(1, 8)])
    with pytest.raises(ValueError, match="DoRA scales"):
        lora_expand(y, buffer, [b], mapping, [(0, 8)], [torch.ones(1, 4)])
    with pytest.raises(ValueError, match="DoRA shifts"):
        lora_expand(y, buffer, [b], mapping, [(0, 8)], [torch.ones(1, 8)],
                    [torch.zeros(1, 8, dtype=torch.float64)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_lora_linear_dora_matches_peft_formula(bias, dtype):
    """DoRA rows give ``scale * (x W^T + x a^T b^T) + bias`` (peft), plain rows
    ``x W^T + bias + x a^T b^T``; a slot that held a DoRA adapter and then a plain one is
    plain again (its scales back to one, its shifts to zero)."""
    gen = torch.Generator().manual_seed(41 + bias)
    enabled = ("q_proj", "v_proj")
    layer = LoRALinear(IN, tuple(QKV_WIDTH.values()), QKV_NAMES, bias=bias, dtype=dtype,
                       device=torch.device("cpu"))
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / IN ** 0.5)
        if bias:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
    slots = layer.create_lora_slots(enabled, MAX_LORAS, MAX_RANK)
    assert (slots.dora_shift_stacked is not None) == bias
    assert all(t.dtype == torch.float32 and t.shape == (MAX_LORAS, QKV_WIDTH[m])
               for t, m in zip(slots.dora_scale_stacked, enabled))

    ranks = {0: 5, 1: 3, 2: 8, 3: 2}
    weights = {}
    for slot, r in ranks.items():
        for m in enabled:
            a = (torch.randn(r, IN, generator=gen) / IN ** 0.5).to(dtype)
            b = (torch.randn(QKV_WIDTH[m], r, generator=gen) / r ** 0.5).to(dtype)
            magnitude = 1 + 0.1 * torch.randn(QKV_WIDTH[m], generator=gen)
            scale = magnitude / dora_row_norm(layer.module_weight(m), a, b)
            if slot == 2:                        # a DoRA adapter, then a plain one
                slots.set_slot(slot, m, a, b, scale)
                scale = None
            if slot == 3 and m == "v_proj":      # a DoRA adapter that does not target v
                a = b = scale = None
            weights[(slot, m)] = (a, b, scale)
            slots.set_slot(slot, m, a, b, scale)
    for t, m in zip(slots.dora_scale_stacked, enabled):
        assert torch.all(t[2] == 1) and (m != "v_proj" or torch.all(t[3] == 1))
    if bias:
        assert all(torch.all(t[2] == 0) for t in slots.dora_shift_stacked)

    token_slots = [0, -1, 1, 2, 3, 3, 0, -1, 2, 1]
    slot_dora = [1, 0, 0, 1]
    x = torch.randn(len(token_slots), IN, generator=gen).to(dtype)
    mapping = build_lora_mapping(token_slots, [ranks[s] for s in range(MAX_LORAS)],
                                 torch.device("cpu"), slot_dora=slot_dora)
    with torch.no_grad():
        got = layer(x, mapping)
        base_only = layer(x, None)

    base = x.double() @ layer.weight.double().T
    want = base.clone()
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for m in enabled:
            a, b, scale = weights[(slot, m)]
            cols = slice(QKV_OFFSET[m], QKV_OFFSET[m] + QKV_WIDTH[m])
            if a is not None:
                want[t, cols] += x[t].double() @ a.double().T @ b.double().T
            if slot_dora[slot] and scale is not None:
                want[t, cols] *= scale.double()
    if bias:
        want += layer.bias.double()
    rows = torch.tensor([s >= 0 for s in token_slots])
    assert torch.equal(got[~rows], base_only[~rows])
    assert rel_err(got, want) < TOL[dtype]


def test_set_slot_rejects_a_dora_scale_of_another_width():
    layer = LoRALinear(IN, (32,), ("o_proj",), bias=True, dtype=torch.float32,
                       device=torch.device("cpu"))
    slots = layer.create_lora_slots(("o_proj",), MAX_LORAS, MAX_RANK)
    a, b = torch.ones(2, IN), torch.ones(32, 2)
    slots.set_slot(0, "o_proj", a, b, torch.full((32,), 2.0))
    with pytest.raises(ValueError, match="DoRA scale"):
        slots.set_slot(0, "o_proj", a * 3, b * 3, torch.ones(16))
    assert torch.all(slots.lora_a_stacked[0][0, :2] == 1), "a refused write changed the slot"
    assert torch.all(slots.dora_scale_stacked[0][0] == 2)
