"""Bad input gets an error whose message names the problem, and the engine keeps serving.

One tiny llama checkpoint (``make_checkpoint``) and peft adapters (``make_peft_adapter``),
written once per module; nothing is downloaded. Broken checkpoints and adapters are made by
copying good ones and damaging the copy.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config

from manylora import LLM, LoRARequest, SamplingParams
from manylora.checkpoint.weights import CheckpointError
from manylora.lora.adapter import LoRAAdapterError
from manylora.testing import make_checkpoint, make_peft_adapter

MAX_MODEL_LEN = 64
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
ENGINE = dict(max_loras=2, max_lora_rank=16, num_kv_blocks=64, block_size=4,
              max_model_len=MAX_MODEL_LEN)
GREEDY8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Once upon a time", "SELECT name FROM users"]

_lora_ids = itertools.count(1)


def lora(path: Path, name: str | None = None) -> LoRARequest:
    """A LoRARequest with a fresh lora_int_id (one per adapter path in the shared engine)."""
    return LoRARequest(name or path.name, next(_lora_ids), str(path))


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bad_input")


@pytest.fixture(scope="module")
def base_dir(root) -> Path:
    return make_checkpoint(root / "base", "llama", seed=0, **TINY)


@pytest.fixture(scope="module")
def good_adapter(base_dir, root) -> Path:
    return make_peft_adapter(base_dir, root / "good", r=8, lora_alpha=16,
                             target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], seed=1)


@pytest.fixture(scope="module")
def good_lora(good_adapter) -> LoRARequest:
    return lora(good_adapter, "good")


@pytest.fixture(scope="module")
def llm(base_dir) -> LLM:
    return LLM(str(base_dir), **ENGINE)


@pytest.fixture
def engine(llm):
    """The shared engine; every test must leave it idle with all blocks free."""
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    yield eng
    assert not eng.has_unfinished_requests()
    kv = eng.engine_core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def assert_read_fails(engine, request: LoRARequest, kind: type[Exception], pattern: str,
                      prompt: str = "hello") -> None:
    """The adapter passes the checks made when its request arrives (config only), and its
    read on a loader thread fails: the request ends with finish_reason "error", no token,
    and an error of ``kind`` whose message matches ``pattern``."""
    rid = engine.add_request(None, prompt, GREEDY8, request)
    out = run_to_completion(engine)[rid]
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    assert isinstance(out.error, kind), out.error
    assert re.search(pattern, str(out.error)), str(out.error)


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(adapter: Path, **changes) -> None:
    path = adapter / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


# ---------------------------------------------------------------------------------------------
# Checkpoints


def test_missing_checkpoint_dir(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        LLM(str(missing), **ENGINE)


def test_corrupt_safetensors(base_dir, tmp_path):
    bad = tmp_path / "corrupt"
    shutil.copytree(base_dir, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(b"\x00garbage, not a safetensors header" * 10)
    with pytest.raises(CheckpointError, match=re.escape(str(weights))):
        LLM(str(bad), **ENGINE)


def test_truncated_safetensors(base_dir, tmp_path):
    bad = tmp_path / "truncated"
    shutil.copytree(base_dir, bad)
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=re.escape(str(weights))):
        LLM(str(bad), **ENGINE)


def test_checkpoint_without_weights(base_dir, tmp_path):
    bad = tmp_path / "no_weights"
    shutil.copytree(base_dir, bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"No weight files in .*no_weights"):
        LLM(str(bad), **ENGINE)


def test_unsupported_architecture(tmp_path):
    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(str(gpt2))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(gpt2), **ENGINE)


def test_max_model_len_beyond_the_model(base_dir):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(base_dir), **{**ENGINE, "max_model_len": 4096})


# ---------------------------------------------------------------------------------------------
# Adapters


def test_rank_above_max_lora_rank(engine, base_dir, root):
    """Refused on arrival from its config, as vLLM refuses an ``r`` over max_lora_rank."""
    big = make_peft_adapter(base_dir, root / "r32", r=32, lora_alpha=32, seed=2)
    with pytest.raises(LoRAAdapterError, match=r"'r32': r = 32 exceeds max_lora_rank=16"):
        engine.add_request(None, "hello", GREEDY8, lora(big))


@pytest.mark.parametrize("config_targets", [["fc1"], r".*\.fc1"], ids=["list", "regex"])
def test_adapter_targets_module_the_model_lacks(engine, good_adapter, tmp_path,
                                                config_targets):
    bad = copy_adapter(good_adapter, tmp_path / "fc1")
    edit_config(bad, target_modules=config_targets)
    tensors = load_file(bad / "adapter_model.safetensors")
    renamed = {k.replace(".q_proj.", ".fc1."): v for k, v in tensors.items()
               if ".q_proj." in k}
    assert renamed
    save_file(renamed, bad / "adapter_model.safetensors")
    if isinstance(config_targets, list):      # named in the config: refused on arrival
        with pytest.raises(LoRAAdapterError, match="fc1"):
            engine.add_request(None, "hello", GREEDY8, lora(bad))
    else:                                     # a pattern: the weights show it
        assert_read_fails(engine, lora(bad), LoRAAdapterError, "fc1")


def test_adapter_for_another_base(engine, root):
    other_base = make_checkpoint(root / "other_base", "llama", seed=5,
                                 **{**TINY, "hidden_size": 48})
    other = make_peft_adapter(other_base, root / "other_adapter", r=4, seed=3)
    assert_read_fails(engine, lora(other), LoRAAdapterError,
                      r"lora_A \(4, 48\).*base projection needs \[r, 32\]")


def test_adapter_dir_missing(engine, tmp_path):
    missing = tmp_path / "no_such_adapter"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        engine.add_request(None, "hello", GREEDY8, lora(missing))


def test_adapter_config_missing(engine, good_adapter, tmp_path):
    bad = copy_adapter(good_adapter, tmp_path / "no_config")
    (bad / "adapter_config.json").unlink()
    with pytest.raises(LoRAAdapterError, match="adapter_config.json is missing"):
        engine.add_request(None, "hello", GREEDY8, lora(bad))


def test_adapter_weights_missing(engine, good_adapter, tmp_path):
    bad = copy_adapter(good_adapter, tmp_path / "no_weights")
    (bad / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match="no adapter_model.safetensors"):
        engine.add_request(None, "hello", GREEDY8, lora(bad))


def test_adapter_weights_corrupt(engine, good_adapter, tmp_path):
    bad = copy_adapter(good_adapter, tmp_path / "corrupt")
    weights = bad / "adapter_model.safetensors"
    weights.write_bytes(b"\xffnot safetensors at all" * 8)
    assert_read_fails(engine, lora(bad), LoRAAdapterError,
                      r"'corrupt': cannot read adapter_model\.safetensors: ")


def test_adapter_config_corrupt(engine, good_adapter, tmp_path):
    bad = copy_adapter(good_adapter, tmp_path / "bad_json")
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError, match="adapter_config.json"):
        engine.add_request(None, "hello", GREEDY8, lora(bad))


def test_dora_adapter_without_magnitudes(engine, base_dir, root):
    from safetensors.torch import load_file, save_file

    dora = make_peft_adapter(base_dir, root / "dora", r=4, use_dora=True, seed=4)
    tensors = load_file(dora / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "magnitude" not in k},
              dora / "adapter_model.safetensors")
    assert_read_fails(engine, lora(dora), LoRAAdapterError, "no lora_magnitude_vector.*DoRA")


def test_lora_target_modules_restriction(base_dir, root):
    llm_qv = LLM(str(base_dir), **ENGINE, lora_target_modules=("q_proj", "v_proj"))
    eng = llm_qv.llm_engine
    qo = make_peft_adapter(base_dir, root / "q_and_o", r=4, target_modules=["q_proj", "o_proj"],
                           seed=9)
    assert_read_fails(eng, lora(qo), LoRAAdapterError, r"targets o_proj.*lora_target_modules")
    assert not eng.has_unfinished_requests()
    qv = make_peft_adapter(base_dir, root / "qv_only", r=4, target_modules=["q_proj", "v_proj"],
                           seed=6)
    [out] = llm_qv.generate("hello", GREEDY8, lora(qv), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8


def test_other_base_model_name_warns_but_serves(llm, engine, good_adapter, tmp_path, caplog):
    renamed = copy_adapter(good_adapter, tmp_path / "renamed_base")
    edit_config(renamed, base_model_name_or_path="some-org/another-model")
    with caplog.at_level(logging.WARNING, logger="manylora"):
        [out] = llm.generate("hello", GREEDY8, lora(renamed), use_tqdm=False)
    assert "some-org/another-model" in caplog.text
    assert len(out.outputs[0].token_ids) == 8
    [ref] = llm.generate("hello", GREEDY8, lora(good_adapter), use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_lora_id_reused_for_another_path(engine, good_lora, good_adapter, tmp_path):
    engine.add_request("reuse-ok", "hello", GREEDY8, good_lora)
    engine.abort_request("reuse-ok")
    other = copy_adapter(good_adapter, tmp_path / "other_path")
    clash = LoRARequest("clash", good_lora.lora_int_id, str(other))
    with pytest.raises(ValueError, match=f"lora_int_id {good_lora.lora_int_id}"):
        engine.add_request(None, "hello", GREEDY8, clash)


# ---------------------------------------------------------------------------------------------
# Prompts, sampling parameters, list arguments


def test_prompt_longer_than_context(engine):
    ids = list(range(5, 5 + MAX_MODEL_LEN))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(None, {"prompt_token_ids": ids}, GREEDY8)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(None, "fox " * 200, GREEDY8)
    # one token shorter leaves room for one generated token
    rid = engine.add_request(None, {"prompt_token_ids": ids[:-1]}, GREEDY8)
    outs = engine.generate_all()
    assert [o.request_id for o in outs] == [rid]
    assert len(outs[0].outputs[0].token_ids) == 1
    assert outs[0].outputs[0].finish_reason == "length"


def test_empty_prompt(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(None, {"prompt_token_ids": []}, GREEDY8)


@pytest.mark.parametrize("bad_id", [-1, 512, 10**9])
def test_token_ids_outside_vocab(engine, bad_id):
    assert engine.vocab_size == 512
    with pytest.raises(ValueError, match=rf"\[{bad_id}\] are outside the vocabulary \[0, 512\)"):
        engine.add_request(None, {"prompt_token_ids": [1, 2, bad_id, 3]}, GREEDY8)


def test_malformed_prompt(engine):
    with pytest.raises(ValueError, match="a prompt must be a string"):
        engine.add_request(None, ["not", "a", "prompt"], GREEDY8)


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
])
def test_invalid_sampling_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_list_length_mismatch(llm, engine, good_lora):
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], [GREEDY8], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 0 entries for 1 prompts"):
        llm.generate(["a"], [], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request has 3 entries for 2 prompts"):
        llm.generate(["a", "b"], GREEDY8, [None, good_lora, None], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request has 0 entries for 2 prompts"):
        llm.generate(["a", "b"], GREEDY8, [], use_tqdm=False)


def test_duplicate_request_id(engine):
    engine.add_request("dup", "hello", GREEDY8)
    with pytest.raises(ValueError, match="'dup' is already in use"):
        engine.add_request("dup", "hello", GREEDY8)
    engine.abort_request("dup")


# ---------------------------------------------------------------------------------------------
# The engine keeps serving


def run_to_completion(engine, max_steps: int = 200) -> dict[str, object]:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return finished


def test_bad_requests_do_not_disturb_good_ones(llm, engine, good_lora, tmp_path):
    loras = [None, good_lora, None]
    ids = [engine.add_request(f"good-{i}", p, GREEDY8, lo)
           for i, (p, lo) in enumerate(zip(PROMPTS, loras, strict=True))]
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("bad-long", {"prompt_token_ids": [5] * (MAX_MODEL_LEN + 3)}, GREEDY8)
    with pytest.raises(FileNotFoundError):
        engine.add_request("bad-adapter", "hello", GREEDY8, lora(tmp_path / "missing"))
    engine.step()           # a step in between, then more bad input while requests run
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("bad-empty", {"prompt_token_ids": []}, GREEDY8)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text("[]")
    with pytest.raises(LoRAAdapterError, match="not a PEFT LoRA config"):
        engine.add_request("bad-config", "hello", GREEDY8, lora(corrupt))
    assert set(engine.engine_core.scheduler.requests) == set(ids)

    finished = run_to_completion(engine)
    assert set(finished) == set(ids)
    for rid in ids:
        comp = finished[rid].outputs[0]
        assert len(comp.token_ids) == 8 and comp.finish_reason == "length"
    kv = engine.engine_core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks

    fresh = llm.generate(PROMPTS, GREEDY8, loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fresh] == \
        [finished[rid].outputs[0].token_ids for rid in ids]
    # the adapter changes the output (so the comparison above means something)
    [base_out] = llm.generate(PROMPTS[1], GREEDY8, use_tqdm=False)
    assert base_out.outputs[0].token_ids != fresh[1].outputs[0].token_ids


@pytest.mark.parametrize("bad", ["too_long", "bad_adapter", "bad_vocab"])
def test_failing_generate_leaves_nothing_queued(llm, engine, good_lora, tmp_path, bad):
    prompts: list = list(PROMPTS)
    loras: list = [good_lora, None, good_lora]
    if bad == "too_long":
        prompts.append({"prompt_token_ids": [7] * MAX_MODEL_LEN})
        loras.append(None)
        error, match = ValueError, "max_model_len"
    elif bad == "bad_adapter":
        prompts.append("hello")
        loras.append(lora(tmp_path / "missing"))
        error, match = FileNotFoundError, "missing"
    else:
        prompts.append({"prompt_token_ids": [1, 100000]})
        loras.append(None)
        error, match = ValueError, "outside the vocabulary"
    with pytest.raises(error, match=match):
        llm.generate(prompts, GREEDY8, loras, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    kv = engine.engine_core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    # and the engine still serves
    outs = llm.generate(prompts[:3], GREEDY8, loras[:3], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]


def test_deleted_adapter_evicted_from_host_tier_fails_only_its_requests(base_dir, root):
    """An adapter that loaded fine, then left the host cache and lost its files: its requests
    end with finish_reason "error" and the error when the engine fails to reload it; the
    others complete."""
    doomed_dir = make_peft_adapter(base_dir, root / "doomed", r=4, seed=7)
    other_dir = make_peft_adapter(base_dir, root / "survivor", r=4, seed=8)
    llm_small = LLM(str(base_dir), **{**ENGINE, "max_loras": 1, "max_cpu_loras": 1})
    eng = llm_small.llm_engine
    doomed, survivor = lora(doomed_dir), lora(other_dir)

    eng.add_lora(doomed)                   # read once (the reads end before add_lora returns)
    eng.add_lora(survivor)                 # evicts doomed from the one-adapter host cache
    manager = eng.engine_core.lora_manager
    assert not manager.is_ready(doomed.lora_int_id) and manager.is_ready(survivor.lora_int_id)
    eng.add_request("doomed-1", PROMPTS[0], GREEDY8, doomed)
    eng.add_request("base", PROMPTS[1], GREEDY8)
    eng.add_request("survivor", PROMPTS[2], GREEDY8, survivor)
    eng.add_request("doomed-2", PROMPTS[1], GREEDY8, doomed)
    eng.add_request("survivor-2", PROMPTS[0], GREEDY8, survivor)
    shutil.rmtree(doomed_dir)

    finished = run_to_completion(eng)
    assert set(finished) == {"doomed-1", "doomed-2", "base", "survivor", "survivor-2"}
    for rid in ("doomed-1", "doomed-2"):
        assert finished[rid].outputs[0].finish_reason == "error"
        assert isinstance(finished[rid].error, FileNotFoundError)
        assert str(doomed_dir) in str(finished[rid].error)
    for rid in ("base", "survivor", "survivor-2"):
        comp = finished[rid].outputs[0]
        assert comp.finish_reason == "length" and len(comp.token_ids) == 8
    kv = eng.engine_core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    with pytest.raises(FileNotFoundError):
        eng.add_request(None, "hello", GREEDY8, doomed)
    # the survivors' tokens are what a fresh run gives
    ref = llm_small.generate([PROMPTS[2], PROMPTS[1]], GREEDY8, [survivor, None], use_tqdm=False)
    assert ref[0].outputs[0].token_ids == finished["survivor"].outputs[0].token_ids
    assert ref[1].outputs[0].token_ids == finished["base"].outputs[0].token_ids


def test_engine_still_serves_after_everything(llm, engine, good_lora):
    outs = llm.generate(PROMPTS, GREEDY8, good_lora, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert all(torch.tensor(o.outputs[0].token_ids).lt(512).all() for o in outs)
