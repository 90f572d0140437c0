"""The rank side of the health check at the start of every attempt (the verdict: ``workers/protocol/health.py``).

Each rank allocates and touches memory on its device, times a small matmul there, then joins one
all-reduce on the attempt's default group (the training backend: NCCL on GPUs, gloo on CPUs) with a
deadline, which proves the new group can communicate, and gathers every rank's measurements. Every rank
reaches the same verdict; if some rank fails, every rank raises :class:`UnhealthyRankError` naming the
first failing rank, and the supervisor excludes that rank's node from the job. A peer that never joins
makes the all-reduce time out: that is a collective failure, which the worker group already explains
(it pings every rank to find the one that is gone).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from etrain.workers.protocol.errors import UnhealthyRankError
from etrain.workers.protocol.health import (
    ALLOC_BYTES,
    MATMUL_REPEATS,
    MATMUL_SIZE,
    RankHealth,
    health_check_timeout_s,
    unhealthy_ranks,
)


def check_health(
    device: torch.device,
    *,
    rank: int,
    node: str,
    drill: Callable[[], str | None] | None = None,
    timeout_s: float | None = None,
) -> RankHealth:
    """Run the check with every rank of the default group; returns this rank's measurements.

    ``drill``: the fault drill's hook (``fail_health_check``): a failure to report instead of measuring.
    Raises UnhealthyRankError when any rank fails, and the collective's own error when a peer is gone.
    ``timeout_s``: the deadline, by default the device type's (``health_check_timeout_s``).
    """
    if timeout_s is None:
        timeout_s = health_check_timeout_s(device.type)
    started = time.monotonic()
    mine = _measure(device, rank=rank, node=node, drill=drill)
    ones = torch.ones(1, device=device)
    work = dist.all_reduce(ones, async_op=True)
    left = max(0.1, timeout_s - (time.monotonic() - started))
    work.wait(timeout=datetime.timedelta(seconds=left))
    if int(ones.item()) != dist.get_world_size():
        raise RuntimeError(f"collective failure on rank {rank}: the health check's all-reduce gave {ones.item()}")
    gathered: list[RankHealth | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    failing = unhealthy_ranks([report for report in gathered if report is not None])
    if failing:
        first = failing[0]
        raise UnhealthyRankError(
            f"health check failed on rank {first.rank} (node {first.node[:12]}): {first.reason}",
            rank=first.rank,
        )
    return mine


def _measure(device: torch.device, *, rank: int, node: str, drill: Callable[[], str | None] | None) -> RankHealth:
    kind = device.type if device.type in ALLOC_BYTES else "cpu"
    failure = drill() if drill is not None else None
    if failure is not None:
        return RankHealth(rank=rank, node=node, device=str(device), failure=failure, gflops=None)
    try:
        block = torch.empty(ALLOC_BYTES[kind] // 4, dtype=torch.float32, device=device)
        block.fill_(1.0)
        del block
    except Exception as err:  # noqa: BLE001 - any allocation error is the finding
        return RankHealth(
            rank=rank, node=node, device=str(device), failure=f"cannot allocate on {device}: {err}", gflops=None
        )
    size = MATMUL_SIZE[kind]
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    try:
        a = torch.ones(size, size, dtype=dtype, device=device)
        b = torch.ones(size, size, dtype=dtype, device=device)
        (a @ b).sum()  # the first call pays for kernel selection, not timed
        _sync(device)
        seconds = float("inf")
        for _ in range(MATMUL_REPEATS):  # the fastest repetition: one preemption is not a slow device
            begin = time.perf_counter()
            product = a @ b
            _sync(device)
            seconds = min(seconds, time.perf_counter() - begin)
        expected = float(size)
        if not torch.all(product[0, :4] == expected):  # ones @ ones: every entry is the side
            return RankHealth(
                rank=rank, node=node, device=str(device), failure=f"matmul on {device} gave wrong numbers", gflops=None
            )
    except Exception as err:  # noqa: BLE001
        return RankHealth(
            rank=rank, node=node, device=str(device), failure=f"matmul on {device} failed: {err}", gflops=None
        )
    gflops = 2.0 * size**3 / max(seconds, 1e-9) / 1e9
    return RankHealth(rank=rank, node=node, device=str(device), failure=None, gflops=gflops)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
