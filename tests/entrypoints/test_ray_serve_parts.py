"""The parts of ``manylora serve-ray`` that need no Ray cluster: the in-process ASGI bridge,
the control replica's adapter changes and liveness, the metrics merge, the flags (argv and
Serve config mappings) and deployment options, and the ingress's routing key, retries and
mid-stream failure, each against an independent expectation (a real FastAPI app, counts
computed here, prometheus_client's parser)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter as Tally
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray.exceptions import ActorDiedError

from manylora.engine.arg_utils import EngineArgs
from manylora.entrypoints.ray_serve import control as control_mod
from manylora.entrypoints.ray_serve import replica as replica_mod
from manylora.entrypoints.ray_serve.app import engine_deployment_options
from manylora.entrypoints.ray_serve.args import argv_of, parse, serve_ray_parser
from manylora.entrypoints.ray_serve.bridge import HTTPRequest, ResponseHead, call_asgi
from manylora.entrypoints.ray_serve.control import AdapterControl
from manylora.entrypoints.ray_serve.ingress import IngressConfig, OpenAIIngress
from manylora.entrypoints.ray_serve.relabel import merge_replica_metrics
from manylora.entrypoints.ray_serve.replica import EngineReplica


def _request(method="POST", path="/echo", body=b"", headers=()) -> HTTPRequest:
    return HTTPRequest(method, path, b"a=1", tuple(headers), body, ("10.0.0.1", 5))


async def _collect(gen) -> list:
    return [part async for part in gen]


# --- the ASGI bridge -------------------------------------------------------------------

def _app(events: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return JSONResponse({"body": (await request.body()).decode(),
                             "query": request.url.query, "client": request.client.host},
                            status_code=201, headers={"x-app": "yes"})

    @app.get("/sse")
    async def sse():
        async def events_():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(events_(), media_type="text/event-stream")

    @app.get("/forever")
    async def forever(request: Request):
        async def events_():
            try:
                while True:
                    yield "data: tick\n\n"
                    await asyncio.sleep(0)
            finally:
                events.append("closed")
        return StreamingResponse(events_(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom():
        raise KeyError("boom")

    return app


def test_bridge_gives_head_then_body_with_the_extra_header():
    parts = asyncio.run(_collect(call_asgi(_app([]), _request(body=b"hello"),
                                           ((b"x-replica", b"r1"),))))
    head, *body = parts
    assert isinstance(head, ResponseHead) and head.status == 201
    assert head.header(b"x-app") == b"yes" and head.header(b"x-replica") == b"r1"
    assert json.loads(b"".join(body)) == {"body": "hello", "query": "a=1",
                                          "client": "10.0.0.1"}


def test_bridge_streams_each_event_as_its_own_chunk():
    head, *chunks = asyncio.run(_collect(call_asgi(_app([]), _request("GET", "/sse"))))
    assert head.header(b"content-type").startswith(b"text/event-stream")
    assert chunks == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]


def test_bridge_stopped_early_lets_the_app_see_the_disconnect():
    events: list[str] = []

    async def run():
        gen = call_asgi(_app(events), _request("GET", "/forever"))
        assert isinstance(await gen.__anext__(), ResponseHead)
        assert await gen.__anext__() == b"data: tick\n\n"
        await gen.aclose()

    asyncio.run(run())
    assert events == ["closed"]


def test_bridge_answers_an_app_error_as_the_app_does():
    head, *body = asyncio.run(_collect(call_asgi(_app([]), _request("GET", "/boom"))))
    assert head.status == 500


def test_bridge_raises_when_the_app_ends_without_a_response():
    async def silent(scope, receive, send):
        return None

    with pytest.raises(RuntimeError, match="without a response"):
        asyncio.run(_collect(call_asgi(silent, _request())))


# --- the control replica ---------------------------------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_publish_waits_for_every_live_replica_and_reports_failures(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(control_mod, "POLL_S", 0.01)

    async def run():
        control = AdapterControl(clock)
        first = await control.poll("r1", "", -1, -1, "m1")
        await control.poll("r2", "", -1, -1, "m2")
        assert first.version == 0 and first.epoch == control.epoch
        publish = asyncio.ensure_future(control.publish("ad", "/p/ad", "r1", timeout=30))
        await asyncio.sleep(0)
        assert not publish.done()
        # r1 took the HTTP request; it applies the new version at once
        got = await control.poll("r1", control.epoch, -1, -1, "m1")
        assert got.adapters["ad"].path == "/p/ad" and got.adapters["ad"].origin == "r1"
        await control.poll("r1", control.epoch, got.version, got.version, "m1")
        await asyncio.sleep(0.05)
        assert not publish.done()                   # r2 has not applied it
        await control.poll("r2", control.epoch, got.version, got.version, "m2",
                           {got.version: (400, "bad adapter")})
        assert await asyncio.wait_for(publish, 5) == {"r2": (400, "bad adapter")}
        assert control.metrics() == {"r1": "m1", "r2": "m2"}
        # r2 stops polling: after LIVE_S it is no longer waited for, nor in /metrics
        clock.now += control_mod.LIVE_S + 1
        await control.poll("r1", control.epoch, got.version, got.version, "m1b")
        publish = asyncio.ensure_future(control.publish("ad", None, "", timeout=30))
        await asyncio.sleep(0.02)
        snap = await control.poll("r1", control.epoch, got.version, got.version, "m1b")
        assert snap.adapters["ad"].path is None
        await control.poll("r1", control.epoch, snap.version, snap.version, "m1b")
        assert await asyncio.wait_for(publish, 5) == {}
        assert control.replicas() == ["r1"] and control.metrics() == {"r1": "m1b"}

    asyncio.run(run())


def test_a_replica_that_does_not_apply_in_time_is_reported(monkeypatch):
    monkeypatch.setattr(control_mod, "POLL_S", 0.01)

    async def run():
        control = AdapterControl()
        await control.poll("r1", "", -1, -1, "")
        return await control.publish("ad", "/p", "", timeout=0.05)

    failed = asyncio.run(run())
    assert list(failed) == ["r1"] and failed["r1"][0] == 504


def test_a_restarted_control_replica_gets_the_adapters_back_from_the_replicas():
    async def run():
        control = AdapterControl()
        # r1 knew another epoch: it reports what it loaded at run time
        snap = await control.poll("r1", "old-epoch", 7, 7, "", None, {"ad6": "/p/ad6"})
        return control, snap

    control, snap = asyncio.run(run())
    assert snap.epoch == control.epoch and snap.adapters["ad6"].path == "/p/ad6"


async def _turns(n: int = 500) -> None:
    """Let the event loop run ``n`` times: every task not waiting on something gets on."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_waiting_poll_is_ended_by_a_change_not_by_another_replicas_poll(monkeypatch):
    monkeypatch.setattr(control_mod, "POLL_S", 3600)      # no poll times out here

    async def run():
        control = AdapterControl()
        snap = await control.poll("r1", "", -1, -1, "")
        waiting = asyncio.ensure_future(
            control.poll("r1", snap.epoch, snap.version, snap.version, ""))
        for _ in range(20):         # r2 keeps polling: r1's wait goes on
            r2 = asyncio.ensure_future(
                control.poll("r2", snap.epoch, snap.version, snap.version, "", wait=False))
            await _turns(20)
            assert r2.done() and not waiting.done()
        publish = asyncio.ensure_future(control.publish("ad", "/p", "", timeout=600))
        got = await asyncio.wait_for(waiting, 60)           # the change ends the wait
        assert got.version == snap.version + 1 and got.adapters["ad"].path == "/p"
        assert not publish.done()
        publish.cancel()

    asyncio.run(run())


