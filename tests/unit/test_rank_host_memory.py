"""``workers/rank/host_memory.py``: what a rank holds in host memory, as its rank log says at each attempt's end."""

from __future__ import annotations

import sys

import pytest

from etrain.workers.rank.host_memory import HostMemoryUse, host_memory_use

ROLLUP = """55d0a0000000-7ffd3e1f6000 ---p 00000000 00:00 0                          [rollup]
Rss:              441940 kB
Pss:              327089 kB
Pss_Anon:         280000 kB
Shared_Clean:     155000 kB
Shared_Dirty:        796 kB
Private_Clean:      6144 kB
Private_Dirty:    280000 kB
Swap:                  0 kB
"""


def test_the_kernels_summary_is_read_in_bytes(tmp_path):
    rollup = tmp_path / "smaps_rollup"
    rollup.write_text(ROLLUP)
    use = host_memory_use(rollup)
    assert (use.pss, use.private) == (327089 * 1024, (6144 + 280000) * 1024)
    assert use.peak_rss > 0
    assert use.describe(reserved=int(0.28 * 1024**3)).endswith("now PSS 0.31 GiB (private 0.27 GiB); reserved 0.28 GiB")


def test_without_the_summary_only_the_peak_is_said(tmp_path):
    use = host_memory_use(tmp_path / "absent")
    assert use.pss is None and use.peak_rss > 0
    assert HostMemoryUse(peak_rss=3 * 1024**3).describe(reserved=0) == "host memory: peak RSS 3.00 GiB; none reserved"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps_rollup is Linux's")
def test_this_process_holds_what_its_pages_say():
    """The real kernel: a 64 MiB buffer written here is private to this process, so private and PSS grow by it
    (the peak resident set never falls)."""
    before = host_memory_use()
    buffer = bytearray(64 * 1024**2)
    buffer[::4096] = b"\x01" * len(buffer[::4096])  # touch every page
    after = host_memory_use()
    assert after.private - before.private >= 60 * 1024**2, (before, after)
    assert after.pss >= after.private and after.peak_rss >= before.peak_rss
    del buffer
