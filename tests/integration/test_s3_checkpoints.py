"""Issue #7 acceptance: s3:// checkpoint save, commit, corruption fallback and restore against a real
S3-compatible server on loopback (moto's server, ``tests/object_store.py``), through s3fs and DCP's
fsspec storage, exactly as against a real object store.

Two gloo ranks train a tiny GPT under FSDP2 (ZeRO-3: each rank writes only its shards) and save
steps 1 (sync), 2 (``AsyncCheckpointer``) and 3 (sync) to ``s3://etrain-test/source``; the test
process then does the supervisor's part: it commits each step with the service's key (a signed
manifest object, written last) and verifies it. Restores into freshly initialised models, on two ranks
and in one process, must give the full model and optimizer state bit for bit (SHA-256 digests over
the full tensors, gathered independently of the checkpoint code). A flipped byte in one shard object
of the newest step makes verification fail and the previous step the one chosen; pruning keeps
``keep_last``. A Llama checkpoint on S3 exports to Hugging Face (to a folder and to an s3:// prefix)
byte-identical to the export of the same checkpoint from a local folder.
"""

from __future__ import annotations

import hashlib
import os
import re

import pytest
import torch
import torch.distributed as dist

from etrain.workers.checkpoints import storage
from etrain.workers.checkpoints.checkpoint import AsyncCheckpointer, load_checkpoint, save_checkpoint
from etrain.workers.checkpoints.checkpoint_commit import commit, list_steps, prune, resolve_latest, step_dir, verify
from etrain.workers.engine.init import build_model
from etrain.workers.families.model import cross_entropy_loss
from etrain.workers.protocol.errors import CheckpointError, ConfigError
from etrain.workers.protocol.run_config import ModelConfig
from tests.dist_utils import run_distributed
from tests.object_store import s3_server

MODEL = ModelConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=8)
LLAMA = ModelConfig(arch="llama", n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, vocab_size=32, seq_len=8)
KEY = b"service-checkpoint-key-0123456789"
JOB = "s3-job"
STEPS = (1, 2, 3)
TIMEOUT_S = 180.0


# -- the ranks (spawned processes) ----------------------------------------------------------------


