"""What a rank holds in host memory, read from the kernel, for the rank log's line at the end of each attempt
beside what its bundle reserves (``resources.host_memory_gb``: ``service/planning/plan_host.py``).

Why: the reservation is the planner's count, and Ray places by it without enforcing it. The line lets an
operator (and the next GPU check) compare the two on every job: on a GPU the count leaves out the process
itself (Python, torch, the CUDA context's host side), which only a real rank shows.

Three figures, since they answer different questions: the peak resident set (``ru_maxrss``: every shared page
whole, what the OOM killer's view starts from), and now the proportional set (PSS: shared pages split among
the processes mapping them, so the ranks of a node add up to what they take together) and the private pages
(what this process alone holds). Linux only (``/proc/self/smaps_rollup``); elsewhere the peak alone. Pure
(no torch, no Ray)."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HostMemoryUse", "host_memory_use"]

_GIB = 1024**3
_ROLLUP = Path("/proc/self/smaps_rollup")


@dataclass(frozen=True)
class HostMemoryUse:
    peak_rss: int  # bytes
    pss: int | None = None  # bytes; None where the kernel does not say
    private: int | None = None

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
        return HostMemoryUse(peak_rss=peak, pss=fields["Pss"], private=private)
    except (OSError, KeyError, ValueError, IndexError):
        return HostMemoryUse(peak_rss=peak)
