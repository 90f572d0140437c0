"""``workers/rank/device_memory.py``: a GPU rank's first attempt waits, within a bound, for memory another
process holds on its device (a killed rank still being torn down). Pure: a fake device, clock and sleep."""

from __future__ import annotations

import pytest

from etrain.workers.rank.device_memory import (
    DEVICE_FREE_WAIT_S,
    FOREIGN_ALLOWANCE_BYTES,
    held_by_others,
    wait_for_device_memory,
)

GIB = 1 << 30
TOTAL = 80 * GIB


class FakeDevice:
    """A GPU whose other process releases ``foreign`` bytes after ``release_after_s`` (None: never), with this
    process's context (1 GiB) and allocator reserve ``own`` in use; time passes only when the rank sleeps."""

    def __init__(self, foreign: int, release_after_s: float | None, own: int = 0):
        self.foreign, self.release_after_s, self.own = foreign, release_after_s, own
        self.now, self.reads, self.sleeps = 0.0, 0, []

    def read(self) -> tuple[int, int, int]:
        self.reads += 1
        released = self.release_after_s is not None and self.now >= self.release_after_s
        used = GIB + self.own + (0 if released else self.foreign)
        return TOTAL - used, TOTAL, self.own

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def wait(self, **kwargs):
        return wait_for_device_memory(self.read, clock=lambda: self.now, sleep=self.sleep, **kwargs)


def test_what_the_process_itself_holds_is_not_another_processs():
    assert held_by_others(TOTAL - GIB, TOTAL, 0) == 0  # the context alone
    assert held_by_others(TOTAL - 41 * GIB, TOTAL, 40 * GIB) == 0  # and its own allocator's reserve
    assert held_by_others(TOTAL - 5 * GIB, TOTAL, 0) == 0  # up to 1/16 of the device (5 GiB of 80): its context
    assert held_by_others(TOTAL - 6 * GIB, TOTAL, 0) == 6 * GIB  # ... or another process's beside it
    assert held_by_others(8 * GIB - 3 * GIB, 8 * GIB, 0) == 3 * GIB  # on a small device the 2 GiB allowance counts
    assert held_by_others(8 * GIB - FOREIGN_ALLOWANCE_BYTES, 8 * GIB, 0) == 0
    assert held_by_others(TOTAL - 40 * GIB, TOTAL, 0) == 40 * GIB  # beyond it: another process's, context included
    assert held_by_others(TOTAL + 1, TOTAL, 0) == 0  # a reading that makes no sense is no memory held


def test_a_free_device_costs_one_read_and_no_wait():
    device = FakeDevice(foreign=0, release_after_s=None, own=3 * GIB)
    found = device.wait()
    assert (found.held_at_start, found.held_at_end, found.waited_s) == (0, 0, 0.0)
    assert device.reads == 1 and device.sleeps == [] and found.released and found.summary() == ""


def test_memory_released_while_waiting_ends_the_wait_at_the_next_poll():
    device = FakeDevice(foreign=40 * GIB, release_after_s=3.1)
    found = device.wait(poll_s=0.25)
    assert found.held_at_start == 41 * GIB and found.released  # its 40 GiB and this process's context
    assert found.waited_s == pytest.approx(3.25)  # the first poll after the release
    assert found.summary() == "41.0 GiB of this GPU held by another process; released after 3.2s"


def test_memory_never_released_is_given_up_on_at_the_bound_and_said_so():
    device = FakeDevice(foreign=40 * GIB, release_after_s=None)
    found = device.wait()
    assert found.waited_s == pytest.approx(DEVICE_FREE_WAIT_S) and not found.released
    assert found.held_at_end == 41 * GIB
    assert all(0 < s <= 0.25 for s in device.sleeps)  # never sleeps past the bound
    assert "held by another process, still 41.0 GiB after 30.0s: starting beside it" in found.summary()
    assert wait_for_device_memory(device.read, timeout_s=0, clock=lambda: device.now, sleep=device.sleep).waited_s == 0


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        wait_for_device_memory(lambda: (0, 0, 0), timeout_s=-1)
    with pytest.raises(ValueError):
        wait_for_device_memory(lambda: (0, 0, 0), poll_s=0)


def test_the_worker_reads_free_total_and_its_own_reserve_from_torch(monkeypatch):
    """``TrainWorker``'s reader, :func:`cuda_memory_reader` (its only GPU part; tests/gpu/test_device_memory_wait.py runs it on a GPU)."""
    import torch

    from etrain.workers.rank.device_memory import cuda_memory_reader

    device = torch.device("cuda", 0)
    asked = []
    in_use = [10 * GIB, 10 * GIB, GIB]  # what each read finds in use: another process's 9 GiB go after two reads
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: asked.append(d) or (TOTAL - in_use.pop(0), TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 9 * GIB)
    assert wait_for_device_memory(cuda_memory_reader(device)).held_at_start == 0 and asked == [
        device
    ]  # its own reserve is its own
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 0)
    found = wait_for_device_memory(cuda_memory_reader(device))
    assert found.held_at_start == 10 * GIB and found.released and 0 < found.waited_s < 2 and len(asked) == 3


def test_on_a_gpu_the_health_checks_deadline_leaves_the_peers_room_for_the_wait():
    from etrain.workers.protocol.health import HEALTH_CHECK_TIMEOUT_S, health_check_timeout_s

    assert health_check_timeout_s("cpu") == HEALTH_CHECK_TIMEOUT_S == 10.0
    assert health_check_timeout_s("cuda") == HEALTH_CHECK_TIMEOUT_S + DEVICE_FREE_WAIT_S == 40.0
