"""Issue 18, finding 8 through the server: one client's ``n=32`` request holds the batch
(``max_num_seqs=8``), another client's 2-token request arrives and finishes before any of
the big request's children does. Race-free: the engine is held (``hold_steps``) until the
second request waits in the scheduler, and the order is read from the scheduler's own
finishing order, not from clocks."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from server_helpers import BASE, hold_steps, running_server

N = 32
MAX_TOKENS = 24


def _wait_for(server, condition) -> None:
    deadline = time.monotonic() + 60
    while not condition(server.engine.snapshot()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition(server.engine.snapshot())


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_small_request_is_not_queued_behind_n32_children(base_dir, policy):
    with running_server(base_dir, "--scheduling-policy", policy,
                        max_num_seqs=8) as (server, url):
        core = server.engine.engine.engine_core
        sched = core.scheduler
        finished: list[str | None] = []          # client groups, in the order they ended
        finish = sched.finish_requests

        def recording(request_ids, status):
            ids = list(request_ids)
            finished.extend(sched.requests[r].client_group for r in ids if r in sched.requests)
            finish(ids, status)

        sched.finish_requests = recording
        release = hold_steps(core, after=3)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
        results: dict[str, object] = {}

        def big():
            results["big"] = client.completions.create(
                model=BASE, prompt="The quick brown fox", n=N, max_tokens=MAX_TOKENS,
                temperature=1.0, seed=1, extra_body={"ignore_eos": True})

        def small():
            results["small"] = client.completions.create(
                model=BASE, prompt="hello", max_tokens=2, temperature=0.0,
                extra_body={"ignore_eos": True})

        threads = [threading.Thread(target=big), threading.Thread(target=small)]
        threads[0].start()
        _wait_for(server, lambda s: s.num_running == 8 and s.num_waiting == N - 8)
        threads[1].start()
        _wait_for(server, lambda s: s.num_waiting == N - 8 + 1)     # queued behind them
        release.set()
        for t in threads:
            t.join(300)
        assert results["small"].choices[0].finish_reason == "length"
        assert [c.finish_reason for c in results["big"].choices] == ["length"] * N
        assert results["big"].usage.completion_tokens == N * MAX_TOKENS
        big_group = next(g for g in finished if g.startswith("cmpl-") and finished.count(g) > 1)
        small_at = next(i for i, g in enumerate(finished) if g != big_group)
        assert len(finished) == N + 1
        if policy == "fair":
            assert small_at == 0                 # before any of the 32 children
            assert sched.fairness_preemptions == 1
        else:                                    # arrival order: behind three waves of 8
            assert small_at >= N - 8
            assert sched.fairness_preemptions == 0
