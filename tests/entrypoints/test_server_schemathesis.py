"""A bounded Schemathesis run over every route of a real ``manylora serve`` on loopback:
``schemathesis run --checks all``, deterministic generation so CI sees the same cases every
time. Two runs: with an API key and run-time adapter updates, every phase (coverage: each
field's boundary and invalid values, hundreds of cases per generation route; fuzzing, a
few examples per route; stateful); without a key, the fuzzing phase alone with
:data:`FUZZ_EXAMPLES` generated requests per route on every ``/v1`` route and
``/tokenize``. Neither may see a 5xx.

Its checks split in two. The contract's (no 5xx, only documented statuses, content types
and headers, bodies that match their schemas, 405 with ``Allow``, 401 without a key) must
all hold. The request-validation pair (``negative_data_rejection``: a schema-violating
request accepted; ``positive_data_acceptance``: a schema-valid one refused) is asserted on
its own, so a failure there names what to fix in the request models. Settings the CLI has
no flag for are in ``schemathesis.toml`` beside this file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import running_server

KEY = "schemathesis-key"
#: Generated requests per route of the fuzzing run. Its wall time grows with it: about 13
#: requests a second on an idle 2-core machine (100: 31 s, 200: 61 s); the whole file
#: takes about a minute at 60.
FUZZ_EXAMPLES = 60
CONFIG = Path(__file__).with_name("schemathesis.toml")
# failure codes of the request-validation checks (the rest are the contract's)
VALIDATION = {"ST201": "negative_data_rejection", "ST202": "positive_data_acceptance"}


def run_schemathesis(url: str, report_dir: Path, *args: str) -> tuple[dict, str]:
    """``schemathesis run --checks all`` against ``url``; its JSON report and its output."""
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
           f"{url}/openapi.json", "--checks", "all", "--generation-deterministic",
           "--workers", "1", "--no-color", "--output-sanitize", "false",
           "--request-timeout", "60", "--report", "json", "--report-dir", str(report_dir),
           *args]
    # run in report_dir: Schemathesis keeps a cache of past crashes (replayed first) and
    # Hypothesis its own files under the working directory; each run starts clean
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=report_dir)
    reports = sorted(report_dir.glob("*.json"))
    assert reports, proc.stdout + proc.stderr
    return json.loads(reports[-1].read_text()), proc.stdout + proc.stderr


def failures(report: dict, validation: bool) -> list[str]:
    """``"CODE title: operations"`` of the report's failures, of the validation checks or
    of the others."""
    return [f"{f['code']} {f['title']}: {', '.join(f.get('operations', []))}"
            for f in report["failures"] if (f["code"] in VALIDATION) == validation]


@pytest.fixture(scope="module")
def keyed_run(base_dir, adapters, lora_root, tmp_path_factory):
    """One run with an API key set (sent by Schemathesis; its ignored_auth check sends
    requests without it too), adapters served and run-time updates on."""
    modules = [f"ad0={adapters['ad0']}", f"ad1={adapters['ad1']}"]
    with running_server(base_dir, "--api-key", KEY, "--enable-lora-runtime-updates",
                        "--lora-root", str(lora_root), lora_modules=modules) as (_, url):
        return run_schemathesis(url, tmp_path_factory.mktemp("schemathesis"),
                                "--header", f"Authorization: Bearer {KEY}",
                                "--max-examples", "6")


def test_schemathesis_contract_checks_with_api_key(keyed_run):
    report, output = keyed_run
    assert report["complete"] and not report["errors"], output
    assert report["operations"]["tested"] == report["operations"]["total"] == 14, output
    assert report["test_cases"]["generated"] > 100, output
    assert not failures(report, validation=False), output


def test_schemathesis_request_validation_with_api_key(keyed_run):
    report, output = keyed_run
    assert not failures(report, validation=True), output


def test_schemathesis_fuzzing_without_api_key(base_dir, tmp_path):
    # no key, no run-time updates: the fuzzing phase alone, FUZZ_EXAMPLES requests per
    # /v1 route and /tokenize (GET /v1/models takes no input: one request)
    with running_server(base_dir) as (_, url):
        report, output = run_schemathesis(
            url, tmp_path, "--max-examples", str(FUZZ_EXAMPLES), "--phases", "fuzzing",
            "--include-path-regex", "^/(v1/|tokenize$)")
    assert report["complete"] and not report["errors"], output
    # completions, chat, responses, GET /v1/models, /v1/models/{id}, /v1/responses/{id},
    # /tokenize
    assert report["operations"]["tested"] == report["operations"]["selected"] == 7, output
    assert report["test_cases"]["generated"] >= 5 * FUZZ_EXAMPLES, output
    assert not failures(report, validation=False), output
    assert not failures(report, validation=True), output
