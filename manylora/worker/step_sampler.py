"""Rank 0's sampling of a step whose logits are launched, and the way of its tokens back to
the host: the grammar bitmask, the logits processors, the sampler, the seeded generators,
and the copy of the tokens (and log-probabilities) on a side stream (``AsyncSampledOutput``).
Nothing here waits for the device until ``StepSampler.read``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from manylora.ops.token_bitmask import apply_token_bitmask_
from manylora.sample.generators import make_generator
from manylora.sample.penalties import penalize_logits
from manylora.sample.sampler import SampledTokens, Sampler, SamplingTensors, flag_empty_rows
from manylora.worker.async_output import AsyncSampledOutput
from manylora.worker.input_batch import SampleInfo


class ForwardStep(NamedTuple):
    """A step whose forward pass and logits are launched and whose sampling is not.

    Attributes:
        info: the host facts of its sampled rows.
        logits: float32 ``[N, V]`` on the device, the sampled rows' logits; None when no
            row samples (a prefill chunk that only computes prompt log-probabilities).
        views: the device views of the step's buffer (the sampling columns).
        prompt: float64, the flattened prompt log-probabilities of the step's prompt rows
            (``ModelRunner.prompt_logprobs``), None when no row asks.
    """

    info: SampleInfo
    logits: torch.Tensor | None
    views: dict
    prompt: torch.Tensor | None = None


class LaunchedStep(NamedTuple):
    """A step on the device whose sampled tokens have not been read yet.

    Attributes:
        info: the host facts of its sampled rows.
        output: its tokens (and log-probabilities) on their way to the host.
    """

    info: SampleInfo
    output: AsyncSampledOutput


class StepSampler:
    """Samples steps on ``device`` over a vocabulary of ``vocab_size``.

    Attributes:
        prev_sampled: int64 ``[N]`` on the device, the last sampled step's tokens (the next
            step gathers its decode tokens still on the device from them, and the
            penalties count them); None before the first.
    """

    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self.prev_sampled: torch.Tensor | None = None
        self._generators: dict[str, torch.Generator] = {}
        self._bitmask_dev: torch.Tensor | None = None
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def sample(self, step: ForwardStep, bitmask: torch.Tensor | None,
               seed_of: Callable[[str], int | None],
               on_sampled: Callable[[torch.Tensor], None] | None = None) -> LaunchedStep:
        """Sample ``step`` and start the copy of its tokens (and log-probabilities) to the
        host (``ModelRunner.sample``, which says the order of the masks). ``seed_of`` gives
        a seeded request's seed (its generator is made on first use); ``on_sampled`` is
        called with the sampled tokens right after sampling."""
        info, logits, views, prompt = step
        if logits is None:
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            return LaunchedStep(info, AsyncSampledOutput(
                empty, empty, [], [], self._copy_stream, prompt, info.prompt, self.vocab_size))
        if bitmask is not None:
            apply_token_bitmask_(logits, self._bitmask_on_device(bitmask))
        top_k = views["top_k"] if info.all_greedy else views["top_k"].long()
        tensors = SamplingTensors(views["temperature"], top_k, views["top_p"], views["min_p"],
                                  info.all_greedy, info.all_random, info.do_top_k,
                                  info.do_top_p, info.do_min_p)
        generators = {i: self._generator(info.req_ids[i], seed_of) for i in info.seeded}
        sample_logits = logits
        if info.penalties is not None:
            sample_logits = penalize_logits(logits, info.penalties, self.prev_sampled)
        sampled = self.sampler.sample(sample_logits, tensors, generators)
        if on_sampled is not None:
            on_sampled(sampled)
        self.prev_sampled = sampled
        reported = None if bitmask is None else flag_empty_rows(sampled, sample_logits)
        return LaunchedStep(info, AsyncSampledOutput(
            sampled, logits, [i for i, _ in info.logprobs], [k for _, k in info.logprobs],
            self._copy_stream, prompt, info.prompt, self.vocab_size, reported))

    @staticmethod
    def read(step: LaunchedStep) -> tuple[list[int], SampledTokens]:
        """Wait for a launched step's tokens: ``(tokens, sampled)``, ``tokens[i]`` the token
        of ``step.info.req_ids[i]`` and ``sampled`` as ``ModelRunner.get_output`` returns
        it. A masked row whose masks allowed no token is named in ``no_token``, its token
        the one ``flag_empty_rows`` reported."""
        info, output = step
        tokens, logprobs, prompt = output.result()
        no_token = frozenset()
        if info.masked is not None:
            empty = [i for i in info.masked.tolist() if tokens[i] < 0]
            if empty:
                tokens = list(tokens)
                for i in empty:
                    tokens[i] = -1 - tokens[i]
                no_token = frozenset(info.req_ids[i] for i in empty)
        return tokens, SampledTokens(
            dict(zip(info.req_ids, tokens)),
            {info.req_ids[i]: lp for i, lp in zip(output.lp_rows, logprobs)},
            prompt, no_token)

    def release(self, request_ids: list[str]) -> None:
        """Drop the seeded generators of finished requests."""
        for rid in request_ids:
            self._generators.pop(rid, None)

    def _generator(self, req_id: str, seed_of: Callable[[str], int | None]
                   ) -> torch.Generator:
        gen = self._generators.get(req_id)
        if gen is None:
            gen = make_generator(seed_of(req_id), self.device)
            self._generators[req_id] = gen
        return gen

    def _bitmask_on_device(self, bitmask: torch.Tensor) -> torch.Tensor:
        """``bitmask`` on the logits' device: one non-blocking copy into a persistent device
        buffer (grown by doubling). The host buffer is refilled only after this step's
        tokens were read, so after this copy ran."""
        if self.device.type == "cpu":
            return bitmask
        k, width = bitmask.shape
        dev = self._bitmask_dev
        if dev is None or dev.shape[0] < k or dev.shape[1] != width:
            rows = max(k, 2 * (0 if dev is None else dev.shape[0]), 16)
            dev = self._bitmask_dev = torch.empty((rows, width), dtype=torch.int32,
                                                  device=self.device)
        dev[:k].copy_(bitmask, non_blocking=True)
        return dev[:k]
