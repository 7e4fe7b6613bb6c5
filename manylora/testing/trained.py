"""A tiny checkpoint trained on a task that needs attention, for accuracy tests whose
random-weight checkpoints are too chaotic (near-uniform next-token distributions, where
any perturbation flips the greedy choice).

The task: a sequence of random tokens that repeats with a fixed ``period``, so from the
second period on, the next token is the one ``period`` positions back. The model can only
predict it by attending to that position's key and value, so an error in the KV cache
shows up in the outputs; a trained model predicts it with the confident margins of a real
language model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from manylora.testing.checkpoint import make_checkpoint


def periodic_batch(gen: torch.Generator, batch: int, length: int, period: int,
                   low: int, high: int) -> torch.Tensor:
    """int64 ``[batch, length]``: each row a random ``period``-token pattern (ids in
    ``[low, high)``) repeated."""
    pattern = torch.randint(low, high, (batch, period), generator=gen)
    reps = -(-length // period)
    return pattern.repeat(1, reps)[:, :length]


def make_trained_checkpoint(out_dir: str | Path, *, period: int = 5, steps: int = 100,
                            seed: int = 0, low: int = 3, high: int = 200,
                            **checkpoint_kwargs: Any) -> Path:
    """Write a tiny checkpoint (``make_checkpoint``), train it with AdamW on periodic
    sequences (see the module docstring) for ``steps`` steps of 32 sequences of 48
    tokens, and save it again with ``save_pretrained`` (float32).

    Returns:
        ``Path(out_dir)``.
    """
    from transformers import AutoModelForCausalLM

    out = make_checkpoint(out_dir, seed=seed, init_std=0.02, **checkpoint_kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = periodic_batch(gen, 32, 48, period, low, high)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(str(out))
    return out
