"""Decode steps replayed as CUDA graphs, one graph per (batch-size bucket, LoRA schedule).

A decode step launches a few hundred small kernels; replaying them as one captured graph
removes the launch gaps (vLLM's ``CUDAGraphRunner``). A graph's inputs are the tensors of
the step it was captured with: the token ids, positions, attention metadata and LoRA mapping
of a batch padded to the bucket size. Before each replay the new step's inputs, built with
the same padding, are copied into those tensors field by field, so every shape and host
value a captured kernel depends on is the same at every replay.

Adapter weights, ranks and DoRA flags are inputs too (the slot buffers, DoRA scales
included, are written in place; the ranks and flags travel in ``LoRAMapping.slot_ranks`` and
``slot_dora``), so loading or evicting adapters, DoRA or not, between steps never forces a
re-capture.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: Batch sizes captured by default. Coarse on purpose: a padded decode row costs almost
#: nothing (the step is bound by reading the weights once), while each size is one more
#: capture.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def copy_inputs(dst: Any, src: Any) -> None:
    """Copy every tensor of ``src`` into the same-shaped tensor of ``dst``, recursively.

    ``dst`` and ``src`` are tensors or (named) tuples of them; other values are host
    constants the graph was captured with and must already be equal.

    Raises:
        ValueError: a host value or a tuple length differs (the graph would be wrong).
    """
    if isinstance(dst, torch.Tensor):
        dst.copy_(src, non_blocking=True)
    elif isinstance(dst, tuple):
        if len(dst) != len(src):
            raise ValueError(f"graph input has {len(dst)} entries, the step {len(src)}")
        for d, s in zip(dst, src):
            copy_inputs(d, s)
    elif dst != src:
        raise ValueError(f"graph was captured with {dst!r}, the step has {src!r}")


class DecodeGraphs:
    """Captures and replays ``forward(*inputs) -> hidden`` for padded decode batches.

    Args:
        forward: the model's forward over ``(input_ids, positions, attn, lora)``; must launch
            no host synchronisation.
        capture_sizes: the batch sizes that get a graph; a step of ``n`` rows is padded to
            the smallest size ``>= n``; steps beyond the largest run eagerly.

    Graphs are captured lazily, the first time a (bucket, schedule) pair occurs, after one
    eager warm-up run (which also compiles the Triton kernels); all share one memory pool.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], capture_sizes: Sequence[int]) -> None:
        self.forward = forward
        self.capture_sizes = tuple(sorted(set(capture_sizes)))
        self._graphs: dict[tuple[int, str | None], tuple[torch.cuda.CUDAGraph, tuple,
                                                         torch.Tensor]] = {}
        self._pool = None

    def bucket(self, num_rows: int) -> int | None:
        """The padded batch size for ``num_rows`` decode rows, or None (run eagerly)."""
        for size in self.capture_sizes:
            if size >= num_rows:
                return size
        return None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, key: tuple[int, str | None], inputs: tuple) -> torch.Tensor:
        """Replay (capturing first if new) the graph for ``key`` on ``inputs``.

        Args:
            key: ``(bucket, LoRA schedule or None)``.
            inputs: ``(input_ids [bucket], positions [bucket], attn, lora or None)`` built
                with ``pad_to=bucket``.

        Returns:
            hidden states ``[bucket, hidden_size]``: a view of the graph's output buffer,
            valid until the next replay.
        """
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(inputs)
            self._graphs[key] = entry
            logger.debug("captured a decode graph for batch %d, LoRA schedule %s", *key)
        graph, static_inputs, output = entry
        copy_inputs(static_inputs, inputs)
        graph.replay()
        return output

    def release(self) -> None:
        """Destroy every captured graph and their memory pool. Under tensor parallelism this
        must come before the process group is destroyed: NCCL's communicator finalisation
        waits for the graphs that captured its collectives (seen on two H200s, torch 2.11)."""
        torch.cuda.synchronize()
        for graph, _, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._pool = None

    def _capture(self, inputs: tuple) -> tuple[torch.cuda.CUDAGraph, tuple, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(*inputs)                                  # warm-up: JIT, allocator
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.forward(*inputs)
        return graph, inputs, output
