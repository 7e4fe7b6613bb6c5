"""``GrammarCompileService`` over a tiny xgrammar vocabulary (no model): the cache bounded
in bytes against xgrammar's own ``memory_size_bytes`` of each grammar compiled by a
separate ``GrammarCompiler``; the time limit (a compile held on an event, and a real slow
regex; the thread of a compile past its time replaced); compiles dropped when no request
waits for them. Waits are on futures and events
with generous deadlines; no timing is asserted."""

from __future__ import annotations

import random
import string
import threading
import time

import pytest
import xgrammar as xgr

from manylora.structured import compiler as compiler_module
from manylora.structured.compiler import GrammarCompileService

WAIT = 60


@pytest.fixture(scope="module")
def info():
    vocab = list(string.printable) + ["ab", "abc", "</s>"]
    return xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])


def _wait_until(condition) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "the condition never came"
        time.sleep(0.01)


def _key(regex: str):
    return ("regex", regex, True)


def _entry_bytes(info, regex: str) -> int:
    """What the cache should count for ``regex``: xgrammar's size of its compiled grammar
    (an independent compiler's) plus the spec's bytes."""
    return (xgr.GrammarCompiler(info, cache_enabled=False).compile_regex(regex)
            .memory_size_bytes + len(regex.encode()))


@pytest.fixture
def gated(monkeypatch):
    """Compiles of the specs in ``gated.specs`` wait for ``gated.gate``; ``gated.calls``
    lists every spec compiled, ``gated.started`` / ``gated.ended`` are set when a gated
    compile starts / ends."""
    compile_one = compiler_module.compile_grammar

    class Gate:
        gate, started, ended = threading.Event(), threading.Event(), threading.Event()
        specs: set[str] = set()
        calls: list[str] = []

    def compile_grammar(compiler, key):
        Gate.calls.append(key[1])
        if key[1] not in Gate.specs:
            return compile_one(compiler, key)
        Gate.started.set()
        Gate.gate.wait()
        try:
            return compile_one(compiler, key)
        finally:
            Gate.ended.set()

    monkeypatch.setattr(compiler_module, "compile_grammar", compile_grammar)
    yield Gate
    Gate.gate.set()


def test_cache_evicts_least_recently_used_by_bytes(info):
    small, mid, large = "a|b", "[a-z]{3}", "(abc|bcd|cde)+x"
    sizes = {rx: _entry_bytes(info, rx) for rx in (small, mid, large)}
    assert sizes[small] <= sizes[mid] <= sizes[large]
    service = GrammarCompileService(lambda: info, cache_bytes=sizes[mid] + sizes[large],
                                    workers=1)
    try:
        for rx in (small, mid):
            service.submit(_key(rx)).result(WAIT)
        assert service.cached_bytes == sizes[small] + sizes[mid]
        service.submit(_key(large)).result(WAIT)          # small, least recent, goes
        assert not service.cached(_key(small))
        assert service.cached_bytes == sizes[mid] + sizes[large]
        hit = service.submit(_key(mid))                   # a hit: done at once, now recent
        assert hit.done()
        service.submit(_key(small)).result(WAIT)          # large is least recent now
        assert service.cached(_key(mid)) and service.cached(_key(small))
        assert not service.cached(_key(large))
        assert service.cached_bytes == sizes[mid] + sizes[small] <= service.cache_bytes
    finally:
        service.shutdown()


def test_grammar_over_the_budget_is_served_not_kept(info):
    service = GrammarCompileService(lambda: info, cache_bytes=100, workers=1)
    try:
        compiled = service.submit(_key("[a-z]{3}")).result(WAIT)
        assert compiled.memory_size_bytes > 100
        assert not service.cached(_key("[a-z]{3}")) and service.cached_bytes == 0
    finally:
        service.shutdown()


def test_time_limit_fails_the_slow_key_and_replaces_its_thread(info, gated):
    # one thread: the slow compile runs out of time, its thread is replaced, and the
    # grammar queued behind it compiles on the new one while the old one is still stuck
    gated.specs.add("slow")
    service = GrammarCompileService(lambda: info, compile_seconds=1.0, workers=1)
    try:
        slow = service.submit(_key("slow"))
        fast = service.submit(_key("[a-z]{3}"))
        error = slow.exception(WAIT)
        assert isinstance(error, ValueError)
        assert str(error) == ("structured_outputs.regex: the grammar did not compile within "
                              "1 s (--max-grammar-compile-seconds); simplify it")
        assert fast.result(WAIT).memory_size_bytes > 0
        assert service.stuck == 1 and not gated.ended.is_set()
        # the failure is kept while the abandoned compile runs: no second compile
        assert service.submit(_key("slow")).exception(0) is error
        gated.gate.set()
        assert gated.ended.wait(WAIT)
        assert gated.calls.count("slow") == 1
        assert service.cached_bytes == len("slow") + _entry_bytes(info, "[a-z]{3}")
    finally:
        service.shutdown()


def test_every_thread_stuck_fails_queued_compiles_at_once(info, gated):
    gated.specs.add("slow")
    service = GrammarCompileService(lambda: info, compile_seconds=1.0, workers=1,
                                    max_abandoned=0)
    try:
        slow = service.submit(_key("slow"))
        queued = service.submit(_key("[a-z]{3}"))
        assert "did not compile within 1 s" in str(slow.exception(WAIT))
        assert "every grammar compile thread is busy" in str(queued.exception(WAIT))
        later = service.submit(_key("[a-z]{4}"))
        assert "every grammar compile thread is busy" in str(later.exception(0))
        assert not service.cached(_key("[a-z]{3}"))     # never ran: may be tried again
        gated.gate.set()                                  # the thread comes back, works on
        _wait_until(lambda: service.stuck == 0)
        assert service.submit(_key("[a-z]{3}")).result(WAIT).memory_size_bytes > 0
        assert gated.calls.count("[a-z]{3}") == 1
    finally:
        service.shutdown()


def test_released_compiles_are_dropped(info, gated):
    gated.specs.add("running")
    service = GrammarCompileService(lambda: info, compile_seconds=None, workers=1)
    try:
        running = service.submit(_key("running"))
        service.submit(_key("running"))                  # a second request waits for it
        assert gated.started.wait(WAIT)
        queued = service.submit(_key("[a-z]{3}"))
        service.release(_key("[a-z]{3}"))
        assert queued.cancelled() and not service.cached(_key("[a-z]{3}"))
        service.release(_key("running"))
        assert service.cached(_key("running")) and not running.done()
        service.release(_key("running"))                 # the last one: dropped
        assert running.cancelled() and not service.cached(_key("running"))
        gated.gate.set()
        assert gated.ended.wait(WAIT)
        assert service.submit(_key("[a-z]{4}")).result(WAIT) is not None
        assert "[a-z]{3}" not in gated.calls              # the queued one never ran
        assert not service.cached(_key("running"))       # its late result is not kept
        assert service.cached_bytes == _entry_bytes(info, "[a-z]{4}")
    finally:
        service.shutdown()


def test_a_real_slow_compile_runs_out_of_time(info):
    rng = random.Random(0)
    regex = "(" + "|".join("".join(rng.choice("abcdefghij") for _ in range(8))
                           for _ in range(20_000)) + ")"
    service = GrammarCompileService(lambda: info, compile_seconds=0.01, workers=1)
    try:
        error = service.submit(_key(regex)).exception(WAIT)
        assert "did not compile within 0.01 s" in str(error)
        _wait_until(lambda: service.stuck == 0)          # the abandoned compile ends
    finally:
        service.shutdown()
