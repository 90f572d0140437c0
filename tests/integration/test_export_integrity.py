"""Issue #17 item 7: the export task loads only the manifest the service verified with its key.

The export runs in a Ray task without the service's key, and it unpickles DCP's ``.metadata``. It used
to verify the manifest without the key, so whoever can write a checkpoint folder could replace
``.metadata`` with a pickle of their own and rewrite the (then unsigned) manifest to list its hash: the
keyless check passed and the task ran the pickle. Now the caller verifies the signature and hands the
task the manifest's digest (``expect_digest``); a manifest that is not exactly that one is refused
before anything is unpickled. Real files, a real signed Llama checkpoint, a real pickle that would
leave a marker file if it ever ran.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path

import pytest
import torch

from etrain.service.errors import JobConflict
from etrain.service.jobs.checkpoints import committed_step
from etrain.service.runtime.hf_export import _export_folder
from etrain.workers.checkpoints.checkpoint import save_checkpoint
from etrain.workers.checkpoints.checkpoint_commit import commit, file_entries, step_dir, verify
from etrain.workers.engine.init import build_model
from etrain.workers.protocol.errors import CheckpointError
from etrain.workers.protocol.run_config import ModelConfig

LLAMA = ModelConfig(arch="llama", n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, vocab_size=32, seq_len=8)
KEY = b"k" * 32
JOB = "job-export-integrity"


class _LeavesAMarker:
    """Unpickling this creates ``path``: proof that the export ran the attacker's pickle."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _signed_checkpoint(root: Path, step: int) -> tuple[str, list]:
    model = build_model(LLAMA, seed=step)
    directory = step_dir(str(root), step)
    report = save_checkpoint(directory, [model], [torch.optim.AdamW(model.parameters())], {"step": step})
    commit(directory, step, "single", 1, [report], key=KEY, job_id=JOB)
    return directory, [report]


def _plant_pickle(directory: str, reports: list, marker: Path) -> None:
    """What a tenant who can write the folder does: its own ``.metadata``, and an unsigned manifest
    listing that file's size and hash (``commit`` without a key), so a keyless check passes."""
    Path(directory, ".metadata").write_bytes(pickle.dumps(_LeavesAMarker(str(marker))))
    Path(directory, "manifest.json").unlink()
    forged = [
        dataclasses.replace(
            report,
            files=tuple(
                file_entries(directory, [entry.path])[0] if entry.path == ".metadata" else entry
                for entry in report.files
            ),
        )
        for report in reports
    ]
    commit(directory, int(Path(directory).name.split("_")[-1]), "single", 1, forged, key=None, job_id=JOB)


@pytest.fixture
def attacked(tmp_path) -> dict:
    root = tmp_path / "ckpt"
    directory, reports = _signed_checkpoint(root, 4)
    verified = committed_step(JOB, str(root), None, key=KEY)  # what the control plane does first
    assert (verified.step, verified.directory) == (4, directory)
    marker = tmp_path / "pickle-ran"
    _plant_pickle(directory, reports, marker)  # between the server's check and the task's read
    return {"root": root, "directory": directory, "digest": verified.digest, "marker": marker}


def test_a_keyless_check_alone_would_run_the_planted_pickle(attacked, tmp_path):
    """The attack is real: without the digest (the old task) the forged manifest verifies."""
    verify(attacked["directory"])  # sizes and checksums all match the planted file
    with pytest.raises(Exception):  # noqa: B017 - whatever the planted object makes DCP raise: the marker is the point
        _export_folder(attacked["directory"], str(tmp_path / "out"), LLAMA, None, False)
    assert attacked["marker"].exists(), "DCP unpickled the planted .metadata"


def test_the_export_task_refuses_a_manifest_other_than_the_verified_one_before_unpickling(attacked, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="not the one the supervisor verified"):
        _export_folder(attacked["directory"], str(out), LLAMA, None, False, attacked["digest"])
    assert not attacked["marker"].exists()
    assert not out.exists() or os.listdir(out) == []


def test_the_control_plane_no_longer_finds_a_committed_step_in_the_forged_folder(attacked):
    with pytest.raises(JobConflict, match="nothing is committed yet"):
        committed_step(JOB, str(attacked["root"]), None, key=KEY)
    assert not attacked["marker"].exists()


def test_an_untouched_checkpoint_exports_with_the_digest(tmp_path):
    root = tmp_path / "ckpt"
    _signed_checkpoint(root, 2)
    directory, reports = _signed_checkpoint(root, 6)
    verified = committed_step(JOB, str(root), None, key=KEY)
    assert verified.step == 6 and verified.digest == verify(directory, key=KEY).digest
    assert committed_step(JOB, str(root), 2, key=KEY).step == 2
    out = Path(_export_folder(directory, str(tmp_path / "out"), LLAMA, None, False, verified.digest))
    assert (out / "config.json").exists() and (out / "model.safetensors").stat().st_size > 4 * 1000
