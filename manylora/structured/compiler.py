"""``GrammarCompileService``: grammars compiled on threads of the core, cached by
``GrammarKey`` within a byte budget, each compile bounded in time (vLLM v1's
``StructuredOutputManager`` compiles on a thread pool too, so the step loop never waits for
a compile; its xgrammar backend bounds the cache in bytes, ``VLLM_XGRAMMAR_CACHE_MB``; vLLM
bounds no compile's time)."""

from __future__ import annotations

import atexit
import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from manylora.structured.grammar import GrammarKey, compile_grammar

__all__ = ["DEFAULT_GRAMMAR_CACHE_BYTES", "DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS",
           "GrammarCompileService", "default_compile_workers", "load_tokenizer_info"]

logger = logging.getLogger(__name__)

#: vLLM's default xgrammar cache (``VLLM_XGRAMMAR_CACHE_MB=512``).
DEFAULT_GRAMMAR_CACHE_BYTES = 512 * 2**20
DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS = 30.0


def default_compile_workers() -> int:
    """Grammars compiled at once: half the CPUs rounded up (vLLM's structured-output
    thread pool), at most 8."""
    return min(8, max(1, ((os.cpu_count() or 1) + 1) // 2))


def load_tokenizer_info(tokenizer_dir: str, trust_remote_code: bool, vocab_size: int) -> Any:
    """The ``xgrammar.TokenizerInfo`` of the checkpoint's Hugging Face tokenizer (a folder's,
    or a ``.gguf`` file's) over the MODEL's vocabulary (``vocab_size``: the LM head's rows,
    padding included): ids past the tokenizer's own vocabulary are never allowed by a
    grammar.

    Raises:
        OSError, ValueError: the tokenizer cannot be read, or xgrammar cannot take it.
    """
    import xgrammar as xgr

    from manylora.checkpoint.gguf import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir, trust_remote_code)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)


@dataclass(eq=False)
class _Entry:
    """One key's compile: ``future`` is what requests wait on (set by the compile, by its
    time limit, or cancelled when dropped); ``waiters`` the holds not released;
    ``nbytes`` what the cache counts for it (the spec's bytes, plus the compiled grammar's
    ``memory_size_bytes`` once compiled)."""

    key: GrammarKey
    nbytes: int
    future: Future = field(default_factory=Future)
    waiters: int = 0


