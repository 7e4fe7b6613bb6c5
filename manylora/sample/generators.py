"""Random generators of the sampler: the process-wide seed (``--seed``) and one seeded
``torch.Generator`` per seeded request (vLLM's seeded sampling)."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (torch's seeds every device's
    too), as vLLM's ``--seed`` does: the draws of unseeded requests come from torch's."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """Return a ``torch.Generator`` on ``device`` seeded with ``seed``.

    One generator per seeded request; the sampler draws that request's noise from it only,
    so its tokens do not depend on the rest of the batch (as vLLM's seeded sampling).
    """
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int(seed))
    return g
