"""``manylora demo``: a server over the demo checkpoint and its adapters, asked by the
official ``openai`` client; every greedy answer checked against transformers + peft."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DEMO_PROMPTS = [
    ("SELECT the names of users who", "sql"),
    ("Write a short greeting for a new customer:", "chat"),
    ("def fibonacci(n):", "code"),
    ("What is seven times six?", "math"),
    ("The quick brown fox", None),
    ("Low-rank adaptation adds a small update", "chat"),
    ("SELECT count(*) FROM orders WHERE", "sql"),
    ("A large language model reads a prompt", None),
]
BASE_NAME = "demo-base"


def run_demo(cache_dir: str, device: str, max_tokens: int) -> int:
    """Build the demo set (once, under ``cache_dir``), serve it on a free loopback port,
    send the demo prompts at once through the ``openai`` client, print each answer under
    its adapter, stream one chat answer, and compare every completion with transformers +
    peft. 0 when all agree, 1 otherwise."""
    import openai

    from manylora.entrypoints.openai.launcher import ServerThread, create_server, serve_parser
    from manylora.testing import compare_greedy, hf_greedy_reference, make_demo_set

    demo = make_demo_set(Path(cache_dir))
    print(f"base model: {demo.base_dir}")
    args = serve_parser().parse_args(
        ["--model", str(demo.base_dir), "--served-model-name", BASE_NAME, "--dtype", "float32",
         "--device", device, "--max-loras", "4", "--max-lora-rank", "64", "--lora-modules",
         *(f"{name}={path}" for name, path in demo.adapters.items())])
    server = create_server(args)
    try:
        with ServerThread(server.app) as http:
            print(f"manylora serve on {http.url}")
            client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="demo")
            print("models:", ", ".join(
                f"{m.id}" + (f" (adapter of {m.parent})" if getattr(m, "parent", None) else "")
                for m in client.models.list().data))

            def ask(item):
                text, name = item
                return client.completions.create(
                    model=name or BASE_NAME, prompt=text, max_tokens=max_tokens,
                    temperature=0.0, logprobs=0,
                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})

            start = time.perf_counter()
            with ThreadPoolExecutor(len(DEMO_PROMPTS)) as pool:
                answers = list(pool.map(ask, DEMO_PROMPTS))
            seconds = time.perf_counter() - start
            stream = client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=max_tokens, temperature=0.0, stream=True)
            chat_text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        server.shutdown()
    tok = server.engine.tokenizer
    names = [n for _, n in DEMO_PROMPTS]
    refs = hf_greedy_reference(demo.base_dir, demo.adapters,
                               [tok(t).input_ids for t, _ in DEMO_PROMPTS], names, max_tokens)
    agree = []
    for (text, name), answer, ref in zip(DEMO_PROMPTS, answers, refs):
        choice = answer.choices[0]
        ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
        ok, _ = compare_greedy(ids, ref)
        agree.append(ok)
        print(f"{name or 'base':>5} | {'agrees' if ok else 'DIFFERS'} | {text!r} -> "
              f"{choice.text!r}")
    print(f" chat | streamed | 'Say hello.' -> {chat_text!r}")
    n_tokens = sum(a.usage.completion_tokens for a in answers)
    print(f"{len(answers)} concurrent requests over {len(set(n for n in names if n))} adapters "
          f"+ base: {n_tokens} tokens in {seconds:.2f} s")
    print("every answer agrees with transformers + peft" if all(agree) else
          f"{agree.count(False)} answers differ from transformers + peft")
    return 0 if all(agree) else 1
