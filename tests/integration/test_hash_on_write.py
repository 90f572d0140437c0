"""A local save's shard report hashes each file as DCP writes it (no read-back), and those hashes are the
files' own: what the supervisor later verifies against the bytes on disk.

Why it matters: reading back a 1B model's 15.9 GB for the report made every save's end a second pass
over the data (``workers/checkpoints/checkpoint_io._hashing``).
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from etrain.workers.checkpoints.checkpoint_io import EXTRA_NAME, dcp_writer, shard_report


@pytest.mark.parametrize("threads", [1, 4])
def test_the_report_hashes_each_file_as_written_and_they_match_the_disk(tmp_path, threads) -> None:
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(64 + i, 33) for i in range(9)} | {"step": torch.tensor(7)}
    torch.save({"step": 7}, tmp_path / EXTRA_NAME)  # rank 0's extra.pt, written before DCP's files
    writer = dcp_writer(str(tmp_path), threads=threads)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, storage_writer=writer)
    report = shard_report(str(tmp_path), writer, None)

    hashed_on_write = {os.path.basename(path) for path in writer.fs.written}
    shards = sorted(name for name in os.listdir(tmp_path) if name.endswith(".distcp"))
    assert len(shards) == threads  # a file per writer thread
    assert set(shards) | {".metadata"} <= hashed_on_write  # none of DCP's files was read back
    assert EXTRA_NAME not in hashed_on_write
    assert {entry.path for entry in report.files} == set(shards) | {".metadata", EXTRA_NAME}
    for entry in report.files:
        data = (tmp_path / entry.path).read_bytes()
        assert (entry.size, entry.sha256) == (len(data), hashlib.sha256(data).hexdigest()), entry.path
