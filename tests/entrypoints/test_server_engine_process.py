"""``manylora serve`` with its engine core in a process of its own: a core that dies ends
every open stream with an error event, and ``/health`` turns unhealthy (503)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
from server_helpers import BASE, running_server

NUM_STREAMS = 3


def test_killed_engine_process_ends_open_streams_and_health_fails(base_dir):
    with running_server(base_dir, engine_process=True, max_model_len=256) as (server, url):
        assert httpx.get(f"{url}/health").status_code == 200
        core = server.engine.engine.client
        assert core.pid != os.getpid()
        errors = asyncio.run(_kill_with_open_streams(url, server, core.pid))
        assert len(errors) == NUM_STREAMS
        for error in errors:
            assert "engine" in error.lower(), error
        assert httpx.get(f"{url}/health").status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"model": BASE, "prompt": "Hi"})
        assert r.status_code == 503


async def _kill_with_open_streams(url: str, server, pid: int) -> list[str]:
    """Open streams, freeze the core (SIGSTOP) once each sent its first chunk, check that
    they are still unfinished in the front, then SIGKILL the core; each stream's error."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    front = server.engine.engine
    try:
        streams = [await client.completions.create(
            model=BASE, prompt="The quick", max_tokens=240, stream=True,
            extra_body={"ignore_eos": True}) for _ in range(NUM_STREAMS)]
        for stream in streams:
            first = await stream.__anext__()
            assert first.choices[0].finish_reason is None
        os.kill(pid, signal.SIGSTOP)
        # what the core sent before it froze reaches the front; 240 tokens take far longer
        # than the few steps that can have run since the first chunks
        await asyncio.sleep(0.5)
        assert front.has_unfinished_requests()
        os.kill(pid, signal.SIGKILL)
        errors = []
        for stream in streams:
            finish = None
            try:
                async for chunk in stream:
                    finish = chunk.choices[0].finish_reason if chunk.choices else finish
            except openai.APIError as e:
                errors.append(str(e))
            assert finish is None          # the stream never completed
        deadline = time.monotonic() + 30
        while server.engine.is_running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return errors
    finally:
        await client.close()
