"""The paged KV cache's shape and storage (``CacheConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

#: ``kv_cache_dtype`` values: the model dtype, or quantized per token and KV head.
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens each.

    Attributes:
        kv_cache_dtype: ``"auto"`` (the model dtype), ``"int8"`` or ``"fp8_e4m3"``.
        enable_prefix_caching: reuse full blocks across requests of the same adapter.
        num_host_blocks: blocks of swap space in host memory (0: none).
    """

    block_size: int
    num_blocks: int
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be ≥ 1, got {self.num_blocks}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be ≥ 0, got {self.num_host_blocks}")
