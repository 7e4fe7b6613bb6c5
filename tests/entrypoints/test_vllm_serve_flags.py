"""Every flag of vLLM's ``vllm serve`` parser (the names, read from vLLM's source and kept in
``data/vllm_serve_flags.txt``) is known to ``manylora serve``; the ones manylora honours work
on a real server (``--seed`` across two engine starts, ``--config`` YAML under command-line
flags, ``--response-role``, ``--return-tokens-as-token-ids``,
``--enable-force-include-usage``, ``--chat-template-content-format``, ``--download-dir``,
``--tool-parser-plugin``, ``--disable-frontend-multiprocessing``); the others are no-ops
with one INFO line or refused with the reason."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest
from server_helpers import BASE, running_server
from transformers import AutoTokenizer

from manylora.entrypoints.cli import _parser
from manylora.entrypoints.openai.chat_template import content_format
from manylora.entrypoints.openai.launcher import create_server
from manylora.entrypoints.openai.serve_args import serve_parser
from manylora.entrypoints.openai.tool_parsers import TOOL_PARSERS
from manylora.entrypoints.openai.vllm_flags import check_vllm_flags
from manylora.entrypoints.ray_serve.args import parse as parse_serve_ray

FLAGS_FILE = Path(__file__).parent / "data" / "vllm_serve_flags.txt"

# a chat template that reads message content as OpenAI parts
PARTS_TEMPLATE = ("{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]"
                  "{% endfor %}{% endfor %}")

PLUGIN = '''
from manylora.entrypoints.openai.tool_parsers import register_tool_parser
from manylora.entrypoints.openai.tool_parsers.hermes import HermesToolParser


@register_tool_parser("plugin_hermes")
class PluginHermes(HermesToolParser):
    name = "plugin_hermes"
'''


def vllm_flags() -> list[str]:
    return [line.strip() for line in FLAGS_FILE.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def _value(action) -> list[str]:
    """A value of the flag's type (none for a switch)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [sorted(action.choices)[0]]
    if action.type is int:
        return ["1"]
    if action.type is float:
        return ["0.5"]
    return ["x"]


@pytest.mark.parametrize("flag", vllm_flags())
def test_every_vllm_serve_flag_is_known(flag, tmp_path):
    parser = serve_parser()
    action = parser._option_string_actions.get(flag)
    assert action is not None, f"manylora serve does not know vLLM's {flag}"
    if flag == "--config":
        (tmp_path / "c.yaml").write_text("max-num-seqs: 3\n")
        value = [str(tmp_path / "c.yaml")]
    elif flag == "--structured-outputs-config":
        value = ['{"disable_any_whitespace": true}']
    else:
        value = _value(action)
    parser.parse_args(["--model", "m", flag, *value])


def test_the_fixture_is_vllms_parser():
    flags = vllm_flags()
    assert len(flags) == len(set(flags)) > 200
    assert {"--seed", "--config", "--enable-chunked-prefill", "-tp", "-O"} <= set(flags)


def test_config_file_under_the_command_line(tmp_path, base_dir):
    """vLLM's YAML: dashes or underscores, true/false switches, lists and mappings; the
    command line wins."""
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {base_dir}\nport: 9000\nmax_num_seqs: 7\n"
                      "enable-prefix-caching: false\nenable-chunked-prefill: true\n"
                      "served-model-name: [a, b]\n"
                      "override-generation-config: {temperature: 0.5}\n")
    args = serve_parser().parse_args(["--config", str(config), "--port", "9001"])
    assert (args.model, args.port, args.max_num_seqs) == (str(base_dir), 9001, 7)
    assert args.enable_prefix_caching is False and args.enable_chunked_prefill is True
    assert args.served_model_name == ["a", "b"]
    assert json.loads(args.override_generation_config) == {"temperature": 0.5}
    # the same through the manylora command's subparser
    args = _parser().parse_args(["serve", f"--config={config}", "--max-num-seqs", "5"])
    assert (args.command, args.model, args.max_num_seqs) == ("serve", str(base_dir), 5)
    # serve-ray reads it too, and hands its replicas the flags, not the file
    ns, argv = parse_serve_ray(["--config", str(config), "--num-replicas", "2"])
    assert (ns.model, ns.max_num_seqs, ns.num_replicas) == (str(base_dir), 7, 2)
    assert "--config" not in argv and "--max-num-seqs" in argv


