"""A GPU rank's first attempt waits for memory another process holds on its device, and starts once that
process has ended (``workers/rank/device_memory.py``; the decision's unit tests: tests/unit/test_device_memory.py).

A child process holds a quarter of the GPU and exits 3 s after it took it, as a killed rank does once the
driver has torn it down; this process's wait must see them held, then released, in about that time.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

HOLD_S = 3.0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _hold(ready, held_bytes: int, hold_s: float) -> None:
    import time

    import torch

    block = torch.empty(held_bytes, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    ready.set()
    time.sleep(hold_s)


def test_a_rank_waits_for_another_processs_memory_and_starts_when_it_is_released():
    from etrain.workers.rank.device_memory import cuda_memory_reader, wait_for_device_memory

    torch.cuda.init()
    held = torch.cuda.get_device_properties(0).total_memory // 4  # well above what a context takes
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    holder = context.Process(target=_hold, args=(ready, held, HOLD_S))
    holder.start()
    try:
        assert ready.wait(120), "the holding process did not allocate in time"
        found = wait_for_device_memory(cuda_memory_reader(torch.device("cuda", 0)))
    finally:
        holder.join(60)
    assert found.held_at_start >= held, found
    assert found.released and 0.5 <= found.waited_s <= HOLD_S + 15, found
    assert (
        wait_for_device_memory(cuda_memory_reader(torch.device("cuda", 0))).held_at_start == 0
    )  # and now nothing is held
