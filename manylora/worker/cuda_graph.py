"""Decode steps replayed as CUDA graphs, one graph per (batch-size bucket, LoRA variant,
projection mask).

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

The graphs of every (bucket, variant) are captured at start-up for all projections. A LoRA
step whose slots target fewer projection kinds (``SlotTable.kind_mask``) replays a graph
captured for its mask, which launches no kernel of the other kinds; those graphs are
captured during serving, on first use, for the masks ``GraphMaskPolicy``
(``worker/graph_masks.py``) admits, and destroyed when it evicts them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from manylora.worker.graph_masks import GraphMaskPolicy

logger = logging.getLogger(__name__)

#: A decode graph's key: (bucket, LoRA variant or None, projection mask).
GraphKey = tuple[int, str | None, int]

#: Batch sizes captured by default. Coarse on purpose: a padded decode row costs almost
#: nothing (the step is bound by reading the weights once), while each size is one more
#: capture.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


class DecodeGraphs:
    """Captures and replays the decode forward pass for padded batch sizes.

    Args:
        capture_sizes: the batch sizes that get a graph; a step of ``n`` rows is padded to
            the smallest size ``>= n``; steps beyond the largest run eagerly.
        full_mask: the projection mask of every kind (``SlotTable.full_mask``; 0 without
            LoRA).
        max_masks, min_uses: the ``GraphMaskPolicy`` of the masked graphs (``max_masks``
            0: LoRA steps always replay the all-kinds graphs).

    The model runner captures every (bucket, variant) pair for ``full_mask`` at start-up
    (``ModelRunner.capture_graphs``), after one eager warm-up run of each (which also
    compiles the Triton kernels); masked graphs are captured when first needed (``select``
    says which key a step replays). All graphs share one memory pool.

    Attributes:
        policy: the ``GraphMaskPolicy``.
        serving_captures: graphs captured after ``end_startup`` (masked ones, or a bucket
            met for the first time); serving_capture_s: the seconds they took, host
            wall-clock (warm-up run and capture, the device synchronisations included).
    """

    def __init__(self, capture_sizes: Sequence[int], full_mask: int = 0, max_masks: int = 4,
                 min_uses: int = 2) -> None:
        self.capture_sizes = tuple(sorted(set(capture_sizes)))
        self.policy = GraphMaskPolicy(full_mask, max_masks, min_uses)
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._serving = False
        self.serving_captures = 0
        self.serving_capture_s = 0.0

    def bucket(self, num_rows: int) -> int | None:
        """The padded batch size for ``num_rows`` decode rows, or None (run eagerly)."""
        for size in self.capture_sizes:
            if size >= num_rows:
                return size
        return None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def has(self, key: GraphKey) -> bool:
        """Whether ``key`` = ``(bucket, LoRA variant or None, projection mask)`` has a
        graph."""
        return key in self._graphs

    @property
    def keys(self) -> tuple[GraphKey, ...]:
        """The keys of the captured graphs, in capture order."""
        return tuple(self._graphs)

    def select(self, bucket: int, variant: str | None, mask: int) -> GraphKey:
        """The key of the graph a decode step replays (``has`` may still say no: capture it
        then), destroying the graphs of any mask the policy evicts.

        Args:
            bucket: the step's padded batch size; variant: its LoRA variant (None: no
                LoRA row, the mask is ignored); mask: its projection mask
                (``StepLayout.lora_mask``, -1: every kind).

        Raises:
            ValueError: mask bits outside ``full_mask``.
        """
        if variant is None:
            return (bucket, None, self.policy.full_mask)
        run, evicted = self.policy.choose(mask)
        if evicted:
            self._drop(set(evicted))
        return (bucket, variant, run)

    def end_startup(self) -> None:
        """Mark the start-up captures done: later captures count as serving ones."""
        self._serving = True

    def capture(self, key: GraphKey, forward: Callable[[], torch.Tensor]) -> None:
        """Capture ``forward`` (no arguments: it reads the persistent input buffers; it must
        launch no host synchronisation) as the graph of ``key``, after one warm-up run on
        a side stream. The capture is ``thread_local``: threads that pin host memory or
        copy adapters meanwhile (loader threads) are not interrupted."""
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()                                                # warm-up: JIT, allocator
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output = forward()
        self._graphs[key] = (graph, output)
        if self._serving:
            self.serving_captures += 1
            self.serving_capture_s += time.perf_counter() - start
        logger.debug("captured a decode graph for batch %d, LoRA variant %s, projection "
                     "mask %#x", *key)

    def _drop(self, masks: set[int]) -> None:
        """Destroy the LoRA graphs of ``masks`` (after the device is idle: a replay of one
        may still run)."""
        keys = [k for k in self._graphs if k[1] is not None and k[2] in masks]
        if not keys:
            return
        torch.cuda.synchronize()
        for key in keys:
            graph, _ = self._graphs.pop(key)
            graph.reset()
        logger.debug("dropped %d decode graphs of projection masks %s", len(keys),
                     sorted(masks))

    def replay(self, key: GraphKey) -> torch.Tensor:
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
