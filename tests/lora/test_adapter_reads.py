"""Adapters read off the engine's thread: a path seen for the first time is read,
validated, digested and pinned on a loader thread while every other request keeps running;
its requests wait in the queue, take the adapter's digest when the read is in, and match
transformers + peft; a bad adapter fails only its own requests, with an error that names
the problem, in the in-process core and in the core's own process.

A slow read is made by wrapping the format reader (``load_adapter_dir``, called on the
loader thread) so that it waits on a ``threading.Event`` the test sets: what the tests
check while the read waits does not depend on timing.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from manylora import LLM, LoRARequest, SamplingParams
from manylora.lora import reader as reader_module
from manylora.lora.adapter import LoRAAdapterError
from manylora.testing import make_checkpoint, make_peft_adapter
from manylora.testing.reference import hf_greedy_reference

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
ENGINE = dict(device="cpu", dtype="float32", max_loras=2, max_lora_rank=16, num_kv_blocks=96,
              block_size=4, max_model_len=64)
GREEDY8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 42, 8, 77, 12, 6], [11, 12, 13, 14, 15, 16, 17], [200, 3, 9, 81]]

_ids = itertools.count(100)


def lora(path: Path) -> LoRARequest:
    """A request for ``path`` under a fresh ``lora_int_id`` (a path the engine never saw)."""
    return LoRARequest(path.name, next(_ids), str(path))


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapter_reads")


@pytest.fixture(scope="module")
def base_dir(root) -> Path:
    return make_checkpoint(root / "base", "llama", seed=0, **TINY)


@pytest.fixture(scope="module")
def adapters(base_dir, root) -> dict[str, Path]:
    return {name: make_peft_adapter(base_dir, root / name, r=8, lora_alpha=16, seed=seed,
                                    target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
            for name, seed in (("a", 1), ("b", 2), ("c", 3))}


@pytest.fixture(scope="module")
def reference(base_dir, adapters):
    """Greedy tokens of every (prompt, adapter or None) from transformers + peft."""
    names = [None, *adapters]
    pairs = [(i, n) for i in range(len(PROMPTS)) for n in names]
    refs = hf_greedy_reference(base_dir, {k: str(v) for k, v in adapters.items()},
                               [PROMPTS[i] for i, _ in pairs], [n for _, n in pairs],
                               LONG.max_tokens)
    return {pair: ref.token_ids for pair, ref in zip(pairs, refs, strict=True)}


@pytest.fixture(scope="module")
def llm(base_dir) -> LLM:
    return LLM(str(base_dir), **ENGINE)


@pytest.fixture(scope="module")
def llm_process(base_dir) -> LLM:
    """The same engine with its core in a process of its own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MANYLORA_ENABLE_MULTIPROCESSING", "1")
        engine = LLM(str(base_dir), **ENGINE)
    yield engine
    engine.llm_engine.shutdown()


@pytest.fixture
def engine(llm):
    """The in-process engine; every test leaves it idle with all blocks free."""
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    yield eng
    assert not eng.has_unfinished_requests()
    kv = eng.engine_core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


class SlowReader:
    """Wraps the loader threads' format reader: every read records its path and waits
    until ``release`` (at most a minute, so a broken test fails instead of hanging)."""

    def __init__(self, monkeypatch) -> None:
        self.gate = threading.Event()
        self.paths: list[str] = []
        self.threads: set[str] = set()
        original = reader_module.load_adapter_dir

        def slow(request, path, target):
            self.paths.append(str(path))
            self.threads.add(threading.current_thread().name)
            assert self.gate.wait(60), "the test never released the read"
            return original(request, path, target)

        monkeypatch.setattr(reader_module, "load_adapter_dir", slow)

    def release(self) -> None:
        self.gate.set()


