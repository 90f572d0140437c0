"""Issue #17 items 2-6, as the attacker ran them: real tenants over HTTP (the real app and ``JobManager``,
real SQLite, ``FakeRuntime`` in place of Ray), real files in real temp directories.

* alice may not read, write or plan with bob's custom checkpoint directory (his export, his rank logs) or a
  storage root marked ``bob=``; the answer is the same whether the file exists or not (no oracle);
* of 30 concurrent submits naming one ``checkpoint.path``, exactly one is accepted, round after round;
* a job's supervisor may resume only from its own steps or those of its tenant's jobs in that directory;
* an export's ``out`` obeys the same reach rule;
* a queue reason never names another tenant's job (the admin sees it).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from etrain.api.app import create_app
from etrain.service.access.checkpoint_key import load_or_create_key
from etrain.service.access.tenancy import Principal
from etrain.service.errors import JobConflict, SpecRejected
from etrain.service.planning.spec import JobSpec
from etrain.service.settings import Settings
from tests.api.test_storage_roots_api import _commit_step as commit_step
from tests.fakes import FakeRuntime
from tests.service_harness import bearer

manager_module = pytest.importorskip("etrain.service.manager")  # imports Ray (never started: FakeRuntime)

ADMIN_TOKEN = "admin-token-17-0123456789"
TENANTS = {"alice": "alice-token-17-0123456789", "bob": "bob-token-17-0123456789"}
REACH = "checkpoint directory of a job you cannot access"
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


@pytest.fixture
def world(tmp_path):
    """<tmp>/shared (a shared root, the server's directory, holding the data directory), <tmp>/alice and
    <tmp>/bob (roots marked for them), each with a corpus."""
    for name in ("shared", "alice", "bob"):
        (tmp_path / name / "corpus").mkdir(parents=True)
        (tmp_path / name / "corpus" / "a.txt").write_text(f"{name} text " * 200)
    return tmp_path


def make(world: Path, runtime: FakeRuntime | None = None, **settings: Any):
    settings = Settings(
        data_dir=world / "shared" / "state",
        api_token=ADMIN_TOKEN,
        api_tokens=TENANTS,
        storage_roots=(world / "shared", f"alice={world / 'alice'}", f"bob={world / 'bob'}"),
        poll_interval_s=60,
        **settings,
    )
    manager = manager_module.JobManager(settings, runtime=runtime or FakeRuntime(), base_dir=str(world / "shared"))
    app = create_app(settings, manager=manager)
    clients = {who: TestClient(app, headers=bearer(token)) for who, token in {"admin": ADMIN_TOKEN, **TENANTS}.items()}
    return manager, clients


@pytest.fixture
def server(world):
    manager, clients = make(world)
    yield manager, clients
    manager.close()


def spec(name: str = "reach", **sections: Any) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"preset": "llama-tiny"},
        "training": {"steps": 10_000, "global_batch": 2},
        **sections,
    }


def text(path: str, **data: Any) -> dict[str, Any]:
    return {"data": {"kind": "text", "path": path, **data}}


def created(client: TestClient, body: dict[str, Any]) -> str:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def bobs_finished_run(manager, clients, world: Path) -> tuple[str, Path]:
    """bob's job with a custom checkpoint.path in the shared root, finished, with an export and rank logs."""
    job_id = created(clients["bob"], spec("bobs", checkpoint={"path": "runs/bob"}))
    manager.store.update_job(job_id, status="SUCCEEDED")
    run = world / "shared" / "runs" / "bob"
    (run / "hf-export").mkdir(parents=True)
    (run / "hf-export" / "config.json").write_text(json.dumps(HF_CONFIG))
    (run / "logs" / job_id).mkdir(parents=True)
    (run / "logs" / job_id / "rank0.log").write_text("bob's loss 1.234 at step 10\n" * 100)
    return job_id, run


def test_another_tenants_custom_checkpoint_directory_is_out_of_reach(world, server):
    manager, clients = server
    alice, admin = clients["alice"], clients["admin"]
    _bob_job, run = bobs_finished_run(manager, clients, world)
    attacks = {
        "model.hf": {"model": {"hf": "runs/bob/hf-export"}},
        "data.path": text("runs/bob/logs"),
        "data.tokenizer": text("corpus", tokenizer="runs/bob/hf-export"),
        "checkpoint.path": {"checkpoint": {"path": "runs/bob"}},
    }
    for field, sections in attacks.items():
        response = alice.post("/v1/jobs", json=spec(**sections))
        assert response.status_code == 422, (field, response.text)
        problems = {p["field"]: p["message"] for p in response.json()["detail"]}
        assert REACH in problems[field], (field, problems)
        assert _bob_job not in response.text and "bob" not in problems[field].replace("runs/bob", "")
    # A symlink into it is resolved before the rule, and the message echoes the link, not where it points.
    (world / "shared" / "mylink").symlink_to(run)
    linked = alice.post("/v1/jobs", json=spec(**text("mylink/logs")))
    assert linked.status_code == 422 and REACH in linked.text and "runs/bob" not in linked.text
    # A folder that contains bob's directory is refused too (the text walk would read his logs) ...
    contains = alice.post("/v1/jobs", json=spec(**text("runs")))
    assert (
        contains.status_code == 422
        and "contains the checkpoint directory of a job you cannot access" in contains.json()["detail"][0]["message"]
    )
    # ... a directory inside it, whether it exists or not, gets the same bytes ...
    target = spec(checkpoint={"path": "runs/bob/next"})
    (run / "next").mkdir()
    existing = alice.post("/v1/jobs", json=target).content
    shutil.rmtree(run / "next")
    assert alice.post("/v1/jobs", json=target).content == existing
    # ... and the admin may use it (its answer is about the file, not the reach rule).
    assert REACH not in admin.post("/v1/jobs", json=spec(model={"hf": "runs/bob/hf-export"})).text
    assert alice.get("/v1/jobs").json()["jobs"] == []  # nothing was created for alice


def test_a_tenant_reuses_its_own_custom_directory(world, server):
    manager, clients = server
    alice = clients["alice"]
    first = created(alice, spec("first", checkpoint={"path": "runs/alice"}))
    manager.store.update_job(first, status="SUCCEEDED")
    key = load_or_create_key(manager.settings.data_dir)
    commit_step(world / "shared" / "runs" / "alice", 10, key=key, job_id=first)
    second = created(alice, spec("second", checkpoint={"path": "runs/alice"}))  # continues from first's steps
    owners = manager.runtime.jobs[second]["policy"].resume_owners
    assert owners == {first, second}
    bob = clients["bob"].post("/v1/jobs", json=spec(checkpoint={"path": "runs/alice"}))
    assert bob.status_code == 422 and REACH in bob.text


def test_storage_roots_marked_for_a_tenant_are_only_that_tenants(world, server):
    _manager, clients = server
    bobs = str(world / "bob" / "corpus")
    for route in ("/v1/jobs", "/v1/plan"):
        refused = clients["alice"].post(route, json=spec(**text(bobs)))
        assert refused.status_code == 422, refused.text
        [problem] = refused.json()["detail"]
        assert problem["field"] == "data.path"
        assert problem["message"] == f"data.path={bobs!r} is in a storage root reserved for another tenant."
        missing = clients["alice"].post(route, json=spec(**text(bobs + "-missing")))
        assert missing.json()["detail"][0]["message"].endswith("is in a storage root reserved for another tenant.")
    refused = clients["alice"].post("/v1/jobs", json=spec(checkpoint={"path": str(world / "bob" / "ckpt")}))
    assert refused.status_code == 422 and refused.json()["detail"][0]["field"] == "checkpoint.path"
    created(clients["alice"], spec(**text(str(world / "alice" / "corpus"))))
    created(clients["bob"], spec(**text(bobs)))
    created(clients["admin"], spec(**text(bobs)))
    created(clients["alice"], spec(**text("corpus")))  # the shared root


def test_a_path_outside_every_root_is_refused_without_naming_other_tenants_roots(world, server, tmp_path_factory):
    """The refusal lists the roots the caller may use: alice sees the shared root and hers, never bob's."""
    _manager, clients = server
    outside = str(tmp_path_factory.mktemp("elsewhere") / "corpus")
    seen = {}
    for who in ("alice", "admin"):
        for route, body in (("/v1/jobs", spec(**text(outside))), ("/v1/plan", spec(**text(outside)))):
            refused = clients[who].post(route, json=body)
            assert refused.status_code == 422, refused.text
            [problem] = refused.json()["detail"]
            assert problem["field"] == "data.path" and "is outside the storage roots" in problem["message"]
            seen[who] = problem["message"] + problem["fix"]
    shared, alices, bobs = (str(world / name) for name in ("shared", "alice", "bob"))
    assert shared in seen["alice"] and alices in seen["alice"] and bobs not in seen["alice"]
    assert all(root in seen["admin"] for root in (shared, alices, bobs))  # the operator sees every root
    job = created(clients["alice"], spec("leaks", checkpoint={"path": "runs/alice-leak"}))
    export = clients["alice"].post(f"/v1/jobs/{job}/export", json={"step": None, "out": outside})
    assert export.status_code == 422 and bobs not in export.text and alices in export.text


def test_plan_applies_the_same_reach_rule_and_is_no_oracle(world, server):
    manager, clients = server
    alice = clients["alice"]
    _bob_job, run = bobs_finished_run(manager, clients, world)
    body = spec(model={"hf": "runs/bob/hf-export"})
    existing = alice.post("/v1/plan", json=body)
    assert existing.status_code == 422, existing.text
    assert existing.json()["detail"][0]["field"] == "model.hf" and REACH in existing.text
    shutil.rmtree(run / "hf-export")
    assert alice.post("/v1/plan", json=body).content == existing.content  # missing: byte-identical
    assert alice.post("/v1/plan", json=spec()).status_code == 200


def test_export_out_may_not_reach_another_tenants_directories(world, server):
    manager, clients = server
    alice = clients["alice"]
    _bob_job, _run = bobs_finished_run(manager, clients, world)
    job = created(alice, spec("exporter", checkpoint={"path": "runs/alice"}))
    commit_step(world / "shared" / "runs" / "alice", 10, key=load_or_create_key(manager.settings.data_dir), job_id=job)
    for out, message in {
        "runs/bob/stolen": REACH,
        "runs/bob/hf-export": REACH,
        str(world / "bob" / "x"): "storage root reserved for another tenant",
    }.items():
        response = alice.post(f"/v1/jobs/{job}/export", json={"step": None, "out": out})
        assert response.status_code == 422, (out, response.text)
        [problem] = response.json()["detail"]
        assert problem["field"] == "out" and message in problem["message"], problem
    assert ("export",) not in [call[:1] for call in manager.runtime.calls]
    # Its own root passes the rule (and stops at the next check: the folder is not empty).
    mine = alice.post(f"/v1/jobs/{job}/export", json={"step": None, "out": str(world / "alice" / "corpus")})
    assert mine.status_code == 409 and "not empty" in mine.text


def test_concurrent_submits_of_one_checkpoint_directory_accept_exactly_one(world):
    # The claim is what races here, not the job cap: the cap counts submits in flight (service/access/
    # quotas.py), so 30 at once may meet the default cap of 20 before the claim answers (a 429, also a refusal).
    manager, _clients = make(world, tenant_max_jobs=None)
    try:
        _race_one_checkpoint_directory(manager)
    finally:
        manager.close()


def _race_one_checkpoint_directory(manager) -> None:
    alice, bob = Principal("alice"), Principal("bob")

    def race(path: str, callers: list[Principal]) -> list[tuple[Principal, object]]:
        barrier = threading.Barrier(len(callers))

        def submit(caller: Principal) -> tuple[Principal, object]:
            body = JobSpec.model_validate(spec("race", checkpoint={"path": path}))
            barrier.wait(timeout=30)
            try:
                return caller, manager.submit(body, principal=caller).id
            except (JobConflict, SpecRejected) as err:
                return caller, err

        with ThreadPoolExecutor(len(callers)) as pool:
            return list(pool.map(submit, callers))

    for round_ in range(3):  # one tenant, 30 at once: exactly one, and the 29 others are told which job holds it
        results = race(f"races/{round_}", [alice] * 30)
        accepted = [outcome for _who, outcome in results if isinstance(outcome, str)]
        assert len(accepted) == 1, (round_, accepted)
        for _who, outcome in results:
            if not isinstance(outcome, str):
                assert isinstance(outcome, JobConflict), outcome
                assert outcome.field == "checkpoint.path" and accepted[0] in outcome.message
        held = [
            job
            for job in manager.store.active_jobs()
            if ((job.spec.get("checkpoint") or {}).get("path") or "").endswith(f"races/{round_}")
        ]
        assert [job.id for job in held] == accepted
    for round_ in range(2):  # two tenants: exactly one; the other tenant's losers never learn its id
        results = race(f"mixed/{round_}", [alice, bob] * 15)
        accepted = [(who, outcome) for who, outcome in results if isinstance(outcome, str)]
        assert len(accepted) == 1, (round_, accepted)
        winner, job_id = accepted[0]
        for who, outcome in results:
            if isinstance(outcome, str):
                continue
            if who == winner:
                assert isinstance(outcome, JobConflict) and job_id in outcome.message
            else:  # a 409 that names no job, or the reach rule's 422 once the winner's row is visible
                assert job_id not in str(getattr(outcome, "message", "")) + str(getattr(outcome, "problems", ""))
    # The directory is free again once its job has ended.
    [first] = manager.store.jobs_in_dir(
        os.path.realpath(manager.settings.data_dir.parent / "races" / "0"), tenant="alice"
    )
    manager.store.update_job(first, status="CANCELLED")
    assert isinstance(
        manager.submit(JobSpec.model_validate(spec("again", checkpoint={"path": "races/0"})), principal=alice).id, str
    )


def test_a_claim_outlives_a_control_plane_restart(world):
    manager, clients = make(world)
    try:
        holder = created(clients["alice"], spec("holder", checkpoint={"path": "runs/held"}))
    finally:
        manager.close()
    manager, clients = make(world)
    try:
        again = clients["alice"].post("/v1/jobs", json=spec(checkpoint={"path": "runs/held/inner"}))
        assert again.status_code == 409 and holder in again.json()["message"]
    finally:
        manager.close()


def test_a_queue_reason_never_names_another_tenants_job(world):
    manager, clients = make(world, FakeRuntime(nodes={"n1": {"CPU": 4.0}}))
    try:

        def job(client: TestClient, name: str, dp: int, priority: int = 0) -> dict[str, Any]:
            response = client.post(
                "/v1/jobs",
                json={
                    "name": name,
                    "priority": priority,
                    "model": {"preset": "gpt-tiny"},
                    "parallelism": {"dp": dp},
                    "training": {"steps": 100_000, "global_batch": 8, "micro_batch": 2},
                },
            )
            assert response.status_code == 201, response.text
            return response.json()

        job(clients["admin"], "blocker", 2)  # holds 2 of the 4 CPUs
        bobq = job(clients["bob"], "bobq", 4, priority=5)  # waits for all 4 and keeps the node for itself
        small = job(clients["alice"], "small", 2)  # fits the 2 free CPUs, but waits behind bobq
        assert (bobq["status"], small["status"]) == ("QUEUED", "QUEUED")

        events = clients["alice"].get(f"/v1/jobs/{small['id']}/events").json()["events"]
        [queued] = [e["detail"]["message"] for e in events if e["kind"] == "queued"]
        assert "waits behind 1 job of another tenant" in queued and bobq["id"] not in queued
        [seen] = clients["alice"].get("/v1/cluster").json()["queue"]
        assert seen["job_id"] == small["id"] and "1 job of another tenant" in seen["reason"]
        assert bobq["id"] not in json.dumps(clients["alice"].get("/v1/cluster").json())
        by_admin = {q["job_id"]: q["reason"] for q in clients["admin"].get("/v1/cluster").json()["queue"]}
        assert f"waits behind {bobq['id']} (priority 5)" in by_admin[small["id"]]
        bob_small = job(clients["bob"], "bobsmall", 2)  # bob's own job is named to bob
        by_bob = {q["job_id"]: q["reason"] for q in clients["bob"].get("/v1/cluster").json()["queue"]}
        assert f"waits behind {bobq['id']}" in by_bob[bob_small["id"]]
    finally:
        manager.close()
