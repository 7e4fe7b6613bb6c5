"""Run-time adapters through a real server: ``load_inplace`` on ``POST /v1/load_lora_adapter``
(new weights for new requests, the old ones for requests already running, no prefix-cache
sharing between the two versions) and vLLM's filesystem LoRA resolver (an unknown ``model``
naming an adapter directory under ``--lora-root`` is loaded on its first request, once for
concurrent first requests; anything else stays a 404).

Reference: transformers + peft greedy decoding of the same token ids (``hf_greedy_reference``).
"""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest
from safetensors.torch import load_file, save_file
from server_helpers import BASE, TARGETS, running_server

from manylora.testing import make_peft_adapter
from manylora.testing.reference import compare_greedy, hf_greedy_reference

PROMPT = list(range(5, 17))           # three full KV blocks of 4: cached after the first use
N = 8


@pytest.fixture(scope="module")
def runtime_root(server_root):
    root = server_root / "runtime"
    root.mkdir()
    return root


@pytest.fixture(scope="module")
def versions(base_dir, runtime_root):
    """Two versions of one adapter (same shapes, other weights), and a broken copy."""
    a = make_peft_adapter(base_dir, runtime_root / "v1", r=4, target_modules=TARGETS, seed=71,
                          init_std=0.3)
    b = make_peft_adapter(base_dir, runtime_root / "v2", r=4, target_modules=TARGETS, seed=72,
                          init_std=0.3)
    bad = runtime_root / "v-nan"
    shutil.copytree(b, bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, bad / "adapter_model.safetensors")
    return a, b, bad


@pytest.fixture(scope="module")
def refs(base_dir, versions):
    a, b, _ = versions
    out = hf_greedy_reference(base_dir, {"a": a, "b": b}, [PROMPT, PROMPT], ["a", "b"], N)
    assert out[0].token_ids != out[1].token_ids      # the versions are told apart
    return {"a": out[0], "b": out[1]}


def _ids(choice_logprobs) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice_logprobs["tokens"]]


def _complete(http: httpx.Client, model: str, max_tokens: int = N) -> list[int]:
    r = http.post("/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    return _ids(r.json()["choices"][0]["logprobs"])


def _agrees(ours: list[int], ref) -> bool:
    return compare_greedy(ours[:len(ref.token_ids)], ref)[0]


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


def test_load_inplace_replaces_weights_and_the_prefix_cache_tells_them_apart(
        base_dir, runtime_root, versions, refs):
    a, b, bad = versions
    with running_server(base_dir, "--enable-lora-runtime-updates", "--lora-root",
                        str(runtime_root)) as (server, url):
        http = httpx.Client(base_url=url, timeout=120)

        def load(path, **extra):
            return http.post("/v1/load_lora_adapter", json={
                "lora_name": "v", "lora_path": str(path), **extra})

        assert load(a).status_code == 200
        first_id = server.models.loras["v"].request.lora_int_id
        assert _agrees(_complete(http, "v"), refs["a"])
        assert "load_inplace" in _error(load(b), 400)             # taken without it
        assert _agrees(_complete(http, "v"), refs["a"])
        assert "load_inplace" in _error(load(b, load_inplace="yes"), 400)   # strict bool
        r = load(b, load_inplace=True)
        assert r.status_code == 200 and "reloaded in place" in r.text
        # the prompt's blocks are cached under the first version's digest: not reused
        assert _agrees(_complete(http, "v"), refs["b"])
        # a bad version loaded in place: 400, and the served one stays
        assert "NaN or Inf" in _error(load(bad, load_inplace=True), 400)
        assert _agrees(_complete(http, "v"), refs["b"])
        cards = [m for m in http.get("/v1/models").json()["data"] if m["id"] == "v"]
        assert [c["root"] for c in cards] == [str(b)]
        # in place onto the base model's name is still refused
        r = http.post("/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": str(a),
                                                      "load_inplace": True})
        assert "base model" in _error(r, 400)
        # the replaced version left the engine once no request used it
        manager = server.engine.engine.engine_core.lora_manager
        assert not manager.is_ready(first_id)
        assert manager.is_ready(server.models.loras["v"].request.lora_int_id)


def test_a_running_request_keeps_the_weights_it_started_with(base_dir, runtime_root,
                                                             versions, refs):
    a, b, _ = versions
    with running_server(base_dir, "--enable-lora-runtime-updates", "--lora-root",
                        str(runtime_root)) as (server, url):
        http = httpx.Client(base_url=url, timeout=120)
        assert http.post("/v1/load_lora_adapter", json={
            "lora_name": "v", "lora_path": str(a)}).status_code == 200
        core = server.engine.engine.engine_core
        step, release, taken = core.step, threading.Event(), []

        def held_step():
            # after two steps, only adapter reads are taken in until released: the running
            # request cannot end while the new version is loaded
            if len(taken) >= 2 and not release.is_set():
                time.sleep(0.01)
                return core.poll_adapters()
            taken.append(1)
            return step()

        core.step = held_step
        result: list[list[int]] = []
        worker = threading.Thread(target=lambda: result.append(_complete(http, "v")))
        worker.start()
        deadline = time.monotonic() + 60
        while len(taken) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.engine.snapshot().num_running == 1
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "v", "lora_path": str(b),
                                                      "load_inplace": True})
        assert r.status_code == 200, r.text
        release.set()
        worker.join(120)
        assert _agrees(result[0], refs["a"])
        assert _agrees(_complete(http, "v"), refs["b"])