def run_until_done(engine, outputs: dict[str, list[int]] | None = None,
                   max_steps: int = 500) -> dict:
    """Step until every request ended; the final ``RequestOutput`` per id (tokens of
    CUMULATIVE outputs seen on the way land in ``outputs``)."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if outputs is not None:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError("the requests did not finish")


# ---------------------------------------------------------------------------------------------
# No stall for a new adapter


def test_streams_run_while_a_new_adapter_is_read(engine, adapters, reference, monkeypatch):
    reader = SlowReader(monkeypatch)
    core = engine.engine_core
    stats0 = engine.lora_cache_stats()
    new = lora(adapters["a"])
    engine.add_request("base", {"prompt_token_ids": PROMPTS[0]}, LONG)
    engine.add_request("new-1", {"prompt_token_ids": PROMPTS[1]}, LONG, new)
    engine.add_request("new-2", {"prompt_token_ids": PROMPTS[2]}, LONG, new)  # joins the read
    waiting = [core.scheduler.requests[r] for r in ("new-1", "new-2")]
    assert all(r.lora_digest is None and r.adapter_pending for r in waiting)

    seen: dict[str, list[int]] = {}
    for _ in range(8):                        # the read cannot end: the gate is shut
        for out in engine.step():
            seen[out.request_id] = list(out.outputs[0].token_ids)
    assert len(seen.get("base", [])) >= 6     # the other stream advanced every step
    assert "new-1" not in seen and "new-2" not in seen
    assert core.lora_manager.is_loading(new.lora_int_id)
    assert not core.lora_manager.is_ready(new.lora_int_id)
    assert all(r.num_computed_tokens == 0 and r.block_hashes == [] for r in waiting)
    assert reader.paths == [str(adapters["a"])]           # one read for both requests
    assert all(name.startswith("lora-loader") for name in reader.threads)

    reader.release()
    finished = run_until_done(engine)
    assert set(finished) == {"base", "new-1", "new-2"}
    assert reader.paths == [str(adapters["a"])]
    digest = core.lora_manager._known[new.lora_int_id].digest
    assert all(r.lora_digest == digest and not r.adapter_pending for r in waiting)
    for rid, (prompt, name) in {"base": (0, None), "new-1": (1, "a"), "new-2": (2, "a")}.items():
        assert finished[rid].outputs[0].token_ids == reference[(prompt, name)], rid

    stats = engine.lora_cache_stats()
    assert stats.host_misses - stats0.host_misses == 1
    assert stats.adapter_waits - stats0.adapter_waits == 2
    assert stats.adapter_wait_seconds > stats0.adapter_wait_seconds
    tensors = load_file(adapters["a"] / "adapter_model.safetensors")
    packed = core.lora_manager.host_cache.get(new.lora_int_id)     # what the host cache holds
    assert stats.host_load_bytes - stats0.host_load_bytes == packed.nbytes
    assert packed.buf.numel() >= sum(
        t.numel() * 4 for k, t in tensors.items() if "lora_" in k)      # float32 A and B


def test_abort_while_waiting_for_the_read(engine, adapters, monkeypatch):
    reader = SlowReader(monkeypatch)
    new = lora(adapters["b"])
    engine.add_request("gone", {"prompt_token_ids": PROMPTS[0]}, GREEDY8, new)
    engine.add_request("base", {"prompt_token_ids": PROMPTS[1]}, GREEDY8)
    engine.step()
    engine.abort_request("gone")
    reader.release()
    finished = run_until_done(engine)
    assert set(finished) == {"base"}
    manager = engine.engine_core.lora_manager
    for _ in range(100):                   # the read ends unwatched; the next poll takes it
        engine.engine_core.poll_adapters()
        if not manager.is_loading(new.lora_int_id):
            break
        reader.gate.wait(0.05)
    assert manager.is_ready(new.lora_int_id) and manager._refs[new.lora_int_id] == 0
    assert engine.remove_lora(new.lora_int_id)


def test_add_lora_returns_when_read_and_remove_during_read_fails_it(engine, adapters,
                                                                    monkeypatch):
    reader = SlowReader(monkeypatch)
    first, second = lora(adapters["c"]), lora(adapters["b"])
    engine.add_request("base", {"prompt_token_ids": PROMPTS[0]}, LONG)
    loading = engine.add_lora_async(first)
    removed = engine.add_lora_async(second)
    got = 0
    for _ in range(4):
        got += len(engine.step())
    assert got >= 3 and not loading.done() and not removed.done()
    assert engine.remove_lora(second.lora_int_id)          # nothing uses it: gone now
    with pytest.raises(ValueError, match=f"adapter {second.lora_int_id} was removed"):
        removed.result(0)
    reader.release()
    run_until_done(engine)
    for _ in range(100):
        if loading.done():
            break
        engine.step()                        # an idle in-process step polls the read in
        reader.gate.wait(0.05)
    assert loading.result(0) is True
    assert engine.engine_core.lora_manager.is_ready(first.lora_int_id)
    assert not engine.engine_core.lora_manager.is_ready(second.lora_int_id)
    engine.remove_lora(first.lora_int_id)


def test_prefix_cache_keeps_two_new_adapters_apart(engine, adapters, reference):
    prompt = {"prompt_token_ids": PROMPTS[0]}
    one, two = lora(adapters["a"]), lora(adapters["b"])
    kv = engine.engine_core.scheduler.kv
    engine.add_request("one", prompt, LONG, one)
    first = run_until_done(engine)["one"].outputs[0].token_ids
    hits = kv.stats.prefix_hits
    engine.add_request("two", prompt, LONG, two)            # same tokens, another adapter
    second = run_until_done(engine)["two"].outputs[0].token_ids
    assert kv.stats.prefix_hits == hits                     # nothing of "one" was reused
    engine.add_request("again", prompt, LONG, one)
    third = run_until_done(engine)["again"].outputs[0].token_ids
    assert kv.stats.prefix_hits > hits                      # the same digest: its blocks
    assert first == third == reference[(0, "a")]
    assert second == reference[(0, "b")]
    for r in (one, two):
        engine.remove_lora(r.lora_int_id)


def test_session_turn_with_a_new_adapter_recomputes_its_history(engine, adapters, base_dir):
    """A turn whose adapter is still being read has no digest yet: the session's KV (made
    under the base model) is not reused for it."""
    engine.add_request("t1", {"prompt_token_ids": PROMPTS[0][:5]}, GREEDY8, session_id="s")
    t1 = run_until_done(engine)["t1"]
    new = lora(adapters["c"])
    engine.add_request("t2", {"prompt_token_ids": PROMPTS[0][5:]}, GREEDY8, new,
                       session_id="s")
    t2 = run_until_done(engine)["t2"]
    history = PROMPTS[0][:5] + t1.outputs[0].token_ids
    assert t2.prompt_token_ids == history + PROMPTS[0][5:]
    ref = hf_greedy_reference(base_dir, {"c": str(adapters["c"])}, [t2.prompt_token_ids],
                              ["c"], 8)
    assert t2.outputs[0].token_ids == ref[0].token_ids
    engine.end_session("s")
    engine.remove_lora(new.lora_int_id)


# ---------------------------------------------------------------------------------------------
# A bad adapter fails only its own requests


def nan_adapter(src: Path, dst: Path) -> Path:
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dst / "adapter_model.safetensors")
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = float("nan")
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


def wrong_shape_adapter(src: Path, dst: Path) -> Path:
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dst / "adapter_model.safetensors")
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 3)
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


@pytest.mark.parametrize("mode", ["in_process", "own_process"])
@pytest.mark.parametrize("damage, pattern", [
    (nan_adapter, r"NaN or Inf in lora_B"),
    (wrong_shape_adapter, r"down_proj has lora_A \(8, 67\).*base projection needs \[r, 64\]"),
], ids=["nan", "shape"])
def test_bad_adapter_fails_only_its_requests(request, mode, damage, pattern, adapters, root,
                                             reference):
    llm = request.getfixturevalue("llm" if mode == "in_process" else "llm_process")
    bad = damage(adapters["a"], root / f"{damage.__name__}-{mode}")
    good, broken = lora(adapters["b"]), lora(bad)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS] + [{"prompt_token_ids": PROMPTS[0]}]
    outs = llm.generate(prompts, LONG, [broken, good, None, broken], use_tqdm=False)
    for i in (0, 3):
        comp = outs[i].outputs[0]
        assert comp.finish_reason == "error" and comp.token_ids == []
        assert isinstance(outs[i].error, LoRAAdapterError)
        assert "adapter" in str(outs[i].error) and bad.name in str(outs[i].error)
        assert re.search(pattern, str(outs[i].error)), outs[i].error
    assert outs[1].outputs[0].token_ids == reference[(1, "b")]
    assert outs[2].outputs[0].token_ids == reference[(2, None)]
    assert outs[1].error is None and outs[1].outputs[0].finish_reason == "length"
    with pytest.raises(LoRAAdapterError, match=pattern):     # add_lora: the same error
        llm.llm_engine.add_lora(lora(bad))
    assert llm.llm_engine.kv_cache_stats().used_blocks == 0
    stats = llm.llm_engine.lora_cache_stats()
    assert stats.host_load_failures >= 2
    llm.llm_engine.remove_lora(good.lora_int_id)


@pytest.mark.parametrize("mode", ["in_process", "own_process"])
def test_missing_adapter_is_refused_on_arrival(request, mode, root):
    llm = request.getfixturevalue("llm" if mode == "in_process" else "llm_process")
    missing = root / "never-written"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        llm.generate("hi", GREEDY8, lora(missing), use_tqdm=False)
    with pytest.raises(FileNotFoundError, match=str(missing)):
        llm.llm_engine.add_lora(lora(missing))
    assert not llm.llm_engine.has_unfinished_requests()


def test_outputs_match_peft_after_a_read_in_the_core_process(llm_process, adapters, reference):
    new = lora(adapters["c"])
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm_process.generate(prompts, LONG, [new, None, new], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        reference[(0, "c")], reference[(1, None)], reference[(2, "c")]]
    stats = llm_process.llm_engine.lora_cache_stats()
    assert stats.adapter_waits >= 2 and stats.host_load_bytes > 0
    assert llm_process.llm_engine.add_lora(lora(adapters["b"])) is True


def test_no_block_hash_without_the_adapter_digest(engine, adapters):
    """A request whose adapter's first read is in flight cannot be hashed into the prefix
    cache (its hashes would be rooted in the base model's)."""
    from manylora.request import Request

    kv = engine.engine_core.scheduler.kv
    req = Request("x", None, list(PROMPTS[0]), GREEDY8, lora(adapters["a"]), 32,
                  adapter_pending=True)
    with pytest.raises(RuntimeError, match="digest is not known yet"):
        kv.lookup(req)


@pytest.mark.gpu
def test_streams_run_while_a_new_adapter_is_read_on_cuda(base_dir, adapters, monkeypatch):
    """The same on a GPU (pinned host copies, the copy stream, CUDA graphs): the other
    stream advances every step while the read waits, and the waiting requests' tokens match
    transformers + peft on the GPU (near-ties forgiven)."""
    from manylora.testing.reference import compare_greedy

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm_gpu = LLM(str(base_dir), **{**ENGINE, "device": "cuda"})
    engine = llm_gpu.llm_engine
    reader = SlowReader(monkeypatch)
    new = lora(adapters["b"])
    engine.add_request("base", {"prompt_token_ids": PROMPTS[0]}, LONG)
    engine.add_request("new", {"prompt_token_ids": PROMPTS[1]}, LONG, new)
    seen: dict[str, list[int]] = {}
    for _ in range(8):
        for out in engine.step():
            seen[out.request_id] = list(out.outputs[0].token_ids)
    assert len(seen.get("base", [])) >= 6 and "new" not in seen
    reader.release()
    finished = run_until_done(engine)
    refs = hf_greedy_reference(base_dir, {"b": str(adapters["b"])}, [PROMPTS[1], PROMPTS[0]],
                               ["b", None], LONG.max_tokens, device="cuda")
    for rid, ref in (("new", refs[0]), ("base", refs[1])):
        ok, where = compare_greedy(finished[rid].outputs[0].token_ids, ref)
        assert ok, (rid, where)
    assert engine.lora_cache_stats().device_load_bytes > 0
    engine.shutdown()


# ---------------------------------------------------------------------------------------------
# A cold burst of new adapters

BURST = 64
BURST_PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def write_random_adapters(root: Path, count: int, base_dir: Path,
                          distinct: int | None = None) -> list[Path]:
    """``count`` rank-4 q/v adapters in PEFT's layout (written directly, no model load:
    cheap), weights large enough to change the greedy output; adapter ``n`` holds weight set
    ``n % distinct`` (default: all distinct)."""
    gen = torch.Generator().manual_seed(2028)
    head = TINY["hidden_size"] // TINY["num_attention_heads"]
    dims = {"q_proj": TINY["hidden_size"], "v_proj": TINY["num_key_value_heads"] * head}
    paths: list[Path] = []
    for n in range(count):
        if distinct is not None and n >= distinct:
            path = root / f"burst{n}"
            shutil.copytree(paths[n % distinct], path)
            paths.append(path)
            continue
        tensors = {}
        for layer in range(TINY["num_hidden_layers"]):
            for module, out in dims.items():
                key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(
                    4, TINY["hidden_size"], generator=gen) * 0.3
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, 4, generator=gen) * 0.3
        path = root / f"burst{n}"
        path.mkdir(parents=True)
        save_file(tensors, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps(dict(
            peft_type="LORA", r=4, lora_alpha=8, target_modules=list(dims), bias="none",
            base_model_name_or_path=str(base_dir), task_type="CAUSAL_LM")))
        paths.append(path)
    return paths


