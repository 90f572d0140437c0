"""Issue #17's rules over plain values and real SQLite: which paths a tenant reaches
(service/access/reach.py, ``tenant=`` marks in ETRAIN_STORAGE_ROOTS), checkpoint-directory claims
(service/store/claims.py) under concurrent writers on one database file, which steps a resume may load
(service/access/checkpoint_dirs.py ``may_resume``, applied by service/runtime/job_checkpoints.py), and
queue reasons as another tenant reads them."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from etrain.service.access.checkpoint_dirs import may_resume
from etrain.service.access.reach import Reach, split_owner
from etrain.service.access.tenancy import ADMIN, Principal
from etrain.service.decisions import admission
from etrain.service.errors import JobConflict, SettingsError
from etrain.service.settings import Settings
from etrain.service.store.claims import DirectoryTaken
from etrain.service.store.job_store import JobStore
from etrain.service.store.schema import MIGRATIONS, migrate

ALICE, BOB = Principal("alice"), Principal("bob")


# --- ETRAIN_STORAGE_ROOTS marks -----------------------------------------------------------------------------


def test_a_root_is_shared_unless_marked_for_a_tenant():
    assert split_owner("alice=/data/alice") == ("alice", "/data/alice")
    assert split_owner("alice=s3://bucket/alice") == ("alice", "s3://bucket/alice")
    for plain in ("/data/a=b", "~/x=y", "s3://bucket/k=v", Path("/p=q")):
        assert split_owner(plain) == (None, plain)
    with pytest.raises(ValueError, match="'Alice' is not a tenant name"):
        split_owner("Alice=/x")

    settings = Settings.from_env({"ETRAIN_STORAGE_ROOTS": "/data/shared,alice=/data/alice:bob=s3://b/bob"})
    assert settings.storage_roots == (Path("/data/shared"), Path("/data/alice"), "s3://b/bob")
    assert settings.tenant_roots == (("alice", Path("/data/alice")), ("bob", "s3://b/bob"))
    again = dataclasses.replace(settings, api_token="another-admin-token-1234")  # `etrain serve` does this
    assert (again.storage_roots, again.tenant_roots) == (settings.storage_roots, settings.tenant_roots)
    assert Settings.from_env({"ETRAIN_STORAGE_ROOTS": "/a:/b"}).tenant_roots == ()  # unmarked: as before
    direct = Settings(storage_roots=("/s",), tenant_roots=(("carol", "/c"),))
    assert direct.storage_roots == (Path("/s"), Path("/c")) and direct.tenant_roots == (("carol", Path("/c")),)
    for bad, why in {
        "alice=/x,bob=/x": "marked for two tenants",
        "Bob=/x": "not a tenant name",
        "alice=relative": "not an absolute path",
    }.items():
        with pytest.raises(SettingsError, match=why) as raised:
            Settings.from_env({"ETRAIN_STORAGE_ROOTS": bad})
        assert "alice=/data/alice" in raised.value.fix


# --- the reach rule ---------------------------------------------------------------------------------------


def test_the_reach_rule_over_every_kind_of_path():
    reach = Reach(
        tree="/data/state/checkpoints",
        owners=[("alice", "/data/alice"), ("bob", "/data/bob"), ("bob", "s3://bkt/bob")],
        token_cache="/data/shared/.tokens",  # ETRAIN_TOKEN_CACHE_DIR set inside a shared root
    )
    tenants = {"a1": "alice", "b1": "bob", "d1": "default"}
    recorded = [
        ("a1", "alice", "/data/shared/runs/alice"),
        ("b1", "bob", "/data/shared/runs/bob"),
        ("d1", "default", "/data/shared/ops"),
    ]

    def verdict(path: str, who: Principal) -> str | None:
        problem = reach.problem("data.path", path, who, job_dirs=lambda _path: recorded, tenant_of=tenants.get)
        return None if problem is None else problem.message.split(" ", 1)[1]

    allowed_for_alice = [
        "/data/shared/corpus",
        "/data/shared/.tokens-other",
        "/data/alice/x",
        "/data/shared/runs/alice/hf-export",
        "/data/state/checkpoints/a1/hf-export",
        "/data/shared/runs/bobby",
        "/data/bob-other",
    ]
    for path in allowed_for_alice:
        assert verdict(path, ALICE) is None, path
    refused = {
        "/data/bob/corpus": "is in a storage root reserved for another tenant.",
        "/data": "contains a storage root reserved for another tenant.",
        "s3://bkt/bob/run": "is in a storage root reserved for another tenant.",
        "/data/state": "contains the service's checkpoint directory",
        "/data/state/checkpoints/b1": "is inside the checkpoint directory of a job you cannot access.",
        "/data/state/checkpoints/no-such-job": "is inside the checkpoint directory of a job you cannot access.",
        "/data/shared/runs/bob/logs": "is inside the checkpoint directory of a job you cannot access.",
        "/data/shared/runs": "contains the checkpoint directory of a job you cannot access.",
        "/data/shared/ops/x": "is inside the checkpoint directory of a job you cannot access.",  # the admin's job
        "/data/shared/.tokens/abc.bin": "is in the service's token cache.",
        "/data/shared/.tokens": "is in the service's token cache.",
        "/data/shared": "contains the service's token cache.",
        # the default token cache lies in the checkpoint tree, whose rule keeps tenants out of it
        "/data/state/checkpoints/.token-cache/abc.bin": "is inside the checkpoint directory of a job you cannot",
    }
    for path, message in refused.items():
        assert message in (verdict(path, ALICE) or ""), path
        assert verdict(path, ADMIN) is None, path  # the admin reaches everything inside the roots
    assert verdict("/data/bob/corpus", BOB) is None and verdict("/data/shared/runs/bob/x", BOB) is None
    assert "reserved for another tenant" in verdict("/data/alice/x", BOB)
    assert "bob" not in verdict("/data/shared/runs/bob/logs", ALICE).replace("runs/bob", "")  # never names b1/bob


# --- checkpoint-directory claims (real SQLite, one file, many connections) ------------------------------------


def create(store: JobStore, job_id: str, directory: str | None, tenant: str = "alice", **extra):
    return store.create_job(
        job_id=job_id, name="j", spec={}, world_size=1, tenant=tenant, checkpoint_dir=directory, **extra
    )


def test_one_unfinished_job_holds_a_directory_even_across_connections(tmp_path):
    db = tmp_path / "etrain.db"
    JobStore(db).close()
    for round_ in range(3):  # 30 writers, each with its own connection (as 30 server processes would be)
        stores = [JobStore(db) for _ in range(30)]
        barrier = threading.Barrier(30)

        def submit(index: int) -> str | None:
            barrier.wait(timeout=30)
            try:
                return create(stores[index], f"r{round_}-{index}", f"/runs/{round_}").id
            except DirectoryTaken:
                return None

        with ThreadPoolExecutor(30) as pool:
            accepted = [job for job in pool.map(submit, range(30)) if job is not None]
        for store in stores:
            store.close()
        assert len(accepted) == 1, accepted
    with JobStore(db) as store:
        assert len(store.list_jobs()) == 3  # the losers left no row


def test_claims_overlap_by_components_and_end_with_the_job(tmp_path):
    with JobStore(tmp_path / "etrain.db") as store:
        create(store, "held", "/runs/a")
        for overlapping in ("/runs/a", "/runs/a/inner", "/runs", "/"):
            with pytest.raises(DirectoryTaken) as taken:
                create(store, "x", overlapping, tenant="bob")
            assert (taken.value.holder, taken.value.tenant, taken.value.held) == ("held", "alice", "/runs/a")
        create(store, "sibling", "/runs/a-2")  # a string prefix, not a component prefix
        with pytest.raises(JobConflict):  # a lost idempotency race is answered as such, and claims nothing
            create(store, "dup-1", "/runs/k1", idempotency_key="k")
            create(store, "dup-2", "/runs/k2", idempotency_key="k")
        create(store, "k2", "/runs/k2")
        store.update_job("held", status="RUNNING")  # not an end
        with pytest.raises(DirectoryTaken):
            create(store, "y", "/runs/a/b")
        store.update_job("held", status="FAILED")
        create(store, "next", "/runs/a/b")
        assert store.jobs_in_dir("/runs/a", tenant="alice") == ["held"]
        assert sorted(store.job_dirs("/runs", other_than="bob")) == [
            ("dup-1", "alice", "/runs/k1"),
            ("held", "alice", "/runs/a"),
            ("k2", "alice", "/runs/k2"),
            ("next", "alice", "/runs/a/b"),
            ("sibling", "alice", "/runs/a-2"),
        ]
        assert store.job_dirs("/runs", other_than="alice") == []


def test_jobs_stored_before_claims_get_their_directories_at_start(tmp_path):
    db = tmp_path / "etrain.db"
    conn = sqlite3.connect(db, isolation_level=None)
    assert migrate(conn, MIGRATIONS[:4]) == 4
    for job_id, status, path in (("old-running", "RUNNING", "/runs/old"), ("old-done", "SUCCEEDED", None)):
        spec = f'{{"checkpoint": {{"path": "{path}"}}}}' if path else "{}"
        conn.execute(
            "INSERT INTO jobs (id, name, status, spec, world_size, created_at, updated_at, tenant) "
            "VALUES (?, 'j', ?, ?, 1, 1.0, 1.0, 'alice')",
            (job_id, status, spec),
        )
    conn.close()
    with JobStore(db) as store:
        located = store.record_checkpoint_dirs(
            lambda job_id, spec: (spec.get("checkpoint") or {}).get("path") or f"/tree/{job_id}"
        )
        assert located == 2 and store.record_checkpoint_dirs(lambda *_: "/never") == 0
        with pytest.raises(DirectoryTaken):
            create(store, "new", "/runs/old/x")
        assert store.job_dirs("/tree", other_than="bob") == [("old-done", "alice", "/tree/old-done")]


# --- which steps a resume may load ------------------------------------------------------------------------------


def test_a_resume_loads_only_its_own_or_its_tenants_steps(tmp_path):
    pytest.importorskip("ray")  # service/runtime imports it (never started here)
    from etrain.service.runtime.job_checkpoints import JobCheckpoints
    from tests.api.test_storage_roots_api import _commit_step as commit_step

    assert may_resume("me", "me", ()) and may_resume("parent", "me", {"parent"})
    assert not may_resume("stranger", "me", {"parent"}) and not may_resume(None, "me", {"parent"})
    key = b"k" * 32
    commit_step(tmp_path, 5, key=key, job_id="parent")
    commit_step(tmp_path, 10, key=key, job_id="me")
    commit_step(tmp_path, 15, key=key, job_id="stranger")  # signed by this service, for another tenant's job
    events: list[tuple[str, str]] = []

    def checkpoints(owners: frozenset[str]) -> JobCheckpoints:
        return JobCheckpoints(
            job_id="me",
            root=str(tmp_path),
            key=key,
            keep_last=3,
            record=lambda kind, detail: events.append((kind, detail)),
            resume_owners=owners,
        )

    assert checkpoints(frozenset({"parent"})).verified_resume_step(15) == 10
    assert events == [("checkpoint_skipped", "step 15: committed by a job this one may not resume from")]
    assert checkpoints(frozenset({"parent"})).verified_resume_step(9) == 5
    assert checkpoints(frozenset()).verified_resume_step(9) is None
    assert os.path.isdir(tmp_path / "step_00000015")  # skipped, never moved or deleted: not this job's


# --- queue reasons --------------------------------------------------------------------------------------------


def test_a_queue_reason_names_the_job_it_waits_behind_only_to_who_may_see_it():
    gang = admission.Gang(per_rank={"CPU": 1.0}, dp_sizes=(4,))
    small = admission.Gang(per_rank={"CPU": 1.0}, dp_sizes=(1,))
    nodes = [admission.NodeView(id="n1", alive=True, total={"CPU": 4.0}, free={"CPU": 2.0})]
    plan = admission.decide(
        [
            admission.QueuedJob(id="bobq-1", priority=5, created_at=1.0, gang=gang),
            admission.QueuedJob(id="mine", priority=0, created_at=2.0, gang=small),
        ],
        nodes,
    )
    wait = plan.waiting("mine")
    assert wait.behind == "bobq-1"
    assert wait.reason_for(sees_behind=True) == wait.reason and "bobq-1 (priority 5)" in wait.reason
    assert wait.reason_for(sees_behind=False) == (
        "fits the free resources but waits behind 1 job of another tenant, which waits for the same nodes: "
        "starting this job first could delay it; position 2 in the queue"
    )
    head = plan.waiting("bobq-1")
    assert head.anonymous_reason is None and head.reason_for(sees_behind=False) == head.reason
    assert Principal.reader_of("default").admin and not Principal.reader_of("alice").admin
