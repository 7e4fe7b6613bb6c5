"""broadcast_tensor_dict and WorkerGroup on CPU (gloo): round trips, bad input, dead workers,
dead rank 0. The pytest process is rank 0; workers are spawned processes running the
module-level targets below."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from manylora.distributed.broadcast import (
    COALESCE_LIMIT_BYTES,
    broadcast_tensor_dict,
    decode_tensor_dict,
    encode_tensor_dict,
)
from manylora.distributed.process_group import end_startup, free_init_method, init_distributed
from manylora.distributed.workers import (
    HARD_EXIT_CODE,
    WorkerDiedError,
    WorkerGroup,
    exit_when_stuck,
)

# Every group here starts with the default start-up timeout (600 s): spawning a worker and
# importing torch on a loaded machine may take many seconds, and no test depends on how many.
# The bounds below time what follows a death (a kill, an exit), never a process start.


def _payload() -> dict:
    """Every supported kind of value, recomputed identically on every rank."""
    g = torch.Generator().manual_seed(1234)
    f32 = torch.randn(4, 6, generator=g)
    f32[0, 0] = float("nan")
    f32[0, 1] = float("-inf")
    d = {
        "float32": f32,
        "float16": torch.randn(3, 5, generator=g).half(),
        "bfloat16": torch.randn(7, generator=g).bfloat16(),
        "float64": torch.randn(2, 2, 2, generator=g).double(),
        "int64": torch.tensor([-(2**63), 2**63 - 1, 0, 42]),
        "int32": torch.arange(-5, 5, dtype=torch.int32).view(2, 5),
        "int16": torch.tensor([-32768, 32767, 7], dtype=torch.int16),
        "int8": torch.tensor([-128, 127, 0], dtype=torch.int8),
        "uint8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([[True, False, True]]),
        "scalar_0d": torch.tensor(3.5),
        "empty": torch.empty(0, dtype=torch.float32),
        "empty_3d": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "transposed": torch.arange(12, dtype=torch.int64).view(3, 4).t(),
        "strided": torch.randn(10, 8, generator=g)[::3, 1::2],
        # at least COALESCE_LIMIT_BYTES: sent on their own rather than packed
        "large_transposed": torch.randn(600, 512, generator=g).t(),
        "large_bf16": torch.randn(COALESCE_LIMIT_BYTES, generator=g).bfloat16(),
        "int": 7,
        "float": 0.1,
        "bool_value": False,
        "str": "héllo, wörld ✓",
        "none": None,
        "list": [1, [2.5, "x"], None, True],
        "tuple": (1, 2),
        "nested": {"a": [1, 2], "b": {"c": None}},
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            d[name] = torch.randn(9, generator=g).to(getattr(torch, name))
    return d


def _same(a, b) -> bool:
    """Bit-exact equality for tensors (NaN included), == for plain values (tuples compare as
    lists, since JSON turns them into lists)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or not b.is_contiguous():
            return False
        b = b.cpu()
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                b.contiguous().reshape(-1).view(torch.uint8)))
    if isinstance(a, tuple):
        a = list(a)
    return a == b


def _compare(expected: dict, got: dict) -> str:
    """'ok', or what differs."""
    if list(expected) != list(got):
        return f"keys differ: {list(expected)} vs {list(got)}"
    bad = [k for k in expected if not _same(expected[k], got[k])]
    return f"values differ: {bad}" if bad else "ok"


def _echo_target(rank: int, tp_size: int, init_method: str, out_dir: str) -> None:
    """Worker: the first message must equal _payload(), the second is the stop message."""
    init_distributed(rank, tp_size, "gloo", init_method)
    first = broadcast_tensor_dict(None, src=0)
    verdict = _compare(_payload(), first)
    second = broadcast_tensor_dict(None, src=0)
    if second != {"stop": True}:
        verdict = f"unexpected second message {second!r}"
    Path(out_dir, f"rank{rank}.txt").write_text(verdict)


