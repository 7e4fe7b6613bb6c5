"""Token embedding (also the LM head's table): allocated uninitialised for the loader.

Under tensor parallelism the table is split by vocabulary rows (Megatron-LM's
VocabParallelEmbedding): each rank holds ``ceil(vocab / tp)`` consecutive rows, the last
ranks' tables padded with zero rows past the vocabulary. The embedding looks up the ids in
the rank's range, zeroes the others and all-reduces; as the LM head each rank computes its
rows' logits and ``LlamaForCausalLM.compute_logits`` all-gathers them. The table's layout
and the LM head's product ``hidden @ weightᵀ`` are the embedding's linear method's
(``manylora.ops.linear_method``; dense today: the lookup reads the dense table).
"""

from __future__ import annotations

import torch
from torch import nn

from manylora.checkpoint.weights import TPSlice
from manylora.distributed.parallel_state import TPGroup
from manylora.ops.linear_method import LinearMethodBase, UnquantizedLinearMethod


class Embedding(nn.Module):
    """``weight [rows, hidden]``; forward ``ids`` int64 ``[T]`` → ``[T, hidden]``; as the LM
    head, ``linear_method.apply(self, hidden [N, hidden])`` → ``[N, rows]`` logits.

    Args:
        vocab_size: the whole vocabulary.
        hidden_size: the embedding width.
        dtype, device: of the table.
        tp: the tensor-parallel group (None: one rank, ``rows == vocab_size``). With more
            ranks ``rows = ceil(vocab_size / tp.size)`` and this rank holds ids
            ``[vocab_start, vocab_end)``; ``weight`` carries ``tp_dim`` 0 and ``tp_slices``
            for the loader (zero rows past the vocabulary).
        linear_method: the table's layout and the LM head's product; None:
            ``UnquantizedLinearMethod``.

    Forward on several ranks is a collective (an all-reduce): every rank runs it together.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, tp: TPGroup | None = None,
                 linear_method: LinearMethodBase | None = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.vocab_size = vocab_size
        rows = -(-vocab_size // self.tp.size)
        self.vocab_start = min(self.tp.rank * rows, vocab_size)
        self.vocab_end = min(self.vocab_start + rows, vocab_size)
        self.linear_method = linear_method or UnquantizedLinearMethod()
        weight_attrs = {} if self.tp.size == 1 else {
            "tp_dim": 0,
            "tp_slices": (TPSlice(0, self.vocab_start, self.vocab_end, vocab_size, rows),)}
        self.linear_method.create_weights(self, hidden_size, rows, dtype, torch.device(device),
                                          weight_attrs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        inside = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(inside, ids - self.vocab_start, torch.zeros_like(ids))
        out = nn.functional.embedding(local, self.weight)                  # [T, hidden]
        out.masked_fill_(~inside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)
