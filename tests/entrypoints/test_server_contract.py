"""The published contract is the enforced one (issue 18, findings 1 and 7): names that
UTF-8 cannot encode never turn a response into a 500, ``openapi.json`` lists the statuses
and content types the server answers, 405 carries ``Allow``, and error messages say what is
wrong once, without colour codes or server paths the caller never gave."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import BASE, running_server

from manylora.engine.stats import EngineSnapshot
from manylora.entrypoints.openai.encoding import SafeJSONResponse, json_text, safe_text
from manylora.entrypoints.openai.errors import OpenAIError, clean_message
from manylora.entrypoints.openai.serving_models import _Served
from manylora.lora_request import LoRARequest
from manylora.metrics.prometheus import PrometheusStatLogger

KEY = "contract-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SURROGATE = "bad\udcffname"    # what an undecodable command-line byte becomes in sys.argv
ROUTES = {("get", "/health"), ("get", "/version"), ("get", "/metrics"),
          ("get", "/v1/models"), ("get", "/v1/models/{model_id}"),
          ("post", "/v1/completions"), ("post", "/v1/chat/completions"),
          ("post", "/v1/load_lora_adapter"), ("post", "/v1/unload_lora_adapter"),
          ("post", "/tokenize"), ("post", "/detokenize"), ("get", "/tokenizer_info"),
          ("post", "/v1/responses"), ("get", "/v1/responses/{response_id}")}


@pytest.fixture(scope="module")
def contract(base_dir, adapters, lora_root):
    """A server with an API key, run-time updates, and an adapter whose name holds a lone
    surrogate, registered past every name check (the request side and the command line
    refuse such names; the responses must encode whatever the registry holds)."""
    with running_server(base_dir, "--api-key", KEY, "--enable-lora-runtime-updates",
                        "--lora-root", str(lora_root),
                        lora_modules=[f"ad0={adapters['ad0']}"]) as (server, url):
        path = str(adapters["ad1"])
        server.models.loras[SURROGATE] = _Served(LoRARequest(SURROGATE, 99, path), 0, path)
        yield server, httpx.Client(base_url=url, headers=AUTH, timeout=60)


def strict_json(r: httpx.Response):
    """The body as JSON, decoded as strict UTF-8 (a lone surrogate escape is refused too,
    as strict parsers such as Rust's serde_json refuse it)."""
    value = json.loads(r.content.decode("utf-8"))
    _assert_encodable(value)
    return value


def _assert_encodable(value) -> None:
    if isinstance(value, str):
        value.encode("utf-8")     # a lone surrogate (from a "\\ud800" escape) raises
    elif isinstance(value, dict):
        for k, v in value.items():
            _assert_encodable(k)
            _assert_encodable(v)
    elif isinstance(value, list):
        for v in value:
            _assert_encodable(v)


# ------------------------------------------------------------------------------ encoding


def test_safe_text_and_json_text_against_the_utf8_codec():
    for text in ("plain", "naïve ☃ 🦙", 'quote" back\\ nl\n nul\x00'):
        assert safe_text(text) == text
        assert json.loads(json_text({"k": text})) == {"k": text}
    for text in ("\ud800", "a\udcffb", "\udfff\ud800", "x\ud83d"):
        out = safe_text(text)
        out.encode("utf-8")   # would raise on a lone surrogate
        assert out == text.encode("utf-8", "backslashreplace").decode("ascii")
        body = json_text({text: [text, 1.5, None]})
        body.encode("utf-8")
        assert json.loads(body) == {out: [out, 1.5, None]}
    with pytest.raises(ValueError):
        json_text({"x": float("nan")})


def test_safe_json_response_renders_what_starlettes_cannot():
    body = SafeJSONResponse({"id": "\ud800x"}).body
    assert json.loads(body.decode("utf-8")) == {"id": "\\ud800x"}


def test_models_stay_200_with_an_unencodable_adapter_name(contract):
    _, http = contract
    for _ in range(2):                       # every client, every time
        r = http.get("/v1/models")
        assert r.status_code == 200
        ids = [m["id"] for m in strict_json(r)["data"]]
        assert ids == [BASE, "ad0", SURROGATE.encode("utf-8", "backslashreplace").decode()]
    assert http.get("/v1/models/ad0").status_code == 200
    r = http.get("/v1/models/nope-\u2603")
    assert r.status_code == 404 and "nope-\u2603" in strict_json(r)["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"model": "x\\udcff", "messages": [{"role": "user", '
                             b'"content": "hi"}]}'),
    ("/v1/unload_lora_adapter", b'{"lora_name": "\\ud800"}'),
])
def test_a_lone_surrogate_in_a_request_is_a_4xx_never_a_500(contract, path, body):
    _, http = contract
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code in (400, 404), r.text      # 400 once names are checked at the edge
    assert strict_json(r)["error"]["message"]
    assert http.get("/v1/models").status_code == 200


