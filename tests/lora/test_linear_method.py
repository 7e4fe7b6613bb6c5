"""``LoRALinear`` over a linear method other than the dense one: its weights are laid out by
the method, filled from a checkpoint through ``ModelWeightsLoader`` (the rank's rows under
tensor parallelism), and the LoRA delta is added on top of the method's product, the same
delta as over the dense method.

The test method stores the weight transposed (``[in, out]``) and fills it through its own
``weight_loader``, as a quantized method's packed layout would be; the reference is the
checkpoint's tensors and a float64 ``x Wᵀ + x Aᵀ Bᵀ``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from manylora.checkpoint.weights import ModelWeightsLoader
from manylora.distributed.parallel_state import TPGroup
from manylora.lora.kernels.meta import build_lora_kernel_meta
from manylora.lora.linear import LoRALinear
from manylora.ops.linear_method import LinearMethodBase, UnquantizedLinearMethod

IN, SIZES, NAMES = 16, (8, 4, 4), ("q_proj", "k_proj", "v_proj")


class TransposedLinearMethod(LinearMethodBase):
    """``weight [in, out]``, filled by a ``weight_loader`` from the checkpoint's ``[out,
    in]`` tensors (the parts the dense layout's ``tp_slices`` name)."""

    def create_weights(self, layer, in_features, out_features, params_dtype, device,
                       weight_attrs):
        weight = nn.Parameter(torch.empty(in_features, out_features, dtype=params_dtype,
                                          device=device), requires_grad=False)
        for name, value in weight_attrs.items():
            setattr(weight, name, value)
        weight.weight_loader = lambda param, tensors: param.copy_(torch.cat(tensors).T)
        layer.weight = weight

    def apply(self, layer, x, bias=None):
        y = x @ layer.weight
        return y if bias is None else y + bias

    def dense_weight(self, layer):
        return layer.weight.T


class Block(nn.Module):
    def __init__(self, method: LinearMethodBase, tp: TPGroup) -> None:
        super().__init__()
        self.qkv_proj = LoRALinear(IN, SIZES, NAMES, True, torch.float32, torch.device("cpu"),
                                   "column", tp, linear_method=method)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"{name}.{kind}": torch.randn(*shape, generator=gen)
               for name, out in zip(NAMES, SIZES)
               for kind, shape in (("weight", (out, IN)), ("bias", (out,)))}
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@pytest.mark.parametrize("tp", [TPGroup.single(), TPGroup(1, 2)], ids=["tp1", "rank1of2"])
def test_another_layout_loads_and_keeps_the_lora_delta(checkpoint, tp):
    path, tensors = checkpoint
    layers = {}
    for name, method in (("dense", UnquantizedLinearMethod()),
                         ("transposed", TransposedLinearMethod())):
        block = Block(method, tp)
        ModelWeightsLoader(path).load_model(block)        # qkv_proj → q_proj, k_proj, v_proj
        layers[name] = block.qkv_proj
    # The rank's rows of each module (rank 1 of 2: the second half), cut by hand.
    rows = [(0, n) if tp.size == 1 else (n // 2, n) for n in SIZES]
    want_w = torch.cat([tensors[f"{m}.weight"][lo:hi] for m, (lo, hi) in zip(NAMES, rows)])
    want_b = torch.cat([tensors[f"{m}.bias"][lo:hi] for m, (lo, hi) in zip(NAMES, rows)])
    k_lo = rows[0][1] - rows[0][0]
    k_hi = k_lo + rows[1][1] - rows[1][0]
    transposed = layers["transposed"]
    assert transposed.weight.shape == (IN, want_w.shape[0])
    assert torch.equal(transposed.linear_method.dense_weight(transposed), want_w)
    assert torch.equal(layers["dense"].weight, want_w)
    assert torch.equal(transposed.module_weight("k_proj"), want_w[k_lo:k_hi])

    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, IN, generator=gen), torch.randn(SIZES[1], 4, generator=gen)
    x = torch.randn(3, IN, generator=gen)
    want = x.double() @ want_w.double().T + want_b.double()
    delta = x.double() @ a.double().T @ b.double()[rows[1][0]:rows[1][1]].T
    want[[0, 2], k_lo:k_hi] += delta[[0, 2]]
    for layer in layers.values():
        slots = layer.create_lora_slots(("k_proj",), 2, 8)
        slots.set_slot(0, "k_proj", a, b)
        meta = build_lora_kernel_meta([0, -1, 0], 2, torch.device("cpu"),
                                      ranks_host=slots.table.ranks_host)
        with torch.no_grad():
            out = layer(x, meta)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