class _Models:
    """A stand-in for a replica's served models: a dict of name → shown path."""

    def __init__(self) -> None:
        self.static_loras: list = []
        self.loras: dict = {}

    async def load_lora_adapter(self, name: str, path: str, load_inplace: bool) -> None:
        self.loras[name] = SimpleNamespace(shown_path=path)

    async def unload_lora_adapter(self, name: str) -> None:
        del self.loras[name]


class _ControlHandle:
    """A deployment handle to an in-process :class:`AdapterControl` that counts the polls
    each replica makes and how many of them are waiting."""

    def __init__(self, control: AdapterControl) -> None:
        self.control = control
        self.calls: Tally[str] = Tally()
        self.waiting: Tally[str] = Tally()

    @property
    def poll(self) -> _ControlHandle:
        return self

    def remote(self, replica_id: str, *args):
        self.calls[replica_id] += 1

        async def call():
            self.waiting[replica_id] += 1
            try:
                return await self.control.poll(replica_id, *args)
            finally:
                self.waiting[replica_id] -= 1
        return call()


async def _replica(monkeypatch, replica_id: str, control: _ControlHandle) -> EngineReplica:
    """An :class:`EngineReplica` of fake models and no engine, following ``control``."""
    server = SimpleNamespace(models=_Models(), registry=CollectorRegistry(),
                             shutdown=lambda: None)
    monkeypatch.setattr(replica_mod, "create_server", lambda args: server)
    monkeypatch.setattr(replica_mod, "serve", SimpleNamespace(
        get_replica_context=lambda: SimpleNamespace(
            replica_id=SimpleNamespace(unique_id=replica_id)),
        multiplexed=lambda **_: lambda f: f))
    replica = EngineReplica.__new__(EngineReplica)
    await replica.__init__(["--model", "/m"], control)     # Ray Serve awaits it so too
    return replica


