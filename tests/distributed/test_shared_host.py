"""Shared host buffers of tensor-parallel slot loads: mapped by name, freed with the tensor."""

from __future__ import annotations

import gc

import pytest
import torch

from manylora.distributed.shared_host import (
    _SHM,
    Acks,
    SharedHostBuffers,
    SharedHostCache,
)


def test_a_buffer_is_seen_by_name_and_unlinked_when_freed():
    buffers = SharedHostBuffers()
    buf = buffers.alloc(1000)
    buf.copy_(torch.arange(1000) % 251)
    name = buffers.name_of(buf)
    cache = SharedHostCache(capacity=2)
    mapped, value = cache.get(name, 1000)
    assert value is None and torch.equal(mapped, buf)
    buf[3] = 77                                  # one memory: later writes show too
    assert mapped[3] == 77
    cache.put(name, "descriptors")
    assert cache.get(name, 1000)[1] == "descriptors"
    del buf
    gc.collect()
    assert not (_SHM / name).exists()
    assert mapped[3] == 77                       # a rank's mapping outlives the name
    with pytest.raises(KeyError):
        buffers.name_of(torch.zeros(3, dtype=torch.uint8))


def test_the_cache_drops_the_least_recently_used_mapping():
    buffers = SharedHostBuffers()
    bufs = [buffers.alloc(64) for _ in range(3)]
    names = [buffers.name_of(b) for b in bufs]
    cache = SharedHostCache(capacity=2)
    for name in names[:2]:
        cache.get(name, 64)
        cache.put(name, name)
    cache.get(names[0], 64)                      # names[1] is now the least recent
    cache.get(names[2], 64)
    assert cache.get(names[0], 64)[1] == names[0]
    assert cache.get(names[1], 64)[1] is None    # mapped again, its value gone


def test_a_freed_buffer_cannot_be_opened():
    buffers = SharedHostBuffers()
    buf = buffers.alloc(64)
    name = buffers.name_of(buf)
    del buf
    gc.collect()
    with pytest.raises(FileNotFoundError, match="is gone"):
        SharedHostCache(1).get(name, 64)
    assert not (_SHM / name).exists()


def test_acks_report_the_slowest_rank():
    acks = Acks(SharedHostBuffers().prefix + "-acks", 3, create=True)
    worker = Acks(acks.name, 3)
    worker.values[1] = 5
    worker.values[2] = 3
    assert acks.handled() == 3
    worker.values[2] = 9
    assert acks.handled() == 5


@pytest.mark.gpu
def test_shared_buffers_are_page_locked_on_cuda():
    buffers = SharedHostBuffers()
    buf = buffers.alloc(1 << 20)
    assert buf.is_pinned()
    mapped, _ = SharedHostCache(1).get(buffers.name_of(buf), 1 << 20)
    assert mapped.is_pinned()
