"""LoRA on the vocabulary-wide modules: the token embedding (``embed_tokens``) and the LM
head (``lm_head``), as peft writes them and vLLM serves them
(``VocabParallelEmbeddingWithLoRA``, ``LogitsProcessorWithLoRA``).

Both keep their adapters in ordinary ``LoRASlots`` (bound to the model's ``SlotTable``
under the key ``(MODEL_LAYER, module)``, loaded by the same one-scatter slot load) and run
the same expand kernel as the projections; only the embedding's shrink differs:

* ``embed_tokens`` (peft's ``lora_embedding_A [r, vocab]``, ``lora_embedding_B [hidden,
  r]``, scaling folded into B): the delta of token ``t`` is ``B @ A[:, t]``, a gather of
  column ``t`` of its slot's A (no product) then the expand, over every token row of the
  step with the projections' mapping. Under tensor parallelism every rank keeps the whole
  A and B and adds the delta after the embedding's all-reduce: each rank computes the same
  rows, so the delta counts once.
* ``lm_head`` (``lora_A [r, hidden]``, ``lora_B [vocab, r]``): shrink and expand over the
  rows whose logits are computed (the sampled rows, or the prompt rows of prompt
  log-probabilities), with a mapping of those rows alone (the reference's
  ``prompt_lora_mapping``): a head adapter costs ``N x r x vocab`` for ``N`` sampled rows,
  never the step's tokens. Under tensor parallelism (a vocabulary-parallel head) A is
  whole on every rank and B cut to the rank's vocabulary rows, added to the rank's logits
  before their all-gather. A tied head (``tie_word_embeddings``) keeps the embedding as
  its base weight; the adapter's ``lm_head`` LoRA has its own slots.

The delta is added in the logits' dtype before their cast to float32 (peft adds it to the
``lm_head`` output), so a family that rescales or soft-caps its logits does so after it.
DoRA is refused on both modules by the adapter readers.
"""

from __future__ import annotations

import torch
from torch import nn

from manylora.lora.kernels.meta import LoRAKernelMeta
from manylora.lora.slots import LoRASlots, SlotSharding


class EmbeddingLoRA(nn.Module):
    """The slots of ``embed_tokens``: ``lora_a_0 [max_loras, max_lora_rank, vocab]`` (A as
    peft stores it), ``lora_b_0 [max_loras, max_lora_rank, hidden]``.

    Args:
        vocab_size, hidden_size: the whole model's.
        max_loras, max_lora_rank: slot count and padded rank.
        dtype, device: of the slot buffers.
    """

    def __init__(self, vocab_size: int, hidden_size: int, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.slots = LoRASlots(vocab_size, [("embed_tokens", 0, hidden_size)], max_loras,
                               max_lora_rank, dtype, device)

    def add_(self, ids: torch.Tensor, x: torch.Tensor, lora: LoRAKernelMeta | None) -> None:
        """``x += B_s @ A_s[:, ids]`` in place for every row with an adapter slot ``s`` that
        targets ``embed_tokens`` (``ids`` int64 ``[T]``, ``x [T, hidden]`` the embedding);
        nothing on a step without LoRA rows or, eagerly, none targeting it. Graph-safe:
        fixed shapes, the slot of each row read from ``lora.token_lora_indices``."""
        slots = self.slots
        if lora is None or not lora.has_lora or not slots.used(lora):
            return
        a = slots.lora_a_stacked[0]                                   # [L, R, vocab]
        rows = lora.token_lora_indices[: ids.shape[0]].long().clamp_(min=0)
        buffer = a[rows, :, ids].float().unsqueeze(1)                 # [T, 1, R]
        slots.expand(x, buffer, lora)


class HeadLoRA(nn.Module):
    """The slots of ``lm_head``: ``lora_a_0 [max_loras, max_lora_rank, hidden]``,
    ``lora_b_0 [max_loras, max_lora_rank, vocab_end - vocab_start]`` (this rank's
    vocabulary rows of B).

    Args:
        hidden_size, vocab_size: the whole model's.
        vocab_range: the rows ``[start, end)`` of the vocabulary this rank's head computes
            (``Embedding.vocab_start`` / ``vocab_end``); ``(0, vocab_size)`` on one rank.
        max_loras, max_lora_rank, dtype, device: as ``EmbeddingLoRA``.
    """

    def __init__(self, hidden_size: int, vocab_size: int, vocab_range: tuple[int, int],
                 max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        lo, hi = vocab_range
        sharding = None if (lo, hi) == (0, vocab_size) else SlotSharding((vocab_size,),
                                                                         ((lo, hi),))
        self.slots = LoRASlots(hidden_size, [("lm_head", 0, hi - lo)], max_loras,
                               max_lora_rank, dtype, device, sharding=sharding)

    def add_(self, hidden: torch.Tensor, logits: torch.Tensor,
             rows: LoRAKernelMeta | None) -> None:
        """``logits += hidden @ A_s^T @ B_s^T`` in place for each row whose slot ``s``
        targets ``lm_head`` (``hidden [N, hidden]``, ``logits [N, local vocab (+ padding)]``
        in the model dtype, ``rows`` the mapping of these ``N`` rows; None or no LoRA row:
        nothing)."""
        slots = self.slots
        if rows is None or not rows.has_lora or not slots.used(rows):
            return
        slots.apply(hidden, logits, rows)
