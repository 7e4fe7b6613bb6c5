"""``POST /v1/load_lora_adapter`` against hostile and careless adapters (issue 18, findings
2, 3, 6), through ``httpx`` and the official ``openai`` client: every malformed class is a
4xx in OpenAI's error shape whose message names the adapter once and no server path; a
slow read lets other streams run to their end while ``/metrics`` shows it pending; a read
over ``--lora-load-timeout`` is a 504 of its own and later loads still work.

Slow reads wrap the loader threads' format reader (the core in this process) so that it
waits on a ``threading.Event`` the test holds: no assertion depends on timing."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from server_helpers import BASE, running_server

from manylora.lora import reader as reader_module
from manylora.testing import make_peft_adapter


@pytest.fixture(scope="module")
def hostile_root(server_root) -> Path:
    root = server_root / "hostile"
    root.mkdir()
    return root


@pytest.fixture(scope="module")
def good(base_dir, hostile_root) -> Path:
    return make_peft_adapter(base_dir, hostile_root / "good", r=4,
                             target_modules=["q_proj", "v_proj"], seed=71)


def _variant(good: Path, root: Path, name: str, config=None, tensors=None) -> Path:
    out = Path(shutil.copytree(good, root / name))
    if config is not None:
        cfg = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors is not None:
        state = load_file(out / "adapter_model.safetensors")
        save_file(tensors(state), out / "adapter_model.safetensors")
    return out


def _fifo(good: Path, root: Path, name: str, file: str) -> Path:
    out = Path(shutil.copytree(good, root / name))
    (out / file).unlink()
    os.mkfifo(out / file)
    return out


@pytest.fixture(scope="module")
def malformed(good, hostile_root) -> dict[str, tuple[str, int, str]]:
    """``{lora_name: (lora_path as sent, status, text the message must hold)}``."""
    r = hostile_root
    _variant(good, r, "rank0", tensors=lambda t: {
        k: v[:0] if "lora_A" in k else v[:, :0] for k, v in t.items()})
    _variant(good, r, "alpha_null", config={"lora_alpha": None})
    _variant(good, r, "alpha_str", config={"lora_alpha": "16"})
    _variant(good, r, "bad_regex", config={"alpha_pattern": {"q_proj(": 4}})
    _variant(good, r, "huge", tensors=lambda t: {k: v.fill_(1e38) for k, v in t.items()})
    _variant(good, r, "nan", tensors=lambda t: {k: v.fill_(float("nan")) for k, v in t.items()})
    _variant(good, r, "layer99", config={"layers_to_transform": [99]})
    _variant(good, r, "regex_nothing", config={"target_modules": r".*\.nothing_proj"})
    _variant(good, r, "rank_huge", config={"rank_pattern": {"q_proj": 100000}})
    _variant(good, r, "alpha_nothing", config={"alpha_pattern": {"o_proj": 2}})
    sparse = Path(shutil.copytree(good, r / "sparse_no_b"))
    header = json.dumps({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": {
        "dtype": "F32", "shape": [16384, 32768], "data_offsets": [0, 2 << 30]}}).encode()
    with open(sparse / "adapter_model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + (2 << 30))
    _fifo(good, r, "fifo_config", "adapter_config.json")
    _fifo(good, r, "fifo_weights", "adapter_model.safetensors")
    (r / "loop").symlink_to(r / "loop")
    inner = Path(shutil.copytree(good, r / "inner_loop"))
    (inner / "adapter_model.safetensors").unlink()
    (inner / "adapter_model.safetensors").symlink_to(inner / "adapter_model.safetensors")
    (r / "escape").mkdir()
    (r / "escape" / "adapter_config.json").symlink_to(good.parent.parent / "base" /
                                                      "config.json")
    return {
        "rank0": ("rank0", 400, "rank must agree and be at least 1"),
        "alpha_null": ("alpha_null", 400, "lora_alpha = None is not a finite number"),
        "alpha_str": ("alpha_str", 400, "lora_alpha = '16' is not a finite number"),
        "bad_regex": ("bad_regex", 400, "alpha_pattern key 'q_proj(' is not a valid regular"),
        "huge": ("huge", 400, "'huge': model.layers.0.self_attn.q_proj: lora_"),
        "nan": ("nan", 400, "NaN or Inf in lora_"),
        "layer99": ("layer99", 400, "layers_to_transform names layers [99], which the base "
                    "model does not have"),
        "regex_nothing": ("regex_nothing", 400, "not found in the base model"),
        "rank_huge": ("rank_huge", 400, "rank_pattern['q_proj'] = 100000 exceeds max_lora_rank"),
        "alpha_nothing": ("alpha_nothing", 400, "alpha_pattern keys ['o_proj'] match no module"),
        "sparse_no_b": ("sparse_no_b", 400, "q_proj has lora_A but not both A and B"),
        "fifo_config": ("fifo_config", 400, "adapter_config.json is a FIFO"),
        "fifo_weights": ("fifo_weights", 400, "adapter_model.safetensors is a FIFO"),
        "loop": ("loop", 400, "'loop': a symlink loop"),
        "inner_loop": ("inner_loop", 400, "a symlink loop"),
        "long": ("a" * 5000, 400, "the path is too long"),
        "nul": ("bad\x00name", 400, "not a valid file name"),
        "escape": ("escape", 403, "links outside the --lora-root"),
        "dotdot": ("../hostile/good", 403, "'..' is not allowed"),
        "gone": ("gone", 404, "no such adapter directory"),
    }


def _scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def _load(http: httpx.Client, name: str, path: str) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def _blocking_reader(monkeypatch, prefix: str) -> threading.Event:
    """Reads of adapters named ``prefix...`` wait for the returned event."""
    gate = threading.Event()
    original = reader_module.load_adapter_dir

    def reader(request, path, target):
        if request.lora_name.startswith(prefix):
            gate.wait()
        return original(request, path, target)

    monkeypatch.setattr(reader_module, "load_adapter_dir", reader)
    return gate


def test_every_malformed_adapter_is_a_4xx_and_slow_reads_stall_nobody(
        base_dir, hostile_root, good, malformed, monkeypatch):
    gate = _blocking_reader(monkeypatch, "slowpoke")
    with running_server(base_dir, "--enable-lora-runtime-updates", "--lora-root",
                        str(hostile_root)) as (_, url):
        http = httpx.Client(base_url=url, timeout=60)
        for name, (path, status, text) in malformed.items():
            r = _load(http, name, path)
            assert r.status_code == status, (name, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert text in error["message"], (name, error["message"])
            assert error["message"].count(f"adapter '{name}'") <= 1, error["message"]
            assert str(hostile_root) not in error["message"], error["message"]
        models = http.get("/v1/models")
        assert models.status_code == 200
        assert {m["id"] for m in models.json()["data"]} == {BASE}

        # a read that hangs: other streams run to their end while it is pending
        done: list[httpx.Response] = []
        loader = threading.Thread(target=lambda: done.append(_load(http, "slowpoke", "good")))
        loader.start()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 120
        while _scrape(url)["manylora:lora_pending_loads"] != 1:
            assert time.monotonic() < deadline, "the load never became pending"
            time.sleep(0.05)
        stream = client.completions.create(model=BASE, prompt="hi", max_tokens=16,
                                           temperature=0.0, stream=True)
        chunks = [c for c in stream if c.choices and c.choices[0].text is not None]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert not done, "the load ended although its read was held"
        samples = _scrape(url)
        assert samples["manylora:lora_pending_loads"] == 1
        assert samples["manylora:lora_oldest_pending_load_seconds"] > 0
        assert http.get("/health").status_code == 200
        gate.set()
        loader.join(60)
        assert done[0].status_code == 200, done[0].text
        assert _scrape(url)["manylora:lora_pending_loads"] == 0
        out = client.completions.create(model="slowpoke", prompt="hi", max_tokens=4)
        assert out.choices[0].finish_reason == "length"
        entry = next(m for m in http.get("/v1/models").json()["data"] if m["id"] == "slowpoke")
        assert entry["root"] == "good"          # the path as given, not the server's


def test_read_over_the_bound_is_a_504_of_its_own(base_dir, hostile_root, good, monkeypatch):
    gate = _blocking_reader(monkeypatch, "stuck")
    try:
        with running_server(base_dir, "--enable-lora-runtime-updates", "--lora-root",
                            str(hostile_root), lora_load_timeout=1) as (_, url):
            http = httpx.Client(base_url=url, timeout=60)
            r = _load(http, "stuck", "good")
            assert r.status_code == 504, r.text
            error = r.json()["error"]
            assert error["code"] == "adapter_load_timeout" and error["param"] == "lora_path"
            assert "adapter 'stuck'" in error["message"]
            assert "no progress for 1 s" in error["message"]
            assert _scrape(url)["manylora:lora_stuck_loader_threads"] == 1
            assert _load(http, "fine", "good").status_code == 200
            assert "stuck" not in {m["id"] for m in http.get("/v1/models").json()["data"]}
    finally:
        gate.set()
