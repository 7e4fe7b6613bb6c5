"""The executor an engine's settings call for: one process, or tensor parallelism."""

from __future__ import annotations

from manylora.executor.abstract import Executor, ExecutorArgs
from manylora.executor.tensor_parallel import TPExecutor
from manylora.executor.uniproc import UniProcExecutor


def create_executor(args: ExecutorArgs) -> Executor:
    """A ``UniProcExecutor``, or a ``TPExecutor`` when ``tensor_parallel_size`` > 1, built
    (model loaded, KV cache and adapter slots sized, graphs captured).

    Raises:
        As the executor's constructor.
    """
    if args.tensor_parallel_size == 1:
        return UniProcExecutor(args)
    return TPExecutor(args)
