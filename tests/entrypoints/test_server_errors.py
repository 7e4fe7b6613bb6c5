"""Every error ``manylora serve`` promises, in OpenAI's shape and with its status, through
the ``openai`` client and raw HTTP; bad input is never a 500 and the server keeps serving."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import httpx
import openai
import pytest
from server_helpers import BASE, hold_steps, running_server

from manylora.testing import make_peft_adapter


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) >= {"message", "type", "code"} and body["message"]
    return body


@pytest.mark.parametrize("body, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"logprobs": 30}, "logprobs"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 500}, "max_tokens"),           # prompt + max_tokens > max_model_len
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [10**6]}, "prompt"),               # a token id outside the vocabulary
    ({"prompt": 123}, "prompt"),
    ({"temperature": "hot"}, "temperature"),
    ({"stop": [""]}, "stop"),
    ({"seed": 1.5}, "seed"),
])
def test_invalid_completion_parameters_are_400(served, body, param):
    r = httpx.post(f"{served[1]}/v1/completions",
                   json={"model": BASE, "prompt": "hello", "max_tokens": 4, **body})
    error = _error(r, 400)
    assert param in error["message"] or error.get("param") == param


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://x/y.png"}}]}]},
    {"messages": "hi"},
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function",
     "function": {"name": "f", "parameters": {}}}]},
])
def test_invalid_chat_requests_are_400(served, body):
    r = httpx.post(f"{served[1]}/v1/chat/completions", json={"model": BASE, **body})
    _error(r, 400)


def test_malformed_bodies_are_400_not_500(served):
    url = f"{served[1]}/v1/completions"
    for content in (b"{not json", b"[1, 2]", b"", b"null"):
        r = httpx.post(url, content=content, headers={"content-type": "application/json"})
        _error(r, 400)


def test_unknown_model_and_adapter_are_404(client, served):
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user",
                                                                "content": "hi"}])
    http = httpx.Client(base_url=served[1])
    _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}), 404)
    _error(http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path":
                                                    "does-not-exist"}), 404)


def test_adapter_loads_stay_under_lora_root(served, lora_root, server_root, base_dir,
                                            adapters):
    http = httpx.Client(base_url=served[1])

    def load(name, path):
        return http.post("/v1/load_lora_adapter", json={"lora_name": name,
                                                        "lora_path": str(path)})

    outside = make_peft_adapter(base_dir, server_root / "outside", r=4,
                                target_modules=["q_proj"], seed=99)
    _error(load("out", outside), 403)
    _error(load("dots", lora_root / ".." / "outside"), 403)
    _error(load("dots2", "ad0/../../outside"), 403)
    link = lora_root / "sneaky"
    if not link.exists():
        os.symlink(outside, link)
    _error(load("sneaky", link), 403)
    inner = lora_root / "inner-link"
    if not inner.exists():
        inner.mkdir()
        for f in adapters["ad0"].iterdir():
            (inner / f.name).write_bytes(f.read_bytes())
        (inner / "adapter_model.safetensors").unlink()
        os.symlink(outside / "adapter_model.safetensors", inner / "adapter_model.safetensors")
    _error(load("inner", inner), 403)
    assert "out" not in {m["id"] for m in http.get("/v1/models").json()["data"]}
    # a bad adapter under the root, and a name already served, are 400
    big = make_peft_adapter(base_dir, lora_root / "too-big", r=16, target_modules=["q_proj"],
                            seed=5)
    assert "max_lora_rank" in _error(load("big", big), 400)["message"]
    _error(load("ad0", adapters["ad0"]), 400)
    _error(load(BASE, adapters["ad5"]), 400)


def test_body_and_prompt_size_limits_are_413(base_dir):
    with running_server(base_dir, "--max-request-body-bytes", "2000") as (_, url):
        r = httpx.post(f"{url}/v1/completions",
                       json={"model": BASE, "prompt": "x " * 2000, "max_tokens": 2})
        _error(r, 413)
        # a chunked body (no Content-Length) over the limit too
        chunks = (b'{"model": "tiny-base", "prompt": "' + b"y" * 500 for _ in range(8))
        r = httpx.post(f"{url}/v1/completions", content=chunks,
                       headers={"content-type": "application/json"})
        _error(r, 413)
        long_prompt = " ".join(["fox"] * 200)             # > max_model_len=128 tokens
        r = httpx.post(f"{url}/v1/completions",
                       json={"model": BASE, "prompt": long_prompt[:1900], "max_tokens": 2})
        assert "128" in _error(r, 413)["message"]
        ok = httpx.post(f"{url}/v1/completions",
                        json={"model": BASE, "prompt": "hello", "max_tokens": 2})
        assert ok.status_code == 200


def test_api_key_guards_v1_only(base_dir):
    with running_server(base_dir, "--api-key", "s3cret") as (_, url):
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=BASE, prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        _error(httpx.get(f"{url}/v1/models"), 401)
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=BASE, prompt="hi", max_tokens=2).choices
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.get(f"{url}/version").json()["version"]


def test_runtime_updates_off_by_default(base_dir):
    with running_server(base_dir) as (_, url):
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a",
                                                            "lora_path": "/tmp"})
        _error(r, 404)


def test_full_waiting_queue_is_503_and_others_finish(base_dir):
    with running_server(base_dir, "--max-waiting-requests", "1",
                        max_num_seqs=1) as (server, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        done: list[str] = []
        # the first request runs one step, then holds until the 503 has been checked
        release = hold_steps(server.engine.engine.engine_core)

        def long_request():
            out = client.completions.create(model=BASE, prompt="The quick", max_tokens=100,
                                            temperature=0.0, extra_body={"ignore_eos": True})
            done.append(out.choices[0].finish_reason)

        def wait_for(condition):
            deadline = time.monotonic() + 60
            while not condition(server.engine.snapshot()) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert condition(server.engine.snapshot())

        threads = [threading.Thread(target=long_request) for _ in range(2)]
        threads[0].start()
        wait_for(lambda s: s.num_running == 1)
        threads[1].start()                 # max_num_seqs=1: this one waits
        wait_for(lambda s: s.num_waiting == 1)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=BASE, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503
        assert "max_waiting_requests" in info.value.message
        release.set()
        for t in threads:
            t.join(120)
        assert done == ["length", "length"]
        assert client.completions.create(model=BASE, prompt="hi", max_tokens=2).choices


def test_adapters_the_server_cannot_serve_are_400_naming_the_field(served, lora_root,
                                                                   base_dir, adapters):
    """peft's TrainableTokens (``trainable_token_indices``), and an ``lm_head`` adapter on a
    server whose slots are the projections only (the default ``--lora-target-modules``)."""
    http = httpx.Client(base_url=served[1])
    tokens = lora_root / "trainable-tokens"
    if not tokens.exists():
        shutil.copytree(adapters["ad1"], tokens)
        cfg = json.loads((tokens / "adapter_config.json").read_text())
        (tokens / "adapter_config.json").write_text(json.dumps(
            {**cfg, "trainable_token_indices": [5, 6]}))
    head = lora_root / "head"
    if not head.exists():
        make_peft_adapter(base_dir, head, r=2, target_modules=["q_proj", "lm_head"], seed=3)
    for name, path, field in (("tokens", tokens, "trainable_token_indices"),
                              ("head", head, "--lora-target-modules")):
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name,
                                                     "lora_path": str(path)})
        assert field in _error(r, 400)["message"]
    served_names = {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert not {"tokens", "head"} & served_names
    r = http.post("/v1/completions", json={"model": "ad1", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
