"""Sampling controls through the whole engine: seeds, stops, EOS, lengths, the CLI, hub ids."""

from __future__ import annotations

import shutil

import pytest

from manylora import LLM, LoRARequest, SamplingParams
from manylora.entrypoints.cli import main as cli_main

PROMPTS = ["The quick brown fox", "SELECT name FROM users WHERE", "Hello", "def add(a, b):"]


@pytest.fixture(scope="module")
def llm(demo_set):
    return LLM(str(demo_set.base_dir), device="cpu", max_loras=2, max_lora_rank=32,
               num_kv_blocks=128, block_size=4)


def _sql(demo_set):
    return LoRARequest("sql", 1, str(demo_set.adapters["sql"]))


def test_same_seed_same_output_whatever_the_batch(llm, demo_set):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12,
                            ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params, _sql(demo_set), use_tqdm=False)[0]
    others = SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True)
    mixed = llm.generate(PROMPTS, [others, params, others, others],
                         [None, None, _sql(demo_set), None], use_tqdm=False)
    mixed2 = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [others, params, others],
                          [None, _sql(demo_set), None], use_tqdm=False)
    assert mixed2[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(mixed[1].outputs[0].token_ids) == 12
    other_seed = llm.generate(PROMPTS[0], SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=12, ignore_eos=True),
        _sql(demo_set), use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_max_tokens_and_finish_reason(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length" and out.finished


def test_stop_token_ids_and_stop_strings(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    by_id = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert by_id.outputs[0].token_ids == full.token_ids[:first + 1]
    assert by_id.outputs[0].finish_reason == "stop"
    assert by_id.outputs[0].stop_reason == stop_id
    tok = llm.get_tokenizer()
    # as vLLM: the stop token is in token_ids, not in the text
    assert by_id.outputs[0].text == tok.decode(full.token_ids[:first], skip_special_tokens=True)

    text = full.text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip()
                and "\ufffd" not in text[i:i + 2])
    cut = text.index(stop)
    by_str = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True, stop=[stop]),
                          use_tqdm=False)[0].outputs[0]
    assert by_str.text == text[:cut]
    assert by_str.finish_reason == "stop" and by_str.stop_reason == stop
    assert by_str.token_ids == full.token_ids[:len(by_str.token_ids)]
    assert stop in tok.decode(by_str.token_ids, skip_special_tokens=True)
    kept = llm.generate(PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:cut + len(stop)]


def test_eos_ends_generation_unless_ignored(llm):
    eos = llm.get_tokenizer().eos_token_id
    engine = llm.llm_engine
    # Make EOS the greedy choice by adding it to the stop set through the engine's own rule:
    # a prompt whose greedy continuation contains a token we declare as EOS.
    full = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=10,
                                                   ignore_eos=True), use_tqdm=False)[0]
    tok_id = full.outputs[0].token_ids[3]
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({eos, tok_id})
    try:
        stopped = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=10),
                               use_tqdm=False)[0].outputs[0]
        ignored = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=10,
                                                          ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
        held = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=10,
                                                       min_tokens=8), use_tqdm=False)[0].outputs[0]
    finally:
        engine.eos_token_ids = saved
    first = full.outputs[0].token_ids.index(tok_id)
    assert stopped.token_ids == full.outputs[0].token_ids[:first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert ignored.token_ids == full.outputs[0].token_ids
    assert len(held.token_ids) >= 8


def test_eos_ids_come_from_the_generation_config(llm, demo_set):
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(demo_set.base_dir).eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    assert set(eos) <= llm.llm_engine.eos_token_ids


def test_cli_generate(demo_set, capsys):
    code = cli_main(["generate", "--model", str(demo_set.base_dir), "--device", "cpu",
                     "--num-kv-blocks", "64", "--max-lora-rank", "32",
                     "--lora", f"sql={demo_set.adapters['sql']}",
                     "--lora", f"code={demo_set.adapters['code']}",
                     "--prompt", "SELECT", "--adapter", "sql",
                     "--prompt", "def f():", "--adapter", "code",
                     "--prompt", "Hello", "--adapter", "base", "--max-tokens", "4"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    assert [line.split("]")[0] for line in lines] == ["[sql", "[code", "[base"]


def test_cli_rejects_unregistered_adapter(demo_set):
    with pytest.raises(SystemExit, match="'nope' was not registered"):
        cli_main(["generate", "--model", str(demo_set.base_dir), "--prompt", "x",
                  "--adapter", "nope"])


def test_model_id_resolves_through_the_hub_cache(demo_set, tmp_path, monkeypatch):
    """A hub id goes through huggingface_hub's snapshot_download (offline: the local cache)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(demo_set.base_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM("acme/tiny-llama", device="cpu", num_kv_blocks=32, enable_lora=False)
    local = LLM(str(demo_set.base_dir), device="cpu", num_kv_blocks=32, enable_lora=False)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert (llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids ==
            local.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids)
