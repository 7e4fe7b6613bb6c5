"""``disable_any_whitespace`` as vLLM has it, server-wide (``--structured-outputs-config``)
on a real ``manylora serve`` of SmolLM2-135M-Instruct's GGUF: the openai client's
``chat.completions.parse`` with a pydantic model finishes its JSON on the EOS within 1.5x
the JSON's own token count (the tokenizer's count of the returned text, transformers'),
instead of running out of tokens in the whitespace a free JSON grammar allows. The
per-request option is checked in ``test_server_stop_token.py``, on that module's server
(no server-wide config). The flag's refusals need no model load."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel
from server_helpers import BASE, running_server

from manylora.entrypoints.openai.launcher import create_server
from manylora.entrypoints.openai.serve_args import serve_parser
from manylora.structured_params import StructuredOutputsConfig, StructuredOutputsParams


class Person(BaseModel):
    name: str
    age: int
    city: str


MESSAGES = [{"role": "user", "content": "Alice is 30 and lives in Paris. Give her as JSON "
                                        "with name, age and city."}]
MAX_TOKENS = 150


def check_parse_finishes(client, tokenizer, **kwargs) -> None:
    """``chat.completions.parse`` into ``Person`` ends on the EOS, with at most 1.5x the
    returned JSON's token count of completion tokens, and writes no optional
    whitespace."""
    reply = client.chat.completions.parse(model=BASE, messages=MESSAGES, temperature=0,
                                          max_tokens=MAX_TOKENS, response_format=Person,
                                          **kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    text = choice.message.content
    assert json.loads(text) == choice.message.parsed.model_dump()
    # no optional whitespace: only the separators xgrammar writes, Python's json.dumps' own
    # (a free grammar lets SmolLM2 write "{\n  " and "\n}" here)
    assert text == json.dumps(json.loads(text), ensure_ascii=False)
    json_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert reply.usage.completion_tokens <= 1.5 * json_tokens, (text, reply.usage)


@pytest.fixture(scope="module")
def client(smollm2_gguf):
    with running_server(smollm2_gguf, "--structured-outputs-config",
                        '{"backend": "xgrammar", "disable_any_whitespace": true, '
                        '"disable_fallback": true}', max_model_len=512, block_size=16,
                        num_kv_blocks=64, max_num_seqs=4) as (_, url):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_server_wide_disable_any_whitespace_finishes_json(client, smollm2_tokenizer):
    check_parse_finishes(client, smollm2_tokenizer)


@pytest.mark.parametrize(("config", "says"), [
    ('{"backend": "outlines"}', "backend 'outlines' is not supported"),
    ('{"disable_any_whitespace": true, "no_such_key": 1}', "unknown key 'no_such_key'"),
    ('{"reasoning_parser": "deepseek_r1"}', "reasoning_parser is not supported"),
    ('{"disable_any_whitespace": "yes"}', "disable_any_whitespace must be a bool"),
])
def test_structured_outputs_config_refusals_name_the_key(base_dir, config, says):
    args = serve_parser().parse_args(["--model", str(base_dir), "--device", "cpu",
                                      "--structured-outputs-config", config])
    with pytest.raises(ValueError, match=says):
        create_server(args)


@pytest.mark.parametrize("value", ["{not json", "[1, 2]"])
def test_structured_outputs_config_must_be_a_json_object(value, capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--model", "m", "--structured-outputs-config", value])
    assert "--structured-outputs-config" in capsys.readouterr().err


def test_the_server_wide_options_reach_each_constraint_and_its_cache_key():
    from manylora.structured.grammar import grammar_key

    request = StructuredOutputsParams(json={"type": "object"})
    config = StructuredOutputsConfig.parse('{"disable_any_whitespace": true}')
    applied = config.apply(request)
    assert applied.disable_any_whitespace and not request.disable_any_whitespace
    assert grammar_key(applied) != grammar_key(request)      # compiled apart
    assert StructuredOutputsConfig.parse(None).apply(request) is request