@pytest.fixture(scope="module")
def resolver_root(server_root, base_dir):
    """A --lora-root with two adapters, a directory without one, a hidden adapter, a link
    leading out of it, and an adapter outside it."""
    root = server_root / "resolver"
    root.mkdir()
    outside = make_peft_adapter(base_dir, server_root / "outside", r=2, seed=81)
    for name, seed in (("res1", 82), ("res2", 83), (".hidden", 84)):
        make_peft_adapter(base_dir, root / name, r=4, target_modules=TARGETS, seed=seed,
                          init_std=0.3)
    (root / "empty").mkdir()
    (root / "escape").symlink_to(outside, target_is_directory=True)
    return root


def test_resolver_loads_an_unknown_name_on_first_use(base_dir, resolver_root):
    ref = hf_greedy_reference(base_dir, {"r": resolver_root / "res1"}, [PROMPT], ["r"], N)[0]
    with running_server(base_dir, "--enable-lora-runtime-updates", "--enable-lora-resolver",
                        "--lora-root", str(resolver_root)) as (_, url):
        http = httpx.Client(base_url=url, timeout=120)
        assert "res1" not in {m["id"] for m in http.get("/v1/models").json()["data"]}
        assert _agrees(_complete(http, "res1"), ref)
        card = next(m for m in http.get("/v1/models").json()["data"] if m["id"] == "res1")
        assert card["root"] == "res1" and card["parent"] == BASE
        assert _agrees(_complete(http, "res1"), ref)                  # now a served name
        for name in ("nope", "empty", "escape", ".hidden", "../outside", "res1/..",
                     str(resolver_root / "res2"), "x" * 300):
            r = http.post("/v1/completions", json={"model": name, "prompt": PROMPT,
                                                   "max_tokens": 1})
            assert "does not exist" in _error(r, 404), name
        assert {m["id"] for m in http.get("/v1/models").json()["data"]} == {BASE, "res1"}
        # the tokenizer routes resolve too
        r = http.post("/tokenize", json={"model": "res2", "prompt": "hi"})
        assert r.status_code == 200, r.text
        assert "res2" in {m["id"] for m in http.get("/v1/models").json()["data"]}


def test_resolver_bad_adapter_is_400_and_off_without_the_flag(base_dir, resolver_root,
                                                              versions):
    bad_root = resolver_root.parent / "resolver-bad"
    bad_root.mkdir()
    shutil.copytree(versions[2], bad_root / "broken")
    with running_server(base_dir, "--enable-lora-runtime-updates", "--enable-lora-resolver",
                        "--lora-root", str(bad_root)) as (_, url):
        r = httpx.post(f"{url}/v1/completions", json={"model": "broken", "prompt": PROMPT,
                                                      "max_tokens": 1}, timeout=60)
        assert "NaN or Inf" in _error(r, 400)
        assert httpx.get(f"{url}/v1/models").json()["data"][-1]["id"] == BASE
    with running_server(base_dir, "--enable-lora-runtime-updates",
                        "--lora-root", str(resolver_root)) as (_, url):
        r = httpx.post(f"{url}/v1/completions", json={"model": "res1", "prompt": PROMPT,
                                                      "max_tokens": 1}, timeout=60)
        _error(r, 404)


def test_concurrent_first_requests_load_once(base_dir, resolver_root):
    with running_server(base_dir, "--enable-lora-runtime-updates", "--enable-lora-resolver",
                        "--lora-root", str(resolver_root)) as (server, url):
        models = server.models
        lookup, gate, entered, lookups, adds = models.resolver, threading.Event(), [], [], []
        resolve_lora, add_lora = models.resolve_lora, server.engine.add_lora

        def held_lookup(name):
            lookups.append(name)
            gate.wait(60)
            return lookup(name)

        async def counting_resolve(name):
            entered.append(name)
            await resolve_lora(name)

        async def counting_add(request):
            adds.append(request.lora_int_id)
            await add_lora(request)

        models.resolver, models.resolve_lora = held_lookup, counting_resolve
        server.engine.add_lora = counting_add
        results: list[int] = []

        def request():
            r = httpx.post(f"{url}/v1/completions", json={
                "model": "res2", "prompt": PROMPT, "max_tokens": 2}, timeout=120)
            results.append(r.status_code)

        threads = [threading.Thread(target=request) for _ in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(entered) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(entered) == 4          # all four wait on the one lookup
        gate.set()
        for t in threads:
            t.join(120)
        assert results == [200] * 4
        assert lookups == ["res2"] and len(adds) == 1
