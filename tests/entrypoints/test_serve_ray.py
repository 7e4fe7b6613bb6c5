"""``manylora serve-ray``'s application on a local Ray instance (4 CPUs, no dashboard): two
engine replicas of the tiny checkpoint behind Ray Serve's proxy on loopback, driven by the
official ``openai`` client.

References: transformers + peft greedy decoding on the same checkpoint and adapters; the
replica that served each request is read from the ``x-manylora-replica`` header, and the
metrics with prometheus_client's own parser.
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from server_helpers import BASE, engine_flags

from manylora.entrypoints.ray_serve import build_app
from manylora.testing import compare_greedy, hf_greedy_reference

APP = "manylora"
SERVED = [f"ad{i}" for i in range(6)]
PROMPTS = ["The quick brown fox", "SELECT name FROM users", "Low-rank adaptation adds",
           "A large language model", "def add(a, b):", "Once upon a time"]
MAX_TOKENS = 8
#: Seconds a replica killed by the test may take to be replaced (Ray Serve's health check,
#: a new actor, torch imported, the checkpoint read): a bound, not an expected time.
RESTART_BOUND_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_url(base_dir, adapters, lora_root):
    """The application with two engine replicas (each: 1 CPU, the engine core in the
    replica's process), ``ad0``..``ad5`` from start-up and run-time updates."""
    with pytest.MonkeyPatch.context() as mp:
        # inherited by the local cluster's processes: on a starved machine the proxy may
        # take longer than Ray Serve's 5 s readiness check to start (then it is killed and
        # serve.start fails)
        for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S",
                     "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
            mp.setenv(name, "60")
        yield from _serving(base_dir, adapters, lora_root)


def _serving(base_dir, adapters, lora_root):
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=80 * 2**20,
             runtime_env={"env_vars": {
                 "MANYLORA_ENABLE_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
                 # the router's queue-length probe of a replica: on two busy CI cores a
                 # replica computing on CPU may answer later than Ray Serve's 0.1 s, and an
                 # unanswered probe sends the request to another replica
                 "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "2",
                 "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "10"}})
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        argv = ["--model", str(base_dir), "--served-model-name", BASE, *engine_flags(),
                "--num-replicas", "2", "--cpus-per-replica", "1",
                "--enable-lora-runtime-updates", "--lora-root", str(lora_root),
                "--disable-log-stats",
                "--lora-modules", *(f"{n}={adapters[n]}" for n in SERVED)]
        serve.run(build_app(argv), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def client(ray_url):
    return openai.OpenAI(base_url=f"{ray_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _complete(client, model, prompt, **kw):
    raw = client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kw)
    return raw.parse(), raw.headers["x-manylora-replica"]


def _ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def test_adapters_and_base_equal_transformers_peft(client, base_dir, adapters):
    names = [*SERVED, None]
    prompts = [*PROMPTS, PROMPTS[0]]
    with ThreadPoolExecutor(len(names)) as pool:
        answers = list(pool.map(lambda a: _complete(client, a[0] or BASE, a[1]),
                                zip(names, prompts)))
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(base_dir)
    refs = hf_greedy_reference(base_dir, {n: adapters[n] for n in SERVED},
                               [tokenizer(p).input_ids for p in prompts], names, MAX_TOKENS)
    for name, (answer, _), ref in zip(names, answers, refs):
        ok, at = compare_greedy(_ids(answer.choices[0]), ref)
        assert ok, f"{name or 'base'} differs from peft at token {at}"
    # streamed: the same text, chunk by chunk, for an adapter and the base
    for name, (answer, _) in [(SERVED[2], answers[2]), (None, answers[-1])]:
        stream = client.completions.create(
            model=name or BASE, prompt=prompts[names.index(name)], max_tokens=MAX_TOKENS,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        chunks = [c.choices[0].text for c in stream if c.choices]
        assert len(chunks) > 1 and "".join(chunks) == answer.choices[0].text
    chat = client.chat.completions.create(
        model=SERVED[4], messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0.0, stream=True)
    assert [c for c in chat if c.choices and c.choices[0].finish_reason == "length"]


def test_each_adapter_keeps_to_one_replica(client):
    for name, prompt in zip(SERVED, PROMPTS):         # warm-up: each adapter placed once
        _complete(client, name, prompt)
    requests = [(name, prompt) for _ in range(10) for name, prompt in zip(SERVED, PROMPTS)]
    with ThreadPoolExecutor(6) as pool:
        served = list(pool.map(lambda r: (r[0], _complete(client, *r)[1]), requests))
    replicas = {name: Counter(r for n, r in served if n == name) for name in SERVED}
    for name, seen in replicas.items():
        top = seen.most_common(1)[0][1]
        assert top >= 0.9 * sum(seen.values()), f"{name} spread over {dict(seen)}"


def _replicas_seen(url: str, path: str, n: int = 8) -> set[str]:
    """The replicas that answered ``n`` GETs of ``path`` (routed by load), each a 200."""
    seen = set()
    with httpx.Client(base_url=url, timeout=60) as http:
        for _ in range(n):
            r = http.get(path)
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-manylora-replica"])
    return seen


def _served() -> dict[str, list[str]]:
    """The adapters each live replica's server answers to, as it reports them to the
    control replica."""
    return serve.get_deployment_handle("AdapterControl", APP).served.remote().result()


def test_runtime_load_and_unload_reach_every_replica(ray_url, client, adapters):
    with httpx.Client(base_url=ray_url, timeout=120) as http:
        r = http.post("/v1/load_lora_adapter",
                      json={"lora_name": "ad6", "lora_path": str(adapters["ad6"])})
        assert r.status_code == 200, r.text
        served = _served()
        assert len(served) == 2 and all("ad6" in names for names in served.values())
        answer, _ = _complete(client, "ad6", PROMPTS[0])
        assert answer.model == "ad6"
        # a bad load is answered by the replica that took it, and reaches no other
        r = http.post("/v1/load_lora_adapter",
                      json={"lora_name": "ad7", "lora_path": "/nonexistent/ad7"})
        assert r.status_code in (403, 404) and r.json()["error"]["param"] == "lora_path"
        assert not any("ad7" in names for names in _served().values())
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "ad6"})
        assert r.status_code == 200, r.text
        served = _served()
        assert len(served) == 2 and not any("ad6" in names for names in served.values())
        assert all(set(SERVED) <= set(names) for names in served.values())
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="ad6", prompt="x", max_tokens=1)


def test_metrics_carry_the_replica_label(ray_url, client):
    _, first = _complete(client, SERVED[0], PROMPTS[0])
    text = httpx.get(f"{ray_url}/metrics", timeout=60).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    live = families["manylora:serve_replicas"].samples[0].value
    assert live == 2
    prompt = families["manylora:prompt_tokens"].samples
    by_replica = {s.labels["replica"]: s.value for s in prompt if s.name.endswith("_total")}
    assert len(by_replica) == 2 and first in by_replica
    info = families["manylora:lora_requests_info"].samples
    assert {s.labels["replica"] for s in info} == set(by_replica)
    assert all("max_lora" in s.labels for s in info)


def _engine_replica_actors() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{APP}#EngineReplica#"))


def test_a_killed_replica_leaves_the_other_serving_and_comes_back(ray_url, client):
    before = _engine_replica_actors()
    assert len(before) == 2
    victim = before[0]
    victim_id = victim.rsplit("#", 1)[1]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    # every request is still answered: by the other replica, or retried on it
    for name, prompt in zip([*SERVED, BASE], [*PROMPTS, PROMPTS[0]]):
        answer, replica = _complete(client, name, prompt)
        assert answer.choices[0].finish_reason == "length" and replica != victim_id
    deadline = time.monotonic() + RESTART_BOUND_S
    while time.monotonic() < deadline:
        after = _engine_replica_actors()
        if len(after) == 2 and victim not in after:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the killed replica was not replaced within {RESTART_BOUND_S} s")
    serve_status = serve.status().applications[APP]
    while time.monotonic() < deadline and serve_status.status != "RUNNING":
        time.sleep(1)
        serve_status = serve.status().applications[APP]
    assert serve_status.status == "RUNNING"
    newcomer = (set(after) - set(before)).pop().rsplit("#", 1)[1]
    while time.monotonic() < deadline and newcomer not in _served():
        time.sleep(1)
    assert set(SERVED) <= set(_served()[newcomer])     # its server is up, with the adapters
    seen: set[str] = set()
    while time.monotonic() < deadline and newcomer not in seen:
        seen |= _replicas_seen(ray_url, "/v1/models")
    assert newcomer in seen
    answer, _ = _complete(client, SERVED[1], PROMPTS[1])
    assert answer.choices[0].finish_reason == "length"