class GrammarCompileService:
    """Compiles grammars with one ``xgrammar.GrammarCompiler`` on ``workers`` threads.

    The tokenizer (``load_info``) is read once, by the first compile, and the threads start
    with the first grammar: an engine that never sees one never reads it, and the step loop
    never waits for it. A compile's ``Future`` is cached under its key (failures too: the
    same spec fails the same way), least recently used first out once the cache holds more
    than ``cache_bytes`` (the spec text of each entry, plus xgrammar's
    ``CompiledGrammar.memory_size_bytes``); a grammar larger than the whole budget is
    handed to its requests and not kept.

    A compile that has not ended ``compile_seconds`` after a thread started it (the
    tokenizer's read by the first one not counted) fails its requests with a
    ``ValueError`` naming the field and the flag (the failure stays cached, so the same
    spec does not take another thread). xgrammar compiles in C++ and cannot be
    interrupted: the thread goes on with it and drops its result, and is replaced (at most
    ``max_abandoned`` at a time, which bounds the threads hostile grammars can keep busy),
    so the other grammars keep their ``workers`` threads, as ``lora.loader_pool`` does for
    adapter reads. When every thread is stuck and none may be replaced, queued compiles
    fail at once instead of waiting behind them. A key whose every hold is ``release``-d
    (its requests aborted) is dropped: never compiled if still queued, its result thrown
    away if under way.

    Args:
        load_info: returns the ``xgrammar.TokenizerInfo`` (``load_tokenizer_info``).
        cache_bytes: bytes of cached grammars (and failed specs) kept.
        compile_seconds: the longest one compile may run, seconds; None: no bound.
        workers: grammars compiled at once (``default_compile_workers``).
        max_abandoned: stuck threads replaced at most (None: ``workers``).
        max_threads: xgrammar's threads inside one compile.

    Attributes:
        notify: called (on a compile thread or the time limits' thread) when a compile
            ends or runs out of time, so a loop waiting for messages wakes to take the
            request in; None: nobody is told.

    Raises:
        ValueError: ``cache_bytes`` below 0, ``compile_seconds`` not above 0, ``workers``
            below 1.
    """

    def __init__(self, load_info: Callable[[], Any],
                 cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
                 compile_seconds: float | None = DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS,
                 workers: int | None = None, max_abandoned: int | None = None,
                 max_threads: int = 4) -> None:
        if cache_bytes < 0:
            raise ValueError(f"grammar_cache_bytes must be ≥ 0, got {cache_bytes}")
        if compile_seconds is not None and not compile_seconds > 0:
            raise ValueError(f"max_grammar_compile_seconds must be > 0, got {compile_seconds}")
        workers = default_compile_workers() if workers is None else workers
        if workers < 1:
            raise ValueError(f"grammar compile workers must be ≥ 1, got {workers}")
        self._load_info = load_info
        self.cache_bytes = cache_bytes
        self.compile_seconds = compile_seconds
        self.workers = workers
        self.max_abandoned = workers if max_abandoned is None else max_abandoned
        self._max_threads = max_threads
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[GrammarKey, _Entry] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Condition()
        self._queue: deque[_Entry] = deque()
        self._running: dict[threading.Thread, tuple[int, _Entry]] = {}   # (run, entry)
        self._runs = itertools.count()
        self._alive: set[threading.Thread] = set()      # started, not exited
        self._stuck: set[threading.Thread] = set()      # inside a compile past its time
        self._replaced: set[threading.Thread] = set()   # of those, the ones replaced
        self._names = itertools.count()
        self._stopped = False
        self._deadlines = None if compile_seconds is None else _Deadlines(self._expire)
        self.notify: Callable[[], None] | None = None
        _SERVICES.add(self)

    @property
    def cached_bytes(self) -> int:
        """Bytes the cache counts now (at most ``cache_bytes`` once compiles end)."""
        with self._lock:
            return self._cached_bytes

    @property
    def stuck(self) -> int:
        """Threads inside a compile that ran out of time."""
        with self._lock:
            return len(self._stuck)

    def cached(self, key: GrammarKey) -> bool:
        """Whether ``key`` has an entry (compiled, failed, queued or under way)."""
        with self._lock:
            return key in self._cache

    def submit(self, key: GrammarKey) -> Future:
        """A ``Future`` of the ``CompiledGrammar`` of ``key`` (done at once when cached),
        held until ``release(key)``; its exception is a ``ValueError`` naming the field
        (``compile_grammar``, the time limit) or what reading the tokenizer met.

        Raises:
            RuntimeError: the service was shut down.
        """
        with self._lock:
            if self._stopped:
                raise RuntimeError("the grammar compile threads were shut down")
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                entry.waiters += 1
                return entry.future
            entry = _Entry(key, len(key[1].encode("utf-8", "surrogatepass")), waiters=1)
            self._insert(entry)
            if not self._alive:
                for _ in range(self.workers):
                    self._start_worker()
            if self._alive <= self._stuck:     # every thread stuck, none may be replaced
                self._fail_stuck(entry)
            else:
                self._queue.append(entry)
                self._lock.notify()
        if self.notify is not None:
            entry.future.add_done_callback(lambda _: self.notify())
        return entry.future

    def release(self, key: GrammarKey) -> None:
        """A request holding ``key``'s compile ended before taking it; when none holds it
        and it is not done, the compile is dropped: never run if still queued, its result
        thrown away if under way."""
        with self._lock:
            entry = self._cache.get(key)
            if entry is None or entry.future.done():
                return
            entry.waiters -= 1
            if entry.waiters > 0:
                return
            self._remove(entry)
            if entry in self._queue:
                self._queue.remove(entry)
            entry.future.cancel()

    def shutdown(self, wait: bool = False) -> None:
        """Stop the compile threads (compiles under way end on their own and are dropped;
        queued ones are cancelled) and the time limits' thread; with ``wait``, until every
        thread has ended (interpreter exit does this: a daemon thread still inside
        xgrammar's C++ when the interpreter finalizes would abort the process)."""
        with self._lock:
            self._stopped = True
            for entry in self._queue:
                entry.future.cancel()
            self._queue.clear()
            self._lock.notify_all()
            threads = list(self._alive)
        if self._deadlines is not None:
            self._deadlines.stop()
        for thread in threads if wait else ():
            thread.join()

    # ------------------------------------------------------------------ threads

    def _start_worker(self) -> None:
        thread = threading.Thread(target=self._work, daemon=True,
                                  name=f"manylora-grammar_{next(self._names)}")
        self._alive.add(thread)
        thread.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                while not self._queue and not self._stopped:
                    self._lock.wait()
                if self._stopped:
                    self._alive.discard(me)
                    return
                entry = self._queue.popleft()
                run = next(self._runs)
                self._running[me] = (run, entry)
            try:
                compiler = self._get_compiler()      # the tokenizer's read is not timed
                if self._deadlines is not None:
                    self._deadlines.add(time.monotonic() + self.compile_seconds, (me, run))
                result, error = compile_grammar(compiler, entry.key), None
            except Exception as e:
                result, error = None, e
            with self._lock:
                self._running.pop(me, None)
                self._stuck.discard(me)
                if me in self._replaced:       # replaced already: drop the result, exit
                    self._replaced.discard(me)
                    self._alive.discard(me)
                    return
                if entry.future.done():        # dropped or out of time: result dropped
                    continue
                if error is None:
                    entry.future.set_result(result)
                else:
                    entry.future.set_exception(error)
                if self._cache.get(entry.key) is entry:    # a grammar over the budget goes
                    self._resize(entry, entry.nbytes + (result.memory_size_bytes
                                                        if error is None else 0))

    def _get_compiler(self) -> Any:
        """The ``xgrammar.GrammarCompiler``, made by the first compile (the tokenizer read
        then; a failed read is tried again by the next compile)."""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                # our cache holds the compiled grammars; xgrammar's would hold them twice
                self._compiler = xgr.GrammarCompiler(self._load_info(), cache_enabled=False,
                                                     max_threads=self._max_threads)
            return self._compiler

    def _expire(self, item: tuple[threading.Thread, int]) -> None:
        """A compile's time is up (``item``: its thread and run number): its requests get
        the error, its thread is written off and replaced (within ``max_abandoned``)."""
        worker, run = item
        with self._lock:
            running = self._running.get(worker)
            if running is None or running[0] != run:        # ended meanwhile
                return
            entry = self._running.pop(worker)[1]
            self._stuck.add(worker)
            if len(self._replaced) < self.max_abandoned and not self._stopped:
                self._replaced.add(worker)
                self._start_worker()
            if not entry.future.done():
                entry.future.set_exception(ValueError(
                    f"structured_outputs.{entry.key[0]}: the grammar did not compile "
                    f"within {self.compile_seconds:g} s (--max-grammar-compile-seconds); "
                    "simplify it"))
            if self._alive <= self._stuck:     # no thread left to run the queued compiles
                for queued in self._queue:
                    self._fail_stuck(queued)
                self._queue.clear()
        logger.warning("a %s grammar (%d bytes) did not compile within %g s; its thread "
                       "goes on with it, its result will be dropped", entry.key[0],
                       entry.nbytes, self.compile_seconds)

    def _fail_stuck(self, entry: _Entry) -> None:
        """Fail ``entry`` at once: every thread is stuck (lock held). Not cached: the same
        spec may be tried again."""
        if self._cache.get(entry.key) is entry:
            self._remove(entry)
        entry.future.set_exception(ValueError(
            f"structured_outputs.{entry.key[0]}: every grammar compile thread is busy with a "
            f"grammar that did not compile within {self.compile_seconds:g} s "
            "(--max-grammar-compile-seconds); try again later"))

    # ------------------------------------------------------------------ the cache (lock held)

    def _insert(self, entry: _Entry) -> None:
        self._cache[entry.key] = entry
        self._cached_bytes += entry.nbytes
        self._evict()

    def _remove(self, entry: _Entry) -> None:
        del self._cache[entry.key]
        self._cached_bytes -= entry.nbytes

    def _resize(self, entry: _Entry, nbytes: int) -> None:
        self._cached_bytes += nbytes - entry.nbytes
        entry.nbytes = nbytes
        self._evict()

    def _evict(self) -> None:
        """Least recently used ended entries out until the cache fits ``cache_bytes``
        (entries queued or under way stay: ``release`` finds them by key)."""
        for old in list(self._cache.values()):
            if self._cached_bytes <= self.cache_bytes:
                return
            if old.future.done():
                self._remove(old)


class _Deadlines:
    """One thread that calls ``on_expire(item)`` when each item's deadline
    (``time.monotonic()`` seconds) passes; started by the first ``add``."""

    def __init__(self, on_expire: Callable[[Any], None]) -> None:
        self._on_expire = on_expire
        self._heap: list[tuple[float, int, Any]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, at: float, item: Any) -> None:
        with self._cond:
            heapq.heappush(self._heap, (at, next(self._order), item))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="manylora-grammar-deadlines")
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (
                        not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap
                                    else None)
                if self._stopped:
                    return
                item = heapq.heappop(self._heap)[2]
            try:
                self._on_expire(item)
            except Exception:
                logger.exception("a grammar compile's time limit failed")


_SERVICES: weakref.WeakSet[GrammarCompileService] = weakref.WeakSet()


@atexit.register
def _join_at_exit() -> None:
    """Let every compile under way end before the interpreter finalizes (what
    ``concurrent.futures`` does for its pools)."""
    for service in list(_SERVICES):
        service.shutdown(wait=True)
