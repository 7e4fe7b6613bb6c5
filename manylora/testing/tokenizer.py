"""A tiny deterministic byte-level BPE tokenizer for tests and demos, trained offline with
the ``tokenizers`` library on an inline corpus (nothing is fetched from the Hugging Face
hub), with a ChatML-like chat template."""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


_SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")

# ChatML-like template; the BOS comes from the template (apply_chat_template tokenizes without
# adding special tokens), like Llama 3's.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A large language model reads a prompt one token at
a time and predicts the next token. Serving many adapters on one base model lets a single GPU
answer requests for many fine-tuned tasks: each request names its adapter, and the engine
batches them together in one launch.

Low-rank adaptation adds a small update to a frozen weight matrix. The update is the product of
two thin matrices, A and B, scaled by alpha over the rank. Because the base weights are shared,
hundreds of adapters fit in memory at once, and swapping between them costs almost nothing.

SELECT name, count(*) FROM users WHERE created_at > '2024-01-01' GROUP BY name ORDER BY 2 DESC;
def add(a, b):
    return a + b
for i in range(10):
    total = total + i * i

Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. Every
morning he walked down to the harbour, pushed his boat into the water and sailed out to the
open sea. Every evening he came back with a basket of fish, and they were happy.

What is the capital of France? The capital of France is Paris. What is two plus two? Two plus
two is four. Please answer the question briefly and politely, then stop.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14159 2.71828 -1 +1 = < > ( ) [ ] { } / \\ | ! ? #

Unicode: café, naïve, über, façade, smörgåsbord, Ελληνικά, русский текст, 日本語のテキスト,
中文文本, 한국어, emoji 🙂🚀, em dash — and ellipsis …
"""


@lru_cache(maxsize=4)
def _train_backend_tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE and return its serialized JSON (cached per vocab size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus line by line so that the merge counts are stable and high enough.
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0",
        pair="<s>:0 $A:0 <s>:1 $B:1",
        special_tokens=[("<s>", bos_id)],
    )
    return tok.to_str()


def make_tokenizer(out_dir: str | Path | None = None, *, vocab_size: int = 512) -> Any:
    """Train a tiny deterministic byte-level BPE tokenizer and (optionally) save it.

    The tokenizer is trained offline with the ``tokenizers`` library on an inline English corpus
    (with a little non-ASCII text), has the special tokens ``<s>`` (id 0), ``</s>`` (1),
    ``<unk>`` (2) and ``<pad>`` (3), prepends ``<s>`` to every encoded prompt like Llama does,
    round-trips any text exactly (byte-level; decode with ``skip_special_tokens=True``) and
    carries a ChatML-like ``chat_template`` (see :data:`CHAT_TEMPLATE`).

    Args:
        out_dir: directory to write ``tokenizer.json``, ``tokenizer_config.json`` and
            ``special_tokens_map.json`` into with ``save_pretrained`` (created if missing);
            ``None`` only returns the tokenizer.
        vocab_size: BPE target vocabulary size (including the 256 byte tokens and 4 specials).

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` (``TokenizersBackend`` on transformers 5)
        that reloads with ``AutoTokenizer.from_pretrained(out_dir)`` and encodes identically.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_train_backend_tokenizer_json(vocab_size))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(out))
        logger.debug("wrote tokenizer (%d tokens) to %s", len(tokenizer), out)
    return tokenizer
