"""``POST /v1/responses`` and ``GET /v1/responses/{id}`` of a real ``manylora serve`` driven by
the official ``openai`` client (``client.responses.create``, ``create(stream=True)``,
``client.responses.stream``, ``client.responses.retrieve``), whose typed parsing must accept
every object and event.

References: the chat completions route on the same server for the same greedy request
(both render through the chat template), and transformers + peft (``hf_greedy_reference``)
for an adapter on the same weights.
"""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import BASE, hold_steps, running_server
from transformers import AutoTokenizer

from manylora.testing.reference import hf_greedy_reference

MAX_TOKENS = 8
KEY = "responses-key"
INSTRUCTIONS = "You write SQL."
CONVERSATION = [{"role": "user", "content": "All users?"},
                {"role": "assistant", "content": "SELECT"},
                {"role": "user", "content": [{"type": "input_text", "text": "Only"},
                                             {"type": "input_text", "text": "names."}]}]


@pytest.fixture(scope="module")
def served(base_dir, adapters):
    """conftest's server with the whole position range as context (256 tokens): the tiny
    tokenizer spends some 20 tokens on each message's chat-template markers."""
    modules = [f"{name}={adapters[name]}" for name in ("ad0", "ad1", "ad2", "ad3")]
    with running_server(base_dir, lora_modules=modules, engine_process=True,
                        max_model_len=256) as (server, url):
        yield server, url


def _chat_messages(instructions, items):
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        content = item["content"]
        messages.append({"role": item["role"], "content": content if isinstance(
            content, str) else "\n".join(p["text"] for p in content)})
    return messages


@pytest.mark.parametrize("model", [BASE, "ad1"])
def test_text_equals_chat_completions_for_the_same_greedy_request(client, model):
    reply = client.responses.create(model=model, instructions=INSTRUCTIONS,
                                    input=CONVERSATION, max_output_tokens=MAX_TOKENS,
                                    temperature=0.0, store=False)
    chat = client.chat.completions.create(
        model=model, messages=_chat_messages(INSTRUCTIONS, CONVERSATION),
        max_tokens=MAX_TOKENS, temperature=0.0)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.model == model
    assert reply.output_text == chat.choices[0].message.content
    message = reply.output[0]
    assert (message.type, message.role) == ("message", "assistant")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.usage.total_tokens == chat.usage.total_tokens
    finish = chat.choices[0].finish_reason
    assert reply.status == ("incomplete" if finish == "length" else "completed")
    assert (reply.temperature, reply.max_output_tokens, reply.instructions,
            reply.store) == (0.0, MAX_TOKENS, INSTRUCTIONS, False)


def test_adapter_text_equals_transformers_and_peft(client, base_dir, adapters):
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    ref = hf_greedy_reference(base_dir, {"ad2": adapters["ad2"]}, [ids], ["ad2"],
                              MAX_TOKENS)[0]
    reply = client.responses.create(model="ad2", input="Say hello.",
                                    max_output_tokens=MAX_TOKENS, temperature=0.0)
    assert reply.output_text == tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    assert reply.usage.output_tokens == len(ref.token_ids)


