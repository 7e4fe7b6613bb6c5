"""Tests for manylora.engine.detokenizer: the incremental decode invariant and stop strings."""

from __future__ import annotations

import random

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from manylora.engine.detokenizer import (  # noqa: E402
    IncrementalDetokenizer,
    check_stop_strings,
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello again, world.",
    "Café crème brûlée, naïve résumé, déjà vu.",
    "中文文本测试，你好世界。这是一个测试。",
    "Emoji time 😀🎉🚀 and more 👍🏽 fun 🇫🇷.",
    "Привет, мир! Ελληνικά γράμματα.",
    "def f(x):\n    return x * 2  # code\n",
] * 4


@pytest.fixture(scope="module")
def tok():
    """A small byte-level BPE tokenizer trained offline, wrapped as a transformers fast
    tokenizer (no hub access)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


def _run(tok, prompt_ids, output_ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [detok.append(t) for t in output_ids]
    assert "".join(pieces) == detok.text
    assert detok.token_ids == list(output_ids)
    return detok


def _expected(tok, ids, skip_special_tokens=True):
    return tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize(
    "text",
    [
        "Hello world! The quick brown fox.",
        " café résumé é",
        "中文文本测试，你好",
        "Emoji 😀🎉🚀👍🏽🇫🇷 end",
        "mixed é中😀 ascii",
    ],
)
def test_invariant_on_text(tok, text):
    prompt = tok.encode("Prompt: ", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    detok = _run(tok, prompt, ids)
    assert detok.text == text == _expected(tok, ids)
    # Every prefix also decodes the same once it does not end mid-character.
    for n in range(len(ids) + 1):
        d = _run(tok, prompt, ids[:n])
        full = _expected(tok, ids[:n])
        if not full.endswith("\ufffd"):
            assert d.text == full
        else:
            assert full.startswith(d.text)


def test_multibyte_characters_are_split_across_tokens(tok):
    # With vocab 300, most of these characters are several byte tokens: the detokenizer
    # must hold the pieces back and emit each character whole.
    text = "😀中é🚀"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = [detok.append(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some token completed nothing on its own
    assert [p for p in pieces if p] == list(text)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_invariant_on_random_ids(tok, seed, skip_special_tokens):
    rng = random.Random(seed)
    vocab = len(tok)
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
    detok = _run(tok, prompt, ids, skip_special_tokens)
    full = _expected(tok, ids, skip_special_tokens)
    if not full.endswith("\ufffd"):
        assert detok.text == full
    else:
        assert full.startswith(detok.text)
    detok.flush()
    assert detok.text == full


def test_random_ids_from_multibyte_corpus(tok):
    # Concatenations of real multi-byte words tokenized separately: the id stream splits
    # characters across tokens in many ways.
    words = ["é", "中文", "😀", "🇫🇷", "café", " world", "мир", "\n", "👍🏽", "ü"]
    rng = random.Random(1234)
    for _ in range(30):
        ids = []
        for _ in range(rng.randrange(1, 12)):
            ids += tok.encode(rng.choice(words), add_special_tokens=False)
        prompt = tok.encode(rng.choice(words), add_special_tokens=False)
        detok = _run(tok, prompt, ids)
        assert detok.text == _expected(tok, ids)


def test_long_sequence_trims_and_stays_exact(tok):
    text = ("Hello world! Café 中文 😀. " * 80).strip()
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 600
    detok = _run(tok, tok.encode("Q:", add_special_tokens=False), ids)
    assert detok.text == text
    assert len(detok._ids) < 300  # the working list is trimmed


def test_special_tokens(tok):
    eos = tok.eos_token_id
    ids = tok.encode("Hello world", add_special_tokens=False) + [eos]
    skipped = _run(tok, [tok.bos_token_id], ids, skip_special_tokens=True)
    assert skipped.text == "Hello world" == _expected(tok, ids, True)
    kept = _run(tok, [tok.bos_token_id], ids, skip_special_tokens=False)
    assert kept.text == "Hello world</s>" == _expected(tok, ids, False)


def test_leading_space_kept_after_prompt(tok):
    prompt = tok.encode("Hello", add_special_tokens=False)
    ids = tok.encode(" world", add_special_tokens=False)
    assert _run(tok, prompt, ids).text == " world"


def test_flush_emits_incomplete_tail(tok):
    ids = tok.encode("a😀", add_special_tokens=False)
    detok = _run(tok, [], ids[:-1])
    assert detok.text == "a"
    assert detok.flush().endswith("\ufffd")
    assert detok.text == _expected(tok, ids[:-1])
    assert detok.flush() == ""


# ---------------------------------------------------------------------------- stop strings


def test_stop_none_and_empty():
    assert check_stop_strings("hello world", 5, [], False) is None
    assert check_stop_strings("hello world", 0, ["world"], False) is None
    assert check_stop_strings("hello world", 5, ["xyz"], False) is None


def test_stop_basic_exclude_and_include():
    assert check_stop_strings("hello world", 5, ["world"], False) == ("hello ", 0)
    assert check_stop_strings("hello world", 5, ["world"], True) == ("hello world", 0)


def test_stop_spanning_old_and_new_text():
    # "wor" was already there, only "ld" is new: still found.
    assert check_stop_strings("hello world", 2, ["world"], False) == ("hello ", 0)


def test_stop_only_in_old_text_is_ignored():
    # "hello" lies entirely before the new characters: it was checked on an earlier step.
    assert check_stop_strings("hello world", 3, ["hello"], False) is None
    assert check_stop_strings("hello world", 3, ["xx", "hello"], True) is None


def test_stop_text_after_match_is_dropped():
    # A multi-character step can complete the stop string and add more text after it.
    assert check_stop_strings("abc STOP tail", 10, ["STOP"], False) == ("abc ", 0)
    assert check_stop_strings("abc STOP tail", 10, ["STOP"], True) == ("abc STOP", 0)


def test_stop_earliest_match_wins_and_index():
    text = "one two three"
    assert check_stop_strings(text, len(text), ["three", "two"], False) == ("one ", 1)
    assert check_stop_strings(text, len(text), ["two", "tw"], True) == ("one two", 0)
    assert check_stop_strings(text, 1, ["e", "ee"], False) == ("one two thr", 1)


def test_stop_whole_text_new():
    assert check_stop_strings("</end>", 6, ["</end>"], False) == ("", 0)
    assert check_stop_strings("</end>", 6, ["</end>"], True) == ("</end>", 0)


def test_stop_multichar_unicode():
    assert check_stop_strings("答案：中文。结束", 2, ["结束"], False) == ("答案：中文。", 0)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_stop_token_is_counted_but_never_decoded(tok, skip_special_tokens):
    # vLLM's detokenizer leaves the stop token (EOS or a stop_token_ids hit) out of the text
    # whatever skip_special_tokens says; transformers' decode of the ids before it is the
    # reference.
    prompt = tok.encode("Q: ", add_special_tokens=False)
    ids = tok.encode("Hello world! Café", add_special_tokens=False)
    eos = tok.eos_token_id
    for stop in (eos, ids[0]):                   # a special EOS, and a plain token id
        detok = _run(tok, prompt, ids, skip_special_tokens)
        detok.skip(stop)
        pieces = detok.text + detok.flush()
        assert pieces == detok.text == _expected(tok, ids, skip_special_tokens)
        assert detok.token_ids == ids + [stop]
        assert detok.num_tokens == len(ids) + 1
    assert tok.eos_token not in detok.text


def _processor_run(tok, ids, stop, **params):
    """``ids`` through an ``OutputProcessor`` as the core sends them, one token a step with
    log-probabilities, the last one (``stop``) ending the request with ``FinishReason.STOP``;
    returns the finished ``CompletionOutput`` and the concatenated ``DELTA`` texts."""
    from manylora.engine.output_processor import OutputProcessor
    from manylora.engine.protocol import EngineCoreOutput, FinishReason
    from manylora.sample.logprobs import TokenLogprobs
    from manylora.sampling_params import RequestOutputKind, SamplingParams

    prompt = tok.encode("Q: ", add_special_tokens=False)
    finals, deltas = [], ""
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA):
        proc = OutputProcessor(tok)
        proc.add("r", None, prompt, SamplingParams(logprobs=0, output_kind=kind, **params),
                 None, 0.0)
        proc.answered("r", [])
        seq = ids + [stop]
        for i, t in enumerate(seq):
            end = i == len(seq) - 1
            outs, _, failed = proc.process_outputs([EngineCoreOutput(
                "r", [t], [TokenLogprobs(-0.5, 1, [], [])],
                FinishReason.STOP if end else None,
                None if t == tok.eos_token_id else t if end else None)])
            assert not failed
            for out in outs:
                if kind is RequestOutputKind.DELTA:
                    deltas += out.outputs[0].text
                else:
                    finals.append(out.outputs[0])
    [final] = finals
    return final, deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_output_processor_leaves_the_stop_token_out_of_text_and_deltas(tok,
                                                                        skip_special_tokens):
    ids = tok.encode("Hello world!", add_special_tokens=False)
    for stop in (tok.eos_token_id, ids[0]):
        final, deltas = _processor_run(tok, ids, stop, skip_special_tokens=skip_special_tokens,
                                       stop_token_ids=[ids[0]], min_tokens=len(ids) + 1)
        want = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert final.text == deltas == want
        assert final.finish_reason == "stop"
        # as vLLM: the stop token stays in the ids and the log-probabilities, with its text
        assert final.token_ids == ids + [stop]
        assert len(final.logprobs) == len(ids) + 1
        assert final.logprobs[-1][stop].decoded_token == tok.convert_tokens_to_string(
            [tok.convert_ids_to_tokens(stop)])


def test_include_stop_str_in_output_keeps_the_stop_token_text(tok):
    # vLLM decodes the stop token only when include_stop_str_in_output asks for it
    ids = tok.encode("Hello world!", add_special_tokens=False)
    final, deltas = _processor_run(tok, ids, tok.eos_token_id, skip_special_tokens=False,
                                   include_stop_str_in_output=True)
    assert final.text == deltas == tok.decode(ids + [tok.eos_token_id],
                                              skip_special_tokens=False)
    assert final.text.endswith(tok.eos_token)
