"""Issue 18, finding 8 through the server: one client's ``n=32`` request holds the batch
(``max_num_seqs=8``), another client's 2-token request arrives and finishes before any of
the big request's children does. Race-free: the engine's steps are let through by count
(``StepGate``): none until all 32 children wait, 3 while they run alone, none until the
second request waits too; the order is the scheduler's own finishing order, not clocks."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from server_helpers import BASE, running_server

from manylora.engine.protocol import EngineCoreOutputs

N = 32
MAX_TOKENS = 24


class StepGate:
    """Lets an in-process ``EngineCore`` run only the steps ``allow`` grants; otherwise its
    loop idles (10 ms, no progress, commands such as adds still taken)."""

    def __init__(self, core) -> None:
        self.left = 0
        self._step = core.step
        core.step = self._gated

    def _gated(self):
        if self.left > 0:
            self.left -= 1
            return self._step()
        time.sleep(0.01)
        return EngineCoreOutputs()

    def allow(self, steps: int) -> None:
        self.left = steps


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
        gate = StepGate(core)
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
        _wait_for(server, lambda s: s.num_waiting == N)             # every child is in
        gate.allow(3)
        _wait_for(server, lambda s: gate.left == 0 and s.num_running == 8
                  and s.num_waiting == N - 8)
        threads[1].start()
        _wait_for(server, lambda s: s.num_waiting == N - 8 + 1)     # queued behind them
        gate.allow(10**9)
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
