"""Per-request sampling parameters, with vLLM's field names, defaults and meaning."""

from __future__ import annotations

import enum
import logging
import math
import operator
from dataclasses import dataclass

from manylora.structured_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# A temperature below this samples greedily (argmax), as in vLLM.
GREEDY_TEMPERATURE_EPS = 1e-5

# The most top tokens ``logprobs`` may ask for per generated token (vLLM's default
# ``max_logprobs`` is 20 too).
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """Which outputs a request reports (vLLM's ``RequestOutputKind``).

    * ``CUMULATIVE``: after every step that gave it a token, the whole text, token ids and
      log-probabilities so far.
    * ``DELTA``: after every such step, only what is new since its previous output (text,
      token ids, log-probabilities); ``cumulative_logprob`` is still the running sum.
    * ``FINAL_ONLY``: one output, when it ends, with everything (what ``LLM.generate``
      uses).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(value: object) -> bool:
    """Return True for a Python/NumPy/torch integer (bools excluded)."""
    if isinstance(value, bool):
        return False
    # NumPy / torch integer scalars are not `int` subclasses but support operator.index.
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


@dataclass
class SamplingParams:
    """How to sample the completion of one request; mirrors ``vllm.SamplingParams``.

    Fields (vLLM's names and defaults):
        n: number of completions per prompt. Only 1 is supported for now.
        temperature: logits are divided by it before sampling; ``< 1e-5`` means greedy
            (argmax). Must be finite and ``>= 0``.
        top_p: nucleus sampling; keep the smallest set of most-probable tokens whose
            cumulative probability is ``>= top_p``. ``0 < top_p <= 1``; 1 disables it.
        top_k: keep only the ``top_k`` most likely tokens (ties at the k-th value kept).
            0 or -1 disables it (-1 is normalized to 0).
        min_p: drop tokens whose probability is below ``min_p`` times the largest
            probability. ``0 <= min_p <= 1``; 0 disables it.
        seed: seed of a per-request random generator, so that the request's tokens do not
            depend on the rest of the batch. None draws from the engine's shared generator.
        max_tokens: most tokens to generate; None means up to the model's context length.
        min_tokens: EOS and ``stop_token_ids`` are not allowed to end the completion before
            this many tokens were generated.
        stop: strings that end the completion when generated (not included in the output
            unless ``include_stop_str_in_output``). Normalized to a list of strings.
        stop_token_ids: token ids that end the completion (included in ``token_ids``, not in
            the text). Normalized to a list of ints.
        ignore_eos: keep generating after the EOS token.
        skip_special_tokens: leave special tokens out of the output text.
        spaces_between_special_tokens: put spaces between the special tokens kept in the
            text (Hugging Face's decode option; fast tokenizers decode alike either way).
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        logprobs: None (default) returns no log-probabilities; ``N`` in ``[0, 20]``
            (:data:`MAX_LOGPROBS`) returns, for each generated token, the natural-log
            probability of the sampled token and of the ``N`` most likely tokens (``N + 1``
            entries, or ``N`` when the sampled token is among them), taken from the raw
            model distribution ``log_softmax(logits)`` before temperature, top-k, top-p and
            min-p (vLLM v1's default ``logprobs_mode="raw_logprobs"``). See
            ``CompletionOutput.logprobs``.
        prompt_logprobs: None (default) returns none; ``N`` in ``[0, 20]`` returns, for
            every prompt token but the first, its log-probability given the tokens before
            it (the raw ``log_softmax`` of the prefill's logits under the request's
            adapter), its rank and the ``N`` most likely tokens at that position; the first
            token's entry is None (``RequestOutput.prompt_logprobs``, vLLM's meaning).
            vLLM's ``-1`` (the whole vocabulary) is refused.
        output_kind: which outputs the request reports while it runs
            (:class:`RequestOutputKind`; default ``CUMULATIVE``).
        presence_penalty: subtracted from the logit of every token the request has
            generated at least once (its output tokens, not the prompt). ``[-2, 2]``; 0 is
            off.
        frequency_penalty: subtracted from a token's logit once per time the request has
            generated it. ``[-2, 2]``; 0 is off.
        repetition_penalty: a token seen in the prompt or the output has its logit divided
            by it when positive and multiplied by it otherwise (the CTRL paper's penalty,
            Keskar et al. 2019, as vLLM applies it). ``> 0``; 1 is off.
        logit_bias: ``{token_id: bias}`` added to those logits before the penalties; biases
            in ``[-100, 100]``, ids in the vocabulary (checked by :meth:`verify_token_ids`).
            Normalized to ``dict[int, float]``; None or ``{}`` is off.
        allowed_token_ids: only these tokens may be sampled (every other logit is
            ``-inf``); a non-empty list of ids in the vocabulary. None is off.
        structured_outputs: the constraint the output must satisfy
            (:class:`~manylora.structured_params.StructuredOutputsParams`: a JSON schema,
            regex, choice, grammar, any JSON object), or None.
        bad_words: words the output must not contain (vLLM's): the front tokenizes each
            with and without a leading space into ``bad_words_token_ids``. None is off.
        bad_words_token_ids: token sequences the output must not contain (the last token
            of a sequence is banned whenever the output ends with the tokens before it; a
            one-token sequence is always banned); filled from ``bad_words`` by the front,
            or given directly (token-id engines). None is off.

    The penalties, ``logit_bias`` and ``allowed_token_ids`` change the logits the token is
    sampled (or argmax-ed) from, as vLLM v1's sampler: ``allowed_token_ids`` mask, then
    ``logit_bias``, then repetition, frequency and presence penalties, then temperature and
    the filters. Log-probabilities stay those of the raw logits.

    Treat instances as values: do not mutate them after construction (validation only runs
    in ``__post_init__``).

    Raises:
        ValueError: from ``__post_init__`` for any invalid field; the message names the
            field and the bad value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        """Normalize and validate the fields.

        Normalization: ``stop`` becomes a list of str (None -> []), ``stop_token_ids`` a list
        of int (None -> []), ``top_k == -1`` becomes 0, numeric fields become Python
        ``int``/``float``.

        Raises:
            ValueError: naming the field and its value, when ``n != 1``; ``temperature`` is
                negative, NaN or infinite; ``top_p`` is not in (0, 1]; ``top_k`` is not an
                int or is below -1; ``min_p`` is not in [0, 1]; ``max_tokens`` is not None
                and below 1; ``min_tokens`` is negative or above ``max_tokens``; a stop
                string is empty or not a str; a stop token id is not an int; ``seed`` is not
                None and not an int; ``logprobs`` is not None and not an int in
                ``[0, MAX_LOGPROBS]``; ``prompt_logprobs`` likewise (-1, vLLM's whole
                vocabulary, is refused by name); ``output_kind`` is not a
                ``RequestOutputKind``; ``presence_penalty`` or ``frequency_penalty`` is not
                in ``[-2, 2]``; ``repetition_penalty`` is not finite and ``> 0``;
                ``logit_bias`` is not a mapping of int ids to biases in ``[-100, 100]``;
                ``allowed_token_ids`` is empty or holds a non-int.
        """
        # n
        if not _is_int(self.n):
            raise ValueError(f"n must be an int, got n={self.n!r}.")
        self.n = int(self.n)
        if self.n != 1:
            raise ValueError(f"n must be 1, got n={self.n}: n>1 is not supported yet.")

        # temperature
        self.temperature = self._as_float("temperature", self.temperature)
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(
                f"temperature must be finite and >= 0, got temperature={self.temperature}."
            )

        # top_p
        self.top_p = self._as_float("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got top_p={self.top_p}.")

        # top_k
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an int, got top_k={self.top_k!r}.")
        self.top_k = int(self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or -1 disables it), got top_k={self.top_k}.")

        # min_p
        self.min_p = self._as_float("min_p", self.min_p)
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got min_p={self.min_p}.")

        # seed
        if self.seed is not None:
            if not _is_int(self.seed):
                raise ValueError(f"seed must be an int or None, got seed={self.seed!r}.")
            self.seed = int(self.seed)

        # max_tokens / min_tokens
        if self.max_tokens is not None:
            if not _is_int(self.max_tokens):
                raise ValueError(
                    f"max_tokens must be an int or None, got max_tokens={self.max_tokens!r}."
                )
            self.max_tokens = int(self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got max_tokens={self.max_tokens}.")
        if not _is_int(self.min_tokens):
            raise ValueError(f"min_tokens must be an int, got min_tokens={self.min_tokens!r}.")
        self.min_tokens = int(self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got min_tokens={self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, "
                f"got min_tokens={self.min_tokens}."
            )

        # stop strings
        if self.stop is None:
            stop: list[str] = []
        elif isinstance(self.stop, str):
            stop = [self.stop]
        else:
            stop = list(self.stop)
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop strings must be str, got stop={stop!r}.")
            if not s:
                raise ValueError(f"stop strings must be non-empty, got stop={stop!r}.")
        self.stop = stop

        # stop token ids
        if self.stop_token_ids is None:
            ids: list[int] = []
        elif _is_int(self.stop_token_ids):
            ids = [int(self.stop_token_ids)]  # type: ignore[arg-type]
        else:
            ids = list(self.stop_token_ids)
        for t in ids:
            if not _is_int(t):
                raise ValueError(f"stop_token_ids must be ints, got stop_token_ids={ids!r}.")
        self.stop_token_ids = [int(t) for t in ids]

        # logprobs
        if self.logprobs is not None:
            if not _is_int(self.logprobs):
                raise ValueError(
                    f"logprobs must be an int or None, got logprobs={self.logprobs!r}."
                )
            self.logprobs = int(self.logprobs)
            if not (0 <= self.logprobs <= MAX_LOGPROBS):
                raise ValueError(
                    f"logprobs must be in [0, {MAX_LOGPROBS}] (or None), "
                    f"got logprobs={self.logprobs}."
                )

        self._check_prompt_logprobs()
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got "
                             f"output_kind={self.output_kind!r}.")
        self._check_processors()
        if (self.structured_outputs is not None
                and not isinstance(self.structured_outputs, StructuredOutputsParams)):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}.")
        self._check_bad_words()
        self.ignore_eos = bool(self.ignore_eos)
        self.skip_special_tokens = bool(self.skip_special_tokens)
        self.spaces_between_special_tokens = bool(self.spaces_between_special_tokens)
        self.include_stop_str_in_output = bool(self.include_stop_str_in_output)

    def _check_prompt_logprobs(self) -> None:
        """Validate ``prompt_logprobs`` (see ``__post_init__``)."""
        value = self.prompt_logprobs
        if value is None:
            return
        if not _is_int(value):
            raise ValueError(f"prompt_logprobs must be an int or None, got "
                             f"prompt_logprobs={value!r}.")
        value = int(value)
        if value == -1:
            raise ValueError(f"prompt_logprobs=-1 (the whole vocabulary) is not supported; "
                             f"ask for at most {MAX_LOGPROBS}.")
        if not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (or None), "
                             f"got prompt_logprobs={value}.")
        self.prompt_logprobs = value

    def _check_processors(self) -> None:
        """Normalize and validate the penalties, ``logit_bias`` and ``allowed_token_ids``
        (ranges as vLLM's ``SamplingParams._verify_args``; see ``__post_init__``)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = self._as_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {name}={value}.")
            setattr(self, name, value)
        rep = self._as_float("repetition_penalty", self.repetition_penalty)
        if not (math.isfinite(rep) and rep > 0.0):
            raise ValueError(f"repetition_penalty must be finite and > 0, "
                             f"got repetition_penalty={rep}.")
        self.repetition_penalty = rep
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got "
                                 f"logit_bias={self.logit_bias!r}.")
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                tok = key
                if isinstance(key, str) and key.lstrip("-").isdigit():
                    tok = int(key)          # JSON object keys are strings
                if not _is_int(tok):
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}.")
                b = self._as_float(f"logit_bias[{key!r}]", value)
                if not -100.0 <= b <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got "
                                     f"logit_bias[{key!r}]={b}.")
                bias[int(tok)] = b
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if _is_int(ids) or isinstance(ids, str | bytes | dict):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got "
                                 f"allowed_token_ids={ids!r}.")
            ids = list(ids)
            if not ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every "
                                 "token).")
            bad = [t for t in ids if not _is_int(t)]
            if bad:
                raise ValueError(f"allowed_token_ids must be ints, got {bad[:5]!r}.")
            self.allowed_token_ids = [int(t) for t in ids]

    def _check_bad_words(self) -> None:
        """``bad_words``: a list of non-empty strings; ``bad_words_token_ids``: a list of
        non-empty lists of ints (normalized to lists; empty lists → None)."""
        words = self.bad_words
        if words is not None:
            if isinstance(words, str) or not all(isinstance(w, str) and w.strip()
                                                 for w in words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got "
                                 f"bad_words={words!r}.")
            self.bad_words = list(words) or None
        seqs = self.bad_words_token_ids
        if seqs is not None:
            if isinstance(seqs, str | bytes | dict) or not all(
                    isinstance(s, list | tuple) and s and all(_is_int(t) for t in s)
                    for s in seqs):
                raise ValueError(f"bad_words_token_ids must be a list of non-empty lists of "
                                 f"token ids, got bad_words_token_ids={seqs!r}.")
            self.bad_words_token_ids = [[int(t) for t in s] for s in seqs] or None

    def verify_token_ids(self, vocab_size: int) -> None:
        """Check that ``logit_bias`` and ``allowed_token_ids`` name tokens of a vocabulary
        of ``vocab_size`` (vLLM checks them in its input processor, where the vocabulary is
        known; the engine core calls this when a request is added).

        Raises:
            ValueError: naming the field and the ids outside ``[0, vocab_size)``.
        """
        for name, ids in (("logit_bias", list(self.logit_bias or ())),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("bad_words_token_ids",
                           [t for s in self.bad_words_token_ids or () for t in s])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} holds token ids {bad[:5]} outside the vocabulary "
                                 f"[0, {vocab_size}).")

    @property
    def uses_host_mask(self) -> bool:
        """True when the row's logits get a token mask built on the host before sampling
        (a grammar, or ``bad_words_token_ids``): ``StructuredOutputManager.fill``."""
        return self.structured_outputs is not None or bool(self.bad_words_token_ids)

    @property
    def uses_logits_processors(self) -> bool:
        """True when a penalty, ``logit_bias`` or ``allowed_token_ids`` changes the logits
        (the sampler's penalty path runs only for such rows)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias)
                or self.allowed_token_ids is not None)

    @staticmethod
    def _as_float(name: str, value: object) -> float:
        """Convert ``value`` to float, raising ValueError that names ``name`` if it is not a
        real number (bools and strings are rejected)."""
        if isinstance(value, bool | str | bytes):
            raise ValueError(f"{name} must be a number, got {name}={value!r}.")
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {name}={value!r}.") from None

    @property
    def greedy(self) -> bool:
        """True when this request samples greedily (``temperature < 1e-5``), as in vLLM."""
        return self.temperature < GREEDY_TEMPERATURE_EPS