def test_metrics_stay_200_and_parse_with_unencodable_names(base_dir):
    """The served name goes into every sample's label; the command line refuses such a
    name, so the stat logger is given one directly, over a live engine's snapshot, and
    scraped as /metrics scrapes its registry."""
    with running_server(base_dir) as (server, url):
        assert httpx.get(f"{url}/metrics").status_code == 200
        registry = CollectorRegistry()
        PrometheusStatLogger(registry, "base\ud800", server.engine.snapshot)
        text = generate_latest(registry)
    families = list(text_string_to_metric_families(text.decode("utf-8")))
    names = {s.labels.get("model_name") for f in families for s in f.samples}
    assert names - {None} == {"base\\ud800"}


def test_prometheus_label_values_round_trip_through_the_parser():
    odd = ["ad\ud800", 'q"uote', "back\\slash", "new\nline", "uni☃"]
    registry = CollectorRegistry()
    snap = EngineSnapshot(max_loras=4, running_lora_adapters=tuple(odd[:3]),
                          waiting_lora_adapters=tuple(odd[3:]))
    PrometheusStatLogger(registry, "m\udcff", lambda: snap, max_model_len=64,
                         clock=lambda: 7.0)
    text = generate_latest(registry).decode("utf-8")
    info = next(s for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "manylora:lora_requests_info")
    assert info.labels == {"max_lora": "4",
                           "running_lora_adapters": 'ad\\ud800,q"uote,back\\slash',
                           "waiting_lora_adapters": "new\nline,uni☃"}
    assert info.value == 7.0
    running = next(s for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "manylora:num_requests_running")
    assert running.labels == {"model_name": "m\\udcff"}


# ------------------------------------------------------------------------------ OpenAPI


def _operations(doc: dict) -> dict[tuple[str, str], dict]:
    return {(method, path): op for path, ops in doc["paths"].items()
            for method, op in ops.items()}


