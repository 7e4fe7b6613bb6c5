"""The paged KV cache of one layer: its ``KVCache`` record, storage dtypes and quantization.

Layout (vLLM's PagedAttention, Kwon et al., SOSP 2023): ``data[2, num_blocks, block_size,
num_kv_heads, head_dim]`` (index 0 keys, 1 values). Token ``p`` of a sequence lives in
physical block ``block_table[p // block_size]`` at offset ``p % block_size``, i.e. flat
cache location ``block_table[p // block_size] * block_size + p % block_size``.

The cache holds the model dtype (``kv_cache_dtype`` "auto") or is quantized ("int8",
"fp8_e4m3"): symmetric, dynamic, one float32 scale per (K/V, token, KV head) in
``scale[2, num_blocks, block_size, num_kv_heads]``, computed when the token is written and
applied when attention reads it (LMDeploy TurboMind's online per-head, per-token KV
quantization, here without a zero point)::

    scale   = max_d |x[d]| / QMAX        QMAX = 127 (int8), 448 (float8 e4m3)
    code[d] = round(x[d] / scale)        (int8: to nearest even, clamped to ±127;
                                          fp8: the cast to float8_e4m3fn, clamped to ±448)
    x[d]   ≈ code[d] * scale             (a zero row has scale 0 and dequantizes to 0)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from manylora.config import KV_CACHE_DTYPES

#: QMAX of each quantized storage dtype: the largest magnitude a stored code takes.
KV_QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_KV_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a KV cache: ``model_dtype`` for "auto", ``torch.int8`` for
    "int8", ``torch.float8_e4m3fn`` for "fp8_e4m3" (vLLM's ``kv_cache_dtype`` names).

    Raises:
        ValueError: ``kv_cache_dtype`` is not one of ``KV_CACHE_DTYPES``.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_STORAGE:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
    return _KV_STORAGE[kv_cache_dtype]


class KVCache(NamedTuple):
    """One layer's paged KV cache: the stored keys/values and, when quantized, their scales.

    Attributes:
        data: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 keys, 1
            values) in the model dtype (unquantized) or ``torch.int8`` /
            ``torch.float8_e4m3fn`` (quantized).
        scale: float32 ``[2, num_blocks, block_size, num_kv_heads]``, one scale per (K/V,
            token, KV head), or None when unquantized. Cache location ``s`` of head ``h`` holds
            ``x ≈ data[:, s // bs, s % bs, h].float() * scale[:, s // bs, s % bs, h, None]``
            with ``scale = max_d |x[d]| / QMAX`` (``KV_QUANT_MAX``; see ``quantize_kv``).

    The layout follows vLLM's PagedAttention; the quantization LMDeploy TurboMind's online
    per-head, per-token int8 KV cache (symmetric here).
    """

    data: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        """True when ``data`` holds int8 / float8 codes with per-(token, head) ``scale``."""
        return self.scale is not None

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype of ``data`` (model dtype, int8 or float8_e4m3fn)."""
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        """The device of ``data`` (and ``scale``)."""
        return self.data.device


def quantize_kv(x: torch.Tensor, storage_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row, per-head quantization of keys or values (the reference the Triton
    write kernel reproduces; LMDeploy TurboMind's online KV quantization, without its zero
    point)::

        scale[t, h]   = max_d |x[t, h, d]| / QMAX                   (float32)
        code[t, h, d] = round(x[t, h, d] / scale[t, h])             (x / 1 where scale is 0)

    int8 rounds half to even and clamps to ±127; float8_e4m3fn clamps to ±448 and casts
    (round to nearest even). A zero row gets scale 0 and codes 0, so it dequantizes to 0.
    Non-finite inputs give non-finite scales.

    Args:
        x: ``[T, num_kv_heads, head_dim]`` float32, bfloat16 or float16 (any strides).
        storage_dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.

    Returns:
        ``(codes [T, num_kv_heads, head_dim] storage_dtype, scale [T, num_kv_heads] float32)``.

    Raises:
        ValueError: ``x`` not 3-D or not floating point, or another storage dtype.
    """
    if storage_dtype not in KV_QUANT_MAX:
        raise ValueError(f"storage_dtype must be one of {list(KV_QUANT_MAX)}, got {storage_dtype}")
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [T, num_kv_heads, head_dim] tensor, got "
                         f"{tuple(x.shape)} {x.dtype}")
    qmax = KV_QUANT_MAX[storage_dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / qmax                                 # [T, Hkv]
    y = (xf / torch.where(scale == 0, 1.0, scale).unsqueeze(-1)).clamp(-qmax, qmax)
    if storage_dtype == torch.int8:
        y = torch.round(y)
    return y.to(storage_dtype), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q.float() * scale[..., None]``: float32 keys/values from codes and their scales.

    Args:
        q: ``[..., head_dim]`` int8 or float8_e4m3fn codes (``quantize_kv``'s first result).
        scale: float32 ``[...]`` (one per row of ``q``).

    Returns:
        float32 ``[..., head_dim]``.

    Raises:
        ValueError: ``scale.shape`` is not ``q.shape[:-1]``.
    """
    if scale.shape != q.shape[:-1]:
        raise ValueError(f"scale {tuple(scale.shape)} must be q's shape {tuple(q.shape)} "
                         "without its last dim")
    return q.float() * scale.float().unsqueeze(-1)


def check_kv_cache(kv_cache: KVCache) -> None:
    """Host-only checks of one layer's cache (no device sync).

    Raises:
        ValueError: ``kv_cache`` not a ``KVCache``; ``data`` not ``[2, blocks, block_size,
            Hkv, D]``; an unquantized cache whose data is not float32/bfloat16/float16; a
            quantized one whose data is not int8/float8_e4m3fn or whose scale is not float32
            ``[2, blocks, block_size, Hkv]`` on the data's device.
    """
    if not isinstance(kv_cache, KVCache):
        raise ValueError(f"the cache must be a KVCache(data, scale), got {type(kv_cache).__name__}")
    data, scale = kv_cache
    if data.dim() != 5 or data.shape[0] != 2:
        raise ValueError(f"kv_cache.data must be [2, blocks, block_size, Hkv, D], got "
                         f"{tuple(data.shape)}")
    if scale is None:
        if data.dtype not in FLOAT_DTYPES:
            raise ValueError(f"an unquantized cache holds {[str(d) for d in FLOAT_DTYPES]}, got "
                             f"{data.dtype} (a quantized cache needs its scale)")
        return
    if data.dtype not in KV_QUANT_MAX:
        raise ValueError(f"a quantized cache holds {[str(d) for d in KV_QUANT_MAX]}, got "
                         f"{data.dtype}")
    if (scale.shape != data.shape[:4] or scale.dtype != torch.float32
            or scale.device != data.device):
        raise ValueError(f"kv_cache.scale must be float32 {tuple(data.shape[:4])} on "
                         f"{data.device}, got {scale.dtype} {tuple(scale.shape)} on {scale.device}")
