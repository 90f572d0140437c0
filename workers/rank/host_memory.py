"""What a rank holds in host memory, read from the kernel: for the rank log's line at the end of each attempt
beside what its bundle reserves (``resources.host_memory_gb``: ``service/planning/plan_host.py``), and sampled
while it trains (:class:`HostMemorySampler`) for the step exchange, from which the supervisor warns when a rank
holds more than it reserved (``service/decisions/host_memory_watch.py``).

Why: the reservation is the planner's count, and Ray places by it without enforcing it. The line lets an
operator (and the next GPU check) compare the two on every job: on a GPU the count leaves out the process
itself (Python, torch, the CUDA context's host side), which only a real rank shows; the warning says so while
the job runs, before the node's other ranks meet the OOM killer.

Three figures, since they answer different questions: the peak resident set (``ru_maxrss``: every shared page
whole, what the OOM killer's view starts from), and now the proportional set (PSS: shared pages split among
the processes mapping them, so the ranks of a node add up to what they take together) and the private pages
(what this process alone holds). Linux only (``/proc/self/smaps_rollup``); elsewhere the peak alone. Pure
(no torch, no Ray)."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HOST_SAMPLE_INTERVAL_S", "HostMemorySampler", "HostMemoryUse", "host_memory_use"]

#: How often a training rank reads its host memory (a read of ``smaps_rollup`` walks the process's mappings:
#: about a millisecond for a torch process, more with many mappings; never every step of a fast job).
HOST_SAMPLE_INTERVAL_S = 10.0

_GIB = 1024**3
_ROLLUP = Path("/proc/self/smaps_rollup")


@dataclass(frozen=True)
class HostMemoryUse:
    peak_rss: int  # bytes
    pss: int | None = None  # bytes; None where the kernel does not say
    private: int | None = None
    #: the anonymous pages (the process's own allocations: tensors, Python objects), which only swap could take
    #: back; a memory-mapped file's pages are the page cache's, reclaimable, though private when one process maps them
    anonymous: int | None = None

    def describe(self, reserved: int) -> str:
        """``host memory: peak RSS 0.42 GiB, now PSS 0.31 GiB (private 0.27 GiB); reserved 0.28 GiB``."""
        now = (
            f", now PSS {self.pss / _GIB:.2f} GiB (private {self.private / _GIB:.2f} GiB)"
            if self.pss is not None and self.private is not None
            else ""
        )
        held = f"; reserved {reserved / _GIB:.2f} GiB" if reserved else "; none reserved"
        return f"host memory: peak RSS {self.peak_rss / _GIB:.2f} GiB{now}{held}"


def host_memory_use(rollup: Path = _ROLLUP) -> HostMemoryUse:
    """This process's host memory now (``rollup``: the kernel's summary of its mappings). Never raises."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    try:
        fields = {}
        for line in rollup.read_text().splitlines()[1:]:  # the first line names the address range
            name, _, rest = line.partition(":")
            fields[name.strip()] = int(rest.split()[0]) * 1024  # kB
        private = fields["Private_Clean"] + fields["Private_Dirty"]
        return HostMemoryUse(peak_rss=peak, pss=fields["Pss"], private=private, anonymous=fields.get("Anonymous"))
    except (OSError, KeyError, ValueError, IndexError):
        return HostMemoryUse(peak_rss=peak)


class HostMemorySampler:
    """A training rank's host memory, read at most every ``interval_s`` (the first call reads): what the step
    exchange carries (``host_mem_bytes``). Its anonymous pages (where the kernel does not say them, its private
    ones), not PSS: they are what this rank's own allocations hold, which the reservation is for, and what the
    node cannot reclaim; the libraries a node's ranks share count once for all of them, and a memory-mapped
    dataset's pages are reclaimable page cache. 0 where the kernel says neither. Pinned buffers the CUDA driver
    maps for a GPU rank (the async checkpoint's staging) may not count as anonymous: not yet seen on a GPU."""

    def __init__(
        self,
        interval_s: float = HOST_SAMPLE_INTERVAL_S,
        *,
        read: Callable[[], HostMemoryUse] = host_memory_use,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._interval_s = interval_s
        self._read = read
        self._clock = clock
        self._next_at: float | None = None
        self._held = 0

    def held_bytes(self) -> int:
        now = self._clock()
        if self._next_at is None or now >= self._next_at:
            use = self._read()
            self._held = (use.anonymous if use.anonymous is not None else use.private) or 0
            self._next_at = now + self._interval_s
        return self._held
