"""Token embedding (also the LM head's table): allocated uninitialised for the loader."""

from __future__ import annotations

import torch
from torch import nn


class Embedding(nn.Module):
    """``weight [vocab, hidden]``; forward ``ids`` int64 ``[T]`` → ``[T, hidden]``."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)

