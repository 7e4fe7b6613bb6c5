"""``echo``, ``max_tokens: 0`` and ``prompt_logprobs`` on ``/v1/completions`` (vLLM's
behaviour, which lm-evaluation-harness's ``local-completions`` relies on for every
loglikelihood task).

* ``echo`` puts the prompt's text before each choice's text; with ``logprobs`` the legacy
  ``logprobs`` object covers the prompt's tokens first (the first one's ``token_logprobs``
  and ``top_logprobs`` null: nothing precedes it), then the generated ones, with one
  ``text_offset`` running over both. The prompt's entries come from the engine's prompt
  log-probabilities (``SamplingParams.prompt_logprobs`` = ``logprobs`` unless the request
  sets ``prompt_logprobs`` itself). Streamed, the echoed prompt comes in the first chunk.
* ``max_tokens: 0`` with ``echo`` returns the prompt alone: the engine runs one token
  (``max_tokens=1``, as vLLM does) and it is dropped (not in the text, the log-probabilities
  or ``usage.completion_tokens``). Without ``echo`` it is a 400, as in vLLM
  (``max_tokens`` must be at least 1).
* chat ``echo`` (vLLM's extra) puts the last message's content before each choice's content
  when that message has the reply's role (``assistant`` with ``add_generation_prompt``,
  else the last message's own, i.e. ``continue_final_message``); streamed, in a chunk of
  its own after the role's.
* ``prompt_logprobs`` (vLLM's extra) returns ``{token_id: Logprob}`` per prompt token, None
  for the first, on each choice (chat: on the response); not with ``stream`` for a value
  above 0, as vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import BaseModel

from manylora.engine.outputs import Logprob
from manylora.entrypoints.openai.errors import bad_request
from manylora.sampling_params import MAX_LOGPROBS

__all__ = [
    "PromptLogprobEntry",
    "chat_echo_text",
    "check_prompt_logprobs",
    "echo_without_generation",
    "engine_max_tokens",
    "engine_prompt_logprobs",
    "prompt_logprobs_json",
]


class PromptLogprobEntry(BaseModel):
    """One token of a prompt position's ``prompt_logprobs`` map (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def check_prompt_logprobs(prompt_logprobs: int | None, stream: bool | None) -> None:
    """Check a request's ``prompt_logprobs`` as vLLM does.

    Raises:
        OpenAIError: 400 naming ``prompt_logprobs``: outside ``[0, MAX_LOGPROBS]`` (vLLM's
            -1, the whole vocabulary, is refused by name), or above 0 with ``stream``.
    """
    if prompt_logprobs is None:
        return
    if prompt_logprobs == -1:
        raise bad_request(f"prompt_logprobs=-1 (the whole vocabulary) is not supported; ask "
                          f"for at most {MAX_LOGPROBS}", param="prompt_logprobs")
    if not 0 <= prompt_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got "
                          f"prompt_logprobs={prompt_logprobs}", param="prompt_logprobs")
    if stream and prompt_logprobs > 0:
        raise bad_request("prompt_logprobs are not available when stream is true",
                          param="prompt_logprobs")


def chat_echo_text(echo: bool | None, messages: Sequence, add_generation_prompt: bool | None
                   ) -> str:
    """What chat ``echo`` puts before each choice's content (vLLM's rule): the last
    message's text when its role is the reply's (``assistant`` when
    ``add_generation_prompt``, else the last message's own), else ``""``; ``""`` without
    ``echo``. ``messages`` are ``ChatCompletionMessageParam`` (``role``, ``text()``)."""
    if not echo or not messages:
        return ""
    last = messages[-1]
    role = "assistant" if add_generation_prompt else last.role
    return (last.text() or "") if last.role == role else ""


def echo_without_generation(echo: bool | None, max_tokens: int | None) -> bool:
    """Whether the request asks for its prompt back and no generated token (vLLM's
    ``echo and max_tokens == 0``)."""
    return bool(echo) and max_tokens == 0


def engine_max_tokens(echo: bool | None, max_tokens: int | None) -> int | None:
    """The ``max_tokens`` the engine runs: 1 for ``echo`` with 0 (the token is dropped),
    else the request's."""
    return 1 if echo_without_generation(echo, max_tokens) else max_tokens


def engine_prompt_logprobs(prompt_logprobs: int | None, echo: bool | None,
                           logprobs: int | None) -> int | None:
    """The engine's ``SamplingParams.prompt_logprobs``: the request's, else ``logprobs``
    when the prompt is echoed (its tokens need theirs), else None."""
    if prompt_logprobs is not None:
        return prompt_logprobs
    return logprobs if echo else None


def prompt_logprobs_json(prompt_logprobs: Sequence[dict[int, Logprob] | None] | None,
                         clamp: Callable[[float], float]
                         ) -> list[dict[int, PromptLogprobEntry] | None] | None:
    """``RequestOutput.prompt_logprobs`` as vLLM's JSON (``{token_id: {logprob, rank,
    decoded_token}}`` per position, null first), log-probabilities clamped by ``clamp``
    (JSON has no ``-inf``); None stays None."""
    if prompt_logprobs is None:
        return None
    return [None if entries is None else
            {tid: PromptLogprobEntry(logprob=clamp(lp.logprob), rank=lp.rank,
                                     decoded_token=lp.decoded_token)
             for tid, lp in entries.items()}
            for entries in prompt_logprobs]
