"""Issue #17 item 1, the torch side: links planted in folders a tenant can write are refused, never followed.

Reproduced attacks, with real links in real folders and a real committed Llama checkpoint:

* (a) a ``model.hf`` folder whose ``tokenizer.json`` is a link to ``<data-dir>/checkpoint-key``: the HF
  export copied the service's HMAC key into the tenant's export (``shutil.copyfile`` follows links), and
  the ``s3://`` export uploaded it. Now the export fails with ``UnsafePathError`` naming ``model.hf`` and
  the key's bytes appear in no exported file or object. Refused rather than skipped: an export silently
  missing its tokenizer would be found out much later, and a link in a model folder is not what its
  owner thinks it is. The weights are read the same way (a linked ``model.safetensors`` is refused).
* (b) a checkpoint directory whose ``hf-export`` is a link to a folder elsewhere: the job's end-of-run
  export deleted that folder and wrote the export there. Now the task refuses the link and the folder
  it points at is untouched; a real ``hf-export`` left by an earlier try is still replaced.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from etrain.service.runtime.hf_export import HF_EXPORT_DIR, _export_folder, job_export_dir
from etrain.workers.checkpoints import storage
from etrain.workers.checkpoints.checkpoint import save_checkpoint
from etrain.workers.checkpoints.checkpoint_commit import commit, step_dir
from etrain.workers.checkpoints.hf_io import export_hf, load_hf_weights
from etrain.workers.engine.init import build_model
from etrain.workers.protocol.errors import CheckpointError, UnsafePathError
from etrain.workers.protocol.run_config import ModelConfig
from tests.object_store import s3_server

LLAMA = ModelConfig(arch="llama", n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, vocab_size=32, seq_len=8)
SECRET = b"etrain-checkpoint-key:0f1e2d3c4b5a69788796a5b4c3d2e1f0"
REFUSED = "symlinks are refused inside the storage roots"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A committed step of a tiny Llama (what the supervisor leaves under a job's checkpoint.path)."""
    root = tmp_path_factory.mktemp("ckpt")
    model = build_model(LLAMA, seed=0)
    directory = step_dir(str(root), 5)
    report = save_checkpoint(directory, [model], [torch.optim.AdamW(model.parameters())], {"step": 5})
    commit(directory, 5, "single", 1, [report])
    return directory


