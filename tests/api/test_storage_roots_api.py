"""Issue #8, storage roots and checkpoint directories through the API: the REAL JobManager (its
validation, store, checkpoint key) behind the real app, with FakeRuntime in place of Ray.

The acceptance rule: a path outside the roots is one 422 whose body is byte-identical whether the
file exists or not, for plain, ``..`` and symlink escapes, on /v1/jobs, /v1/plan and export."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from etrain.api.app import create_app
from etrain.service.access.checkpoint_key import load_or_create_key
from etrain.service.settings import Settings
from etrain.workers.checkpoints.checkpoint_commit import commit, file_entry, step_dir
from etrain.workers.protocol.manifest import ShardReport
from tests.fakes import FakeRuntime
from tests.service_harness import bearer

ADMIN_TOKEN = "admin-token-0123456789"
TENANTS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}


@pytest.fixture
def world(tmp_path):
    """<tmp>/roots (the only root, the server's directory), <tmp>/outside/{secret.txt, dir/}, state dir."""
    roots = tmp_path / "roots"
    (roots / "corpus").mkdir(parents=True)
    (roots / "corpus" / "a.txt").write_text("hello world " * 100)
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "secret.txt").write_text("secret " * 100)
    (roots / "link-file").symlink_to(outside / "secret.txt")
    (roots / "link-dir").symlink_to(outside / "dir")
    return tmp_path


@contextlib.contextmanager
def serving(world: Path, **settings: Any) -> Iterator[tuple[Any, TestClient]]:
    """The real manager and app over ``world`` (roots: ``<world>/roots``, the server's directory too), and an admin
    client; ``settings`` override the service's."""
    manager_module = pytest.importorskip("etrain.service.manager")  # imports Ray (not started)
    settings = Settings(
        data_dir=world / "roots" / "state",
        storage_roots=(world / "roots",),
        api_token=ADMIN_TOKEN,
        api_tokens=TENANTS,
        poll_interval_s=60,
        **settings,
    )
    manager = manager_module.JobManager(settings, runtime=FakeRuntime(), base_dir=str(world / "roots"))
    try:
        yield manager, TestClient(create_app(settings, manager=manager), headers=bearer(ADMIN_TOKEN))
    finally:
        manager.close()


@pytest.fixture
def server(world):
    with serving(world) as served:
        yield served


def spec(**sections: Any) -> dict[str, Any]:
    return {
        "name": "roots",
        "model": {"preset": "llama-tiny"},
        "training": {"steps": 10_000, "global_batch": 2},
        **sections,
    }


def text(path: str, **data: Any) -> dict[str, Any]:
    return {"data": {"kind": "text", "path": path, **data}}


def answers(client: TestClient, body: dict[str, Any]) -> tuple[bytes, bytes]:
    """The raw 422 bodies of POST /v1/jobs and POST /v1/plan for ``body``."""
    submitted, planned = client.post("/v1/jobs", json=body), client.post("/v1/plan", json=body)
    assert submitted.status_code == 422 and planned.status_code == 422, (submitted.text, planned.text)
    return submitted.content, planned.content


def test_outside_the_roots_is_the_same_422_whether_the_file_exists_or_not(world, server):
    _manager, client = server
    secret = world / "outside" / "secret.txt"
    cases = {
        "absolute": text(str(secret)),
        "dot-dot": text("corpus/../../outside/secret.txt"),
        "symlink": text("link-file"),
        "symlinked dir": text("link-dir/../secret.txt"),
    }
    for label, body in cases.items():
        secret.write_text("secret " * 100)
        existing = answers(client, spec(**body))
        secret.unlink()
        missing = answers(client, spec(**body))
        assert existing == missing, label
        detail = client.post("/v1/jobs", json=spec(**body)).json()["detail"]
        assert [item["field"] for item in detail] == ["data.path"], label
        assert detail[0]["message"] == (
            f"data.path={body['data']['path']!r} is outside the storage roots ({world / 'roots'}); paths are "
            "resolved (relative to the server's directory, symlinks and '..' followed) before this check."
        )
        assert str(world / "outside") not in detail[0]["message"] or label == "absolute"  # links are not revealed
    assert client.get("/v1/jobs").json()["jobs"] == []  # nothing was created


