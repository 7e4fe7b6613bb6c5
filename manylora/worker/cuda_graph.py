"""Decode steps replayed as CUDA graphs, one graph per (batch-size bucket, LoRA schedule).

A decode step launches a few hundred small kernels; replaying them as one captured graph
removes the launch gaps (vLLM's ``CUDAGraphRunner``). A graph is captured on the model
runner's persistent device buffers (``worker/step_inputs.py``): the step's ids, positions,
token rows, sequence lengths, attention tiles and LoRA mapping are views of one device
buffer at offsets fixed by the bucket, and the slot mapping and the step's block table are
computed inside the graph from the persistent device block table. A step is written into
those buffers by one host → device copy, then the graph replays: nothing is copied in.

Adapter weights, ranks and DoRA flags are inputs too (the slot buffers, DoRA scales
included, are written in place; the ranks and flags travel in the LoRA segment of the step
buffer), so loading or evicting adapters, DoRA or not, between steps never forces a
re-capture.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

#: Batch sizes captured by default. Coarse on purpose: a padded decode row costs almost
#: nothing (the step is bound by reading the weights once), while each size is one more
#: capture.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


class DecodeGraphs:
    """Captures and replays the decode forward pass for padded batch sizes.

    Args:
        capture_sizes: the batch sizes that get a graph; a step of ``n`` rows is padded to
            the smallest size ``>= n``; steps beyond the largest run eagerly.

    The model runner captures every (bucket, schedule) pair at start-up
    (``ModelRunner.capture_graphs``), after one eager warm-up run of each (which also
    compiles the Triton kernels); all graphs share one memory pool.
    """

    def __init__(self, capture_sizes: Sequence[int]) -> None:
        self.capture_sizes = tuple(sorted(set(capture_sizes)))
        self._graphs: dict[tuple[int, str | None], tuple[torch.cuda.CUDAGraph,
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

    def has(self, key: tuple[int, str | None]) -> bool:
        """Whether ``key`` = ``(bucket, LoRA schedule or None)`` has a graph."""
        return key in self._graphs

    def capture(self, key: tuple[int, str | None], forward: Callable[[], torch.Tensor]) -> None:
        """Capture ``forward`` (no arguments: it reads the persistent input buffers; it must
        launch no host synchronisation) as the graph of ``key``, after one warm-up run on
        a side stream."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()                                                # warm-up: JIT, allocator
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward()
        self._graphs[key] = (graph, output)
        logger.debug("captured a decode graph for batch %d, LoRA schedule %s", *key)

    def replay(self, key: tuple[int, str | None]) -> torch.Tensor:
        """Replay the graph of ``key`` over the current contents of its input buffers.

        Returns:
            hidden states ``[bucket, hidden_size]``: a view of the graph's output buffer,
            valid until the next replay.

        Raises:
            KeyError: no graph was captured for ``key``.
        """
        graph, output = self._graphs[key]
        graph.replay()
        return output

    def release(self) -> None:
        """Destroy every captured graph and their memory pool. Under tensor parallelism this
        must come before the process group is destroyed: NCCL's communicator finalisation
        waits for the graphs that captured its collectives (seen on two H200s, torch 2.11)."""
        torch.cuda.synchronize()
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._pool = None
