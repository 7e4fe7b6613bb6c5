"""vLLM's ``serve`` front-end flags on a real server: ``--served-model-name`` aliases, CORS
(Starlette's middleware: preflights from allowed and refused origins), TLS (uvicorn's, with a
self-signed certificate made by the ``openssl`` CLI and the ``openai`` client trusting it),
``--root-path`` (the OpenAPI document's server and ``/docs``; routes served, the API key
still wanted under the prefix), the request log (``--enable-log-requests``, off by default)
and the stats log line, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` and the flags' errors."""

from __future__ import annotations

import contextlib
import logging
import shutil
import ssl
import subprocess

import httpx
import openai
import pytest
from server_helpers import BASE, engine_flags, running_server

from manylora.engine.stats import EngineSnapshot, IterationStats
from manylora.entrypoints.openai.frontend_args import env_true, uvicorn_tls_options
from manylora.entrypoints.openai.launcher import ServerThread, create_server
from manylora.entrypoints.openai.serve_args import serve_parser
from manylora.metrics.log_stats import LoggingStatLogger
from manylora.scheduler.kv_cache_manager import KVCacheStats


def test_served_model_name_aliases(base_dir):
    with running_server(base_dir, "--served-model-name", BASE, "alias-b") as (_, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == [BASE, "alias-b"]
        assert client.models.retrieve("alias-b").root == str(base_dir)
        by_alias = client.completions.create(model="alias-b", prompt="hi", max_tokens=3,
                                             temperature=0.0)
        by_name = client.completions.create(model=BASE, prompt="hi", max_tokens=3,
                                            temperature=0.0)
        assert by_alias.model == BASE                     # reported by its first name
        assert by_alias.choices[0].text == by_name.choices[0].text
        chat = client.chat.completions.create(
            model="alias-b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.model == BASE
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="alias-c", prompt="hi", max_tokens=1)


def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(f"{url}/v1/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_allowed_and_refused_origins(base_dir):
    with running_server(base_dir, "--allowed-origins", "https://good.example",
                        '["https://also.example"]', "--api-key", "k") as (_, url):
        ok = _preflight(url, "https://good.example")
        assert ok.status_code == 200        # answered before the API key is asked for
        assert ok.headers["access-control-allow-origin"] == "https://good.example"
        assert "POST" in ok.headers["access-control-allow-methods"]
        assert _preflight(url, "https://also.example").status_code == 200
        refused = _preflight(url, "https://evil.example")
        assert refused.status_code == 400
        assert "access-control-allow-origin" not in refused.headers
        # a real cross-origin request: the header on the answer, errors included
        r = httpx.get(f"{url}/v1/models", headers={"Origin": "https://good.example",
                                                   "Authorization": "Bearer k"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://good.example"
        r = httpx.get(f"{url}/v1/models", headers={"Origin": "https://good.example"})
        assert r.status_code == 401
        assert r.headers["access-control-allow-origin"] == "https://good.example"
        r = httpx.get(f"{url}/v1/models", headers={"Origin": "https://evil.example",
                                                   "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in r.headers
    with running_server(base_dir) as (_, url):        # vLLM's default: any origin
        r = _preflight(url, "https://anywhere.example")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_with_a_self_signed_certificate(base_dir, tmp_path, monkeypatch):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    monkeypatch.setenv("MANYLORA_ENABLE_MULTIPROCESSING", "0")
    args = serve_parser().parse_args(["--model", str(base_dir), "--served-model-name", BASE,
                                      *engine_flags(), "--ssl-keyfile", str(key),
                                      "--ssl-certfile", str(cert)])
    server = create_server(args)
    try:
        with ServerThread(server.app, tls=uvicorn_tls_options(args)) as http:
            assert http.url.startswith("https://")
            client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="x", max_retries=0,
                                   http_client=httpx.Client(verify=ssl.create_default_context(
                                       cafile=str(cert))))
            out = client.completions.create(model=BASE, prompt="hi", max_tokens=2)
            assert out.choices[0].text is not None
            with pytest.raises(httpx.ConnectError):          # not trusted without the CA
                httpx.get(f"{http.url}/health")
            with pytest.raises(httpx.HTTPError):             # no plain HTTP on the port
                httpx.get(http.url.replace("https://", "http://") + "/health")
    finally:
        server.shutdown()


def test_root_path(base_dir):
    with running_server(base_dir, "--root-path", "/api", "--api-key", "k") as (_, url):
        doc = httpx.get(f"{url}/openapi.json").json()
        assert doc["servers"] == [{"url": "/api"}]
        assert "/api/openapi.json" in httpx.get(f"{url}/docs").text
        key = {"Authorization": "Bearer k"}
        # a proxy that strips the prefix, and one that does not: both served
        assert httpx.get(f"{url}/v1/models", headers=key).status_code == 200
        assert httpx.get(f"{url}/api/v1/models", headers=key).status_code == 200
        # the key is wanted under the prefix too
        assert httpx.get(f"{url}/api/v1/models").status_code == 401
        assert httpx.post(f"{url}/api/tokenize", json={"prompt": "hi"}).status_code == 401
        assert httpx.get(f"{url}/api/health").status_code == 200


def _completion(url: str, prompt: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": BASE, "prompt": prompt,
                                                  "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text


def test_request_log_line(base_dir, caplog):
    caplog.set_level(logging.INFO, logger="manylora.requests")
    with running_server(base_dir) as (_, url):
        _completion(url, "quiet prompt")
    assert not [r for r in caplog.records if r.name == "manylora.requests"]
    with running_server(base_dir, "--enable-log-requests") as (_, url):
        _completion(url, "logged prompt")
    lines = [r.getMessage() for r in caplog.records if r.name == "manylora.requests"]
    assert len(lines) == 1 and lines[0].startswith("Received request ")
    assert "'logged prompt'" in lines[0] and "lora_request: None" in lines[0]
    caplog.clear()
    with running_server(base_dir, "--enable-log-requests", "--max-log-len",
                        "3") as (_, url):
        _completion(url, "truncated prompt")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "manylora.requests"]
    assert "prompt: 'tru'," in line
    with running_server(base_dir, "--enable-log-requests", "--disable-log-requests"):
        pass                                    # vLLM's older flag is accepted (and wins)


def test_stats_log_line(base_dir, caplog):
    caplog.set_level(logging.INFO, logger="manylora.stats")
    now = [100.0]
    snap = [EngineSnapshot(kv=KVCacheStats(num_blocks=200, used_blocks=50, prefix_queries=10,
                                           prefix_hits=5))]
    stat_logger = LoggingStatLogger(lambda: snap[0], interval=10.0, clock=lambda: now[0])
    now[0] = 105.0
    stat_logger.record(IterationStats(num_prompt_tokens=40, num_generation_tokens=10))
    assert not caplog.records                           # the interval has not passed
    now[0] = 120.0
    snap[0] = EngineSnapshot(num_running=3, num_waiting=2, kv=KVCacheStats(
        num_blocks=200, used_blocks=50, prefix_queries=110, prefix_hits=30))
    stat_logger.record(IterationStats(num_prompt_tokens=60, num_generation_tokens=30))
    (line,) = [r.getMessage() for r in caplog.records]
    # 100 prompt and 40 generated tokens in 20 s; 25 of 100 looked-up tokens hit
    assert line == ("Avg prompt throughput: 5.0 tokens/s, Avg generation throughput: 2.0 "
                    "tokens/s, Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 25.0%")
    with _built(base_dir, "--disable-log-stats") as server:
        assert not any(isinstance(s, LoggingStatLogger) for s in server.engine.stat_loggers)
    with _built(base_dir) as server:
        assert any(isinstance(s, LoggingStatLogger) for s in server.engine.stat_loggers)


@contextlib.contextmanager
def _built(base_dir, *extra: str):
    """``create_server`` alone (no HTTP), its engine in this process."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MANYLORA_ENABLE_MULTIPROCESSING", "0")
        server = create_server(serve_parser().parse_args(
            ["--model", str(base_dir), *engine_flags(), *extra]))
    try:
        yield server
    finally:
        server.shutdown()


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), (" TRUE ", True),
                                       ("True", True), ("0", False), ("false", False),
                                       ("yes", False), ("", False)])
def test_env_truth_values(value, on):
    assert env_true("VLLM_ALLOW_RUNTIME_LORA_UPDATING", {"VLLM_ALLOW_RUNTIME_LORA_UPDATING":
                                                         value}) is on
    assert env_true("VLLM_ALLOW_RUNTIME_LORA_UPDATING", {}) is False


def test_runtime_updates_env_alias(base_dir, lora_root, adapters, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    with running_server(base_dir, "--lora-root", str(lora_root)) as (_, url):
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "e",
                                                            "lora_path": "ad0"}, timeout=60)
        assert r.status_code == 200, r.text
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    with running_server(base_dir, "--lora-root", str(lora_root)) as (_, url):
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "e",
                                                            "lora_path": "ad0"})
        assert r.status_code == 404


def test_vllm_resolver_env_alias(base_dir, lora_root, adapters, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "other, lora_filesystem_resolver")
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(lora_root))
    with running_server(base_dir) as (_, url):
        r = httpx.post(f"{url}/v1/completions", json={"model": "ad1", "prompt": "hi",
                                                      "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("flags, env, match", [
    (["--ssl-keyfile", "k.pem"], {}, "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-cert-reqs", "7"], {}, "--ssl-cert-reqs must be 0, 1 or 2"),
    (["--root-path", "api"], {}, "--root-path 'api' must start with '/'"),
    (["--root-path", "/api/"], {}, "not end with one"),
    (["--max-log-len", "-1"], {}, "--max-log-len must be ≥ 0"),
    (["--allowed-origins", "[1]"], {}, "not a JSON list of strings"),
    (["--enable-lora-resolver", "--lora-root", "."], {}, "the LoRA resolver needs runtime"),
    (["--enable-lora-runtime-updates"], {"VLLM_PLUGINS": "lora_filesystem_resolver"},
     "VLLM_LORA_RESOLVER_CACHE_DIR is not set"),
    (["--served-model-name", BASE, "bad\nname"], {}, "--served-model-name .*control"),
    (["--timeout-request-head", "0"], {}, "--timeout-request-head must be > 0"),
    (["--limit-concurrency", "-1"], {}, "--limit-concurrency must be > 0"),
])
def test_flag_errors(base_dir, monkeypatch, flags, env, match):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = serve_parser().parse_args(["--model", str(base_dir), *engine_flags(), *flags])
    with pytest.raises(ValueError, match=match):
        create_server(args)
