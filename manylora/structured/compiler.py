"""``GrammarCompileService``: grammars compiled on a worker thread of the core, cached by
``GrammarKey`` (vLLM v1's ``StructuredOutputManager`` compiles on a thread pool too, so the
step loop never waits for a compile)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from manylora.structured.grammar import GrammarKey, compile_grammar

__all__ = ["GrammarCompileService", "load_tokenizer_info"]

logger = logging.getLogger(__name__)


def load_tokenizer_info(tokenizer_dir: str, trust_remote_code: bool, vocab_size: int) -> Any:
    """The ``xgrammar.TokenizerInfo`` of the checkpoint's Hugging Face tokenizer over the
    MODEL's vocabulary (``vocab_size``: the LM head's rows, padding included): ids past the
    tokenizer's own vocabulary are never allowed by a grammar.

    Raises:
        OSError, ValueError: the tokenizer cannot be read, or xgrammar cannot take it.
    """
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)


class GrammarCompileService:
    """Compiles grammars with one ``xgrammar.GrammarCompiler`` on a worker thread.

    The tokenizer (``load_info``) is read once, on that thread, by the first compile: an
    engine that never sees a grammar never reads it, and the step loop never waits for it.
    A compile's ``Future`` is cached under its key (failures too: the same spec fails the
    same way), the least recently used dropped past ``max_cached`` entries.

    Args:
        load_info: returns the ``xgrammar.TokenizerInfo`` (``load_tokenizer_info``).
        max_cached: compiled grammars kept.
        max_threads: xgrammar's threads inside one compile.

    Attributes:
        notify: called (on the worker thread) when a compile ends, so a loop waiting for
            messages wakes to take the request in; None: nobody is told.
    """

    def __init__(self, load_info: Callable[[], Any], max_cached: int = 256,
                 max_threads: int = 4) -> None:
        self._load_info = load_info
        self._max_cached = max_cached
        self._max_threads = max_threads
        self._compiler = None
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="manylora-grammar")
        self.notify: Callable[[], None] | None = None

    def submit(self, key: GrammarKey) -> Future:
        """A ``Future`` of the ``CompiledGrammar`` of ``key`` (done at once when cached);
        its exception is a ``ValueError`` naming the field (``compile_grammar``) or what
        reading the tokenizer met."""
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        if self.notify is not None:
            future.add_done_callback(lambda _: self.notify())
        return future

    def _compile(self, key: GrammarKey) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            # our cache holds the compiled grammars; xgrammar's would hold them twice
            self._compiler = xgr.GrammarCompiler(self._load_info(), cache_enabled=False,
                                                 max_threads=self._max_threads)
        return compile_grammar(self._compiler, key)

    def shutdown(self) -> None:
        """Stop the worker thread (a compile under way finishes; queued ones are dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
