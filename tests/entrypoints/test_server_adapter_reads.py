"""The server and adapters read off the engine's thread, through the official ``openai``
client and ``httpx``: a bad adapter's load is a 400 that names the problem, a missing one a
404; a request whose adapter cannot be read again fails with the OpenAI error shape (404
naming the files), streamed or not, while other requests are served; ``/metrics`` counts
the host reads, their bytes, the slot loads and the requests that waited for a read,
parsed by ``prometheus_client``'s parser."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from server_helpers import BASE, running_server

from manylora.testing import make_peft_adapter


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) >= {"message", "type", "code"} and body["message"]
    return body


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples, name: str, **labels) -> float:
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == w for k, w in labels.items()))


def _adapter_bytes(path) -> int:
    """float32 bytes of an adapter's A and B tensors (the server's dtype)."""
    tensors = load_file(path / "adapter_model.safetensors")
    return sum(t.numel() * 4 for k, t in tensors.items() if "lora_" in k)


@pytest.fixture(scope="module")
def reads_root(server_root):
    root = server_root / "reads"
    root.mkdir()
    return root


@pytest.mark.parametrize("engine_process", [False, True], ids=["in_process", "own_process"])
def test_bad_adapter_load_is_400_and_missing_is_404(base_dir, reads_root, engine_process):
    good = make_peft_adapter(base_dir, reads_root / f"good-{engine_process}", r=4,
                             target_modules=["q_proj", "v_proj"], seed=31)
    bad = reads_root / f"nan-{engine_process}"
    shutil.copytree(good, bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, bad / "adapter_model.safetensors")
    with running_server(base_dir, "--enable-lora-runtime-updates", "--lora-root",
                        str(reads_root), engine_process=engine_process) as (_, url):
        http = httpx.Client(base_url=url, timeout=60)

        def load(name, path):
            return http.post("/v1/load_lora_adapter", json={"lora_name": name,
                                                            "lora_path": str(path)})

        message = _error(load("nan", bad), 400)["message"]
        assert "NaN or Inf in lora_B" in message and "'nan'" in message
        assert str(reads_root / "gone") in _error(load("gone", reads_root / "gone"),
                                                  404)["message"]
        assert load("good", good).status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="good", prompt="hi", max_tokens=4,
                                        temperature=0.0)
        assert out.choices[0].finish_reason == "length"
        assert "nan" not in {m.id for m in client.models.list().data}
        samples = _scrape(url)
        assert _value(samples, "manylora:lora_load_failures_total") == 1
        assert _value(samples, "manylora:request_success_total", finished_reason="error") == 0


def test_unreadable_adapter_fails_its_requests_and_metrics_count_reads(base_dir, reads_root):
    one = make_peft_adapter(base_dir, reads_root / "one", r=4,
                            target_modules=["q_proj", "v_proj", "o_proj"], seed=41)
    two = make_peft_adapter(base_dir, reads_root / "two", r=8,
                            target_modules=["q_proj", "k_proj", "down_proj"], seed=42)
    with running_server(base_dir, "--enable-lora-runtime-updates", "--lora-root",
                        str(reads_root), max_loras=1, max_cpu_loras=1) as (_, url):
        http = httpx.Client(base_url=url, timeout=60)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for name, path in (("one", one), ("two", two)):   # two evicts one from the host cache
            r = http.post("/v1/load_lora_adapter", json={"lora_name": name,
                                                         "lora_path": str(path)})
            assert r.status_code == 200, r.text
        # "one" is on disk only: its request waits for the re-read, then runs in the slot
        out = client.completions.create(model="one", prompt="hi", max_tokens=4,
                                        temperature=0.0)
        assert out.choices[0].finish_reason == "length"
        samples = _scrape(url)
        assert _value(samples, "manylora:lora_loads_total", tier="host") == 3
        assert _value(samples, "manylora:lora_loads_total", tier="device") == 1
        # Both byte counters count an adapter's packed form (its A and B, 16-byte aligned,
        # and its slot-load descriptors): "one" read twice and copied once, "two" read once.
        one_bytes = _value(samples, "manylora:lora_device_load_bytes_total")
        two_bytes = _value(samples, "manylora:lora_host_load_bytes_total") - 2 * one_bytes
        for packed, tensors in ((one_bytes, _adapter_bytes(one)), (two_bytes, _adapter_bytes(two))):
            assert tensors <= packed < 2 * tensors
        assert _value(samples, "manylora:lora_load_seconds_total", tier="device") > 0
        assert _value(samples, "manylora:lora_load_seconds_total", tier="host") > 0
        assert _value(samples, "manylora:lora_adapter_waits_total") == 1
        assert _value(samples, "manylora:lora_adapter_wait_seconds_total") > 0
        assert _value(samples, "manylora:lora_load_failures_total") == 0

        shutil.rmtree(two)           # "two" left the host cache for "one": its re-read fails
        with pytest.raises(openai.NotFoundError, match="no longer on disk") as info:
            client.completions.create(model="two", prompt="hi", max_tokens=4)
        assert info.value.status_code == 404
        body = info.value.body
        assert set(body) >= {"message", "type", "code"}
        assert str(two) not in body["message"]      # no server path to a client
        with pytest.raises(openai.NotFoundError, match="no longer on disk"):
            client.chat.completions.create(model="two", stream=True, max_tokens=4,
                                           messages=[{"role": "user", "content": "hi"}])
        # everyone else is served
        out = client.completions.create(model=BASE, prompt="hi", max_tokens=4)
        assert out.choices[0].finish_reason == "length"
        samples = _scrape(url)
        assert _value(samples, "manylora:lora_load_failures_total") == 1
        assert _value(samples, "manylora:request_success_total", finished_reason="error") == 1
