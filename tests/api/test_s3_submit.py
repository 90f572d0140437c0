"""Issue #7, s3:// checkpoints at submit: the REAL JobManager (validation, storage roots, checkpoint
directories, key) behind the real app, FakeRuntime in place of Ray, and a real S3-compatible server on
loopback (moto's, ``tests/object_store.py``) holding the objects the rules look at.

* ``checkpoint.path`` may be ``s3://...`` only inside an ``s3://`` storage root: one 422 naming the
  field and the roots, byte-identical whether objects exist under the prefix or not;
* ``data.path``, ``data.tokenizer`` and ``model.hf`` stay local (422 with the fix);
* without the backend installed the 422 says to install ``etrain[s3]``;
* the directory rules hold on S3: a prefix holding a checkpoint this service did not commit is
  refused, two unfinished jobs never share a prefix, and ``ETRAIN_CHECKPOINT_ROOT=s3://...`` gives a job
  with no ``checkpoint.path`` the prefix ``<root>/<job-id>``.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from etrain.api.app import create_app
from etrain.service.access.checkpoint_key import load_or_create_key
from etrain.service.settings import Settings
from etrain.workers.checkpoints import storage
from etrain.workers.checkpoints.checkpoint_commit import commit, file_entry, step_dir
from etrain.workers.protocol.manifest import ShardReport
from tests.fakes import FakeRuntime
from tests.object_store import s3_server
from tests.service_harness import bearer

ADMIN_TOKEN = "admin-token-0123456789"
ROOT = "s3://etrain-test/jobs"


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


def make_server(tmp_path, **settings: Any):
    manager_module = pytest.importorskip("etrain.service.manager")  # imports Ray (not started)
    settings = Settings(
        data_dir=tmp_path / "state",
        storage_roots=(tmp_path, ROOT),
        api_token=ADMIN_TOKEN,
        poll_interval_s=60,
        **settings,
    )
    runtime = FakeRuntime()
    manager = manager_module.JobManager(settings, runtime=runtime, base_dir=str(tmp_path))
    return manager, runtime, TestClient(create_app(settings, manager=manager), headers=bearer(ADMIN_TOKEN))


@pytest.fixture
def server(s3, tmp_path):
    manager, runtime, client = make_server(tmp_path)
    yield manager, runtime, client
    manager.close()


def spec(**checkpoint: Any) -> dict[str, Any]:
    return {
        "name": "s3",
        "model": {"preset": "gpt-tiny"},
        "data": {"kind": "synthetic"},
        "training": {"steps": 10_000, "global_batch": 2},
        "checkpoint": checkpoint,
    }


def refusal(client: TestClient, body: dict[str, Any]) -> tuple[bytes, list[dict[str, Any]]]:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    return response.content, response.json()["detail"]


def _foreign_checkpoint(root: str, step: int, key: bytes | None) -> None:
    directory = step_dir(root, step)
    for name in ("__0_0.distcp", ".metadata", "extra.pt"):
        storage.write_bytes(storage.join(directory, name), name.encode() * 10)
    report = ShardReport(
        rank=0,
        world_size=1,
        directory=f"step_{step:08d}",
        files=tuple(file_entry(directory, name) for name in ("__0_0.distcp", ".metadata", "extra.pt")),
    )
    commit(directory, step, "single", 1, [report], key=key, job_id="someone-else")


def test_an_s3_checkpoint_path_outside_the_s3_roots_is_one_422_whatever_exists(server, s3, tmp_path):
    _manager, runtime, client = server
    outside = "s3://etrain-test/elsewhere/run"
    absent, detail = refusal(client, spec(path=outside))
    storage.write_bytes(storage.join(outside, "step_00000005", "manifest.json"), b"{}")
    present, _ = refusal(client, spec(path=outside))
    assert absent == present
    [problem] = detail
    assert problem["field"] == "checkpoint.path"
    assert problem["message"] == (
        f"checkpoint.path='{outside}' is outside the storage roots ({tmp_path}, {ROOT}); "
        "paths are resolved (relative to the server's directory, symlinks and '..' "
        "followed) before this check."
    )
    assert problem["fix"] == (
        f"put it under one of the storage roots ({tmp_path}, {ROOT}), or ask the operator to "
        "add a root to ETRAIN_STORAGE_ROOTS"
    )
    for sneaky in ("s3://etrain-test/jobs-evil/x", "s3://etrain-test/jobs/../elsewhere/run"):
        [problem] = refusal(client, spec(path=sneaky))[1]
        assert problem["field"] == "checkpoint.path", problem
    assert runtime.calls == []


def test_data_and_model_paths_stay_local(server):
    _manager, _runtime, client = server
    body = {**spec(), "data": {"kind": "text", "path": f"{ROOT}/corpus", "tokenizer": f"{ROOT}/tok.json"}}
    fields = {p["field"]: p for p in refusal(client, body)[1]}
    assert set(fields) == {"data.path", "data.tokenizer"}
    assert fields["data.path"]["message"] == (
        f"data.path='{ROOT}/corpus' is an object-store URL; data.path must be a "
        "local path (only checkpoint.path may name object storage)."
    )
    body = {**spec(), "model": {"hf": f"{ROOT}/llama"}}
    [problem] = refusal(client, body)[1]
    assert problem["field"] == "model.hf" and "must be a local path" in problem["message"]


def test_without_the_backend_the_422_says_to_install_the_extra(server, monkeypatch):
    _manager, _runtime, client = server
    monkeypatch.setitem(storage.SUPPORTED_SCHEMES, "s3", ("etrain_no_such_backend", "s3"))
    [problem] = refusal(client, spec(path=f"{ROOT}/run"))[1]
    assert problem["field"] == "checkpoint.path"
    assert "pip install 'etrain[s3]'" in problem["message"] and "etrain[s3]" in problem["fix"]


def test_s3_checkpoint_directories_follow_the_same_ownership_rules(server, s3, tmp_path):
    manager, runtime, client = server
    key = load_or_create_key(tmp_path / "state")
    created = client.post("/v1/jobs", json=spec(path=f"{ROOT}/run-a/"))
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    assert runtime.jobs[job_id]["config"].checkpoint.path == f"{ROOT}/run-a"  # pinned without the trailing '/'
    # Two unfinished jobs never share a prefix (equal, inside, or containing).
    for path in (f"{ROOT}/run-a", f"{ROOT}/run-a/sub", ROOT):
        response = client.post("/v1/jobs", json=spec(path=path))
        assert response.status_code == 409, response.text  # issue #17: a claim conflict with that job
        [problem] = response.json()["detail"]
        assert "overlaps the checkpoint directory of another job that has not finished" in problem["message"], path
    # A prefix holding a checkpoint another service (another key) or nobody signed is refused.
    _foreign_checkpoint(f"{ROOT}/stolen", 20, key=b"another-service-key-0123456789ab")
    [problem] = refusal(client, spec(path=f"{ROOT}/stolen"))[1]
    assert problem["message"].startswith(
        f"checkpoint.path='{ROOT}/stolen' holds step 20, which this service did "
        "not commit for you, so the job may not resume from it: "
    )
    assert "signature does not verify" in problem["message"]
    # One this service signed (for a job the admin may see) resumes; an uncommitted step is not a checkpoint.
    _foreign_checkpoint(f"{ROOT}/ours", 20, key=key)
    storage.write_bytes(storage.join(step_dir(f"{ROOT}/ours", 30), "__0_0.distcp"), b"partial")
    resumed = client.post("/v1/jobs", json=spec(path=f"{ROOT}/ours"))
    assert resumed.status_code == 201, resumed.text
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202


def test_an_s3_checkpoint_root_setting_gives_each_job_its_prefix(s3, tmp_path):
    manager, runtime, client = make_server(tmp_path, checkpoint_base=f"{ROOT}/default/")
    try:
        created = client.post("/v1/jobs", json=spec())
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        assert runtime.jobs[job_id]["config"].checkpoint.path == f"{ROOT}/default/{job_id}"
        # The tree rule: a path into another job's default prefix names that job (visible to the admin) ...
        second = client.post("/v1/jobs", json=spec(path=f"{ROOT}/default/{job_id}"))
        assert second.status_code == 409 and "overlaps" in second.json()["detail"][0]["message"]
        # ... and its rank logs are read from the object store.
        storage.write_bytes(f"{ROOT}/default/{job_id}/logs/{job_id}/rank0.log", b"2026-01-01T00:00:00 hello\n")
        logs = client.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0})
        assert logs.status_code == 200, logs.text
        assert logs.json()["lines"] == ["2026-01-01T00:00:00 hello"]
    finally:
        manager.close()
