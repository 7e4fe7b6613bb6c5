"""The one in-memory form of a LoRA adapter, whatever format it was read from."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

#: ``dtype → (integer dtype of its width, exponent mask)``: a value is NaN or Inf exactly when
#: all its exponent bits are set (IEEE 754 binary16/32/64 and bfloat16).
_EXPONENT_BITS = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the problem."""


class LoRALoadTimeoutError(LoRAAdapterError):
    """An adapter read that did not end within its bound (``lora_load_timeout``); only its
    own requests fail."""


#: The largest ``||A||_F * ||B||_F`` (scaling folded into B) ``check_delta`` accepts.
MAX_DELTA_GAIN = 1e12


def check_delta(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Refuse a module whose delta ``x @ a^T @ b^T`` cannot stay finite.

    The rule, on ``a [r, in]`` and ``b [out, r]`` as they will be served (the model dtype,
    LoRA scaling folded into ``b``):

    1. every value is finite (the cast to the model dtype did not overflow);
    2. the probe ``b @ (a @ 1)``, the delta of the all-ones input ``1 [in]`` (RMS 1),
       computed in float32 as the kernels accumulate, is finite;
    3. the gain bound ``||a||_F * ||b||_F`` (float64), which bounds the spectral norm of
       ``b @ a`` and so the delta's output norm per unit of input norm, is at most
       ``MAX_DELTA_GAIN`` (1e12).

    A trained adapter is far inside these: values within ±10 at rank 512 on 65536-wide
    projections give a gain of at most 3.4e9 before scaling.

    Stacked expert weights (``a [E, r, in]``, ``b [E, out, r]``) are checked expert by
    expert, the message naming the expert.

    Args:
        what: how messages name the module, e.g. ``"adapter 'x': model.layers.0...q_proj"``.
        a, b: the module's tensors, 2-D, or 3-D with one A/B per expert.

    Raises:
        LoRAAdapterError: naming the module (and expert) and the rule it breaks.
    """
    if a.dim() == 3:
        for e in range(a.shape[0]):
            check_delta(f"{what} (expert {e})", a[e], b[e])
        return
    for label, t in (("lora_A", a), ("lora_B", b)):
        if not all_finite(t):
            raise LoRAAdapterError(f"{what}: {label} overflows {t.dtype} (values beyond its "
                                   "range after the LoRA scaling)")
    probe = b.float() @ (a.float() @ torch.ones(a.shape[1], dtype=torch.float32))
    gain = float(torch.linalg.vector_norm(a, dtype=torch.float64)
                 * torch.linalg.vector_norm(b, dtype=torch.float64))
    probe_finite = all_finite(probe)
    if not probe_finite or not gain <= MAX_DELTA_GAIN:
        raise LoRAAdapterError(
            f"{what}: its weights are too large to compute with (||A||·||B|| = {gain:.3g}, "
            f"the bound is {MAX_DELTA_GAIN:.0e}; a probe input gives "
            f"{'finite' if probe_finite else 'non-finite'} outputs)")


@dataclass(frozen=True)
class LoRAWeights:
    """One targeted module of one layer.

    Attributes:
        a: ``[r, in_features]``; for the stacked experts (``experts.*``) ``[E, r, in]``, one
            A per expert.
        b: ``[out_features, r]`` with the LoRA scaling (alpha/r or alpha/sqrt(r)) folded in,
            so the module's delta is ``x @ a^T @ b^T``; for the experts ``[E, out, r]``
            (expert ``e``'s delta ``x @ a[e]^T @ b[e]^T``).
        dora_scale: DoRA (Liu et al. 2024, arXiv 2402.09353) only: float32 ``[out_features]``,
            the magnitude already normalized against the base weight,
            ``m / ||W + b @ a||`` (L2 norm of each output row; TensorRT-LLM's normalized DoRA
            scale). The module's output is then ``dora_scale * (x W^T + x a^T b^T) + bias``.
    """

    a: torch.Tensor
    b: torch.Tensor
    dora_scale: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        """``r`` (``a.shape[-2]``: the same for 2-D and stacked expert weights)."""
        return self.a.shape[-2]

    @property
    def num_experts(self) -> int:
        """``E`` of stacked expert weights; 0 for a 2-D module."""
        return self.a.shape[0] if self.a.dim() == 3 else 0

    @property
    def nbytes(self) -> int:
        """Host bytes of the tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.a, self.b) if self.dora_scale is None else (self.a, self.b, self.dora_scale)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite (``torch.isfinite(t).all()``).

    A CPU tensor of a float dtype is tested on its bits with numpy: NaN or Inf exactly when
    every exponent bit is set (about 30x faster than ``torch.isfinite`` on bfloat16, which a
    27 MB adapter read spent seconds in); other tensors go to ``torch.isfinite``. Integer
    tensors are finite.
    """
    if not t.is_floating_point():
        return True
    spec = _EXPONENT_BITS.get(t.dtype)
    if spec is None or t.device.type != "cpu":
        return bool(torch.isfinite(t).all())
    int_dtype, mask = spec
    bits = t.detach().contiguous().view(int_dtype).numpy()
    return not bool(np.any(np.bitwise_and(bits, mask) == mask))


def weights_digest(weights: Mapping[tuple[int, str], LoRAWeights]) -> str:
    """A content digest (BLAKE2b, 128-bit hex) of an adapter's weights.

    Covers every module's layer, name, dtypes, shapes and bytes, so two adapters get the same
    digest only when they compute the same deltas in the same dtype.
    """
    h = hashlib.blake2b(digest_size=16)
    for (layer, module), w in sorted(weights.items()):
        h.update(f"{layer}:{module};".encode())
        for t in w.tensors():
            t = t.detach().contiguous().cpu()
            h.update(f"{t.dtype}{tuple(t.shape)};".encode())
            if t.numel():
                h.update(t.view(torch.uint8).numpy())          # the bytes, not a copy
    return h.hexdigest()


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter, as the format readers produce it (the host cache keeps it pinned:
    ``manylora.lora.pinned.pin_adapter``).

    Attributes:
        lora_int_id: the adapter's identity in the caches (``LoRARequest.lora_int_id``, which
            TensorRT-LLM calls task_id).
        name: ``LoRARequest.lora_name``.
        weights: ``{(layer_index, module_name): LoRAWeights}``, host tensors in the model
            dtype (DoRA scales in float32); module names are the seven HF projection names,
            ``embed_tokens`` / ``lm_head`` (layer ``MODEL_LAYER``) and the MoE block's
            ``LORA_MOE_MODULES`` (``experts.*`` with 3-D weights).
        digest: ``weights_digest(weights)`` (and the invocation tokens of an activated
            adapter); with the name, what identifies the adapter's cached state (two
            adapters that share a name never share it).
        invocation_tokens: an activated LoRA's (aLoRA; peft's ``alora_invocation_tokens``)
            invocation token ids: its weights apply from the start of the last occurrence
            of this sequence in a request's prompt on (``alora_start``); None: a plain
            adapter, on every token.
    """

    lora_int_id: int
    name: str
    weights: dict[tuple[int, str], LoRAWeights]
    digest: str = field(default="")
    invocation_tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.digest:
            digest = weights_digest(self.weights)
            if self.invocation_tokens is not None:
                h = hashlib.blake2b(digest.encode(), digest_size=16)
                h.update(("alora:" + ",".join(map(str, self.invocation_tokens))).encode())
                digest = h.hexdigest()
            object.__setattr__(self, "digest", digest)

    @property
    def rank(self) -> int:
        """The largest rank over all targeted modules."""
        return max(w.rank for w in self.weights.values())

    @property
    def has_dora(self) -> bool:
        return any(w.dora_scale is not None for w in self.weights.values())

    @property
    def nbytes(self) -> int:
        """Host bytes of all its tensors."""
        return sum(w.nbytes for w in self.weights.values())