def test_every_path_field_is_fenced(world, server):
    _manager, client = server
    body = spec(
        model={"hf": "link-dir"},
        checkpoint={"path": "../outside/dir/ckpt"},
        **text("corpus", tokenizer=str(world / "outside" / "secret.txt")),
    )
    fields = [item["field"] for item in client.post("/v1/jobs", json=body).json()["detail"]]
    assert fields == ["model.hf", "data.tokenizer", "checkpoint.path"]
    private = client.post("/v1/jobs", json=spec(data={"kind": "tokens", "path": "state/etrain.db"}))
    assert private.status_code == 422 and "service's own files" in private.json()["detail"][0]["message"]
    key = client.post("/v1/jobs", json=spec(**text("state/checkpoint-key")))
    assert key.status_code == 422 and key.json()["detail"][0]["field"] == "data.path"


def test_inside_the_roots_a_missing_file_is_still_reported_as_missing(server):
    _manager, client = server
    response = client.post("/v1/jobs", json=spec(**text("corpus/nope.txt")))
    assert response.status_code == 422
    assert "does not exist" in response.json()["detail"][0]["message"]
    assert client.post("/v1/jobs", json=spec(**text("corpus"))).status_code == 201


def _llama_job(client: TestClient, **sections: Any) -> str:
    response = client.post("/v1/jobs", json=spec(**sections))
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_export_out_must_be_inside_the_roots(world, server):
    _manager, client = server
    job_id = _llama_job(client)
    bodies = []
    for exists in (True, False):
        target = world / "outside" / "export"
        if exists:
            target.mkdir()
            (target / "x").write_text("not empty")
        else:
            shutil.rmtree(target)
        response = client.post(f"/v1/jobs/{job_id}/export", json={"step": None, "out": "../outside/export"})
        assert response.status_code == 422, response.text
        bodies.append(response.content)
    assert bodies[0] == bodies[1]
    assert client.post(f"/v1/jobs/{job_id}/export", json={"step": None, "out": "link-dir/x"}).status_code == 422
    # Inside the roots the request goes on to the checkpoint check (nothing committed yet: 409).
    assert client.post(f"/v1/jobs/{job_id}/export", json={"step": None, "out": "exports/x"}).status_code == 409


def test_a_checkpoint_directory_belongs_to_one_unfinished_job(world, server):
    _manager, client = server
    _llama_job(client, checkpoint={"path": "ckpt/run"})
    for path in ("ckpt/run", "ckpt/run/nested", "ckpt", str(world / "roots" / "ckpt" / "run" / ".." / "run")):
        response = client.post("/v1/jobs", json=spec(checkpoint={"path": path}))
        assert response.status_code == 409, path  # issue #17: the claim is a conflict with that job
        [problem] = response.json()["detail"]
        assert problem["field"] == "checkpoint.path"
        assert "overlaps the checkpoint directory of another job that has not finished" in problem["message"]
    assert client.post("/v1/jobs", json=spec(checkpoint={"path": "ckpt/other"})).status_code == 201


def _commit_step(root: Path, step: int, *, key: bytes | None, job_id: str | None) -> None:
    directory = step_dir(root, step)
    os.makedirs(directory)
    for name in (".metadata", "__0_0.distcp"):
        Path(directory, name).write_bytes(b"x" * 16)
    report = ShardReport(
        rank=0,
        world_size=1,
        directory=os.path.basename(directory),
        files=tuple(file_entry(directory, name) for name in (".metadata", "__0_0.distcp")),
    )
    commit(directory, step, "pp1·dp1·tp1 zero=0", 1, [report], key=key, job_id=job_id)


def test_resuming_needs_checkpoints_this_service_committed(world, server):
    manager, client = server
    key = load_or_create_key(manager.settings.data_dir)  # the key the manager generated at start
    first = _llama_job(client, checkpoint={"path": "ckpt/first"})
    client.post(f"/v1/jobs/{first}/cancel")
    manager.store.update_job(first, status="CANCELLED")  # FakeRuntime: no poll in this test

    ours = world / "roots" / "ckpt" / "first"
    _commit_step(ours, 10, key=key, job_id=first)
    resumed = client.post("/v1/jobs", json=spec(checkpoint={"path": "ckpt/first"}))
    assert resumed.status_code == 201, resumed.text

    for label, committed_with in {"unsigned": None, "another key": b"k" * 32}.items():
        root = world / "roots" / "ckpt" / label.replace(" ", "-")
        _commit_step(root, 10, key=committed_with, job_id=first)
        response = client.post("/v1/jobs", json=spec(checkpoint={"path": str(root)}))
        assert response.status_code == 422, label
        [problem] = response.json()["detail"]
        assert problem["field"] == "checkpoint.path"
        assert "holds step 10, which this service did not commit for you" in problem["message"]
        assert "signature" in problem["message"], problem["message"]


