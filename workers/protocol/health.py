"""Health checks before trust: what each rank measures at the start of an attempt, and the verdict.

Pure (no torch, no Ray): the rank side (``workers/rank/health_check.py``) measures, every rank of the
attempt gathers every report, and :func:`unhealthy_ranks` decides the same on each of them. Why at the
start of every attempt, the first launch and every replacement or resize alike: a rank that cannot
allocate on its device, multiplies far slower than its peers or cannot reach them is cheaper to find
before training than as a crash, a straggler or a hang dozens of steps later. A failing rank's node is
excluded from the job, as a straggler's is on eviction ([12] in service/decisions/supervisor.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

#: The whole check (allocation, matmul, the collective among the new group) must finish within this.
HEALTH_CHECK_TIMEOUT_S = 10.0
#: The longest a GPU rank's first attempt waits, just before its check, for device memory another process
#: still holds (``workers/rank/device_memory.py``): a killed rank of the attempt before, being torn down.
DEVICE_FREE_WAIT_S = 30.0


def health_check_timeout_s(device_type: str) -> float:
    """The check's deadline on ``device_type``: :data:`HEALTH_CHECK_TIMEOUT_S`, and on a GPU
    :data:`DEVICE_FREE_WAIT_S` more, so that the peers' collective waits for a rank that first waited for its
    device's memory."""
    return HEALTH_CHECK_TIMEOUT_S + (DEVICE_FREE_WAIT_S if device_type == "cuda" else 0.0)


#: A GPU rank whose matmul rate is below this fraction of its peers' median fails: a device running at a
#: tenth of its peers is broken or throttled, not noisy.
MIN_RATE_FRACTION = 0.1
#: The device types whose rates are judged. Not CPUs: CPU ranks share cores with each other and with the
#: node's other work, so a preempted rank's matmul reads 40x slower than its peers' while nothing is wrong
#: (measured under a loaded 2-core test run: 1.36 against 55.9 GFLOP/s); their rates are recorded only.
RATE_JUDGED_DEVICES = ("cuda",)
#: What the device check allocates and touches (bytes): enough to fail on a device with no memory left.
ALLOC_BYTES = {"cpu": 8 << 20, "cuda": 256 << 20}
#: The matmul's side and repetitions per device type (a few milliseconds on a healthy device).
MATMUL_SIZE = {"cpu": 256, "cuda": 4096}
#: Each repetition is timed on its own and the fastest counts: a rank preempted once is not a slow device.
MATMUL_REPEATS = 5


@dataclass(frozen=True)
class RankHealth:
    """One rank's own measurements: ``failure`` says what failed locally (None: allocation and matmul
    worked); ``gflops`` is its matmul rate (None when it could not run)."""

    rank: int
    node: str
    device: str
    failure: str | None
    gflops: float | None


@dataclass(frozen=True)
class Unhealthy:
    rank: int
    node: str
    reason: str


def unhealthy_ranks(reports: list[RankHealth], *, min_rate_fraction: float = MIN_RATE_FRACTION) -> list[Unhealthy]:
    """The ranks that fail, lowest rank first: a local failure, or (on a device type whose rates are
    judged, :data:`RATE_JUDGED_DEVICES`) a matmul rate below ``min_rate_fraction`` of the median of the
    other ranks' rates (peers that measured one)."""
    failing: list[Unhealthy] = []
    judged = [report for report in reports if report.device.split(":")[0] in RATE_JUDGED_DEVICES]
    rates = {report.rank: report.gflops for report in judged if report.failure is None and report.gflops}
    for report in sorted(reports, key=lambda r: r.rank):
        if report.failure is not None:
            failing.append(Unhealthy(report.rank, report.node, report.failure))
            continue
        others = [rate for rank, rate in rates.items() if rank != report.rank]
        if report not in judged or report.gflops is None or not others:
            continue
        reference = median(others)
        if report.gflops < min_rate_fraction * reference:
            failing.append(
                Unhealthy(
                    report.rank,
                    report.node,
                    f"matmul at {report.gflops:.3g} GFLOP/s on {report.device}, below {min_rate_fraction:.0%} of "
                    f"its peers' median {reference:.3g} GFLOP/s",
                )
            )
    return failing
