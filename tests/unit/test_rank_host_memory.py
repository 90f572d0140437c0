"""``workers/rank/host_memory.py``: what a rank holds in host memory, as its rank log says at each attempt's end."""

from __future__ import annotations

import sys

import pytest

from etrain.workers.rank.host_memory import HostMemorySampler, HostMemoryUse, host_memory_use

ROLLUP = """55d0a0000000-7ffd3e1f6000 ---p 00000000 00:00 0                          [rollup]
Rss:              441940 kB
Pss:              327089 kB
Pss_Anon:         280000 kB
Shared_Clean:     155000 kB
Shared_Dirty:        796 kB
Private_Clean:      6144 kB
Private_Dirty:    280000 kB
Anonymous:        279000 kB
Swap:                  0 kB
"""


def test_the_kernels_summary_is_read_in_bytes(tmp_path):
    rollup = tmp_path / "smaps_rollup"
    rollup.write_text(ROLLUP)
    use = host_memory_use(rollup)
    assert (use.pss, use.private, use.anonymous) == (327089 * 1024, (6144 + 280000) * 1024, 279000 * 1024)
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


def test_a_training_rank_reads_its_anonymous_pages_at_most_every_interval():
    reads, now = [], [0.0]

    def read():
        reads.append(now[0])
        held = (4 + len(reads)) * 1024**3
        return HostMemoryUse(peak_rss=1, pss=7 * 1024**3, private=held + 1024**3, anonymous=held)

    sampler = HostMemorySampler(10.0, read=read, clock=lambda: now[0])
    assert sampler.held_bytes() == 5 * 1024**3  # the first call reads
    for now[0] in (1.0, 5.0, 9.99):
        assert sampler.held_bytes() == 5 * 1024**3  # the same sample: no read within the interval
    now[0] = 10.0
    assert sampler.held_bytes() == 6 * 1024**3 and reads == [0.0, 10.0]
    older_kernel = HostMemorySampler(read=lambda: HostMemoryUse(peak_rss=1, pss=3, private=2))
    assert older_kernel.held_bytes() == 2  # no Anonymous line: the private pages
    unknown = HostMemorySampler(read=lambda: HostMemoryUse(peak_rss=1))
    assert unknown.held_bytes() == 0  # no smaps_rollup: nothing said, never a guess


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps_rollup is Linux's")
def test_the_sampler_counts_allocations_not_a_mapped_files_pages(tmp_path):
    """The real kernel: 64 MiB written into a buffer raise the sample by about that; 64 MiB of a file mapped and
    read raise the private pages (only this process maps them) but not the sample (page cache, reclaimable)."""
    import mmap

    sampler = HostMemorySampler(0.0)
    before = sampler.held_bytes()
    buffer = bytearray(64 * 1024**2)
    buffer[::4096] = b"\x01" * len(buffer[::4096])
    grown = sampler.held_bytes() - before
    assert 60 * 1024**2 <= grown <= 80 * 1024**2, grown
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"\x02" * 64 * 1024**2)
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        private_before, held_before = host_memory_use().private, sampler.held_bytes()
        assert sum(mapped[offset] for offset in range(0, len(mapped), 4096)) == 2 * 16384  # every page read
        assert host_memory_use().private - private_before >= 60 * 1024**2
        assert abs(sampler.held_bytes() - held_before) < 8 * 1024**2
    del buffer