@pytest.mark.parametrize("name, text", [("c.json", "{}"), ("c.yaml", "- a list\n"),
                                        ("c.yaml", "a: [\n")])
def test_bad_config_file(tmp_path, name, text, capsys):
    (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--config", str(tmp_path / name)])
    assert "--config" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2: manylora does not "
                                        "split layers over GPUs"),
    (["-pp", "4"], "--pipeline-parallel-size 4"),
    (["--lora-extra-vocab-size", "256"], "--lora-extra-vocab-size 256: manylora's adapters "
                                         "cannot add tokens"),
    (["--default-mm-loras", '{"image": "/a"}'], "--default-mm-loras"),
    (["--long-lora-scaling-factors", "4.0"], "--long-lora-scaling-factors 4.0: manylora "
                                             "has no long-context LoRA"),
    (["--quantization", "awq"], "quantization='awq' needs a checkpoint in that format"),
    (["-q", "int3"], "unknown quantization 'int3'"),
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend ray"),
    (["--enable-lora-bias"], "--enable-lora-bias: manylora's adapters have no bias"),
    (["--enable-expert-parallel"], "--enable-expert-parallel: manylora has no expert "
                                   "parallelism"),
    (["--reasoning-parser", "granite"], "--reasoning-parser 'granite': no such parser (one "
                                        "of deepseek_r1, qwen3)"),
    (["--tokenizer-mode", "mistral"], "tokenizer_mode 'mistral' is not supported"),
    (["--tool-call-parser", "nope"], "--tool-call-parser 'nope': no such parser"),
    (["--tool-parser-plugin", "/nonexistent.py"], "no such file"),
    (["--data-parallel-size", "2"], "manylora serve-ray"),
])
def test_refused_flags(base_dir, flags, message):
    args = serve_parser().parse_args(["--model", str(base_dir), "--device", "cpu", *flags])
    with pytest.raises(ValueError) as e:
        create_server(args)
    assert message in str(e.value)


def test_noops_log_one_line_each(caplog):
    flags = ["--enable-chunked-prefill", "--max-seq-len-to-capture", "8192",
             "--disable-custom-all-reduce", "--distributed-executor-backend", "mp",
             "--pipeline-parallel-size", "1", "--no-enable-lora-bias"]
    with caplog.at_level(logging.INFO, "manylora.entrypoints.openai.vllm_flags"):
        check_vllm_flags(serve_parser().parse_args(["--model", "m", *flags]))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6
    for shown in ("--enable-chunked-prefill:", "--max-seq-len-to-capture 8192:",
                  "--disable-custom-all-reduce:", "--distributed-executor-backend mp:",
                  "--pipeline-parallel-size 1:", "--no-enable-lora-bias:"):
        assert sum(line.startswith(shown) for line in lines) == 1, shown
    assert all("no effect in manylora" in line for line in lines)


def test_content_format():
    assert content_format("auto", PARTS_TEMPLATE) == "openai"
    assert content_format("auto", "{% for m in messages %}{{ m['content'] }}{% endfor %}"
                          ) == "string"
    assert content_format("string", PARTS_TEMPLATE) == "string"
    assert content_format("openai", None) == "openai"


def _hub_cache(base_dir: Path, cache: Path) -> None:
    """``base_dir`` as the snapshot of hub repo ``org/tiny`` in a hub cache folder."""
    repo = cache / "models--org--tiny"
    shutil.copytree(base_dir, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)


def _sample_twice(url: str) -> list[list[str]]:
    """Two unseeded sampled completions' tokens, one after the other."""
    out = []
    for _ in range(2):
        body = httpx.post(f"{url}/v1/completions", json={
            "model": BASE, "prompt": "hello", "max_tokens": 8, "temperature": 1.0,
            "ignore_eos": True, "logprobs": 0}, timeout=60).json()
        out.append(body["choices"][0]["logprobs"]["tokens"])
    return out