def test_openapi_lists_the_real_statuses_and_content_types(contract):
    _, http = contract
    doc = http.get("/openapi.json").json()
    ops = _operations(doc)
    assert set(ops) == ROUTES
    statuses = {route: set(op["responses"]) for route, op in ops.items()}
    v1 = {"401", "413"}
    assert statuses[("get", "/health")] == {"200", "413", "503"}
    assert statuses[("get", "/version")] == {"200", "413"}
    assert statuses[("get", "/metrics")] == {"200", "413"}
    assert statuses[("get", "/v1/models")] == {"200"} | v1
    assert statuses[("get", "/v1/models/{model_id}")] == {"200", "400", "404"} | v1
    for route in (("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                  ("post", "/v1/responses")):
        assert statuses[route] == {"200", "400", "404", "503", "504"} | v1
        assert set(ops[route]["responses"]["200"]["content"]) == {"application/json",
                                                                 "text/event-stream"}
    assert statuses[("post", "/v1/load_lora_adapter")] == {"200", "400", "403", "404",
                                                           "503", "504"} | v1
    assert statuses[("post", "/v1/unload_lora_adapter")] == {"200", "400", "404", "503"} | v1
    for route in (("post", "/tokenize"), ("post", "/detokenize")):   # 503/504: the resolver
        assert statuses[route] == {"200", "400", "404", "503", "504"} | v1
    assert statuses[("get", "/tokenizer_info")] == {"200", "400"} | v1
    assert statuses[("get", "/v1/responses/{response_id}")] == {"200", "400", "404"} | v1
    assert set(ops[("get", "/metrics")]["responses"]["200"]["content"]) == {"text/plain"}
    assert "content" not in ops[("get", "/health")]["responses"]["200"]
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for route, op in ops.items():
        assert ("security" in op) == (route[1].startswith("/v1") or "token" in route[1])
        for status, response in op["responses"].items():
            if int(status) >= 400:
                assert response["content"] == {"application/json": {"schema": error_ref}}
    schemas = doc["components"]["schemas"]
    assert schemas["ErrorResponse"]["properties"]["error"] == {
        "$ref": "#/components/schemas/ErrorInfo"}
    assert set(schemas["ErrorInfo"]["required"]) == {"message", "type"}
    assert "HTTPValidationError" not in schemas
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_openapi_without_keys_documents_no_401(base_dir):
    with running_server(base_dir) as (_, url):
        doc = httpx.get(f"{url}/openapi.json").json()
    ops = _operations(doc)
    assert ("post", "/v1/load_lora_adapter") not in ops     # run-time updates off
    assert all("401" not in op["responses"] and "security" not in op for op in ops.values())
    assert "securitySchemes" not in doc.get("components", {})


def test_validation_errors_are_400_never_the_422_fastapi_documents(contract):
    _, http = contract
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": "many"}),
                       ("/v1/chat/completions", {"messages": 3}),
                       ("/v1/load_lora_adapter", {"lora_name": ""}),
                       ("/v1/unload_lora_adapter", {})):
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert r.headers["content-type"] == "application/json"
        assert set(strict_json(r)["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("method, path, allow", [
    ("PUT", "/v1/models", "GET"), ("DELETE", "/v1/completions", "POST"),
    ("GET", "/v1/chat/completions", "POST"), ("POST", "/health", "GET"),
    ("PATCH", "/v1/load_lora_adapter", "POST")])
def test_405_carries_allow(contract, method, path, allow):
    _, http = contract
    r = http.request(method, path)
    assert r.status_code == 405
    assert r.headers["allow"] == allow
    error = strict_json(r)["error"]
    assert method in error["message"] and path in error["message"]
    assert error["code"] == 405


def test_unknown_route_is_404_in_openai_shape(contract):
    _, http = contract
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404
    assert strict_json(r)["error"]["message"] == "GET /v1/nothing-here: no such route"


def test_401_is_openai_shaped_and_documented(contract):
    _, http = contract
    r = http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert strict_json(r)["error"]["code"] == "invalid_api_key"


def test_a_server_bug_is_a_500_in_openai_shape_without_internals(contract, monkeypatch):
    server, http = contract

    def broken():
        raise RuntimeError("secret /srv/internal/state")

    monkeypatch.setattr(server.models, "list_models", broken)
    r = http.get("/v1/models")
    assert r.status_code == 500
    assert strict_json(r)["error"] == {"message": "internal server error",
                                       "type": "InternalServerError", "param": None,
                                       "code": "internal_error"}
    monkeypatch.undo()
    assert http.get("/v1/models").status_code == 200


# ------------------------------------------------------------------------------ messages


def test_clean_message():
    assert clean_message("adapter 'x': adapter 'x': bad rank") == "adapter 'x': bad rank"
    assert clean_message("a: a: a: b") == "a: b"
    assert clean_message("cfg: value: value: 3") == "cfg: value: 3"
    assert clean_message("bad: ad: x") == "bad: ad: x"       # not a repeat of a whole prefix
    assert clean_message("\x1b[31mError\x1b[0m: see \x1b[1;4mdocs\x1b[m") == "Error: see docs"
    assert clean_message("/srv/loras/ab/cfg.json and /srv/loras/abc",
                         paths={"/srv/loras/abc": "abc", "/srv/loras/ab": "ab"}
                         ) == "ab/cfg.json and abc"
    assert clean_message("x\ud800") == "x\\ud800"
    assert OpenAIError(400, "\x1b[33mhint\x1b[0m: hint: n").message == "hint: n"


def test_load_errors_name_the_adapter_once_and_the_path_as_given(contract, lora_root):
    server, http = contract
    broken = lora_root / "contract-broken"
    broken.mkdir(exist_ok=True)
    (broken / "README").write_text("no adapter here")
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "broken",
                                                 "lora_path": "contract-broken"})
    assert r.status_code in (400, 404), r.text
    message = strict_json(r)["error"]["message"]
    assert message.count("adapter 'broken'") == 1, message
    assert message.startswith("adapter 'broken': "), message
    assert str(lora_root.resolve()) not in message, message
    assert "adapter_config.json" in message, message
    assert "broken" not in [m["id"] for m in strict_json(http.get("/v1/models"))["data"]]


def test_models_root_is_the_path_as_given(contract, adapters, lora_root):
    _, http = contract
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "given", "lora_path": "ad5"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    try:
        cards = {m["id"]: m for m in strict_json(http.get("/v1/models"))["data"]}
        assert cards["given"]["root"] == "ad5"                   # as the caller gave it
        assert cards["ad0"]["root"] == str(adapters["ad0"])      # as the operator gave it
        assert cards["given"]["parent"] == BASE
        assert http.get("/v1/models/given").json() == cards["given"]
    finally:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "given"}
                         ).status_code == 200
