"""``LoggingStatLogger``: vLLM's periodic engine log line (``--disable-log-stats`` turns it
off): prompt and generation throughput over the last interval, running and waiting
requests, KV cache use and the prefix cache's hit rate over the interval."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from manylora.engine.stats import EngineSnapshot, IterationStats

logger = logging.getLogger("manylora.stats")

#: Seconds between two log lines (vLLM's ``VLLM_LOG_STATS_INTERVAL`` default).
LOG_STATS_INTERVAL_S = 10.0


class LoggingStatLogger:
    """A stat logger (``AsyncLLM.stat_loggers``) that logs one INFO line on the
    ``manylora.stats`` logger at most every ``interval`` seconds, from the steps it was given
    since the last line (vLLM's ``LoggingStatLogger``).

    Args:
        snapshot: returns the engine's latest ``EngineSnapshot`` (``AsyncLLM.snapshot``).
        interval: seconds between two lines.
        clock: monotonic seconds (``time.monotonic``; a test passes its own).

    The line: ``Avg prompt throughput: P tokens/s, Avg generation throughput: G tokens/s,
    Running: R reqs, Waiting: W reqs, KV cache usage: U%, Prefix cache hit rate: H%``, where
    P and G are the tokens of the interval over its length in seconds, U the share of the
    device KV blocks held, and H the prompt tokens found in the prefix cache over those
    looked up during the interval (0 when none were).
    """

    def __init__(self, snapshot: Callable[[], EngineSnapshot],
                 interval: float = LOG_STATS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.snapshot = snapshot
        self.interval = interval
        self.clock = clock
        self._since = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        kv = snapshot().kv
        self._queries, self._hits = kv.prefix_queries, kv.prefix_hits

    def record(self, stats: IterationStats) -> None:
        """Count one step's tokens; log the line when ``interval`` has passed since the
        last one."""
        self._prompt_tokens += stats.num_prompt_tokens
        self._generation_tokens += stats.num_generation_tokens
        now = self.clock()
        elapsed = now - self._since
        if elapsed < self.interval:
            return
        snap = self.snapshot()
        kv = snap.kv
        queries, hits = kv.prefix_queries - self._queries, kv.prefix_hits - self._hits
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            self._prompt_tokens / elapsed, self._generation_tokens / elapsed,
            snap.num_running, snap.num_waiting,
            100.0 * kv.used_blocks / kv.num_blocks if kv.num_blocks else 0.0,
            100.0 * hits / queries if queries else 0.0)
        self._since = now
        self._prompt_tokens = self._generation_tokens = 0
        self._queries, self._hits = kv.prefix_queries, kv.prefix_hits
