"""A step's sampled tokens on their way to the host (vLLM v1's ``AsyncModelRunnerOutput``).

Under async scheduling the engine launches step n+1 before it reads step n's tokens. The
sampled tokens (and the log-probabilities asked for, flattened by
``sample.sampler.flatten_tokens_and_logprobs``) are copied into pinned host memory on a side
stream that first waits for the sampler; an event marks the copy's end, and ``result``
waits for that event only, never for the compute stream, where the next step already runs.
On the CPU the tensors are already on the host and nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manylora.sample.logprobs import (
    TokenLogprobs,
    flatten_tokens_and_logprobs,
    unflatten_tokens_and_logprobs,
)
from manylora.sample.prompt_logprobs import (
    PromptLogprobs,
    PromptLogprobsPlan,
    unpack_prompt_logprobs,
)


class AsyncSampledOutput:
    """One step's sampled tokens and log-probabilities, copied to the host asynchronously.

    Args:
        tokens: int64 ``[N]``, the sampled token ids, on the device.
        logits: float32 ``[N, V]``, the sampled rows' raw logits (read only when
            ``lp_rows`` is not empty).
        lp_rows: indices in ``[0, N)`` of the rows that asked for log-probabilities.
        lp_counts: their counts (``SamplingParams.logprobs``).
        copy_stream: the side stream of the device-to-host copy; None on the CPU.
        prompt: float64, the step's flattened prompt log-probabilities
            (``sample.prompt_logprobs.compute_prompt_logprobs``), or None; appended to the
            same copy.
        prompt_plan: the plan they follow (None with ``prompt`` None).
        vocab_size: V (the prompt log-probabilities' K is clamped to it).
        reported: int64 ``[N]``, the ids copied to the host in place of ``tokens``
            (``sample.sampler.flag_empty_rows``: rows that allowed no token marked); None:
            ``tokens``. Log-probabilities are always those of ``tokens``.

    Raises:
        ValueError: ``lp_rows`` and ``lp_counts`` differ in length.
    """

    def __init__(self, tokens: torch.Tensor, logits: torch.Tensor, lp_rows: Sequence[int],
                 lp_counts: Sequence[int], copy_stream: torch.cuda.Stream | None,
                 prompt: torch.Tensor | None = None,
                 prompt_plan: PromptLogprobsPlan | None = None, vocab_size: int = 0,
                 reported: torch.Tensor | None = None) -> None:
        flat, self._k = flatten_tokens_and_logprobs(logits, tokens, lp_rows, lp_counts)
        if reported is not None:
            if len(lp_rows):
                flat[:tokens.shape[0]] = reported
            else:
                flat = reported
        self._prompt_plan, self._vocab_size = prompt_plan, vocab_size
        self._prompt_size = 0
        if prompt is not None:
            self._prompt_size = prompt.shape[0]
            flat = torch.cat([flat.to(torch.float64), prompt])
        self.num_tokens = tokens.shape[0]
        self.lp_rows = list(lp_rows)
        self._counts = list(lp_counts)
        self._event = None
        if copy_stream is None or flat.device.type != "cuda":
            self._host = flat
            return
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        copy_stream.wait_stream(torch.cuda.current_stream(flat.device))
        with torch.cuda.stream(copy_stream):
            host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(copy_stream)
        flat.record_stream(copy_stream)         # the compute stream may not reuse it early
        self._host = host

    def result(self) -> tuple[list[int], list[TokenLogprobs], dict[str, PromptLogprobs]]:
        """Wait for the copy; ``(token_ids, logprobs, prompt_logprobs)``: the N sampled
        ids, one ``TokenLogprobs`` per entry of ``lp_rows`` in that order, and the
        ``{request_id: PromptLogprobs}`` of the prompt plan (empty without one)."""
        if self._event is not None:
            self._event.synchronize()
        host = self._host
        prompt: dict[str, PromptLogprobs] = {}
        if self._prompt_size:
            cut = host.shape[0] - self._prompt_size
            prompt = unpack_prompt_logprobs(host[cut:].numpy(), self._prompt_plan,
                                            self._vocab_size)
            host = host[:cut]
        tokens, logprobs = unflatten_tokens_and_logprobs(host.tolist(), self.num_tokens,
                                                      self._counts, self._k)
        if self._prompt_size and not self._counts:
            tokens = [int(t) for t in tokens]
        return tokens, logprobs, prompt
