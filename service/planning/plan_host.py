"""Host memory per rank: what a rank holds in its node's RAM, which Ray reserves with its CPUs and GPUs
(``resources.host_memory_gb``, a ``memory`` entry in each rank's placement-group bundle).

Why the service reserves it: the device plan says whether a rank fits its GPU, but the node's RAM is shared by
every rank placed on it, and nothing checked it. On a GPU rank the host holds more than it seems: the async
checkpoint's staging copy of the rank's whole state (pinned, reused by every save: ``AsyncCheckpointer``),
two in-memory snapshots of it where an in-place repair or resize can read them (``TrainWorker._store_snapshot``:
the newest two), and under ``offload: cpu`` the parameters, gradients and AdamW states themselves. Eight 8B-class ranks
with async checkpoints and snapshots hold 3 copies of their state each: with ZeRO-3 over the 8, 3 × 16 GB;
without sharding 3 × 128 GB per rank, which no node has. Placed by CPUs and GPUs alone, such ranks are
OOM-killed mid-run; reserved, the job queues until a node has the memory, or is refused at submit with the
numbers (``service/decisions/admission.py``).

The figures come from the device plan's own counts (``MemoryBreakdown``): ``checkpoint_bytes`` for the staging
copy of the state and ``snapshot_bytes`` for each snapshot (a tied embedding twice in the first, once in the
second), ``host_bytes`` for the offloaded state or the initial draw; a CPU rank's whole plan, its process
included. What a GPU rank's figure leaves out: the process itself (Python, torch, the CUDA context's host side:
a few GB) and the data loader's buffers. Pure (no torch, no Ray).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from etrain.service.planning.plan_memory import GiB, MemoryBreakdown, gib
from etrain.workers.protocol.memory_resume import SNAPSHOTS_KEPT, every_rank_has_a_replica

__all__ = ["SNAPSHOTS_KEPT", "HostMemory", "host_memory", "host_memory_gb", "snapshot_copies"]


@dataclass(frozen=True)
class HostMemory:
    """Bytes one rank holds in host memory, by what holds them."""

    #: on a CPU rank, everything its plan holds (the device is the host); under ``offload: cpu`` the
    #: parameters, gradients and AdamW states FSDP2 keeps there
    state: int
    #: a GPU rank's largest parameter, materialised whole in fp32 on the host before it is sharded and moved
    init_draw: int
    #: an async checkpoint's staging copy of the rank's state, allocated at the first save and reused
    checkpoint_staging: int
    #: the in-memory copies of the state an in-place repair or resize restores from
    snapshots: int

    @property
    def total(self) -> int:
        return self.state + self.init_draw + self.checkpoint_staging + self.snapshots

    def to_dict(self) -> dict:
        parts = {
            "state": self.state,
            "init_draw": self.init_draw,
            "checkpoint_staging": self.checkpoint_staging,
            "snapshots": self.snapshots,
        }
        return {
            "bytes": {**parts, "total": self.total},
            "gib": {**{name: gib(value) for name, value in parts.items()}, "total": gib(self.total)},
        }


def snapshot_copies(
    *, read: bool, dp: int, zero: int, dp_replicate: int = 1, ep: int = 1, cp: int = 1, may_grow: bool = False
) -> int:
    """How many in-memory copies of its state a rank keeps (``TrainWorker._keep_snapshot``): :data:`SNAPSHOTS_KEPT`
    where something reads them (``read``: ``memory_resume.snapshots_are_read``) and a data-parallel replica holds
    the same state, or at dp=1 in a job that may grow (its added ranks receive the copy); else none."""
    if not read:
        return 0
    replicated = every_rank_has_a_replica(dp=dp, zero=zero, dp_replicate=dp_replicate, ep=ep, cp=cp)
    grows_from_one = may_grow and dp == 1 and every_rank_has_a_replica(dp=2, zero=zero, ep=1, cp=cp)
    return SNAPSHOTS_KEPT if replicated or grows_from_one else 0


def host_memory(memory: MemoryBreakdown, *, device: str, async_checkpoints: bool, snapshots: int) -> HostMemory:
    """One rank's host memory from its device plan: ``async_checkpoints`` (``checkpoint.async`` as resolved),
    ``snapshots`` (:func:`snapshot_copies`)."""
    if device == "cpu":
        state, draw = memory.total, 0
    elif memory.offloaded:
        state, draw = memory.host_bytes, 0
    else:
        state, draw = 0, memory.host_bytes
    return HostMemory(
        state=state,
        init_draw=draw,
        checkpoint_staging=memory.checkpoint_bytes if async_checkpoints else 0,
        snapshots=snapshots * memory.snapshot_bytes,
    )


def host_memory_gb(nbytes: int) -> float:
    """Bytes as the GiB ``resources.host_memory_gb`` holds: rounded up to 0.01 GiB, never below it."""
    return max(0.01, math.ceil(nbytes / GiB * 100) / 100)
