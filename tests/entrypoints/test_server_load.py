"""A bounded load test: 200 concurrent streaming requests over 8 adapters through the
``openai`` client, a quarter of the clients disconnecting mid-stream. Every other request
completes in full, and afterwards no request is left running or waiting and every KV block
is free or cached."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import BASE, hold_steps, running_server

NUM_REQUESTS = 200
MAX_TOKENS = 32


def test_200_streams_8_adapters_quarter_disconnect(base_dir, adapters):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    with running_server(base_dir, lora_modules=modules, max_loras=8,
                        max_num_seqs=256) as (server, url):
        results = asyncio.run(_load(url, list(adapters)))
        completed = [r for r in results if r is not None]
        assert len(completed) == NUM_REQUESTS - NUM_REQUESTS // 4
        for finish, _, usage in completed:
            assert finish == "length"
            assert usage.completion_tokens == MAX_TOKENS
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            snap = server.engine.snapshot()
            if snap.num_running == snap.num_waiting == snap.kv.used_blocks == 0:
                break
            time.sleep(0.05)
        snap = server.engine.snapshot()
        assert snap.num_running == snap.num_waiting == 0
        assert snap.kv.used_blocks == 0
        assert snap.kv.cached_blocks + snap.kv.free_blocks == snap.kv.num_blocks
        assert not server.engine.engine.has_unfinished_requests()
        assert server.engine.engine.engine_core.lora_manager._refs == {}
        ended = {s.labels["finished_reason"]: s.value for f in
                 text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
                 for s in f.samples if s.name == "manylora:request_success_total"
                 and s.labels["model_name"] == BASE}
        # a client that left after its third chunk may still have been finished by the
        # engine before the disconnect reached it: it then counts as "length"
        assert 0 < ended["abort"] <= NUM_REQUESTS // 4
        assert ended["abort"] + ended["length"] == NUM_REQUESTS


async def _load(url: str, names: list[str]):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                timeout=120,
                                http_client=httpx.AsyncClient(
                                    limits=httpx.Limits(max_connections=NUM_REQUESTS + 8)))

    async def one(i: int):
        stream = await client.completions.create(
            model=names[i % len(names)], prompt=f"request {i}: the quick brown fox",
            max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if i % 4 == 3 and len(chunks) == 3:      # a quarter disconnect mid-stream
                await stream.close()
                return None
        finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
        return finish, len(chunks), chunks[-1].usage

    try:
        return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
    finally:
        await client.close()


def test_non_streamed_request_aborted_when_client_leaves(base_dir):
    with running_server(base_dir) as (server, url):
        engine = server.engine.engine.engine_core
        hold_steps(engine)        # the request runs one step, then can only end by an abort
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", timeout=0.5, json={
                "model": BASE, "prompt": "The quick", "max_tokens": 100, "ignore_eos": True})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            snap = server.engine.snapshot()
            if snap.num_running == snap.num_waiting == snap.kv.used_blocks == 0:
                break
            time.sleep(0.05)
        assert not engine.has_unfinished_requests()
        snap = server.engine.snapshot()
        assert snap.num_running == snap.num_waiting == snap.kv.used_blocks == 0
        text = httpx.get(f"{url}/metrics").text
        aborted = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "manylora:request_success_total"
                   and s.labels["finished_reason"] == "abort"]
        assert aborted == [1]
