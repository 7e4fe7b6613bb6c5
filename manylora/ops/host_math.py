"""Integer helpers of the kernels' launch heuristics, as plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are Triton ``constexpr_function`` objects in
recent Triton: callable from the host, but each call unwraps its arguments first, several
microseconds that the wrappers paid many times per launch on the hot path.
"""

from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for ints, ``y > 0``."""
    return -(-x // y)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ ``n`` (1 for ``n ≤ 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
