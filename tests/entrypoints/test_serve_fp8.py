"""``manylora serve --quantization fp8`` (vLLM's online FP8 flag) reaches the engine: the
served model's projections hold float8_e4m3fn weights and the server answers with them."""

from __future__ import annotations

import httpx
import torch
from server_helpers import BASE, running_server

from manylora.lora.linear import LoRALinear


def test_serve_quantization_fp8_quantizes_the_served_model(base_dir):
    with running_server(base_dir, "--quantization", "fp8") as (server, url):
        body = httpx.post(f"{url}/v1/completions", json={
            "model": BASE, "prompt": "hello", "max_tokens": 2}, timeout=60).json()
        assert body["usage"]["completion_tokens"] == 2
        model = server.engine.engine.engine_core.executor.model
        linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
        assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