def test_streamed_events_concatenate_to_the_non_streamed_text(client):
    args = dict(model="ad1", input=CONVERSATION, instructions=INSTRUCTIONS, temperature=0.0,
                max_output_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    whole = client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == MAX_TOKENS
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    # the client's stream helper accumulates the same response
    with client.responses.stream(**args) as stream:
        helper = stream.get_final_response()
    assert helper.output_text == whole.output_text


def test_max_output_tokens_makes_the_response_incomplete(client):
    reply = client.responses.create(model=BASE, input="The quick brown fox",
                                    max_output_tokens=2, extra_body={"ignore_eos": True})
    assert reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output[0].status == "incomplete"
    assert reply.usage.output_tokens == 2


def test_stored_response_is_retrieved_and_continued(client):
    first = client.responses.create(model="ad1", instructions=INSTRUCTIONS,
                                    input=CONVERSATION[:1], max_output_tokens=MAX_TOKENS,
                                    temperature=0.0)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    follow = [{"role": "user", "content": "Only names."}]
    second = client.responses.create(model="ad1", previous_response_id=first.id, input=follow,
                                     instructions=INSTRUCTIONS, max_output_tokens=MAX_TOKENS,
                                     temperature=0.0)
    history = [*CONVERSATION[:1], {"role": "assistant", "content": first.output_text},
               *follow]
    chat = client.chat.completions.create(
        model="ad1", messages=_chat_messages(INSTRUCTIONS, history), max_tokens=MAX_TOKENS,
        temperature=0.0)
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    unstored = client.responses.create(model=BASE, input="hi", store=False,
                                       max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(unstored.id)
    assert info.value.body["param"] == "response_id"


def test_json_format_is_refused_naming_text_or_followed(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    try:
        reply = client.responses.create(
            model=BASE, input="A number as JSON.", max_output_tokens=40,
            text={"format": {"type": "json_schema", "name": "num", "schema": schema,
                             "strict": True}})
    except openai.BadRequestError as e:  # until the engine's grammar path (task 19D)
        assert e.body["param"] == "text"
    else:
        if reply.status == "completed":
            jsonschema.validate(json.loads(reply.output_text), schema)


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    # a function tool with the default auto choice needs a --tool-call-parser (vLLM's rule)
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tool_choice"),
    ({"reasoning": {"effort": "high"}}, "reasoning"), ({"background": True}, "background"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": []}, "input"), ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**4}, "max_output_tokens"), ({"temperature": "hot"}, "temperature"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"stream": "yes"}, "stream"), ({"model": "\ud800"}, "model"),
])
def test_bad_fields_get_400_naming_them(served, body, param):
    reply = httpx.post(f"{served[1]}/v1/responses",
                       content=json.dumps({"model": BASE, "input": "hi", **body}),
                       headers={"Content-Type": "application/json"}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_unknown_model_and_previous_response_are_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="nope", input="hi")
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=BASE, input="hi", previous_response_id="resp_unknown")
    assert info.value.body["param"] == "previous_response_id"


def test_api_key_is_needed(base_dir):
    with running_server(base_dir, "--api-key", KEY) as (_, url):
        body = {"model": BASE, "input": "hi", "max_output_tokens": 2}
        assert httpx.post(f"{url}/v1/responses", json=body).status_code == 401
        assert httpx.get(f"{url}/v1/responses/resp_x").status_code == 401
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        reply = keyed.responses.create(**body)
        assert keyed.responses.retrieve(reply.id).id == reply.id


def _wait_idle(server, engine) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        snap = server.engine.snapshot()
        if snap.num_running == snap.num_waiting == snap.kv.used_blocks == 0:
            break
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()


def test_client_leaving_aborts_the_request_streamed_or_not(base_dir):
    body = {"model": BASE, "input": "The quick", "max_output_tokens": 60, "ignore_eos": True}
    with running_server(base_dir) as (server, url):
        engine = server.engine.engine.engine_core
        release = hold_steps(engine)  # a request runs one step, then can only end by an abort
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/responses", json=body, timeout=0.5)
        _wait_idle(server, engine)
        release.set()
        # the streamed one: a few steps (its first token, under async scheduling, is out
        # after the second), then it too can only end by an abort
        release = hold_steps(engine, after=3)
        with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True},
                          timeout=60) as reply:
            lines = reply.iter_lines()
            assert next(lines) == "event: response.created"
            created = json.loads(next(lines).removeprefix("data: "))["response"]
            # the response is its own fairness group in the scheduler
            groups = {r.client_group for r in engine.scheduler.requests.values()}
            assert groups == {created["id"]}
        _wait_idle(server, engine)
        release.set()
        text = httpx.get(f"{url}/metrics").text
        aborted = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "manylora:request_success_total"
                   and s.labels["finished_reason"] == "abort"]
        assert aborted == [2]


def test_output_logprobs_equal_chat_completions(client):
    args = dict(model="ad1", max_output_tokens=4, temperature=0.0)
    reply = client.responses.create(input="Hi", include=["message.output_text.logprobs"],
                                    top_logprobs=3, extra_body={"ignore_eos": True}, **args)
    chat = client.chat.completions.create(
        model="ad1", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0.0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    ours = reply.output[0].content[0].logprobs
    theirs = chat.choices[0].logprobs.content
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs):
        assert (a.token, a.bytes) == (b.token, b.bytes)
        assert abs(a.logprob - b.logprob) < 1e-5
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
    events = list(client.responses.create(input="Hi", stream=True, include=[
        "message.output_text.logprobs"], top_logprobs=3, extra_body={"ignore_eos": True},
        **args))
    streamed = [lp for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in ours]
    plain = client.responses.create(input="Hi", **args)
    assert plain.output[0].content[0].logprobs is None
