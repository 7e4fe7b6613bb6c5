"""The churn workload of issue 17, shared by ``bench_lora`` (GPU) and ``sim_churn`` (no GPU).

1,024 requests arrive at once; request i uses adapter ``zipf_adapters(...)[i]``, drawn
Zipf(1.0) over 256 adapters (weight of the adapter of popularity rank k = 1 / k), with a
fixed seed, so the measured run and the simulation replay the same sequence. Pure Python:
importing it needs neither torch nor numpy.
"""

from __future__ import annotations

import random

#: Requests, adapters, prompt tokens and new tokens of issue 17's churn workload.
REQUESTS = 1024
ADAPTERS = 256
PROMPT = 128
NEW = 64
SEED = 0


def zipf_adapters(requests: int = REQUESTS, adapters: int = ADAPTERS, seed: int = SEED,
                  exponent: float = 1.0) -> list[int]:
    """Adapter index (0 = most popular) of each request, drawn independently with weight
    ``1 / (k + 1) ** exponent`` for index k (``random.Random(seed).choices``).

    Raises:
        ValueError: ``requests`` < 0 or ``adapters`` < 1.
    """
    if requests < 0 or adapters < 1:
        raise ValueError(f"need requests >= 0 and adapters >= 1, got {requests}, {adapters}")
    weights = [1.0 / (k + 1) ** exponent for k in range(adapters)]
    return random.Random(seed).choices(range(adapters), weights=weights, k=requests)
