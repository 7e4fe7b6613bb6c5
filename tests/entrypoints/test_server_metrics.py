"""``GET /metrics`` scraped and parsed by ``prometheus_client``'s parser: the values match
what was sent (tokens, requests, latencies counted per request and token, per adapter), the
KV cache and adapter signals match the engine, ``lora_requests_info`` names the adapters in
use, every series vLLM's own Grafana dashboard queries exists under vLLM's name and labels,
and every query of the shipped dashboard (``examples/grafana/manylora.json``) resolves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import BASE, running_server

ROOT = Path(__file__).resolve().parents[2]
VLLM_GRAFANA_NAMES = ROOT / "tests" / "metrics" / "data" / "vllm_grafana_metric_names.txt"
DASHBOARD = ROOT / "examples" / "grafana" / "manylora.json"
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
    # vLLM's names: the same values, with vLLM's engine label
    for ours, theirs in (("prompt_tokens_total", "prompt_tokens_total"),
                         ("generation_tokens_total", "generation_tokens_total"),
                         ("time_to_first_token_seconds_count",) * 2,
                         ("e2e_request_latency_seconds_sum",) * 2,
                         ("inter_token_latency_seconds_count",
                          "time_per_output_token_seconds_count"),
                         ("inter_token_latency_seconds_count",) * 2,
                         ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
                         ("prefix_cache_hits_total",) * 2, ("num_requests_running",) * 2):
        assert value(s, "vllm:" + theirs, engine="0") == value(s, "manylora:" + ours), theirs
    assert value(s, "vllm:request_success_total", engine="0", finished_reason="length") == n
    # the request phases: one observation each per request; queue + prefill + decode is
    # the end-to-end latency (all measured on the same monotonic clock)
    phases = 0.0
    for phase in ("queue", "prefill", "decode"):
        assert value(s, f"vllm:request_{phase}_time_seconds_count", engine="0") == n
        phases += value(s, f"manylora:request_{phase}_time_seconds_sum")
    assert value(s, "manylora:request_prefill_time_seconds_sum") > 0
    assert value(s, "manylora:request_decode_time_seconds_sum") > 0
    assert phases == pytest.approx(value(s, "manylora:e2e_request_latency_seconds_sum"),
                                   rel=1e-6)
    assert value(s, "vllm:request_time_per_output_token_seconds_count", engine="0") == sum(
        u.completion_tokens > 1 for u in usages)
    assert value(s, "vllm:request_max_num_generation_tokens_sum", engine="0") \
        == completion_tokens
    assert value(s, "vllm:request_params_max_tokens_sum", engine="0") == sum(
        5 + i for i in range(len(PROMPTS))) + 3
    info = [labels for (name, labels) in s if name == "vllm:cache_config_info"]
    assert len(info) == 1 and dict(info[0])["num_gpu_blocks"] == str(kv.num_blocks)
    # per adapter: the base model's requests have no lora_name series
    for name in ("ad0", "ad1"):
        mine = [u for u, (_, a) in zip(usages, [*PROMPTS, ("hello", "ad1")]) if a == name]
        assert value(s, "manylora:lora_request_success_total", lora_name=name,
                     finished_reason="length") == len(mine)
        assert value(s, "manylora:lora_prompt_tokens_total", lora_name=name) == sum(
            u.prompt_tokens for u in mine)
        assert value(s, "manylora:lora_generation_tokens_total", lora_name=name) == sum(
            u.completion_tokens for u in mine)
        assert value(s, "manylora:lora_time_to_first_token_seconds_count",
                     lora_name=name) == len(mine)
    assert {dict(labels)["lora_name"] for (name, labels) in s
            if name == "manylora:lora_prompt_tokens_total"} == {"ad0", "ad1"}


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


def test_vllm_grafana_dashboard_names_exist(metrics_server):
    """Every series vLLM's Grafana dashboard queries exists, with ``model_name``."""
    _, url = metrics_server
    wanted = [line.strip() for line in VLLM_GRAFANA_NAMES.read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert len(wanted) >= 15
    text = httpx.get(f"{url}/metrics").text
    have = {(s.name, s.labels.get("model_name")) for family in
            text_string_to_metric_families(text) for s in family.samples}
    missing = [name for name in wanted if (name, BASE) not in have]
    assert not missing


#: A series name in PromQL (``vllm:`` or ``manylora:``), then its label matchers, if any.
SELECTOR = re.compile(r"\b((?:manylora|vllm):[A-Za-z0-9_:]+)(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*=~?\s*"([^"]*)"')


def dashboard_selectors(dashboard: dict) -> list[tuple[str, dict[str, str]]]:
    """``(sample name, {label: value})`` of every series selector in every panel's
    queries; matchers on Grafana variables (``$model_name``) are left out."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for name, matchers in SELECTOR.findall(target["expr"]):
                out.append((name, {k: v for k, v in MATCHER.findall(matchers)
                                   if "$" not in v}))
    return out


def test_shipped_dashboard_queries_resolve(metrics_server):
    """Every series each panel of ``examples/grafana/manylora.json`` queries exists on a
    live server, with the label values its matchers name; the panels cover throughput,
    latency, KV and adapter caches, slot loads and per-adapter traffic."""
    _, url = metrics_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    client.completions.create(model="ad0", prompt="hi", max_tokens=2)
    dashboard = json.loads(DASHBOARD.read_text())
    selectors = dashboard_selectors(dashboard)
    text = httpx.get(f"{url}/metrics").text
    samples = [(s.name, s.labels) for family in text_string_to_metric_families(text)
               for s in family.samples]
    for name, matchers in selectors:
        assert any(n == name and all(labels.get(k) == v for k, v in matchers.items())
                   for n, labels in samples), (name, matchers)
    names = {name for name, _ in selectors}
    for needed in ("manylora:generation_tokens_total",
                   "manylora:time_to_first_token_seconds_bucket",
                   "manylora:inter_token_latency_seconds_bucket",
                   "manylora:e2e_request_latency_seconds_bucket",
                   "manylora:kv_cache_usage_perc", "manylora:lora_cache_hits_total",
                   "manylora:lora_loads_total", "manylora:lora_request_success_total",
                   "manylora:lora_time_to_first_token_seconds_bucket"):
        assert needed in names, needed
    variable = dashboard["templating"]["list"][1]["query"]["query"]
    assert any(n == SELECTOR.search(variable).group(1) and labels.get("model_name") == BASE
               for n, labels in samples)


def test_request_phases_cross_the_engine_process(served, client):
    """With the engine core in a process of its own (``manylora serve``'s way), the time
    the scheduler first ran each request reaches the front: prefill time is counted, and
    the phases add up to the end-to-end latency."""
    _, url = served
    for prompt in ("one two three", "four five"):
        client.completions.create(model=BASE, prompt=prompt, max_tokens=3)
    s = scrape(url)
    assert value(s, "manylora:request_prefill_time_seconds_count") == 2
    assert value(s, "manylora:request_prefill_time_seconds_sum") > 0
    phases = sum(value(s, f"manylora:request_{p}_time_seconds_sum")
                 for p in ("queue", "prefill", "decode"))
    assert phases == pytest.approx(value(s, "manylora:e2e_request_latency_seconds_sum"),
                                   rel=1e-6)


def test_metric_flags_choose_names_and_bound_adapter_labels(base_dir, adapters):
    """``--metrics-names manylora`` leaves vLLM's names out; ``--max-lora-metric-labels 1``
    gives the first adapter its own series and counts the next under ``"other"``."""
    modules = [f"ad0={adapters['ad0']}", f"ad1={adapters['ad1']}"]
    with running_server(base_dir, "--metrics-names", "manylora", "--max-lora-metric-labels",
                        "1", lora_modules=modules) as (_, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        for name in ("ad0", "ad1", "ad1"):
            client.completions.create(model=name, prompt="hi", max_tokens=2)
        s = scrape(url)
    assert not [name for name, _ in s if name.startswith("vllm:")]
    counts = {dict(labels)["lora_name"]: v for (name, labels), v in s.items()
              if name == "manylora:lora_time_to_first_token_seconds_count"}
    assert counts == {"ad0": 1, "other": 2}
