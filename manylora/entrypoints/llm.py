"""``LLM``: the offline API, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from manylora.engine.arg_utils import EngineArgs
from manylora.engine.llm_engine import LLMEngine, SubmittedRequest
from manylora.engine.outputs import RequestOutput
from manylora.lora_request import LoRARequest
from manylora.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | dict


class LLM:
    """Generate with one base model and many LoRA adapters, batched together.

    Takes the keyword arguments of ``EngineArgs`` (``model``, ``dtype``, ``device``,
    ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``num_kv_blocks``, ...).

    Raises:
        CheckpointError: a missing or corrupt checkpoint.
        ValueError: an unsupported architecture or an invalid setting.
        FileNotFoundError: ``model`` is neither a directory nor a cached hub repo.
    """

    def __init__(self, model: str, **kwargs) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._calls = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | None | Sequence[LoRARequest | None] = None,
                 use_tqdm: bool = True,
                 session_id: str | None | Sequence[str | None] = None) -> list[RequestOutput]:
        """Generate for every prompt; the outputs in prompt order.

        Args:
            prompts: strings or ``{"prompt_token_ids": [...]}``, one or a list.
            sampling_params: one for all prompts or one per prompt (default: SamplingParams()).
            lora_request: one (or None, the base model) for all prompts, or one per prompt.
            use_tqdm: show a progress bar.
            session_id: the multi-turn session each prompt is the next turn of (None: no
                session), one for all prompts or one per prompt; a session takes one turn
                per call. The prompt holds only the new turn; see
                ``LLMEngine.add_request``.

        The call's requests form one client group for the scheduler's fair sharing
        (``scheduling_policy``): alone, they may take the whole batch.

        Raises:
            ValueError: a list argument whose length differs from the prompts', or any bad
                prompt, sampling parameter or adapter. Nothing of the call is left queued.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        n = len(prompts)
        params = _per_prompt(SamplingParams() if sampling_params is None else sampling_params,
                             n, "sampling_params")
        loras = _per_prompt(lora_request, n, "lora_request")
        sessions = _per_prompt(session_id, n, "session_id")
        engine = self.llm_engine
        final: dict[int, SamplingParams] = {}      # each request reports only its end
        for p in params:
            if id(p) not in final:
                final[id(p)] = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
        # one message: the core takes every request in before its first step
        group = f"generate-{next(self._calls)}"
        ids = engine.submit_requests([
            SubmittedRequest(None, prompt, final[id(p)], lora, sid, client_group=group)
            for prompt, p, lora, sid in zip(prompts, params, loras, sessions)])
        try:
            errors = [e for e in engine.wait_added(ids).values() if e is not None]
            if errors:
                raise errors[0]
        except BaseException:
            engine.abort_request(ids)
            raise
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=n, desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(done) < n:
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

    def end_session(self, session_id: str) -> bool:
        """Free what a multi-turn session holds (``LLMEngine.end_session``)."""
        return self.llm_engine.end_session(session_id)


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