def _serve_target(rank: int, tp_size: int, init_method: str) -> None:
    """Worker: receive broadcasts until {'stop': True}."""
    init_distributed(rank, tp_size, "gloo", init_method)
    while not broadcast_tensor_dict(None, src=0).get("stop"):
        pass


def _stall_target(rank: int, tp_size: int, init_method: str) -> None:
    """Worker: the last rank never enters the all-reduce (the test kills it); the others do."""
    init_distributed(rank, tp_size, "gloo", init_method)
    if rank == tp_size - 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(4))


def _startup_then_hang_target(rank: int, tp_size: int, init_method: str) -> None:
    """Worker: end start-up with a 1 s collective timeout, then never enter a collective."""
    init_distributed(rank, tp_size, "gloo", init_method)
    end_startup("cpu", 1.0)
    time.sleep(600)


def _exit_target(rank: int, tp_size: int, init_method: str, out_dir: str) -> None:
    """Worker: gives up before joining the process group, writing when (``time.monotonic``,
    one clock for every process of the machine) it did."""
    Path(out_dir, "exit_time").write_text(repr(time.monotonic()))
    raise SystemExit(3)


@pytest.fixture
def cleanup():
    """Groups to shut down after the test; the default process group is destroyed."""
    groups: list[WorkerGroup] = []
    yield groups
    for g in groups:
        g.shutdown(timeout=2.0)
    if dist.is_initialized():
        dist.destroy_process_group()


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("tp_size", [2, 3])
def test_round_trip_every_kind(tp_size, tmp_path, cleanup):
    group = WorkerGroup(_echo_target, tp_size, backend="gloo", init_method=free_init_method(),
                        args=(str(tmp_path),))
    cleanup.append(group)
    group.join_process_group()

    # Bad values are refused on the sender before anything is sent: the workers' first
    # message is still the payload below.
    with pytest.raises(TypeError, match="'bad'"):
        group.broadcast({"ok": torch.ones(3), "bad": object()})
    with pytest.raises(TypeError, match="'nested_bad'"):
        group.broadcast({"nested_bad": [1, {2, 3}]})
    with pytest.raises(TypeError, match="'complex'"):
        group.broadcast({"complex": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="keys must be str"):
        group.broadcast({1: 2})

    payload = _payload()
    sent = group.broadcast(payload)
    assert sent.keys() == payload.keys() and all(sent[k] is payload[k] for k in payload)
    group.broadcast({"stop": True})
    codes = group.shutdown(timeout=10.0)
    assert codes == {r: 0 for r in range(1, tp_size)}
    for r in range(1, tp_size):
        assert (tmp_path / f"rank{r}.txt").read_text() == "ok"


def test_killed_worker_fails_the_next_broadcast(cleanup):
    group = WorkerGroup(_serve_target, 3, backend="gloo", init_method=free_init_method())
    cleanup.append(group)
    group.join_process_group()
    group.broadcast({"x": torch.arange(5)})
    pids = group.pids

    os.kill(pids[2], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        for _ in range(1000):  # the first broadcasts may still succeed, never hang
            group.broadcast({"x": torch.arange(5)})
            time.sleep(0.01)
    assert time.monotonic() - t0 < 10.0
    assert info.value.rank == 2 and info.value.exitcode == -signal.SIGKILL
    assert "rank 2" in str(info.value) and "SIGKILL" in str(info.value)
    with pytest.raises(WorkerDiedError):
        group.check()
    # the monitor stopped the surviving worker too
    assert _wait_gone(pids.values(), 30.0) == []
    group.shutdown(timeout=1.0)
    assert _wait_gone(pids.values(), 0.0) == []


def test_worker_dying_at_start_fails_the_rendezvous(tmp_path, cleanup):
    group = WorkerGroup(_exit_target, 2, backend="gloo", init_method=free_init_method(),
                        args=(str(tmp_path),))
    cleanup.append(group)
    with pytest.raises(WorkerDiedError, match="exited with code 3"):
        group.join_process_group()
    # timed from the worker's exit, not its start: rank 0 did not wait for the timeout
    assert time.monotonic() - float((tmp_path / "exit_time").read_text()) < 10.0
    assert not dist.is_initialized()
    assert group.shutdown(timeout=1.0) == {1: 3}


def test_worker_death_unblocks_a_waiting_collective(cleanup):
    # Rank 0 and rank 1 wait in an all-reduce for rank 2, which is killed while they wait:
    # gloo alone would block rank 0 until the process-group timeout.
    group = WorkerGroup(_stall_target, 3, backend="gloo", init_method=free_init_method())
    cleanup.append(group)
    group.join_process_group()
    killer = threading.Timer(0.5, os.kill, args=(group.pids[2], signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info, group.guard():
        dist.all_reduce(torch.ones(4))
    killer.join()
    assert time.monotonic() - t0 < 10.0
    assert info.value.rank == 2
    assert isinstance(info.value.__cause__, RuntimeError)
    pids = list(group.pids.values())
    group.shutdown(timeout=1.0)
    assert _wait_gone(pids, 0.0) == []


def test_end_startup_bounds_later_collectives(cleanup):
    """Start-up runs under the 600 s start-up timeout; after ``end_startup`` a collective the
    worker never enters raises after the collective timeout (1 s) instead of waiting."""
    group = WorkerGroup(_startup_then_hang_target, 2, backend="gloo",
                        init_method=free_init_method())
    cleanup.append(group)
    group.join_process_group()
    end_startup("cpu", 1.0)
    with pytest.raises(RuntimeError, match="[Tt]imed out"), group.guard(wait_s=0.0):
        dist.all_reduce(torch.ones(4))
    assert group.error is None     # the worker is alive: a timeout, not a death


def _rank0_main(mode: str, pid_file: str) -> None:
    """A rank 0 in its own process (see the test below): start a worker, broadcast once,
    write the worker's pid, then misbehave as ``mode`` says."""
    if mode == "stuck_opted_in":
        exit_when_stuck(1.0)
    group = WorkerGroup(_serve_target, 2, backend="gloo", init_method=free_init_method())
    group.join_process_group()
    group.broadcast({"hello": 1})
    Path(pid_file).write_text(" ".join(str(p) for p in group.pids.values()))
    if mode == "return":  # no shutdown: the finalizer must stop the workers at exit
        return
    if mode == "kill":  # no cleanup at all: the workers must notice by themselves
        os.kill(os.getpid(), signal.SIGKILL)
    sigterms = []
    signal.signal(signal.SIGTERM, lambda *args: sigterms.append(args))
    os.kill(group.pids[1], signal.SIGKILL)
    if mode == "stuck":  # a worker dies and rank 0 does not look: its process is left alone
        group._monitor.join()          # the monitor is done with the death, and returned
        with contextlib.suppress(WorkerDiedError):
            group.check()
            raise AssertionError("check() did not raise")
        print(f"rank 0 alive, SIGTERMs received: {len(sigterms)}", file=sys.stderr)
        group.shutdown()
        return
    if mode == "stuck_opted_in":  # exit_when_stuck: SIGTERM (ignored here), then os._exit
        time.sleep(600)
        os._exit(0)  # not reached: the monitor ends the process


def _start_rank0(mode: str, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    pid_file = tmp_path / f"{mode}.pids"
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import test_broadcast_workers as m; m._rank0_main({mode!r}, {str(pid_file)!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    return proc, pid_file


def test_rank0_exit_leaves_no_orphans_and_a_dead_worker_never_ends_rank0(tmp_path):
    modes = ["return", "kill", "stuck", "stuck_opted_in"]
    started = {m: _start_rank0(m, tmp_path) for m in modes}  # concurrently: it saves time
    results = {}
    for mode, (proc, pid_file) in started.items():
        try:
            # a bound on four Python processes each starting a worker: only a hang fails it
            _, err = proc.communicate(timeout=300)
        finally:
            proc.kill()
        results[mode] = (proc.returncode, err)
        pids = [int(p) for p in pid_file.read_text().split()]
        assert _wait_gone(pids, 30.0) == [], (mode, err)
    assert results["return"][0] == 0, results["return"][1]
    assert results["kill"][0] == -signal.SIGKILL
    # without the opt-in, the monitor neither signals nor ends the process
    assert results["stuck"][0] == 0, results["stuck"][1]
    assert "rank 0 alive, SIGTERMs received: 0" in results["stuck"][1]
    assert "did not react" not in results["stuck"][1]
    # the server's opt-in: SIGTERM (ignored here), then os._exit
    assert results["stuck_opted_in"][0] == HARD_EXIT_CODE, results["stuck_opted_in"][1]
    assert "did not react" in results["stuck_opted_in"][1]
    assert "still stuck" in results["stuck_opted_in"][1]


def test_exit_when_stuck_wants_a_positive_delay():
    with pytest.raises(ValueError, match="after_s"):
        exit_when_stuck(0.0)
    exit_when_stuck(None)


def _nccl_target(rank: int, tp_size: int, init_method: str, out_dir: str) -> None:
    """Worker (NCCL): check one payload, join one all-reduce, then hang until killed."""
    init_distributed(rank, tp_size, "nccl", init_method)
    got = broadcast_tensor_dict(None, src=0)
    verdict = _compare(_payload(), got)
    if verdict == "ok" and any(isinstance(v, torch.Tensor) and v.device.type != "cuda"
                               for v in got.values()):
        verdict = "received tensors not on the GPU"
    Path(out_dir, f"rank{rank}.txt").write_text(verdict)
    dist.all_reduce(torch.ones(4, device="cuda"))
    torch.cuda.synchronize()
    time.sleep(600)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_round_trip_and_dead_worker(tmp_path, cleanup):
    group = WorkerGroup(_nccl_target, 2, backend="nccl", init_method=free_init_method(),
                        args=(str(tmp_path),), timeout_s=60.0)
    cleanup.append(group)
    group.join_process_group()
    payload = _payload()
    # half the tensors on the GPU, half on the host: both packing paths
    mixed = {k: v.cuda() if isinstance(v, torch.Tensor) and i % 2 else v
             for i, (k, v) in enumerate(payload.items())}
    group.broadcast(mixed)
    x = torch.ones(4, device="cuda")
    with group.guard():
        dist.all_reduce(x)
        torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4
    assert (tmp_path / "rank1.txt").read_text() == "ok"

    # The worker hangs outside the collective and is killed while rank 0 waits in it: NCCL
    # would wait forever; the monitor's abort ends the wait and the guard reports the death.
    killer = threading.Timer(0.5, os.kill, args=(group.pids[1], signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info, group.guard():
        dist.all_reduce(x)
        torch.cuda.synchronize()
    killer.join()
    assert time.monotonic() - t0 < 10.0 and info.value.rank == 1
    with pytest.raises(RuntimeError):  # the communicators are aborted
        dist.all_reduce(x)
        torch.cuda.synchronize()
    pid = group.pids[1]
    group.shutdown(timeout=1.0)
    assert _wait_gone([pid], 0.0) == []


def test_pack_unpack_round_trip_is_bit_exact():
    """``encode_tensor_dict`` / ``decode_tensor_dict`` (the tensor-parallel workers' pipe
    messages) give back every kind of value bit for bit, large tensors packed too."""
    payload = _payload()
    got = decode_tensor_dict(encode_tensor_dict(payload))
    assert list(got) == list(payload)
    for key, want in payload.items():
        assert _same(want, got[key]), key
    with pytest.raises(TypeError, match="'bad'"):
        encode_tensor_dict({"bad": object()})
    with pytest.raises(ValueError, match="not an encoded tensor dict"):
        decode_tensor_dict((7).to_bytes(8, "little") + b'{"a":1}')