def test_idle_replicas_wait_in_their_polls_and_a_publish_reaches_them_at_once(monkeypatch):
    monkeypatch.setattr(control_mod, "POLL_S", 3600)      # no poll times out here

    async def run():
        handle = _ControlHandle(AdapterControl())
        replicas = [await _replica(monkeypatch, r, handle) for r in ("r1", "r2")]
        try:
            await _turns()
            idle = dict(handle.calls)
            await _turns()
            # idle: each replica has one poll waiting and makes no other call
            assert handle.calls == idle and handle.waiting == {"r1": 1, "r2": 1}
            failed = await asyncio.wait_for(
                handle.control.publish("ad", "/p/ad", "", timeout=600), 60)
            assert failed == {}
            assert [r.server.models.loras["ad"].shown_path for r in replicas] == ["/p/ad"] * 2
            await _turns()
            idle = dict(handle.calls)
            await _turns()
            assert handle.calls == idle and handle.waiting == {"r1": 1, "r2": 1}
        finally:
            for replica in replicas:
                for task in replica._tasks:
                    task.cancel()

    asyncio.run(run())


# --- the metrics merge -----------------------------------------------------------------

def _replica_text(tokens: float, running: str) -> str:
    registry = CollectorRegistry()
    Counter("manylora:prompt_tokens", "Prompt tokens.", ["model_name"],
            registry=registry).labels("base").inc(tokens)
    Histogram("manylora:e2e_request_latency_seconds", "Latency.", ["model_name"],
              registry=registry).labels("base").observe(tokens / 100)
    Gauge("manylora:lora_requests_info", "Adapters.",
          ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
          registry=registry).labels("4", running, "").set(1.5e9)
    return generate_latest(registry).decode()


