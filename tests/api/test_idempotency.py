"""Idempotent submit (``Idempotency-Key``) through a real uvicorn server and the real ``JobManager``
(real SQLite and its unique index; Ray replaced by the named ``FakeRuntime``)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from etrain.api.app import create_app
from etrain.service.planning.spec import JobSpec
from etrain.service.settings import Settings
from etrain.service.store.idempotency import MAX_KEY_LENGTH, ReplayedJob, request_hash
from tests.fakes import FakeRuntime
from tests.service_harness import serve_app

manager_module = pytest.importorskip("etrain.service.manager")  # imports Ray (never started here)

ADMIN, ALICE, BOB = "admin-token-0123456789", "alice-token-0123456789", "bob-token-0123456789"


def spec(name: str = "idem", steps: int = 10_000) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"preset": "gpt-tiny"},
        "training": {"steps": steps, "global_batch": 8, "micro_batch": 2},
        "parallelism": {"dp": 2},
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def manager(tmp_path):
    settings = Settings(
        data_dir=tmp_path, api_token=ADMIN, api_tokens=(("alice", ALICE), ("bob", BOB)), poll_interval_s=0.05
    )
    manager = manager_module.JobManager(settings, runtime=FakeRuntime(steps_per_update=0), base_dir=str(tmp_path))
    yield manager
    manager.close()


def serving(manager, data_dir: Path):
    return serve_app(create_app(manager.settings, manager=manager))


@pytest.fixture
def url(manager, tmp_path):
    with serving(manager, tmp_path) as url:
        yield url


def post(url: str, body: Any, *, key: str | None, token: str = ALICE) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{url}/v1/jobs", content=content, headers=headers, timeout=30)


def job_ids(manager, tenant: str | None = None) -> list[str]:
    return [job.id for job in manager.store.list_jobs(tenant=tenant)]


def test_the_same_key_and_body_return_the_same_job_with_200(url, manager):
    first = post(url, spec(), key="retry-1")
    assert first.status_code == 201, first.text
    job_id = first.json()["id"]
    # The same spec written differently (key order, spacing, an explicit default) is the same request.
    reordered = json.dumps(
        {
            "parallelism": {"dp": 2},
            "training": {"micro_batch": 2, "global_batch": 8, "steps": 10_000},
            "model": {"preset": "gpt-tiny"},
            "name": "idem",
            "priority": 0,
        },
        indent=3,
    )
    for body in (spec(), reordered):
        again = post(url, body, key="retry-1")
        assert again.status_code == 200, again.text
        assert again.json()["id"] == job_id and again.headers["Location"] == f"/v1/jobs/{job_id}"
    assert job_ids(manager) == [job_id]
    assert [e.kind for e in manager.store.events(job_id)].count("submitted") == 1
    assert [call for call in manager.runtime.calls if call[0] == "start"] == [("start", job_id)]


def test_the_same_key_with_another_body_is_409_naming_the_job(url, manager):
    job_id = post(url, spec(), key="retry-2").json()["id"]
    other = post(url, spec(steps=20), key="retry-2")
    assert other.status_code == 409
    assert other.json() == {
        "error": "conflict",
        "message": f"Idempotency-Key 'retry-2' was already used for job {job_id} with a different request body.",
        "fix": f"send the original body to get job {job_id} back, or a new Idempotency-Key for a new job",
        "detail": [
            {
                "field": "Idempotency-Key",
                "message": f"Idempotency-Key 'retry-2' was already used for job {job_id} with a different request body.",
                "fix": f"send the original body to get job {job_id} back, or a new Idempotency-Key for a new job",
            }
        ],
    }
    assert job_ids(manager) == [job_id]


def test_without_a_key_every_submit_is_a_new_job_and_keys_are_per_job(url, manager):
    ids = {post(url, spec(), key=None).json()["id"] for _ in range(2)}
    ids |= {post(url, spec(), key=key).json()["id"] for key in ("a", "b")}
    assert len(ids) == 4 and sorted(job_ids(manager)) == sorted(ids)


@pytest.mark.parametrize("key", ["x" * (MAX_KEY_LENGTH + 1), "tab\there"])
def test_a_bad_key_is_422_naming_the_header_and_the_fix(url, manager, key):
    response = post(url, spec(), key=key)
    assert response.status_code == 422, response.text
    (item,) = response.json()["detail"]
    assert item["field"] == "Idempotency-Key"
    assert f"must be 1..{MAX_KEY_LENGTH} printable ASCII characters" in item["message"]
    assert item["fix"].startswith("send a UUID")
    assert job_ids(manager) == []


def test_concurrent_identical_submits_create_exactly_one_job(url, manager):
    barrier = threading.Barrier(8)
    answers: list[httpx.Response] = []
    lock = threading.Lock()

    def submit() -> None:
        barrier.wait(timeout=10)
        response = post(url, spec(), key="race")
        with lock:
            answers.append(response)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(r.status_code for r in answers) == [200] * 7 + [201]
    assert len({r.json()["id"] for r in answers}) == 1
    assert job_ids(manager) == [answers[0].json()["id"]]


def test_the_unique_index_decides_a_race_past_the_first_lookup(manager, monkeypatch):
    """Both requests find no job for the key (both pass the early lookup), then both insert: the index
    lets one win and the other answers with the winner's job, creating nothing."""
    from etrain.service.access.tenancy import Principal

    barrier = threading.Barrier(2)
    validate = manager.validate

    def slow_validate(job_spec):  # both threads are past the lookup before either inserts
        barrier.wait(timeout=10)
        return validate(job_spec)

    monkeypatch.setattr(manager, "validate", slow_validate)
    alice = Principal(tenant="alice")
    results: list[Any] = []

    def submit() -> None:
        results.append(manager.submit(JobSpec.model_validate(spec()), principal=alice, idempotency_key="k"))

    threads = [threading.Thread(target=submit) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(results) == 2 and results[0].id == results[1].id
    assert sorted(isinstance(r, ReplayedJob) for r in results) == [False, True]
    assert job_ids(manager) == [results[0].id]
    assert manager.store.find_idempotent("alice", "k")[1] == request_hash(JobSpec.model_validate(spec()))


def test_the_hash_leaves_out_the_fields_at_their_defaults():
    """A retry that spans an upgrade adding a defaulted spec field is the same request: fields at their defaults
    (which the new version fills in and the old did not) are not hashed; a value other than the default is."""
    import hashlib
    import json

    body = spec()
    sent = JobSpec.model_validate(body).model_dump(mode="json", by_alias=True, exclude_defaults=True)
    assert "export_dtype" not in json.dumps(sent)  # a default, added 2026-12-06: not part of the request
    expected = hashlib.sha256(json.dumps(sent, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert request_hash(JobSpec.model_validate(body)) == expected
    with_dtype = {**body, "checkpoint": {**body.get("checkpoint", {}), "export_dtype": "bfloat16"}}
    assert request_hash(JobSpec.model_validate(with_dtype)) != expected
    at_default = {**body, "checkpoint": {**body.get("checkpoint", {}), "export_dtype": "float32"}}
    assert request_hash(JobSpec.model_validate(at_default)) == expected


def test_a_key_stored_before_the_hash_left_out_defaults_still_replays(manager):
    """A key stored by a version before 2026-12-06 holds that version's hash: every default written out, and no
    checkpoint.export_dtype (which it did not have). A retry of the same request after the upgrade replays; another
    request with that key is still a 409."""
    import hashlib
    import json

    from etrain.service.errors import JobConflict
    from etrain.service.store.idempotency import ReplayedJob

    body = JobSpec.model_validate(spec())
    old = body.model_dump(mode="json", by_alias=True)  # as the old version hashed it, written out here
    del old["checkpoint"]["export_dtype"]
    old_digest = hashlib.sha256(json.dumps(old, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    manager.store.create_job(
        job_id="old-1",
        name="old",
        spec=body.model_dump(mode="json", by_alias=True),
        world_size=1,
        layout="pp1·dp1·tp1 zero=0",
        tenant="default",
        idempotency_key="before-upgrade",
        request_hash=old_digest,
    )
    retried = manager.submit(body, idempotency_key="before-upgrade")
    assert isinstance(retried, ReplayedJob) and retried.id == "old-1"
    # the builds of 2026-12-06 that had the field wrote it out with the other defaults
    full = body.model_dump(mode="json", by_alias=True)
    manager.store.create_job(
        job_id="old-2",
        name="old",
        spec=full,
        world_size=1,
        layout="pp1·dp1·tp1 zero=0",
        tenant="default",
        idempotency_key="during-upgrade",
        request_hash=hashlib.sha256(json.dumps(full, sort_keys=True, separators=(",", ":")).encode()).hexdigest(),
    )
    assert manager.submit(body, idempotency_key="during-upgrade").id == "old-2"
    other = JobSpec.model_validate({**spec(), "priority": 5})
    with pytest.raises(JobConflict, match="with a different request body"):
        manager.submit(other, idempotency_key="before-upgrade")
    bf16 = JobSpec.model_validate({**spec(), "checkpoint": {"export_dtype": "bfloat16"}})
    with pytest.raises(JobConflict):  # a request the old version could not have taken is never its hash
        manager.submit(bf16, idempotency_key="before-upgrade")


def test_keys_are_per_tenant(url, manager):
    alice = post(url, spec(), key="shared", token=ALICE)
    bob = post(url, spec(), key="shared", token=BOB)
    assert (alice.status_code, bob.status_code) == (201, 201)
    assert alice.json()["id"] != bob.json()["id"]
    assert (alice.json()["tenant"], bob.json()["tenant"]) == ("alice", "bob")
    # Each tenant's retry finds its own job; bob's different body conflicts only with bob's own key.
    assert post(url, spec(), key="shared", token=ALICE).json()["id"] == alice.json()["id"]
    assert post(url, spec(steps=5), key="shared", token=BOB).status_code == 409
    assert job_ids(manager, "alice") == [alice.json()["id"]] and job_ids(manager, "bob") == [bob.json()["id"]]
