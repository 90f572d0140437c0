"""Whether a rank holds more host memory than its bundle reserves, from the step reports' samples.

Why: each rank's bundle reserves the planner's figure as Ray's ``memory`` resource (``resources.host_memory_gb``,
``service/planning/plan_host.py``), and Ray places ranks by it without enforcing it. A rank that holds more than
its share (the figure leaves out the process itself: Python, torch, a GPU's CUDA context on the host side, the
data loader) takes it from its node's other ranks, and a node packed by the reservations can run out of RAM: the
kernel's OOM killer (or Ray's memory monitor) then ends some process on it, which the job meets as a lost rank.
The job says so while it runs, once per attempt, naming the rank, what it holds and what to reserve instead.

A rank may hold a little more than its reservation before that is worth saying (:func:`allowance`): the
allocator's slack, buffers the planner does not itemise, the sample's moment. Each rank samples its anonymous pages
every few seconds (``workers/rank/host_memory.py``) and the step exchange carries them to rank 0's reports.
Pure (no torch, no Ray).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from etrain.service.planning.plan_host import host_memory_gb
from etrain.service.planning.plan_memory import GiB

__all__ = ["SLACK_BYTES", "SLACK_FRACTION", "HostMemoryOver", "allowance", "over_reservation"]

#: What a rank may hold beyond its reservation unsaid: the larger of half a GiB and a tenth of it.
SLACK_BYTES = GiB // 2
SLACK_FRACTION = 0.10
#: The figure suggested instead is what the rank held plus this share (it may still grow).
HEADROOM = 0.10


def allowance(reserved: int) -> int:
    """The most a rank of ``reserved`` bytes may hold before the job says it holds more."""
    return reserved + max(SLACK_BYTES, int(SLACK_FRACTION * reserved))


@dataclass(frozen=True)
class HostMemoryOver:
    """The rank holding the most host memory, beyond its reservation's :func:`allowance`."""

    rank: int
    held: int  # bytes, its anonymous pages at the sample
    reserved: int  # bytes, its bundle's ``memory``

    @property
    def suggested_gb(self) -> float:
        """A ``resources.host_memory_gb`` that holds what the rank held, with :data:`HEADROOM`."""
        return host_memory_gb(int(self.held * (1 + HEADROOM)))

    def describe(self, node: str) -> str:
        return (
            f"rank {self.rank} (node {node}) holds {self.held / GiB:.2f} GiB of host memory (anonymous pages), more "
            f"than the {self.reserved / GiB:.2f} GiB its bundle reserves (resources.host_memory_gb; the planner "
            "counts the model's state, not the data loader's or the process's own memory: POST /v1/plan's "
            "host_memory). Ray places ranks by the reservation without enforcing it, so the node can run out of "
            f"memory and lose ranks: resubmit with resources.host_memory_gb: {self.suggested_gb:g}"
        )


def over_reservation(held: Sequence[int], reserved: int) -> HostMemoryOver | None:
    """The rank (by index in ``held``, one sample per rank; 0 where unknown) that holds the most, where that is
    beyond :func:`allowance` of ``reserved``; None when none is, or nothing is reserved (a job stored before the
    reservation existed: nothing to compare with)."""
    if reserved <= 0 or not held:
        return None
    rank = max(range(len(held)), key=lambda index: held[index])
    return (
        HostMemoryOver(rank=rank, held=int(held[rank]), reserved=reserved) if held[rank] > allowance(reserved) else None
    )
