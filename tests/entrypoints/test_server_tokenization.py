"""vLLM's tokenizer routes on a real server: ``/tokenize`` (text and chat), ``/detokenize``
and ``/tokenizer_info``, checked against the checkpoint's own Hugging Face tokenizer and
chat template, per model name (base and adapter), with their 400s, 404s and API key."""

from __future__ import annotations

import threading

import httpx
import pytest
from server_helpers import BASE, ENGINE, running_server
from transformers import AutoTokenizer

KEY = "tok-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = "The quick brown fox, 12345 times: héllo wörld!"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "It is"}]


@pytest.fixture(scope="module")
def reference(base_dir):
    return AutoTokenizer.from_pretrained(base_dir)


@pytest.fixture(scope="module")
def server(base_dir, adapters):
    with running_server(base_dir, "--api-key", KEY,
                        lora_modules=[f"ad0={adapters['ad0']}"]) as (srv, url):
        yield srv, httpx.Client(base_url=url, headers=AUTH, timeout=60)


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return error


@pytest.mark.parametrize("model", [None, BASE, "ad0"])
@pytest.mark.parametrize("special", [True, False])
def test_tokenize_text_matches_the_tokenizer(server, reference, model, special):
    body = {"prompt": TEXT, "add_special_tokens": special, "return_token_strs": True}
    if model is not None:
        body["model"] = model
    r = server[1].post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    expected = reference(TEXT, add_special_tokens=special).input_ids
    assert r.json() == {"count": len(expected), "max_model_len": ENGINE["max_model_len"],
                        "tokens": expected,
                        "token_strs": reference.convert_ids_to_tokens(expected)}
    assert (expected[0] == reference.bos_token_id) == special


def test_tokenize_text_longer_than_the_context_is_counted(server, reference):
    long = "lorem ipsum dolor " * 200
    r = server[1].post("/tokenize", json={"prompt": long})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == len(reference(long).input_ids) > ENGINE["max_model_len"]
    assert r.json()["token_strs"] is None


@pytest.mark.parametrize("generation, final", [(True, False), (False, True), (False, False)])
def test_tokenize_chat_renders_the_template(server, reference, generation, final):
    r = server[1].post("/tokenize", json={
        "model": "ad0", "messages": MESSAGES, "add_generation_prompt": generation,
        "continue_final_message": final})
    assert r.status_code == 200, r.text
    text = reference.apply_chat_template(MESSAGES, tokenize=False,
                                         add_generation_prompt=generation,
                                         continue_final_message=final)
    expected = reference(text, add_special_tokens=False).input_ids
    assert r.json()["tokens"] == expected and r.json()["count"] == len(expected)


def test_tokenize_chat_prompt_equals_the_chat_route_prompt(server):
    ids = server[1].post("/tokenize", json={"messages": MESSAGES[:2]}).json()["tokens"]
    chat = server[1].post("/v1/chat/completions", json={
        "model": BASE, "messages": MESSAGES[:2], "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("model", [None, "ad0"])
def test_detokenize_matches_the_tokenizer(server, reference, model):
    ids = reference(TEXT).input_ids + [reference.eos_token_id]
    body = {"tokens": ids} if model is None else {"tokens": ids, "model": model}
    r = server[1].post("/detokenize", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": reference.decode(ids)}
    assert r.json()["prompt"].endswith(reference.eos_token)


def test_tokenizer_info_is_the_tokenizers_configuration(server, reference, base_dir):
    r = server[1].get("/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] == type(reference).__name__
    assert info["chat_template"] == reference.chat_template
    assert info["bos_token"] == reference.bos_token and info["eos_token"] == reference.eos_token
    assert str(base_dir) not in r.text        # no server paths
    assert not any(key.endswith("_file") for key in info)


@pytest.mark.parametrize("route, body, status, param", [
    ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ("/tokenize", {"model": BASE}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": True,
                   "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [1, 10**12]}, 400, "tokens[1]"),
])
def test_bad_bodies_are_named(server, route, body, status, param):
    error = _error(server[1].post(route, json=body), status, param)
    assert "internal" not in error["message"]
    if route == "/tokenize" and "prompt" not in body and "messages" not in body:
        assert error["message"] == "prompt: Field required; messages: Field required"


def test_token_past_the_vocabulary_is_a_400_naming_it(server, reference):
    error = _error(server[1].post("/detokenize", json={"tokens": [0, len(reference)]}), 400,
                   "tokens[1]")
    assert str(len(reference)) in error["message"]


@pytest.mark.parametrize("method, route, body", [
    ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/tokenizer_info", None)])
def test_routes_want_the_api_key(server, method, route, body):
    bare = httpx.Client(base_url=str(server[1].base_url), timeout=60)
    _error(bare.request(method, route, json=body), 401, None)
    assert server[1].request(method, route, json=body).status_code == 200


def test_tokenize_runs_on_the_tokenization_worker(server, reference):
    tokenizer = server[0].app.state.prompt_tokenizer.tokenizer
    seen: list[str] = []
    call = type(tokenizer).__call__

    def recording(self, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return call(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(tokenizer), "__call__", recording)
        r = server[1].post("/tokenize", json={"prompt": TEXT})
    assert r.status_code == 200 and r.json()["tokens"] == reference(TEXT).input_ids
    assert seen and all(name.startswith("manylora-tokenize") for name in seen)


def test_openapi_documents_the_routes_with_their_key(server):
    doc = server[1].get("/openapi.json").json()
    # 503 / 504: a model name the LoRA resolver loads on first use
    keyed = {"200", "400", "401", "404", "413", "503", "504"}
    for path, method, statuses in [("/tokenize", "post", keyed), ("/detokenize", "post", keyed),
                                   ("/tokenizer_info", "get", {"200", "400", "401", "413"})]:
        operation = doc["paths"][path][method]
        assert set(operation["responses"]) == statuses, path
        assert operation["security"] == [{"bearer": []}]


def test_without_a_tokenizer_the_routes_are_a_named_400(base_dir):
    with running_server(base_dir, "--skip-tokenizer-init") as (_, url):
        http = httpx.Client(base_url=url, timeout=60)
        for method, route, body, param in [
                ("POST", "/tokenize", {"prompt": "hi"}, "prompt"),
                ("POST", "/tokenize", {"messages": MESSAGES}, "messages"),
                ("POST", "/detokenize", {"tokens": [1]}, "tokens"),
                ("GET", "/tokenizer_info", None, None)]:
            error = _error(http.request(method, route, json=body), 400, param)
            assert "without" in error["message"] and "tokenizer" in error["message"]