def _fsdp_model(seed: int, lr: float):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(MODEL, seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def _state_digest(model, optimizer, *, sharded: bool = True) -> str:
    """SHA-256 over the FULL model and optimizer state, by FQN. ``sharded``: an FSDP2 model, gathered whole
    (a collective: every rank gets it); False: a plain single-process model, whole already (the same FQNs
    and flattened optimizer keys, so the same digest for the same state)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=sharded, flatten_optimizer_state_dict=True)
    state = {
        **{f"model.{k}": v for k, v in get_model_state_dict(model, options=options).items()},
        **{f"optim.{k}": v for k, v in get_optimizer_state_dict(model, optimizer, options=options).items()},
    }
    digest = hashlib.sha256()
    for name in sorted(state):
        value = state[name]
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def _train_step(model, optimizer, step: int) -> float:
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    tokens = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len + 1), generator=generator)
    loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _save_three_steps(rank: int, world_size: int, root: str) -> dict:
    model, optimizer = _fsdp_model(seed=0, lr=1e-2)
    checkpointer = AsyncCheckpointer()
    reports, digests, losses = {}, {}, {}
    for step in STEPS:
        losses[step] = _train_step(model, optimizer, step)
        directory = step_dir(root, step)
        if step == 2:  # asynchronous: staged in memory, written by a background thread through fsspec
            reports[step] = checkpointer.save(directory, [model], [optimizer], {"step": step}).wait(timeout_s=60)
        else:
            reports[step] = save_checkpoint(directory, [model], [optimizer], {"step": step})
        digests[step] = _state_digest(model, optimizer)
    checkpointer.close()
    losses[4] = _train_step(model, optimizer, 4)  # what a restore of step 3 must reproduce
    return {"reports": reports, "digests": digests, "losses": losses}


def _restore_on_two_ranks(rank: int, world_size: int, directory: str, manifest_digest: str) -> dict:
    model, optimizer = _fsdp_model(seed=1, lr=5e-3)  # other weights, another lr: the checkpoint must win
    before = _state_digest(model, optimizer)
    extra = load_checkpoint(directory, [model], [optimizer], checksums=False, expect_digest=manifest_digest)
    return {
        "before": before,
        "after": _state_digest(model, optimizer),
        "extra": extra,
        "next_loss": _train_step(model, optimizer, 4),
    }


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def saved(s3):
    """Steps 1-3 saved by two FSDP2 ranks to s3://etrain-test/source and committed (signed) here."""
    root = s3.url("source")
    results = run_distributed(_save_three_steps, 2, root, timeout_s=TIMEOUT_S)
    manifests = {}
    for step in STEPS:
        reports = [results[rank]["reports"][step] for rank in (0, 1)]
        manifests[step] = commit(step_dir(root, step), step, "dp2 fsdp", 2, reports, key=KEY, job_id=JOB)
    return {"root": root, "results": results, "manifests": manifests}


def _copy(s3, source: str, name: str) -> str:
    """A private copy of the committed checkpoints (each test mutates its own)."""
    target = s3.url(name)
    storage.rmtree(target)
    for rel in storage.walk_files(source):
        storage.write_bytes(storage.join(target, rel), storage.read_bytes(storage.join(source, rel)))
    return target


# -- tests -------------------------------------------------------------------------------------------


def test_two_ranks_save_to_s3_and_the_supervisor_commits_signed_manifests(saved, s3):
    root, results, manifests = saved["root"], saved["results"], saved["manifests"]
    assert [step for step, _ in list_steps(root)] == [1, 2, 3]
    # Each rank reported its own shard objects; rank 0 also DCP's index and the extra state.
    for step in STEPS:
        assert [entry.path for entry in results[0]["reports"][step].files] == ["__0_0.distcp", ".metadata", "extra.pt"]
        assert [entry.path for entry in results[1]["reports"][step].files] == ["__1_0.distcp"]
    listing = storage.file_sizes(step_dir(root, 3))
    assert sorted(listing) == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt", "manifest.json"]
    assert not any(name.endswith(".tmp") for name in storage.walk_files(root))  # DCP's .metadata.tmp was renamed
    for step, manifest in manifests.items():
        assert (manifest.step, manifest.world_size, manifest.job_id) == (step, 2, JOB)
        assert {entry.path: entry.size for entry in manifest.files} == {
            name: size for name, size in storage.file_sizes(step_dir(root, step)).items() if name != "manifest.json"
        }
        assert verify(step_dir(root, step), key=KEY).digest == manifest.digest  # signature and every sha256
    # Both ranks hold the same full state, and every step changed it.
    digests = results[0]["digests"]
    assert results[1]["digests"] == digests and len(set(digests.values())) == 3
    found = resolve_latest(root, key=KEY)
    assert (found.step, found.skipped) == (3, ())


def test_restore_from_s3_gives_the_saved_state_bit_for_bit(saved):
    root, results, manifests = saved["root"], saved["results"], saved["manifests"]
    expected = results[0]["digests"]
    # Two ranks, FSDP2, another seed and learning rate: DCP reads each rank's slices from the objects.
    restored = run_distributed(_restore_on_two_ranks, 2, step_dir(root, 3), manifests[3].digest, timeout_s=TIMEOUT_S)
    for rank in (0, 1):
        assert restored[rank]["before"] != expected[3]
        assert restored[rank]["after"] == expected[3]
        assert restored[rank]["extra"] == {"step": 3}
        # Training goes on exactly as it did after the save: the same step-4 loss on each rank's rows.
        assert restored[rank]["next_loss"] == results[rank]["losses"][4]
    # One process, no process group: the async-saved step 2 resharded into a plain model.
    model = build_model(MODEL, seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert _state_digest(model, optimizer, sharded=False) != expected[2]
    extra = load_checkpoint(step_dir(root, 2), [model], [optimizer], expect_digest=manifests[2].digest)
    assert extra == {"step": 2}
    assert _state_digest(model, optimizer, sharded=False) == expected[2]


def test_a_corrupted_shard_object_falls_back_to_the_previous_step(saved, s3):
    root = _copy(s3, saved["root"], "corrupt")
    expected = saved["results"][0]["digests"]
    shard = storage.join(step_dir(root, 3), "__1_0.distcp")
    data = bytearray(storage.read_bytes(shard))
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    storage.write_bytes(shard, bytes(data))
    assert storage.getsize(shard) == len(data)  # same size: only the checksum can tell
    with pytest.raises(CheckpointError, match=r"step_00000003: __1_0\.distcp sha256 mismatch"):
        verify(step_dir(root, 3), key=KEY)
    found = resolve_latest(root, key=KEY)
    assert found.step == 2 and found.step_dir == step_dir(root, 2)
    [skipped] = found.skipped
    assert skipped.step == 3 and "__1_0.distcp sha256 mismatch" in skipped.reason and not skipped.refused
    # The fallback step restores exactly; loading the corrupt one is refused before DCP reads anything.
    model = build_model(MODEL, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        load_checkpoint(step_dir(root, 3), [model], [optimizer])
    assert load_checkpoint(found.step_dir, [model], [optimizer], expect_digest=found.manifest.digest) == {"step": 2}
    assert _state_digest(model, optimizer, sharded=False) == expected[2]
    # Saving step 3 again (the re-run after the fallback) keeps the corrupt copy aside, and commits afresh.
    report = save_checkpoint(step_dir(root, 3), [model], [optimizer], {"step": 3})
    commit(step_dir(root, 3), 3, "single", 1, [report], key=KEY, job_id=JOB)
    assert verify(step_dir(root, 3), key=KEY).world_size == 1
    aside = [name for name in storage.listdir(root) if name.startswith("step_00000003.corrupt-")]
    assert len(aside) == 1, storage.listdir(root)
    assert [step for step, _ in list_steps(root)] == [1, 2, 3]


def test_prune_keeps_the_last_checkpoints_on_s3(saved, s3):
    root = _copy(s3, saved["root"], "prune")
    assert prune(root, keep_last=2, key=KEY, owner=JOB) == [step_dir(root, 1)]
    assert [step for step, _ in list_steps(root)] == [2, 3]
    assert storage.walk_files(step_dir(root, 1)) == []
    assert prune(root, keep_last=2, key=KEY, owner=JOB) == []
    assert prune(root, keep_last=1, key=KEY, owner="another-job") == []  # only the committing job deletes
    assert [step for step, _ in list_steps(root)] == [2, 3]


def test_a_llama_checkpoint_on_s3_exports_like_a_local_one(s3, tmp_path):
    from etrain.workers.checkpoints.hf_io import export_hf

    model = build_model(LLAMA, seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    remote = step_dir(s3.url("llama"), 5)
    commit(remote, 5, "single", 1, [save_checkpoint(remote, [model], [optimizer], {"step": 5})], key=KEY, job_id=JOB)
    local = tmp_path / "ckpt" / "step_00000005"
    local.mkdir(parents=True)
    for rel in storage.walk_files(remote):
        storage.download(storage.join(remote, rel), local / rel)

    reference = export_hf(str(local), tmp_path / "from-local", LLAMA)
    from_s3 = export_hf(remote, tmp_path / "from-s3", LLAMA)
    to_s3 = export_hf(remote, s3.url("exports", "llama"), LLAMA)
    assert to_s3 == s3.url("exports", "llama")
    names = sorted(os.listdir(reference))
    assert names == ["config.json", "model.safetensors"] == sorted(os.listdir(from_s3)) == storage.walk_files(to_s3)
    for name in names:
        expected = (tmp_path / "from-local" / name).read_bytes()
        assert (tmp_path / "from-s3" / name).read_bytes() == expected
        assert storage.read_bytes(storage.join(to_s3, name)) == expected
    with pytest.raises(ConfigError, match=re.escape(f"export destination {to_s3} already holds objects")) as refused:
        export_hf(remote, to_s3, LLAMA)
    assert refused.value.field == "checkpoint.export"
    assert storage.walk_files(to_s3) == names  # the first export is untouched
