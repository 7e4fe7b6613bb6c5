"""``GET /metrics`` scraped and parsed by ``prometheus_client``'s parser: the values match
what was sent (tokens, requests, latencies counted per request and token), the KV cache and
adapter signals match the engine, and ``lora_requests_info`` names the adapters in use."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import BASE, running_server

PROMPTS = [("The quick brown fox", "ad0"), ("SELECT name FROM users", "ad1"),
           ("The quick brown fox", "ad0"), ("Low-rank adaptation", None)]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of one scrape."""
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels) -> float:
    want = {"model_name": BASE, **labels} if name != "manylora:lora_requests_info" else labels
    return samples[(name, tuple(sorted(want.items())))]


@pytest.fixture(scope="module")
def metrics_server(base_dir, adapters):
    modules = [f"ad0={adapters['ad0']}", f"ad1={adapters['ad1']}"]
    with running_server(base_dir, lora_modules=modules) as (server, url):
        yield server, url


def test_metrics_match_what_was_sent(metrics_server):
    server, url = metrics_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    before = scrape(url)
    assert value(before, "manylora:prompt_tokens_total") == 0
    assert value(before, "manylora:lora_loads_total", tier="host") == 2   # --lora-modules
    usages = []
    for i, (prompt, name) in enumerate(PROMPTS):
        out = client.completions.create(model=name or BASE, prompt=prompt, max_tokens=5 + i,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        usages.append(out.usage)
    stream = client.completions.create(model="ad1", prompt="hello", max_tokens=3,
                                       stream=True, stream_options={"include_usage": True})
    usages.append(list(stream)[-1].usage)
    s = scrape(url)
    n = len(usages)
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    completion_tokens = sum(u.completion_tokens for u in usages)
    assert value(s, "manylora:prompt_tokens_total") == prompt_tokens
    assert value(s, "manylora:generation_tokens_total") == completion_tokens
    assert value(s, "manylora:request_success_total", finished_reason="length") == n
    assert value(s, "manylora:request_success_total", finished_reason="abort") == 0
    assert value(s, "manylora:time_to_first_token_seconds_count") == n
    assert value(s, "manylora:e2e_request_latency_seconds_count") == n
    assert value(s, "manylora:inter_token_latency_seconds_count") == completion_tokens - n
    assert value(s, "manylora:request_prompt_tokens_sum") == prompt_tokens
    assert value(s, "manylora:request_generation_tokens_sum") == completion_tokens
    assert value(s, "manylora:time_to_first_token_seconds_sum") > 0
    assert value(s, "manylora:num_requests_running") == 0
    assert value(s, "manylora:num_requests_waiting") == 0
    # the KV cache at rest: nothing used, every block cached or free
    kv = server.engine.snapshot().kv
    assert value(s, "manylora:kv_cache_usage_perc") == 0
    assert value(s, "manylora:kv_cache_blocks", state="used") == 0
    assert (value(s, "manylora:kv_cache_blocks", state="cached")
            + value(s, "manylora:kv_cache_blocks", state="free")) == kv.num_blocks
    # the third prompt repeats the first under the same adapter: a prefix hit
    assert value(s, "manylora:prefix_cache_hits_total") == kv.prefix_hits > 0
    assert value(s, "manylora:prefix_cache_queries_total") == kv.prefix_queries
    assert value(s, "manylora:prefix_cache_hit_rate") == pytest.approx(
        kv.prefix_hits / kv.prefix_queries)
    lora = server.engine.snapshot().lora
    assert value(s, "manylora:lora_cache_hits_total", tier="device") == lora.device_hits > 0
    assert value(s, "manylora:lora_loads_total", tier="device") == lora.device_misses > 0
    assert value(s, "manylora:lora_load_seconds_total", tier="host") == pytest.approx(
        lora.host_load_seconds)


def test_lora_requests_info_names_running_adapters(metrics_server):
    server, url = metrics_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model="ad1", prompt="hello", max_tokens=100,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(stream)
    s = scrape(url)
    info = [labels for (name, labels) in s if name == "manylora:lora_requests_info"]
    assert len(info) == 1
    labels = dict(info[0])
    assert labels == {"max_lora": "4", "running_lora_adapters": "ad1",
                      "waiting_lora_adapters": ""}
    assert value(s, "manylora:num_requests_running") == 1
    assert value(s, "manylora:kv_cache_usage_perc") > 0
    stream.close()