@pytest.fixture
def tool_parser_registry():
    """The process-wide tool-parser registry, as it was before the test loaded a plugin."""
    before = dict(TOOL_PARSERS)
    yield TOOL_PARSERS
    TOOL_PARSERS.clear()
    TOOL_PARSERS.update(before)


def test_honoured_flags_on_a_server(base_dir, tmp_path, monkeypatch, tool_parser_registry):
    """Two starts with ``--seed 7`` sample the same unseeded tokens; the model comes from
    the hub cache in ``--download-dir`` (offline); the other honoured flags on the way."""
    _hub_cache(base_dir, tmp_path / "hub")
    (tmp_path / "plugin.py").write_text(PLUGIN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    flags = ["--model", "org/tiny", "--download-dir", str(tmp_path / "hub"), "--seed", "7",
             "--response-role", "bot", "--return-tokens-as-token-ids",
             "--enable-force-include-usage", "--chat-template", PARTS_TEMPLATE,
             "--tool-parser-plugin", str(tmp_path / "plugin.py"),
             "--enable-auto-tool-choice", "--tool-call-parser", "plugin_hermes",
             "--enable-prompt-tokens-details"]
    runs = []
    for start in range(2):
        with running_server(base_dir, *flags) as (server, url):
            runs.append(_sample_twice(url))
            if start:
                continue
            assert "plugin_hermes" in tool_parser_registry
            tokens = runs[0][0]
            assert len(tokens) == 8 and all(t.startswith("token_id:") for t in tokens)
            body = httpx.post(f"{url}/v1/completions", json={
                "model": BASE, "prompt": "hello", "max_tokens": 2, "logprobs": 0,
                "return_tokens_as_token_ids": False}, timeout=60).json()
            assert not body["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
            messages = [{"role": "user", "content": "hi"}]
            chat = httpx.post(f"{url}/v1/chat/completions", json={
                "model": BASE, "messages": messages, "max_tokens": 2}, timeout=60).json()
            assert chat["choices"][0]["message"]["role"] == "bot"
            cont = httpx.post(f"{url}/v1/chat/completions", json={
                "model": BASE, "messages": messages, "max_tokens": 2,
                "add_generation_prompt": False}, timeout=60).json()
            assert cont["choices"][0]["message"]["role"] == "user"
            with httpx.stream("POST", f"{url}/v1/chat/completions", json={
                    "model": BASE, "messages": messages, "max_tokens": 2, "stream": True},
                    timeout=60) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
            assert events[0]["choices"][0]["delta"]["role"] == "bot"
            assert events[-1]["choices"] == []
            assert events[-1]["usage"]["completion_tokens"] == 2
            # auto content format: the template loops over content, so it gets parts
            tok = httpx.post(f"{url}/tokenize", json={"model": BASE, "messages": messages},
                             timeout=60).json()
            expected = AutoTokenizer.from_pretrained(base_dir)("[hi]",
                                                               add_special_tokens=False)
            assert tok["tokens"] == expected["input_ids"]
            _cached_tokens_reported(url)
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


def _cached_tokens_reported(url: str) -> None:
    """``usage.prompt_tokens_details.cached_tokens``: none the first time a prompt is seen,
    whole KV blocks of it (4 tokens each, never its last token) the second time, streamed
    or not."""
    prompt = "a prompt long enough to fill several blocks of the prefix cache " * 2
    usages = []
    for stream in (False, True):
        body = {"model": BASE, "prompt": prompt, "max_tokens": 2, "stream": stream}
        if not stream:
            usages.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60
                                     ).json()["usage"])
            continue
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            usages.append([json.loads(line[6:]) for line in r.iter_lines()
                           if line.startswith("data: {")][-1]["usage"])
    first, second = (u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert first == 0
    assert 0 < second < usages[1]["prompt_tokens"] and second % 4 == 0


def test_disable_frontend_multiprocessing(base_dir):
    with running_server(base_dir, "--disable-frontend-multiprocessing",
                        engine_process=True) as (server, url):
        assert server.engine.engine.client.in_process
        usage = httpx.post(f"{url}/v1/completions", json={
            "model": BASE, "prompt": "hi", "max_tokens": 1}, timeout=60).json()["usage"]
        assert "prompt_tokens_details" not in usage
