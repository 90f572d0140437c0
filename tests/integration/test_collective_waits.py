"""The collective-wait clock (workers/engine/collective_waits.py) on two real gloo ranks: rank 1 arrives late at
each collective, so rank 0 waits; the clock times exactly those waits while armed, on the arming
thread, through both wait points (``Work.wait`` and the functional collectives' ``wait_tensor``)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.dist_utils import run_distributed

LATE_S = 1.0  # long next to the scheduling noise of a shared 2-core machine


def _waits(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from etrain.workers.engine.collective_waits import CollectiveWaitClock

    clock = CollectiveWaitClock(torch.device("cpu"))
    tensor = torch.ones(4)
    out: dict = {}

    def late():
        if rank == 1:
            time.sleep(LATE_S)

    # 1. unarmed: a wait is not counted (this also initialises the functional collectives, whose first
    # call takes seconds: not a wait)
    late()
    dist.all_reduce(tensor)
    funcol.all_reduce(tensor, "sum", dist.group.WORLD).wait()
    out["unarmed"] = clock.waits

    # 2. armed: Work.wait (a synchronous call waits through it) and funcol's wait_tensor
    with clock.armed():
        first = clock.mark()
        late()
        dist.all_reduce(tensor)
        middle = clock.mark()
        late()
        funcol.all_reduce(tensor, "sum", dist.group.WORLD).wait()
        last = clock.mark()
    out["work_wait_s"] = clock.between(first, middle)
    out["wait_tensor_s"] = clock.between(middle, last)
    out["armed_waits"] = clock.waits

    # 3. armed, but the wait happens on another thread (an async checkpoint's): not counted
    with clock.armed():
        before = clock.mark()
        late()
        worker = threading.Thread(target=dist.all_reduce, args=(tensor,))
        worker.start()
        worker.join()
        out["other_thread_s"] = clock.between(before, clock.mark())
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_waits, 2, timeout_s=120.0)


def test_waits_are_timed_only_while_armed(results):
    assert results[0]["unarmed"] == 0
    assert results[0]["armed_waits"] == 2


def test_the_rank_that_waited_measures_the_wait_and_the_late_rank_does_not(results):
    early, late = results
    for key in ("work_wait_s", "wait_tensor_s"):
        assert LATE_S * 0.6 < early[key] < LATE_S + 1.0, (key, early[key])
        assert late[key] < LATE_S * 0.4, (key, late[key])


def test_waits_on_other_threads_are_not_counted_on_cpu(results):
    assert results[0]["other_thread_s"] == 0.0
