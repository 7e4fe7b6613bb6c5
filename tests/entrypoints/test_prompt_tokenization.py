"""Tokenization in the serving layer: the token-count lower bound against the real
tokenizer's encodings, encoding on the worker thread (same ids as a direct call), and the
checks that answer before any tokenization (choices bound, obviously too long text)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from manylora.entrypoints.openai.errors import OpenAIError
from manylora.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from manylora.entrypoints.openai.serving_chat import OpenAIServingChat
from manylora.entrypoints.openai.serving_completion import OpenAIServingCompletion
from manylora.entrypoints.openai.tokenization import PromptTokenizer, max_token_chars
from manylora.testing import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    tok = make_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                         "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    return tok


class CountingTokenizer:
    """Delegates to a tokenizer, counting encode calls and the threads they ran on."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0
        self.threads: set[int] = set()

    def __call__(self, text, **kwargs):
        self.calls += 1
        self.threads.add(threading.get_ident())
        return self.inner(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class NoEngine:
    """An engine no request may reach."""

    def __init__(self, tokenizer, max_model_len=128):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def generate(self, *args, **kwargs):
        raise AssertionError("the request reached the engine")


class BaseOnly:
    base_model_name = "base"

    def resolve(self, name):
        return None


def _random_text(rng: random.Random, n: int) -> str:
    alphabet = "abc xyz\n\t.,;!?'\"0123456789éü日本語😀\x00\x7f" + "the quick brown fox "
    return "".join(rng.choice(alphabet) for _ in range(n))


def test_max_token_chars_bounds_every_token_and_every_encoding(tokenizer):
    bound = max_token_chars(tokenizer)
    assert bound is not None and bound >= 1
    # no token decodes to more characters than the bound (the claim the check relies on)
    for token_id in range(len(tokenizer)):
        assert len(tokenizer.decode([token_id])) <= bound
    rng = random.Random(0)
    for size in (1, 7, 100, 3000):
        text = _random_text(rng, size)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert len(ids) >= -(-len(text) // bound)
    assert len(tokenizer("the " * 500, add_special_tokens=False).input_ids) >= 2000 // bound


def test_max_token_chars_refuses_pipelines_that_drop_characters():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()     # whitespace is dropped
    assert max_token_chars(PreTrainedTokenizerFast(tokenizer_object=words)) is None

    class Slow:                          # no backend pipeline to read
        def get_vocab(self):
            return {"abc": 0}

    assert max_token_chars(Slow()) is None
    assert PromptTokenizer(None).min_tokens(10**6) == 0


def test_worker_thread_encoding_matches_direct_calls(tokenizer):
    counting = CountingTokenizer(tokenizer)
    prompts = PromptTokenizer(counting)
    texts = [_random_text(random.Random(i), 50 + 40 * i) for i in range(4)]

    async def run():
        return await prompts.encode(texts, add_special_tokens=True), threading.get_ident()

    encoded, loop_thread = asyncio.run(run())
    assert encoded == [tokenizer(t, add_special_tokens=True).input_ids for t in texts]
    assert counting.calls == 4 and loop_thread not in counting.threads


def test_issue18_choices_bound_answers_before_tokenizing(tokenizer):
    counting = CountingTokenizer(tokenizer)
    serving = OpenAIServingCompletion(NoEngine(counting), BaseOnly(), max_choices=6)

    def status(**body) -> OpenAIError:
        with pytest.raises(OpenAIError) as info:
            asyncio.run(serving.create_completion(CompletionRequest(**body)))
        return info.value

    error = status(prompt=["a"] * 4, n=2)
    assert (error.status, error.param) == (400, "n") and "8" in error.message
    error = status(prompt=["word"] * 150_000)
    assert (error.status, error.param) == (400, "prompt") and "150000" in error.message
    error = status(prompt=[[5, 6]] * 7)
    assert (error.status, error.param) == (400, "prompt")
    assert counting.calls == 0

    chat = OpenAIServingChat(NoEngine(counting), BaseOnly(), max_choices=6)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(chat.create_chat_completion(ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi"}], n=7)))
    assert (info.value.status, info.value.param) == (400, "n") and counting.calls == 0
    with pytest.raises(ValueError, match="max_choices"):
        OpenAIServingCompletion(NoEngine(counting), BaseOnly(), max_choices=0)


def test_issue18_obviously_long_text_is_refused_without_tokenizing(tokenizer):
    counting = CountingTokenizer(tokenizer)
    serving = OpenAIServingCompletion(NoEngine(counting, max_model_len=128), BaseOnly())
    bound = serving.prompts.max_chars_per_token
    huge = "x" * (128 * bound)           # at least 128 tokens: the whole context
    with pytest.raises(OpenAIError) as info:
        asyncio.run(serving.create_completion(CompletionRequest(prompt=["ok", huge])))
    assert (info.value.status, info.value.code) == (413, "context_length_exceeded")
    assert info.value.param == "prompt" and counting.calls == 0

    chat = OpenAIServingChat(NoEngine(counting, max_model_len=128), BaseOnly(),
                             prompt_tokenizer=serving.prompts)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(chat.create_chat_completion(ChatCompletionRequest(
            messages=[{"role": "user", "content": "y" * 10**6}])))
    assert (info.value.status, info.value.param) == (413, "messages")
    assert counting.calls == 0


def test_text_under_the_bound_is_tokenized_and_checked_exactly(tokenizer):
    counting = CountingTokenizer(tokenizer)
    serving = OpenAIServingCompletion(NoEngine(counting, max_model_len=128), BaseOnly())
    # under the character bound, but over the context once tokenized: the exact check
    text = "the quick brown fox " * 40
    assert serving.prompts.min_tokens(len(text)) < 128
    assert len(tokenizer(text).input_ids) >= 128
    with pytest.raises(OpenAIError) as info:
        asyncio.run(serving.create_completion(CompletionRequest(prompt=text)))
    assert info.value.status == 413 and counting.calls == 1