@pytest.fixture
def planted(tmp_path) -> dict[str, Path]:
    """The service's data directory with its key, and a tenant's model folder whose tokenizer.json links to it."""
    data_dir, model = tmp_path / "data-dir", tmp_path / "roots" / "alice" / "model.hf"
    data_dir.mkdir()
    (data_dir / "checkpoint-key").write_bytes(SECRET)
    model.mkdir(parents=True)
    (model / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    (model / "tokenizer.json").symlink_to(data_dir / "checkpoint-key")
    return {"data_dir": data_dir, "model": model, "key": data_dir / "checkpoint-key"}


def _files_holding(folder: Path, needle: bytes) -> list[str]:
    return sorted(
        str(path)
        for path in folder.rglob("*")
        if path.is_file() and not path.is_symlink() and needle in path.read_bytes()
    )


def _check_refusal(err: pytest.ExceptionInfo, field: str) -> None:
    assert isinstance(err.value, UnsafePathError) and err.value.field == field
    assert REFUSED in err.value.message and "checkpoint-key" not in err.value.message


def test_a_linked_tokenizer_file_never_reaches_a_local_export(checkpoint, planted, tmp_path):
    out = tmp_path / "roots" / "alice" / "export"
    with pytest.raises(UnsafePathError) as err:
        export_hf(checkpoint, out, LLAMA, source_dir=planted["model"])
    _check_refusal(err, "model.hf")
    assert "tokenizer.json" in err.value.message
    assert not out.exists() and not [p for p in out.parent.iterdir() if ".tmp-" in p.name]
    assert _files_holding(tmp_path, SECRET) == [str(planted["key"])]  # the key itself, nowhere else

    os.remove(planted["model"] / "tokenizer.json")  # the same folder without the link exports its real files
    (planted["model"] / "tokenizer.json").write_text('{"version": "1.0"}')
    exported = Path(export_hf(checkpoint, out, LLAMA, source_dir=planted["model"]))
    assert sorted(os.listdir(exported)) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (exported / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert not any(p.is_symlink() for p in exported.iterdir())


def test_a_linked_tokenizer_file_never_reaches_an_s3_export(checkpoint, planted):
    with s3_server() as s3:
        out = s3.url("exports", "alice")
        with pytest.raises(UnsafePathError) as err:
            export_hf(checkpoint, out, LLAMA, source_dir=planted["model"])
        _check_refusal(err, "model.hf")
        assert storage.walk_files(out) == []  # refused before anything is uploaded


def test_linked_weights_are_refused_where_model_hf_is_loaded(checkpoint, planted, tmp_path):
    source = Path(export_hf(checkpoint, tmp_path / "real-model", LLAMA))
    model_hf = planted["model"]
    (model_hf / "config.json").write_bytes((source / "config.json").read_bytes())
    (model_hf / "model.safetensors").symlink_to(source / "model.safetensors")  # someone else's weights
    with pytest.raises(UnsafePathError) as err:
        load_hf_weights([build_model(LLAMA, seed=1)], model_hf, LLAMA)
    _check_refusal(err, "model.hf")

    os.remove(model_hf / "model.safetensors")  # a real file loads, read through its checked descriptor
    (model_hf / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    model = build_model(LLAMA, seed=1)
    report = load_hf_weights([model], model_hf, LLAMA)
    reference = build_model(LLAMA, seed=0)
    assert report.tensors > 0
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


def test_an_hf_export_link_in_a_checkpoint_folder_is_refused_and_its_target_survives(checkpoint, tmp_path):
    root = Path(checkpoint).parent
    elsewhere = tmp_path / "outside-the-roots"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("not the service's to delete")
    link = root / HF_EXPORT_DIR
    link.symlink_to(elsewhere)
    try:
        out = job_export_dir(str(root))
        assert out == str(link)  # joined, not resolved to the link's target
        with pytest.raises(UnsafePathError) as err:
            _export_folder(checkpoint, out, LLAMA, None, True)
        _check_refusal(err, "checkpoint.path")
        assert link.is_symlink() and sorted(os.listdir(elsewhere)) == ["precious.txt"]
        assert (elsewhere / "precious.txt").read_text() == "not the service's to delete"
    finally:
        link.unlink()

    (root / HF_EXPORT_DIR).mkdir()  # a real folder left by an earlier supervisor of the job is replaced
    (root / HF_EXPORT_DIR / "stale.safetensors").write_bytes(b"old")
    try:
        assert _export_folder(checkpoint, job_export_dir(str(root)), LLAMA, None, True) == str(root / HF_EXPORT_DIR)
        assert sorted(os.listdir(root / HF_EXPORT_DIR)) == ["config.json", "model.safetensors"]
    finally:
        storage.rmtree(root / HF_EXPORT_DIR)


def test_a_checkpoint_folder_swapped_for_a_link_after_start_gets_no_write_commit_or_prune(tmp_path):
    """(c) the checkpoint folder is swapped for a link to another tenant's folder after the job started.
    Before, every save, commit and prune went by name, so they went through the link: shards and a signed
    manifest written into the victim's folder, its old steps pruned. Now the rank and the supervisor each
    hold the folder by descriptor (``storage.hold_dir``): the four saves, their commits and the prunes all
    land in the folder that passed, and the victim's folder is byte-for-byte what it was."""
    from etrain.service.decisions.supervisor_events import CommitSucceeded
    from etrain.service.runtime.job_checkpoints import JobCheckpoints
    from etrain.workers.protocol.run_config import ParallelConfig

    root, moved, victim = tmp_path / "runs" / "job", tmp_path / "runs" / "job-real", tmp_path / "bob"
    victim.mkdir()
    (victim / "step_1").mkdir()
    (victim / "step_1" / "manifest.json").write_text("bob's")
    before = {str(p): p.read_bytes() for p in victim.rglob("*") if p.is_file()}
    events: list[tuple[str, str]] = []
    key = b"k" * 32
    checkpoints = JobCheckpoints(
        job_id="job", root=str(root), key=key, keep_last=1, record=lambda kind, detail: events.append((kind, detail))
    )
    rank_root = storage.hold_dir(str(root))  # what the rank's attempt holds (workers/rank/worker.py)
    os.rename(root, moved)
    os.symlink(victim, root)
    model = build_model(LLAMA, seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (2, 4, 6, 8):
        report = save_checkpoint(rank_root.inside(step_dir(str(root), step)), [model], [optimizer], {"step": step})
        checkpoints.reported(step, 0, report)
        assert isinstance(checkpoints.commit(step, parallel=ParallelConfig(), world_size=1), CommitSucceeded)
        checkpoints.wait_for_prune(30)
    rank_root.close()
    assert {str(p): p.read_bytes() for p in victim.rglob("*") if p.is_file()} == before
    assert sorted(os.listdir(moved)) == [os.path.basename(step_dir(str(moved), 8))]  # committed and pruned there
    assert checkpoints.resume_from(8)[0] == step_dir(str(root), 8)  # what other processes are told: the name
    # A link planted at a step's name is refused where the step is cleared, never written through.
    os.symlink(victim, moved / "step_10")
    with pytest.raises(CheckpointError, match="is a symbolic link") as err:  # the save's refusal, on every rank
        save_checkpoint(os.path.join(checkpoints._io, "step_10"), [model], [optimizer], {"step": 10})
    assert f"checkpoint.path='{moved / 'step_10'}'" in str(err.value) and "/proc/" not in str(err.value)
    assert {str(p): p.read_bytes() for p in victim.rglob("*") if p.is_file()} == before
