"""Structured output's cost: offline throughput with 25% of the requests carrying a JSON
schema, against none (issue 19's target: at least 90% of the throughput without schemas).

A Llama-3-8B-shaped model with random bf16 weights (``load_format="dummy"``) and a byte-level
BPE tokenizer of Llama-3's vocabulary size written locally (``write_tokenizer``: the 256 byte
tokens, every two-byte and then three-byte merge up to 128,000 tokens, 256 special tokens;
xgrammar builds its token trie from it as from Llama-3's, no hub). ``LLM.generate`` (the core
in its own process), every request at once (``max_num_seqs`` = the batch), prompts of 128
random token ids, 128 new tokens each: plain requests with ``ignore_eos``, constrained ones
with one of 4 schemas (nested objects, arrays of at least 20 items, bounded strings,
integers and enums: no output of 128 tokens completes them, so they end by length and both
cases generate the same tokens; temperature 1, seeded). A warm-up pass compiles the four
grammars (cached afterwards, as a server's repeated schemas are) and meets every shape.
Output tok/s = output tokens / the median time of ``--repeats`` passes, each on token ids
of its own. One line per (batch, case) and the ratio.

    python -m benchmarks.bench_structured            # H100: batches 64 and 256
    python -m benchmarks.bench_structured --tiny     # CPU smoke run: tiny model, batches 4, 8

Each (batch, case) starts an engine of its own (Triton warm-up, CUDA graphs: about a minute
on an H100), four in all; near a 10-minute limit, run ``--batches 64`` and ``--batches 256``
separately.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import command_line, gpu_name, record
from benchmarks.llama3_8b import LLAMA3_8B, TINY, write_config

TARGET_RATIO = 0.90
PROMPT, NEW = 128, 128
SCHEMAS = [
    {"type": "object",
     "properties": {"items": {"type": "array", "minItems": 20 + k, "items": {
         "type": "object",
         "properties": {"name": {"type": "string", "maxLength": 12 + 2 * k},
                        "qty": {"type": "integer", "minimum": 0, "maximum": 1000},
                        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                 "maxItems": 3},
                        "meta": {"type": "object",
                                 "properties": {"ok": {"type": "boolean"},
                                                "score": {"type": "number"}},
                                 "required": ["ok", "score"]}},
         "required": ["name", "qty", "tags", "meta"]}}},
     "required": ["items"]}
    for k in range(4)]


def write_tokenizer(directory: Path, vocab_size: int, num_special: int) -> Path:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens in ``directory`` (Hugging Face's
    ``tokenizer.json`` and config): the 256 byte tokens, then every two-byte token and
    three-byte tokens (each with its merge) up to ``vocab_size - num_special`` tokens, then
    ``num_special`` special tokens, the first of them BOS and the second EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    chars = sorted(alphabet)
    vocab = {c: i for i, c in enumerate(chars)}
    merges = []
    regular = vocab_size - num_special
    pairs = ((a, b) for a in chars for b in chars)
    triples = ((a + b, c) for a in chars for b in chars for c in chars)
    for left, right in _chain(pairs, triples):
        if len(vocab) >= regular:
            break
        if left not in vocab:
            continue
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    specials = [f"<|special_{i}|>" for i in range(num_special)]
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=specials[0],
                                  eos_token=specials[1])
    tok.save_pretrained(str(directory))
    return directory


def _chain(*iterables):
    for it in iterables:
        yield from it


def run_case(model_dir: Path, batch: int, structured: bool, repeats: int, tiny: bool,
             vocab: int) -> float:
    """Output tok/s (median of ``repeats`` timed passes) of ``batch`` requests, a quarter
    of them with a schema when ``structured``; prompts of random ids below ``vocab`` (the
    regular tokens)."""
    from manylora import LLM, SamplingParams
    from manylora.structured_params import StructuredOutputsParams

    new = 16 if tiny else NEW
    kwargs = dict(load_format="dummy", max_num_seqs=batch, max_model_len=PROMPT + new + 16,
                  max_num_batched_tokens=max(2048, batch * 32), enable_prefix_caching=False)
    if tiny:
        kwargs.update(device="cpu", dtype="float32")
    llm = LLM(str(model_dir), **kwargs)
    params = []
    for i in range(batch):
        if structured and i % 4 == 0:
            params.append(SamplingParams(
                temperature=1.0, seed=i, max_tokens=new,
                structured_outputs=StructuredOutputsParams(json=SCHEMAS[i // 4 % 4])))
        else:
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=new,
                                         ignore_eos=True))

    def prompts(seed: int) -> list[dict]:
        rng = random.Random(seed)
        return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(PROMPT)]}
                for _ in range(batch)]

    llm.generate(prompts(0), params, use_tqdm=False)           # warm-up: compiles, shapes
    times, tokens = [], 0
    for r in range(repeats):
        batch_prompts = prompts(r + 1)
        start = time.perf_counter()
        outs = llm.generate(batch_prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.llm_engine.shutdown()
    return tokens / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke run)")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-record", action="store_true", help="print only, no BENCHMARKS.md")
    args = ap.parse_args()
    config = TINY if args.tiny else LLAMA3_8B
    batches = args.batches or ([4, 8] if args.tiny else [64, 256])
    vocab = config["vocab_size"]
    special = 8 if args.tiny else 256
    regular = vocab - special
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "model", dict(
            config, bos_token_id=regular, eos_token_id=regular + 1))
        write_tokenizer(model_dir, vocab, special)
        for batch in batches:
            plain = run_case(model_dir, batch, False, args.repeats, args.tiny, regular)
            mixed = run_case(model_dir, batch, True, args.repeats, args.tiny, regular)
            ratio = mixed / plain
            print(f"batch {batch}: no schema {plain:,.0f} tok/s; 25% with a JSON schema "
                  f"{mixed:,.0f} tok/s; ratio {ratio:.3f} (target >= {TARGET_RATIO})",
                  flush=True)
            rows.append((batch, f"{plain:,.0f}", f"{mixed:,.0f}", f"{ratio:.3f}",
                         "yes" if ratio >= TARGET_RATIO else "no"))
    record(f"Structured output: 25% of requests with a JSON schema ({gpu_name()})",
           command_line("benchmarks.bench_structured"),
           ["batch", "no schema (tok/s)", "25% schema (tok/s)", "ratio", f">= {TARGET_RATIO}"],
           rows, notes=f"Prompts {PROMPT} random ids, {16 if args.tiny else NEW} new tokens "
           "each, temperature 1; constrained requests end by length (their schemas need "
           "more), so both cases generate the same tokens.",
           write=not (args.no_record or args.tiny))


if __name__ == "__main__":
    main()
