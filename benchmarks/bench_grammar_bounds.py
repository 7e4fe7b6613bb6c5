"""What one request may cost at the default structured-output bounds: the compile time and
xgrammar's ``memory_size_bytes`` of grammars at ``--max-structured-output-spec-bytes``
(a regex, a JSON schema, a ``choice`` list), and the per-step host cost of a request with
``--max-bad-words`` words (the ``BadWords`` index against a scan of every sequence).

A byte-level BPE tokenizer of Llama-3's vocabulary size written locally
(``bench_structured.write_tokenizer``, no hub). Compiles run on one
``xgrammar.GrammarCompiler`` (cache off, 4 threads, as the engine's), one at a time, each
spec once (a compile is what the time limit bounds); the bad_words step cost is the median
of 200 steps over a random output. No GPU: run it on the serving host's CPU.

    python -m benchmarks.bench_grammar_bounds            # Llama-3's 128,256 tokens
    python -m benchmarks.bench_grammar_bounds --tiny     # smoke run: 512 tokens
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_structured import write_tokenizer
from benchmarks.common import command_line, record
from manylora.structured.bad_words import DEFAULT_MAX_BAD_WORDS, BadWords, bad_words_token_ids
from manylora.structured.compiler import (
    DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS,
    load_tokenizer_info,
)
from manylora.structured.grammar import DEFAULT_MAX_SPEC_BYTES, choice_ebnf


def _words(rng: random.Random, n: int, length: int = 8) -> list[str]:
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length))
            for _ in range(n)]


def specs(max_bytes: int) -> dict[str, tuple[str, str]]:
    """``{case: (kind, spec)}``, each spec just under ``max_bytes``."""
    rng = random.Random(0)
    n = max_bytes // 9 - 1                      # "word|" per alternative
    regex = "(" + "|".join(_words(rng, n)) + ")"
    enum = _words(rng, max_bytes // 11 - 20)    # '"word", ' per value
    schema = json.dumps({"type": "object", "properties": {"w": {"enum": enum}},
                         "required": ["w"]}, separators=(",", ":"))
    choice = choice_ebnf(_words(rng, max_bytes // 13 - 2))   # '"word" | ' each
    return {"regex": ("regex", regex), "json (enum)": ("json", schema),
            "choice": ("grammar", choice)}


def compile_cases(tokenizer_dir: Path, vocab: int, max_bytes: int) -> list[tuple]:
    import xgrammar as xgr

    info = load_tokenizer_info(str(tokenizer_dir), False, vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False, max_threads=4)
    rows = []
    for case, (kind, spec) in specs(max_bytes).items():
        start = time.perf_counter()
        if kind == "regex":
            compiled = compiler.compile_regex(spec)
        elif kind == "json":
            compiled = compiler.compile_json_schema(spec)
        else:
            compiled = compiler.compile_grammar(spec)
        seconds = time.perf_counter() - start
        size = len(spec.encode())
        print(f"{case}: {size:,} bytes, compiled in {seconds:.2f} s, "
              f"{compiled.memory_size_bytes / 2**20:.1f} MiB", flush=True)
        rows.append((case, f"{size:,}", f"{seconds:.2f}",
                     f"{compiled.memory_size_bytes / 2**20:.1f}"))
    return rows


def bad_words_case(tokenizer_dir: Path, vocab: int) -> tuple:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rng = random.Random(1)
    words = _words(rng, DEFAULT_MAX_BAD_WORDS, 6)
    start = time.perf_counter()
    sequences = bad_words_token_ids(tok, words)
    tokenize = time.perf_counter() - start
    start = time.perf_counter()
    index = BadWords(sequences, vocab)
    build = time.perf_counter() - start
    prompt, output = [1] * 16, tok.encode(" ".join(_words(rng, 200, 5)),
                                          add_special_tokens=False)[:200]
    row = np.full(-(-vocab // 32), 0xFFFFFFFF, dtype=np.uint32)
    indexed, scanned = [], []
    for n in range(1, len(output) + 1):
        tokens = prompt + output[:n]
        t0 = time.perf_counter()
        more = index.bans(tokens, len(prompt))
        if more is not None:
            index.clear(row, more)
        t1 = time.perf_counter()
        _scan(sequences, output[:n], row)
        t2 = time.perf_counter()
        indexed.append(t1 - t0)
        scanned.append(t2 - t1)
    index_us, scan_us = statistics.median(indexed) * 1e6, statistics.median(scanned) * 1e6
    print(f"bad_words: {len(words)} words -> {len(sequences)} sequences; tokenized in "
          f"{tokenize * 1e3:.1f} ms, indexed in {build * 1e3:.1f} ms; one row per step "
          f"{index_us:.1f} us (a scan of every sequence: {scan_us:.1f} us)", flush=True)
    return (len(words), len(sequences), f"{tokenize * 1e3:.1f}", f"{build * 1e3:.1f}",
            f"{index_us:.1f}", f"{scan_us:.1f}")


def _scan(sequences, output, row) -> None:
    """vLLM's rule over every sequence, bits cleared one by one (the code before the
    index)."""
    n = len(output)
    for seq in sequences:
        k = len(seq) - 1
        if k == 0 or (n >= k and list(output[n - k:]) == list(seq[:k])):
            t = seq[-1]
            row[t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a 512-token vocabulary (smoke run)")
    ap.add_argument("--spec-bytes", type=int, default=DEFAULT_MAX_SPEC_BYTES)
    ap.add_argument("--no-record", action="store_true", help="print only, no BENCHMARKS.md")
    args = ap.parse_args()
    vocab, special = (512, 8) if args.tiny else (128_256, 256)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = write_tokenizer(Path(tmp), vocab, special)
        compiles = compile_cases(tokenizer_dir, vocab, args.spec_bytes)
        bad = bad_words_case(tokenizer_dir, vocab)
    command = command_line("benchmarks.bench_grammar_bounds")
    write = not (args.no_record or args.tiny)
    record(f"Grammar compiles at --max-structured-output-spec-bytes ({vocab:,} tokens, CPU)",
           command, ["spec", "bytes", "compile (s)", "memory_size_bytes (MiB)"], compiles,
           notes=f"One compile each, 4 xgrammar threads; the default time limit is "
           f"{DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS:g} s.", write=write, device="cpu")
    record(f"bad_words at --max-bad-words ({vocab:,} tokens, CPU)", command,
           ["words", "sequences", "tokenize (ms)", "index (ms)", "step, indexed (us/row)",
            "step, full scan (us/row)"], [bad],
           notes="Per step: the bans of one row after each of 200 output tokens, median.",
           write=write, device="cpu")


if __name__ == "__main__":
    main()