def test_a_burst_of_new_adapters_loads_while_the_engine_decodes(base_dir, root):
    """64 adapters never seen (more than the host cache's 32 and the 16 slots; 64 paths and
    ids over 8 weight sets, so that peft's reference loads 8) named at once
    by requests arriving while base streams decode: every read succeeds, the base streams
    keep producing tokens meanwhile, and every request's tokens equal transformers +
    peft's (up to the reference's EOS, where greedy decoding there stops)."""
    paths = write_random_adapters(root / "burst", BURST, base_dir, distinct=8)
    prompts = {f"burst-{n}": [3 + n, 40 + n, 7, 99 - n] for n in range(BURST)}
    names = {f"burst-{n}": paths[n % 8].name for n in range(BURST)}     # same weights
    base_prompts = {"base-0": PROMPTS[0], "base-1": PROMPTS[1]}
    refs = hf_greedy_reference(base_dir, {p.name: str(p) for p in paths[:8]},
                               list(prompts.values()), list(names.values()),
                               BURST_PARAMS.max_tokens)
    expected = dict(zip(prompts, (r.token_ids for r in refs), strict=True))
    base_refs = hf_greedy_reference(base_dir, {}, list(base_prompts.values()), [None, None],
                                    LONG.max_tokens)
    expected.update(zip(base_prompts, (r.token_ids for r in base_refs), strict=True))
    assert len({tuple(t) for t in expected.values()}) > BURST // 2     # adapters matter

    llm = LLM(str(base_dir), **{**ENGINE, "max_loras": 16})
    engine = llm.llm_engine
    for rid, prompt in base_prompts.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, LONG)
    seen: dict[str, list[int]] = {}
    for out in engine.step():                    # the base streams are decoding
        seen[out.request_id] = list(out.outputs[0].token_ids)
    for n, path in enumerate(paths):             # then the burst, all at once
        engine.add_request(f"burst-{n}", {"prompt_token_ids": prompts[f"burst-{n}"]},
                           BURST_PARAMS, lora(path))
    before = {rid: len(seen.get(rid, [])) for rid in base_prompts}
    engine.step()
    progress: dict[str, list[int]] = {}
    finished = run_until_done(engine, progress, max_steps=5000)
    assert set(finished) == set(expected)
    for rid, out in finished.items():
        assert out.outputs[0].finish_reason == "length", (rid, out.outputs[0])
        ref = expected[rid]
        assert list(out.outputs[0].token_ids)[:len(ref)] == ref, rid
    assert all(len(progress[rid]) > before[rid] for rid in base_prompts)
    stats = engine.lora_cache_stats()
    assert stats.host_load_failures == 0
    assert stats.host_misses >= BURST
    engine.shutdown()