def test_merged_metrics_keep_each_replica_apart_under_its_label():
    text = merge_replica_metrics({"r1": _replica_text(5, "ad0"),
                                  "r2": _replica_text(7, "ad1,ad2")}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    tokens = {s.labels["replica"]: s.value for s in families["manylora:prompt_tokens"].samples
              if s.name == "manylora:prompt_tokens_total"}
    assert tokens == {"r1": 5.0, "r2": 7.0}
    info = {s.labels["replica"]: s.labels["running_lora_adapters"]
            for s in families["manylora:lora_requests_info"].samples}
    assert info == {"r1": "ad0", "r2": "ad1,ad2"}
    latency = families["manylora:e2e_request_latency_seconds"]
    assert latency.type == "histogram"
    counts = {s.labels["replica"]: s.value for s in latency.samples
              if s.name.endswith("_count")}
    assert counts == {"r1": 1.0, "r2": 1.0}
    assert text.count("# TYPE manylora:prompt_tokens_total counter") == 1


def test_merged_metrics_refuse_a_malformed_text():
    with pytest.raises(ValueError):
        merge_replica_metrics({"r1": "manylora:x{ 1\n"})


# --- flags and deployment options ------------------------------------------------------

def test_a_serve_config_mapping_is_the_command_line_it_stands_for():
    parser = serve_ray_parser()
    argv = argv_of({"model": "/m", "lora-modules": ["a=/a", "b=/b"], "api_key": ["k1", "k2"],
                    "enable_lora_runtime_updates": True, "enable_prefix_caching": False,
                    "disable_log_stats": False, "num_replicas": 3, "max_waiting_requests": None,
                    "override_generation_config": {"temperature": 0.5}}, parser)
    ns = parser.parse_args(argv)
    assert ns.model == "/m" and ns.lora_modules == ["a=/a", "b=/b"]
    assert ns.api_key == ["k1", "k2"] and ns.enable_lora_runtime_updates
    assert ns.enable_prefix_caching is False and ns.disable_log_stats is False
    assert ns.num_replicas == 3 and ns.max_waiting_requests is None
    assert json.loads(ns.override_generation_config) == {"temperature": 0.5}
    with pytest.raises(ValueError, match="'num_gpus' is not a manylora serve-ray flag"):
        argv_of({"model": "/m", "num_gpus": 1}, parser)


@pytest.mark.parametrize("flags, message", [
    (["--num-replicas", "0"], "--num-replicas must be at least 1"),
    (["--max-replicas", "4"], "needs both --min-replicas and --max-replicas"),
    (["--min-replicas", "5", "--max-replicas", "4"], "--min-replicas <= --max-replicas"),
    (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs"),
    (["--timeout-keep-alive", "9", "--backlog", "4"],
     "--timeout-keep-alive, --backlog: Ray Serve's proxy"),
    (["--no-such-flag"], "bad flags"),
])
def test_bad_ray_flags_are_named(flags, message):
    with pytest.raises(ValueError, match=message):
        parse(["--model", "/m", *flags])


def _options(*flags: str) -> dict:
    ns, _ = parse(["--model", "/m", "--max-num-seqs", "16", *flags])
    return engine_deployment_options(ns, EngineArgs.from_cli_args(ns))


def test_engine_deployment_options():
    fixed = _options("--num-replicas", "3", "--cpus-per-replica", "2")
    assert fixed == {"num_replicas": 3, "max_ongoing_requests": 16,
                     "ray_actor_options": {"num_cpus": 2.0, "num_gpus": 0.0}}
    scaled = _options("--min-replicas", "1", "--max-replicas", "8")
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 8,
                                            "target_ongoing_requests": 16}
    tp = _options("--gpus-per-replica", "2", "--max-ongoing-requests", "100")
    assert tp["ray_actor_options"]["num_gpus"] == 2.0 and tp["max_ongoing_requests"] == 100
    assert tp["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 2.0}]
    assert tp["placement_group_strategy"] == "STRICT_PACK"
    with pytest.raises(ValueError, match="--gpus-per-replica"):
        _options("--gpus-per-replica", "-1")


# --- the ingress ------------------------------------------------------------------------

class _Engines:
    """A stand-in for the engine deployment's handle: each call plays the next script (a
    list of parts, where an exception is raised in its place)."""

    def __init__(self, *scripts) -> None:
        self.scripts = list(scripts)
        self.calls: list[str] = []

    def options(self, stream: bool, multiplexed_model_id: str) -> _Engines:
        assert stream
        self.calls.append(multiplexed_model_id)
        return self

    @property
    def forward(self) -> _Engines:
        return self

    def remote(self, request, adapter):
        return _Stream(self.scripts.pop(0))


class _Stream:
    def __init__(self, parts) -> None:
        self.parts = list(parts)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.parts:
            raise StopAsyncIteration
        part = self.parts.pop(0)
        if isinstance(part, Exception):
            raise part
        return part

    def cancel(self) -> None:
        self.cancelled = True


def _ingress(*scripts) -> OpenAIIngress:
    return OpenAIIngress(_Engines(*scripts), None, IngressConfig(("base", "base-alias"),
                                                                 2**20, 60.0))


JSON_HEAD = ResponseHead(200, ((b"content-type", b"application/json"),
                               (b"content-length", b"2"), (b"x-manylora-replica", b"r2")))
SSE_HEAD = ResponseHead(200, ((b"content-type", b"text/event-stream"),
                              (b"x-manylora-replica", b"r1")))


@pytest.mark.parametrize("body, adapter", [
    ({"model": "ad3", "prompt": "x"}, "ad3"),
    ({"model": "base", "prompt": "x"}, ""),
    ({"model": "base-alias"}, ""),
    ({"prompt": "x"}, ""),
    ({"model": 7}, ""),
    ([1, 2], ""),
])
def test_the_routing_key_is_the_adapter_the_body_names(body, adapter):
    request = _request(path="/v1/completions", body=json.dumps(body).encode())
    assert _ingress().adapter_of(request) == adapter


def test_the_routing_key_of_other_requests_is_empty():
    ingress = _ingress()
    assert ingress.adapter_of(_request(path="/v1/completions", body=b"{not json")) == ""
    assert ingress.adapter_of(_request("GET", "/v1/models/ad3")) == ""
    body = json.dumps({"lora_name": "ad3", "model": "ad3"}).encode()
    assert ingress.adapter_of(_request(path="/v1/load_lora_adapter", body=body)) == ""


def test_a_replica_dying_before_its_answer_is_retried_on_another():
    ingress = _ingress([ActorDiedError()], [JSON_HEAD, ActorDiedError()], [JSON_HEAD, b"{}"])
    body = json.dumps({"model": "ad1"}).encode()
    response = asyncio.run(ingress.call(_request(path="/v1/completions", body=body)))
    assert response.status_code == 200 and response.body == b"{}"
    assert response.headers["x-manylora-replica"] == "r2"
    assert response.headers["content-length"] == "2"
    assert ingress.engines.calls == ["ad1", "ad1", "ad1"]


def test_every_attempt_failing_is_a_503_naming_why():
    from manylora.entrypoints.openai.errors import OpenAIError

    ingress = _ingress(*[[ActorDiedError()]] * 3)
    with pytest.raises(OpenAIError) as e:
        asyncio.run(ingress.call(_request(path="/v1/completions", body=b"{}")))
    assert e.value.status == 503 and "ActorDiedError" in e.value.message


def test_a_stream_cut_by_a_dying_replica_ends_with_an_error_event():
    stream_parts = [SSE_HEAD, b"data: {\"a\": 1}\n\n", ActorDiedError()]
    ingress = _ingress(stream_parts)

    async def run():
        response = await ingress.call(_request(path="/v1/completions", body=b"{}"))
        return response, [c async for c in response.body_iterator]

    response, chunks = asyncio.run(run())
    assert response.headers["x-manylora-replica"] == "r1"
    assert chunks[0] == b"data: {\"a\": 1}\n\n"
    event = json.loads(chunks[1].decode().removeprefix("data: "))
    assert event["error"]["code"] == 503
    assert "replica r1" in event["error"]["message"] and len(chunks) == 2


def test_the_cli_has_serve_ray_and_names_bad_flags(capsys):
    from manylora.entrypoints.cli import _parser, main

    args = _parser().parse_args(["serve-ray", "--model", "/m", "--num-replicas", "2",
                                 "--address", "auto", "--lora-modules", "a=/a"])
    assert (args.command, args.num_replicas, args.address) == ("serve-ray", 2, "auto")
    with pytest.raises(SystemExit, match="manylora serve-ray: autoscaling needs both"):
        main(["serve-ray", "--model", "/m", "--min-replicas", "1"])


def test_the_control_replica_knows_what_each_live_replica_serves():
    clock = _Clock()

    async def run():
        control = AdapterControl(clock)
        await control.poll("r1", "", -1, -1, "", None, None, ["ad1", "ad0"])
        await control.poll("r2", "", -1, -1, "", None, None, ["ad0"])
        first = control.served()
        clock.now += control_mod.LIVE_S + 1
        await control.poll("r2", "", -1, -1, "", None, None, [])
        return first, control.served()

    first, later = asyncio.run(run())
    assert first == {"r1": ["ad0", "ad1"], "r2": ["ad0"]} and later == {"r2": []}
