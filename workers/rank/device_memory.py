"""Before a GPU rank's first attempt: wait, within a bound, for device memory that another process holds.

Why: on NCCL every lost rank relaunches the job (``JobPolicy.collectives_fail_on_peer_loss``), and the new
ranks are placed on the same GPUs as the ranks just killed. ``WorkerGroup.stop`` waits up to 10 s for the
killed processes to end, but a process SIGKILLed while its kernels wait on a dead peer can take longer
for the driver to tear down, and until then its memory stays allocated: a new rank materialising its model
beside it runs out of memory, which fails the attempt and spends a restart. So a rank's first attempt
reads the device's free memory first and, where more is in use than its own process can account for,
polls until it is released (a fraction of a second per poll) or :data:`DEVICE_FREE_WAIT_S` passes; then
it goes on either way, and says in the rank log what it found (a process outside etrain may hold memory
by design, and the job may fit beside it).

It waits after the rendezvous and before the health check (whose allocation would fail on a device another
process still fills, and fail the node with it); the health check's deadline on a GPU is longer by
``DEVICE_FREE_WAIT_S`` (``workers/protocol/health.py``, which owns both), so that its peers wait for a rank
that waited.

The decision is :func:`wait_for_device_memory`, pure apart from the reader, clock and sleep it is given
(``tests/unit/test_device_memory.py``); ``TrainWorker`` calls it with :func:`cuda_memory_reader`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from etrain.workers.protocol.health import DEVICE_FREE_WAIT_S

__all__ = [
    "DEVICE_FREE_WAIT_S",
    "FOREIGN_ALLOWANCE_BYTES",
    "FOREIGN_ALLOWANCE_FRACTION",
    "DeviceMemoryWait",
    "cuda_memory_reader",
    "held_by_others",
    "wait_for_device_memory",
]

#: Memory in use that this process's allocator does not account for and is still its own: the CUDA context,
#: cuBLAS's workspace and the kernels loaded (about 0.5-1 GiB on an H100), with room to spare; at least
#: :data:`FOREIGN_ALLOWANCE_FRACTION` of the device, so that a small process that shares the GPU for good (a
#: monitor, another context) does not cost every start the whole wait. More than this in use beyond the
#: allocator's reserve is another process's: a killed rank holds most of the device.
FOREIGN_ALLOWANCE_BYTES = 2 << 30
FOREIGN_ALLOWANCE_FRACTION = 1 / 16
#: How often the device's free memory is read while waiting.
POLL_S = 0.25


@dataclass(frozen=True)
class DeviceMemoryWait:
    """What the check found: bytes another process held when it started and when it ended, the seconds
    it waited, and whether the memory was released within the bound."""

    held_at_start: int
    held_at_end: int
    waited_s: float

    @property
    def released(self) -> bool:
        return self.held_at_end == 0

    def summary(self) -> str:
        """A rank-log line ("" when nothing was held: the usual start)."""
        if self.held_at_start == 0:
            return ""
        gib = self.held_at_start / (1 << 30)
        if self.released:
            return f"{gib:.1f} GiB of this GPU held by another process; released after {self.waited_s:.1f}s"
        return (
            f"{gib:.1f} GiB of this GPU held by another process, still {self.held_at_end / (1 << 30):.1f} GiB "
            f"after {self.waited_s:.1f}s: starting beside it (a rank of an earlier attempt still exiting, or a "
            "process outside etrain; if this rank runs out of memory, free that GPU)"
        )


def held_by_others(free: int, total: int, own: int, *, allowance: int = FOREIGN_ALLOWANCE_BYTES) -> int:
    """Bytes in use on the device beyond this process's allocator reserve ``own`` where they exceed the larger
    of ``allowance`` and :data:`FOREIGN_ALLOWANCE_FRACTION` of ``total`` (what its context and libraries
    take): then another process holds most of them (the figure includes this process's context, well under
    the allowance); 0 otherwise."""
    beyond = max(0, total - free - own)
    return beyond if beyond > max(allowance, int(total * FOREIGN_ALLOWANCE_FRACTION)) else 0


def wait_for_device_memory(
    read: Callable[[], tuple[int, int, int]],
    *,
    timeout_s: float = DEVICE_FREE_WAIT_S,
    poll_s: float = POLL_S,
    allowance: int = FOREIGN_ALLOWANCE_BYTES,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> DeviceMemoryWait:
    """Poll ``read`` (``(free, total, own)`` bytes: the device's free and total memory and this process's
    allocator reserve) until no other process holds memory, or ``timeout_s`` has passed."""
    if timeout_s < 0 or poll_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be >= 0 and poll_s={poll_s} > 0")
    started = clock()
    first = held = held_by_others(*read(), allowance=allowance)
    while held and clock() - started < timeout_s:
        sleep(min(poll_s, max(0.0, timeout_s - (clock() - started))))
        held = held_by_others(*read(), allowance=allowance)
    return DeviceMemoryWait(held_at_start=first, held_at_end=held, waited_s=round(clock() - started, 3))


def cuda_memory_reader(device: Any) -> Callable[[], tuple[int, int, int]]:
    """The reader for a CUDA ``device``: its free and total memory (``torch.cuda.mem_get_info``, the driver's
    figures, every process's use included) and this process's allocator reserve."""
    import torch

    def read() -> tuple[int, int, int]:
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total), int(torch.cuda.memory_reserved(device))

    return read