def test_a_tenant_cannot_reach_another_tenants_checkpoints(world, server):
    manager, client = server
    alice = TestClient(client.app, headers=bearer(TENANTS["alice"]))
    bob = TestClient(client.app, headers=bearer(TENANTS["bob"]))
    job = alice.post("/v1/jobs", json=spec(checkpoint={"path": "ckpt/alice"}))
    assert job.status_code == 201, job.text
    job_id = job.json()["id"]
    manager.store.update_job(job_id, status="SUCCEEDED")
    _commit_step(
        world / "roots" / "ckpt" / "alice", 10, key=load_or_create_key(manager.settings.data_dir), job_id=job_id
    )
    tree = manager.settings.data_dir / "checkpoints" / job_id / "hf-export"

    refused = bob.post("/v1/jobs", json=spec(checkpoint={"path": "ckpt/alice"}))
    assert refused.status_code == 422  # issue #17: alice's recorded directory is out of bob's reach
    assert "checkpoint directory of a job you cannot access" in refused.json()["detail"][0]["message"]
    inside = bob.post("/v1/jobs", json=spec(**text(str(tree))))
    assert inside.status_code == 422
    assert "checkpoint directory of a job you cannot access" in inside.json()["detail"][0]["message"]
    whole = bob.post("/v1/jobs", json=spec(**text("state")))
    assert whole.status_code == 422 and "holds other jobs' checkpoints" in whole.json()["detail"][0]["message"]

    assert alice.post("/v1/jobs", json=spec(checkpoint={"path": "ckpt/alice"})).status_code == 201


def test_no_tenant_path_reaches_the_token_cache(world):
    """The service trusts a tokenized corpus in its token cache by its name: where that folder lies inside a storage
    root (here in the service's data directory, which is inside the root; by default in the checkpoint tree), no
    tenant's path reaches it, as none reaches the checkpoint tree."""
    (world / "roots" / "state" / "tokens").mkdir(parents=True)
    (world / "roots" / "state" / "tokens" / "abc.bin").write_bytes(b"\x01\x00" * 64)
    with serving(world, token_cache_base=str(world / "roots" / "state" / "tokens")) as (manager, admin):
        bob = TestClient(admin.app, headers=bearer(TENANTS["bob"]))
        for body, field in [
            (spec(data={"kind": "tokens", "path": "state/tokens/abc.bin"}), "data.path"),  # others' corpora
            (spec(checkpoint={"path": "state/tokens/run"}), "checkpoint.path"),  # write into it
        ]:
            response = bob.post("/v1/jobs", json=body)
            assert response.status_code == 422, body
            [problem] = response.json()["detail"]
            assert problem["field"] == field and "the service's token cache" in problem["message"], problem
        assert bob.post("/v1/jobs", json=spec(**text("corpus"))).status_code == 201

        # A link a tenant swaps after the reach check stores no path the rule did not pass: the path is resolved
        # once, and the job keeps what was checked (here: the link led to a token file of the shared root when
        # checked, and into the token cache after; resolved again, the job would have read the cache's ids).
        (world / "roots" / "mine.bin").write_bytes(b"\x02\x00" * 64)
        link = world / "roots" / "swapped"
        link.symlink_to(world / "roots" / "mine.bin")
        check = manager._check_reach

        def check_then_swap(given, principal):
            checked = check(given, principal)
            link.unlink()
            link.symlink_to(world / "roots" / "state" / "tokens" / "abc.bin")
            return checked

        manager._check_reach = check_then_swap
        response = bob.post("/v1/jobs", json=spec(data={"kind": "tokens", "path": "swapped"}))
        assert response.status_code == 201, response.text
        assert response.json()["spec"]["data"]["path"] == str((world / "roots" / "mine.bin").resolve())
