"""Auth on by default, tenants, per-tenant quotas, chaos for the admin only (issue #8).

The route matrix runs in process (``create_app`` over the named fake ``InMemoryManager``: real store,
real spec checks); quotas go through the real ``JobManager`` (Ray replaced by ``FakeRuntime``), which is
where they are enforced; the CLI tests run a real uvicorn server. tests/e2e/test_tenants.py repeats
isolation end to end over real Ray.
"""

from __future__ import annotations

import io
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi.testclient import TestClient

from etrain.api import cli
from etrain.api.app import create_app
from etrain.api.cli.client import client_token
from etrain.service.access.api_token import ensure_api_token, new_api_token, read_api_token, token_path
from etrain.service.access.quotas import TenantQuotas
from etrain.service.access.tenancy import ADMIN, Principal
from etrain.service.errors import QuotaExceeded, SettingsError
from etrain.service.settings import Settings
from etrain.service.store.job_store import JobStore
from tests.fakes import FakeRuntime, InMemoryManager
from tests.service_harness import bearer, free_port

ADMIN_TOKEN = "admin-token-9f3c2a71d0"
ALICE = "alice-token-5e1b77c0aa"
BOB = "bob-token-0c4d93e2f1"
TENANTS = {"alice": ALICE, "bob": BOB}


def tiny_spec(name: str = "tiny", **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "model": {"preset": "gpt-tiny"},
        "training": {"steps": 20, "global_batch": 8, "micro_batch": 2},
        "parallelism": {"dp": 2},
        "resources": {"min_dp": 1, "max_dp": 2},
    }
    spec.update(overrides)
    return spec


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("ETRAIN_API_TOKEN", "ETRAIN_API_TOKENS", "ETRAIN_API_TOKENS_FILE", "ETRAIN_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def store(tmp_path):
    with JobStore(tmp_path / "etrain.db") as store:
        yield store


# -- the generated token: no configuration at all ----------------------------------------------------------------


def test_a_generated_token_never_begins_with_a_dash_so_a_command_line_takes_it(monkeypatch):
    """One in 64 of secrets.token_urlsafe begins with "-"; `etrain --token -x...` then fails to parse."""
    draws = iter(["-starts-like-an-option", "-again", "a-usable-token"])
    monkeypatch.setattr("etrain.service.access.api_token.secrets.token_urlsafe", lambda nbytes: next(draws))
    assert new_api_token() == "a-usable-token"
    monkeypatch.undo()
    token = new_api_token()
    assert cli.build_parser().parse_args(["--token", token, "list"]).token == token


def test_no_configuration_means_a_generated_token_and_401_without_it(tmp_path, store):
    data_dir = tmp_path / "fresh"
    app = create_app(Settings(data_dir=data_dir), manager=InMemoryManager(store))
    client = TestClient(app, raise_server_exceptions=False)

    path = data_dir / "api-token"
    assert mode_of(path) == 0o600 and mode_of(data_dir) == 0o700
    token = path.read_text().strip()
    assert len(token) == 43  # secrets.token_urlsafe(32)

    missing = client.get("/v1/jobs")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    body = missing.json()
    assert (body["error"], body["message"], body["detail"]) == (
        "unauthorized",
        "this server requires an API token.",
        [],
    )
    assert "ETRAIN_API_TOKEN" in body["fix"] and "api-token" in body["fix"] and str(data_dir) not in body["fix"]
    wrong = client.get("/v1/jobs", headers=bearer(token + "x"))
    assert (wrong.status_code, wrong.json()["message"]) == (401, "the API token is not valid.")
    assert client.get("/v1/jobs", headers=bearer(token)).json()["jobs"] == []
    assert client.get("/healthz").status_code == 200 and client.get("/metrics").status_code == 200

    # A second start reuses the file: same token, same mode, still required.
    again = TestClient(create_app(Settings(data_dir=data_dir), manager=InMemoryManager(store)))
    assert path.read_text().strip() == token and mode_of(path) == 0o600
    assert again.get("/v1/jobs").status_code == 401
    assert again.get("/v1/jobs", headers=bearer(token)).status_code == 200


def test_a_configured_token_writes_no_file(tmp_path, store):
    client = TestClient(create_app(Settings(data_dir=tmp_path, api_token=ADMIN_TOKEN), manager=InMemoryManager(store)))
    assert not (tmp_path / "api-token").exists()
    assert client.get("/v1/jobs", headers=bearer(ADMIN_TOKEN)).status_code == 200


def test_tenant_tokens_alone_need_no_admin_file(tmp_path, store):
    client = TestClient(create_app(Settings(data_dir=tmp_path, api_tokens=TENANTS), manager=InMemoryManager(store)))
    assert not (tmp_path / "api-token").exists()
    assert client.get("/v1/jobs", headers=bearer(ALICE)).status_code == 200


def test_the_token_file_is_refused_when_others_can_read_it(tmp_path, store):
    path = tmp_path / "api-token"
    first = ensure_api_token(tmp_path)
    assert first.created and first.path == path
    second = ensure_api_token(tmp_path)
    assert (second.created, second.token) == (False, first.token)

    path.chmod(0o640)
    with pytest.raises(SettingsError) as refused:
        create_app(Settings(data_dir=tmp_path), manager=InMemoryManager(store))
    assert "accessible to other users (-rw-r-----)" in refused.value.message
    assert refused.value.fix.startswith(f"chmod 600 {path}")
    assert first.token not in str(refused.value)


@pytest.mark.parametrize("make", ["symlink", "empty", "spaces"])
def test_a_token_file_that_is_not_a_plain_secret_is_refused(tmp_path, make, monkeypatch):
    path = token_path(tmp_path)
    if make == "symlink":
        target = tmp_path / "elsewhere"
        target.write_text("stolen-token\n")
        target.chmod(0o600)
        path.symlink_to(target)
        expected = "is a symlink"
    else:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"" if make == "empty" else b"two words\n")
        os.close(fd)
        expected = "holds no valid token"
    with pytest.raises(SettingsError, match=expected):
        read_api_token(path)
    if make == "empty":
        monkeypatch.setattr("etrain.service.access.api_token._WRITER_WAIT_S", 0.3)
        started = time.monotonic()
        with pytest.raises(SettingsError, match=expected):
            ensure_api_token(tmp_path)  # waits a moment for a concurrent writer, then refuses
        assert 0.3 <= time.monotonic() - started < 3


def test_two_servers_starting_at_once_agree_on_one_token(tmp_path):
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_api_token(tmp_path))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(results) == 8
    assert len({r.token for r in results}) == 1 and sum(r.created for r in results) == 1


# -- 401 before validation; OpenAPI ---------------------------------------------------------------------------------


@pytest.fixture
def tenant_app(tmp_path, store):
    manager = InMemoryManager(store, base_dir=str(tmp_path), enable_chaos=True, checkpoint_every=5)
    app = create_app(
        Settings(data_dir=tmp_path, api_token=ADMIN_TOKEN, api_tokens=TENANTS, enable_chaos=True), manager=manager
    )
    return app, manager


def client_for(app, token: str | None) -> TestClient:
    return TestClient(app, raise_server_exceptions=False, headers=bearer(token) if token else {})


def test_without_a_token_nothing_about_the_body_leaks(tenant_app):
    app, _ = tenant_app
    anonymous = client_for(app, None)
    for body in (b"{not json", b'{"name": 5}', b"x" * 10):
        response = anonymous.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 401
        assert response.json() == {
            "error": "unauthorized",
            "message": "this server requires an API token.",
            "fix": response.json()["fix"],
            "detail": [],
        }
    assert (
        client_for(app, ALICE)
        .post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
        .status_code
        == 422
    )


def test_openapi_declares_bearer_auth_on_every_v1_operation(tenant_app):
    app, _ = tenant_app
    anonymous = client_for(app, None)
    document = anonymous.get("/openapi.json").json()
    assert document["components"]["securitySchemes"]["bearer"]["type"] == "http"
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    v1 = [
        (path, method, op)
        for path, ops in document["paths"].items()
        for method, op in ops.items()
        if path.startswith("/v1/")
    ]
    assert len(v1) >= 10
    for path, method, op in v1:
        assert op["security"] == [{"bearer": []}], (method, path)
        assert "401" in op["responses"], (method, path)
        # and the server does what the document says: no token, no entry
        response = anonymous.request(method.upper(), path.replace("{job_id}", "any-job"))
        assert (response.status_code, response.headers["www-authenticate"]) == (401, "Bearer"), (method, path)
    for path in ("/healthz", "/metrics"):
        assert "security" not in document["paths"][path]["get"]
    assert "429" in document["paths"]["/v1/jobs"]["post"]["responses"]


# -- tenant isolation on every route ---------------------------------------------------------------------------------

#: Valid bodies for the job routes that take one, so a 404 is not hidden behind a 422.
BODIES: dict[str, Any] = {
    "scale": {"dp": 1},
    "chaos": {"action": "kill_rank", "rank": 0},
}


def _job_routes(app) -> list[tuple[str, str]]:
    """Every (method, path) of the document that names a job: new routes are covered as they are added."""
    document = app.openapi()
    return [(method.upper(), path) for path, ops in document["paths"].items() for method in ops if "{job_id}" in path]


def _call(client: TestClient, method: str, path: str, job_id: str, tmp_path: Path):
    verb = path.rsplit("/", 1)[-1]
    body = {"out": str(tmp_path / "export-out")} if verb == "export" else BODIES.get(verb)
    return client.request(method, path.replace("{job_id}", job_id), json=body if method == "POST" else None)


def test_another_tenants_job_is_404_on_every_route(tenant_app, tmp_path):
    app, manager = tenant_app
    alice, bob, admin = client_for(app, ALICE), client_for(app, BOB), client_for(app, ADMIN_TOKEN)
    alice_job = alice.post("/v1/jobs", json=tiny_spec("alices")).json()
    bob_job = bob.post("/v1/jobs", json=tiny_spec("bobs")).json()
    assert (alice_job["tenant"], bob_job["tenant"]) == ("alice", "bob")
    manager.advance(alice_job["id"], 10)  # steps, events and a checkpoint to leak, if anything did

    routes = _job_routes(app)
    assert {path.rsplit("/", 1)[-1] for _, path in routes} >= {
        "{job_id}",
        "events",
        "metrics",
        "cancel",
        "scale",
        "export",
        "chaos",
    }
    missing_id = "nosuch-00000000"
    for method, path in routes:
        theirs = _call(bob, method, path, alice_job["id"], tmp_path)
        nobodys = _call(bob, method, path, missing_id, tmp_path)
        assert theirs.status_code == 404, (method, path, theirs.text)
        # the same answer as for a job that does not exist: the id is the only difference
        assert theirs.text.replace(alice_job["id"], missing_id) == nobodys.text, (method, path)
        assert theirs.json()["error"] == "job_not_found"

    # nothing happened to alice's job
    after = alice.get(f"/v1/jobs/{alice_job['id']}").json()
    assert (after["status"], after["step"], after["world_size"]) == ("RUNNING", 10, 2)
    assert manager.chaos_orders == [] and manager.exports == []

    # lists: each tenant its own, the admin everything
    assert [j["id"] for j in bob.get("/v1/jobs").json()["jobs"]] == [bob_job["id"]]
    assert [j["id"] for j in alice.get("/v1/jobs").json()["jobs"]] == [alice_job["id"]]
    assert {j["id"] for j in admin.get("/v1/jobs").json()["jobs"]} == {alice_job["id"], bob_job["id"]}
    for job in (alice_job, bob_job):
        assert admin.get(f"/v1/jobs/{job['id']}").status_code == 200
        assert admin.get(f"/v1/jobs/{job['id']}/events").status_code == 200
    assert alice.get(f"/v1/jobs/{alice_job['id']}/metrics").json()["steps"][-1]["step"] == 10
    assert admin.post(f"/v1/jobs/{alice_job['id']}/cancel").status_code in (200, 202)


def _samples(text: str) -> dict[str, float]:
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}


def test_open_metrics_show_no_job_ids_and_a_token_shows_only_its_jobs(tenant_app):
    app, manager = tenant_app
    alice, bob, admin = client_for(app, ALICE), client_for(app, BOB), client_for(app, ADMIN_TOKEN)
    alice_id = alice.post("/v1/jobs", json=tiny_spec("alices")).json()["id"]
    bob_id = bob.post("/v1/jobs", json=tiny_spec("bobs", parallelism={"dp": 1})).json()["id"]
    manager.advance(alice_id, 3)

    anonymous = client_for(app, None).get("/metrics")
    assert anonymous.status_code == 200
    assert alice_id not in anonymous.text and bob_id not in anonymous.text
    assert "alice" not in anonymous.text and "job_id" not in anonymous.text
    samples = _samples(anonymous.text)
    assert samples['etrain_jobs{status="RUNNING"}'] == 2.0 and samples["etrain_active_workers"] == 3.0
    assert sum(samples.values()) == 5.0  # two jobs counted once, three workers; no other series
    assert all(key.startswith(('etrain_jobs{status="', "etrain_active_workers")) for key in samples)

    as_alice = _samples(alice.get("/metrics").text)
    assert as_alice[f'etrain_job_step{{job_id="{alice_id}",name="alices"}}'] == 3.0
    assert not any(bob_id in key for key in as_alice)
    as_admin = _samples(admin.get("/metrics").text)
    assert as_admin[f'etrain_job_world_size{{job_id="{alice_id}",name="alices"}}'] == 2.0
    assert as_admin[f'etrain_job_world_size{{job_id="{bob_id}",name="bobs"}}'] == 1.0
    wrong = client_for(app, "not-a-token").get("/metrics")
    assert (wrong.status_code, wrong.json()["error"]) == (401, "unauthorized")


# -- chaos: the admin's, and only when enabled ------------------------------------------------------------------------


def test_chaos_is_for_the_admin_only(tenant_app):
    app, manager = tenant_app
    alice, admin = client_for(app, ALICE), client_for(app, ADMIN_TOKEN)
    job_id = alice.post("/v1/jobs", json=tiny_spec()).json()["id"]

    refused = alice.post(f"/v1/jobs/{job_id}/chaos", json={"action": "kill_rank", "rank": 1})
    assert refused.status_code == 403
    assert refused.json() == {
        "error": "admin_only",
        "message": "fault injection (chaos) is an operator action: only the admin token may use it, and this "
        "request comes from tenant 'alice'.",
        "fix": "ask the operator, who holds ETRAIN_API_TOKEN (the server's admin token)",
        "detail": [],
    }
    # before the body: an invalid order is still "admin only", not a 422
    assert alice.post(f"/v1/jobs/{job_id}/chaos", json={"action": "nope"}).status_code == 403
    assert manager.chaos_orders == []

    armed = admin.post(f"/v1/jobs/{job_id}/chaos", json={"action": "kill_rank", "rank": 1})
    assert (armed.status_code, armed.json()["armed"]) == (200, True)
    assert manager.chaos_orders == [(job_id, {"action": "kill_rank", "rank": 1})]


def test_chaos_stays_off_when_disabled_even_for_the_admin(tmp_path, store):
    app = create_app(
        Settings(data_dir=tmp_path, api_token=ADMIN_TOKEN, api_tokens=TENANTS), manager=InMemoryManager(store)
    )
    job_id = client_for(app, ALICE).post("/v1/jobs", json=tiny_spec()).json()["id"]
    for token in (ADMIN_TOKEN, ALICE, BOB):
        response = client_for(app, token).post(f"/v1/jobs/{job_id}/chaos", json={"action": "kill_rank", "rank": 0})
        assert (response.status_code, response.json()["error"]) == (403, "chaos_disabled"), token


# -- quotas ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def quota_app(tmp_path):
    manager_module = pytest.importorskip("etrain.service.manager")  # imports Ray (not started)
    settings = Settings(
        data_dir=tmp_path,
        api_token=ADMIN_TOKEN,
        api_tokens=TENANTS,
        tenant_max_jobs=2,
        tenant_max_workers=3,
        poll_interval_s=60,
    )
    manager = manager_module.JobManager(settings, runtime=FakeRuntime(steps_per_update=1), base_dir=str(tmp_path))
    yield create_app(settings, manager=manager)
    manager.close()


def long_spec(name: str, dp: int) -> dict[str, Any]:
    return tiny_spec(
        name,
        training={"steps": 100_000, "global_batch": 8, "micro_batch": 2},
        parallelism={"dp": dp},
        resources={"min_dp": 1, "max_dp": 2},
    )


def test_a_tenant_over_its_quota_gets_429_with_the_numbers(quota_app):
    alice, bob, admin = (client_for(quota_app, t) for t in (ALICE, BOB, ADMIN_TOKEN))
    first = alice.post("/v1/jobs", json=long_spec("one", dp=2))
    assert first.status_code == 201, first.text

    workers = alice.post("/v1/jobs", json=long_spec("two", dp=2))
    assert workers.status_code == 429
    assert workers.json() == {
        "error": "quota_exceeded",
        "message": "tenant 'alice' may hold at most 3 workers (ETRAIN_TENANT_MAX_WORKERS=3); its unfinished jobs "
        "hold 2 and this job needs 2, 4 in all.",
        "fix": "submit with fewer workers (at most 1 now: lower parallelism.dp, tp or pp), wait for or cancel one "
        "of your jobs, or ask the operator to raise ETRAIN_TENANT_MAX_WORKERS",
        "detail": [{"field": "parallelism", "message": workers.json()["message"], "fix": workers.json()["fix"]}],
        "quota": {
            "name": "max_workers",
            "setting": "ETRAIN_TENANT_MAX_WORKERS",
            "tenant": "alice",
            "limit": 3,
            "used": 2,
            "requested": 2,
        },
        "retry_after_s": 30,
    }
    assert workers.headers["retry-after"] == "30"
    assert alice.post("/v1/jobs", json=long_spec("two", dp=1)).status_code == 201  # 3 of 3 workers

    jobs = alice.post("/v1/jobs", json=long_spec("three", dp=1))
    assert jobs.status_code == 429
    assert jobs.json()["quota"] == {
        "name": "max_jobs",
        "setting": "ETRAIN_TENANT_MAX_JOBS",
        "tenant": "alice",
        "limit": 2,
        "used": 2,
        "requested": 1,
    }
    assert jobs.json()["message"] == (
        "tenant 'alice' may have at most 2 unfinished jobs (ETRAIN_TENANT_MAX_JOBS=2) and has 2; this job would make 3."
    )
    assert len(alice.get("/v1/jobs").json()["jobs"]) == 2  # nothing was created by the refusals

    # quotas are per tenant, and the admin has none
    assert bob.post("/v1/jobs", json=long_spec("bobs", dp=2)).status_code == 201
    for name in ("ops-1", "ops-2", "ops-3"):
        assert admin.post("/v1/jobs", json=long_spec(name, dp=2)).status_code == 201

    # a finished job frees its slot
    oldest = alice.get("/v1/jobs").json()["jobs"][-1]["id"]
    assert alice.post(f"/v1/jobs/{oldest}/cancel").status_code in (200, 202)
    deadline = time.monotonic() + 20
    while alice.get(f"/v1/jobs/{oldest}").json()["status"] != "CANCELLED":
        assert time.monotonic() < deadline, "the cancel never landed"
        time.sleep(0.05)
    assert alice.post("/v1/jobs", json=long_spec("three", dp=1)).status_code == 201


def test_a_refused_submit_leaves_its_checkpoint_directory_free(quota_app, tmp_path):
    """The directory claim taken before the quota gate is given back when the gate refuses."""
    alice, admin = client_for(quota_app, ALICE), client_for(quota_app, ADMIN_TOKEN)
    assert alice.post("/v1/jobs", json=long_spec("one", dp=2)).status_code == 201
    shared = str(tmp_path / "shared-ckpt")
    refused = long_spec("two", dp=2)
    refused["checkpoint"] = {"path": shared}
    assert alice.post("/v1/jobs", json=refused).status_code == 429
    taken = long_spec("ops", dp=1)
    taken["checkpoint"] = {"path": shared}
    response = admin.post("/v1/jobs", json=taken)
    assert response.status_code == 201, response.text


def test_concurrent_submits_cannot_both_take_the_last_slot(tmp_path, store):
    """The quota gate counts admitted submits whose row is not written yet."""
    quotas = TenantQuotas(max_jobs=1, max_workers=None)
    alice = Principal("alice")
    quotas.admit(alice, "job-a", 2, store)  # admitted; its row is not written yet
    with pytest.raises(QuotaExceeded) as second:
        quotas.admit(alice, "job-b", 2, store)
    assert (second.value.used, second.value.limit) == (1, 1)
    quotas.admit(Principal("bob"), "job-c", 2, store)  # another tenant is not affected
    quotas.admit(ADMIN, "job-d", 64, store)  # nor the admin
    store.create_job(job_id="job-a", name="a", spec={}, world_size=2, layout="dp2", tenant="alice", priority=0)
    with pytest.raises(QuotaExceeded) as third:
        quotas.admit(alice, "job-e", 2, store)
    assert third.value.used == 1  # now counted from the store, not twice
    assert quotas._reserved.keys() == {"job-c"}  # the row replaced job-a's reservation; the admin takes none


# -- settings ---------------------------------------------------------------------------------------------------------


def test_tenant_tokens_from_the_environment_and_a_file(tmp_path):
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(
        "# tenant=token, one a line\n\ncarol = carol-token-00000001\nalice=alice-token-rotated-001\n"
    )
    settings = Settings.from_env(
        {
            "ETRAIN_API_TOKENS": " alice=alice-token-00000001 , bob=b=ob-token=-0123456,",
            "ETRAIN_API_TOKENS_FILE": str(tokens_file),
            "ETRAIN_TENANT_MAX_JOBS": "4",
            "ETRAIN_TENANT_MAX_WORKERS": "",
        }
    )
    assert dict(settings.token_tenants) == {
        "alice-token-00000001": "alice",
        "b=ob-token=-0123456": "bob",
        "carol-token-00000001": "carol",
        "alice-token-rotated-001": "alice",
    }
    assert (settings.tenant_max_jobs, settings.tenant_max_workers) == (4, None)
    assert settings.auth_configured and settings.api_token is None
    assert "alice-token-00000001" not in repr(settings)


@pytest.mark.parametrize(
    ("env", "message", "field"),
    [
        ({"ETRAIN_API_TOKENS": "alice"}, "ETRAIN_API_TOKENS entry 1 is not 'tenant=token'.", "ETRAIN_API_TOKENS"),
        (
            {"ETRAIN_API_TOKENS": "Alice=token-0123456789"},
            "ETRAIN_API_TOKENS: 'Alice' is not a tenant name.",
            "ETRAIN_API_TOKENS",
        ),
        (
            {"ETRAIN_API_TOKENS": "a=token-0123456789,b=token-0123456789"},
            "ETRAIN_API_TOKENS: tenant 'b' has the same token as tenant 'a'.",
            "ETRAIN_API_TOKENS",
        ),
        (
            {"ETRAIN_API_TOKENS": "a=tok 1"},
            "ETRAIN_API_TOKENS: the token of tenant 'a' is empty or holds spaces, commas or non-ASCII characters.",
            "ETRAIN_API_TOKENS",
        ),
        (
            {"ETRAIN_API_TOKENS": "a=admin-token-0123456789", "ETRAIN_API_TOKEN": "admin-token-0123456789"},
            "ETRAIN_API_TOKENS: tenant 'a' has the admin token (ETRAIN_API_TOKEN).",
            "ETRAIN_API_TOKENS",
        ),
        (
            {"ETRAIN_API_TOKENS": "default=token-0123456789"},
            "ETRAIN_API_TOKENS: the tenant name 'default' is reserved for the operator's own jobs (those submitted "
            "with ETRAIN_API_TOKEN).",
            "ETRAIN_API_TOKENS",
        ),
        ({"ETRAIN_TENANT_MAX_WORKERS": "-1"}, "tenant_max_workers=-1 must be 0 or more.", "tenant_max_workers"),
        (
            {"ETRAIN_TENANT_MAX_JOBS": "many"},
            "ETRAIN_TENANT_MAX_JOBS='many' is not an integer.",
            "ETRAIN_TENANT_MAX_JOBS",
        ),
    ],
)
def test_bad_tenant_settings_are_refused_by_name(env, message, field):
    with pytest.raises(SettingsError) as refused:
        Settings.from_env(env)
    assert (refused.value.message, refused.value.field) == (message, field)
    tokens = [entry.partition("=")[2] for entry in env.get("ETRAIN_API_TOKENS", "").split(",")]
    assert not any(token and token in refused.value.message for token in tokens)  # secrets stay out of logs


def test_a_bad_tokens_file_line_is_named_by_file_and_line(tmp_path):
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("alice=tok-a\n# comment\nbob tok-b\n")
    with pytest.raises(SettingsError) as refused:
        Settings.from_env({"ETRAIN_API_TOKENS_FILE": str(tokens_file)})
    assert refused.value.message == f"{tokens_file}:3 is not 'tenant=token'."
    assert refused.value.field == "ETRAIN_API_TOKENS_FILE"
    with pytest.raises(SettingsError, match="cannot read the tenant tokens file"):
        Settings.from_env({"ETRAIN_API_TOKENS_FILE": str(tmp_path / "missing")})


# -- the CLI: finds a local server's token; `etrain serve` generates it -------------------------------------------------


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_the_cli_finds_a_local_servers_token_file(tmp_path, store, monkeypatch):
    data_dir = tmp_path / "server"
    port = free_port()
    app = create_app(Settings(data_dir=data_dir, port=port), manager=InMemoryManager(store))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    try:
        monkeypatch.setenv("ETRAIN_DATA_DIR", str(tmp_path / "elsewhere"))  # no token file there
        code, _, err = run_cli("--url", url, "list")
        assert code == 1 and "HTTP 401" in err and "api-token" in err

        monkeypatch.setenv("ETRAIN_DATA_DIR", str(data_dir))
        code, out, err = run_cli("--url", url, "list")
        assert (code, out.strip(), err) == (0, "no jobs", "")
        monkeypatch.chdir(tmp_path)  # default ETRAIN_DATA_DIR: ./.etrain
        monkeypatch.delenv("ETRAIN_DATA_DIR")
        (tmp_path / ".etrain").mkdir()
        (data_dir / "api-token").rename(tmp_path / ".etrain" / "api-token")
        assert run_cli("--url", f"http://localhost:{port}", "list")[0] == 0

        (tmp_path / ".etrain" / "api-token").chmod(0o644)
        code, _, err = run_cli("--url", url, "list")
        assert code == 1 and "is accessible to other users (-rw-r--r--)" in err and "chmod 600" in err
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_cli_never_sends_the_local_token_to_a_remote_server(tmp_path, monkeypatch):
    ensure_api_token(tmp_path)
    monkeypatch.setenv("ETRAIN_DATA_DIR", str(tmp_path))
    local = read_api_token(tmp_path / "api-token")
    assert client_token("http://127.0.0.1:8000", None) == local
    assert client_token("http://[::1]:8000", None) == local
    assert client_token("https://etrain.example.com", None) is None
    assert client_token("http://10.0.0.7:8000", None) is None
    assert client_token("http://10.0.0.7:8000", "given") == "given"


def test_serve_generates_the_token_once_and_prints_where_it_is(tmp_path, monkeypatch):
    apps: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: apps.append(app))
    data_dir = tmp_path / "data"

    code, out, _ = run_cli("serve", "--data-dir", str(data_dir), "--port", "8123")
    assert code == 0
    path = (data_dir / "api-token").resolve()
    assert f"API token:      {path} (generated, mode 0600;" in out and mode_of(path) == 0o600
    token = path.read_text().strip()
    assert apps[0].state.settings.api_token == token and token not in out
    assert TestClient(apps[0]).get("/v1/jobs").status_code == 401

    code, out, _ = run_cli("serve", "--data-dir", str(data_dir), "--port", "8123")
    assert code == 0 and f"API token:      {path} (existing, mode 0600;" in out
    assert apps[1].state.settings.api_token == token

    monkeypatch.setenv("ETRAIN_API_TOKEN", ADMIN_TOKEN)  # configured: no file, no line
    code, out, _ = run_cli("serve", "--data-dir", str(tmp_path / "other"), "--port", "8123")
    assert code == 0 and "API token:" not in out and not (tmp_path / "other" / "api-token").exists()

    path.chmod(0o604)
    monkeypatch.delenv("ETRAIN_API_TOKEN")
    code, out, err = run_cli("serve", "--data-dir", str(data_dir), "--port", "8123")
    assert code == 1 and "is accessible to other users (-rw----r--)" in err and len(apps) == 3


def test_the_new_errors_survive_pickling_with_their_fields():
    import pickle

    from etrain.service.errors import AdminOnly, NotAuthenticated

    quota = pickle.loads(pickle.dumps(QuotaExceeded("max_workers", tenant="alice", limit=8, used=6, requested=4)))
    assert quota.to_dict() == {
        "name": "max_workers",
        "setting": "ETRAIN_TENANT_MAX_WORKERS",
        "tenant": "alice",
        "limit": 8,
        "used": 6,
        "requested": 4,
    }
    assert (quota.field, quota.fix.split(":")[0]) == ("parallelism", "submit with fewer workers (at most 2 now")
    refused = pickle.loads(pickle.dumps(AdminOnly("fault injection (chaos)", tenant="bob")))
    assert (refused.action, refused.tenant) == ("fault injection (chaos)", "bob")
    assert pickle.loads(pickle.dumps(NotAuthenticated(token_given=True))).message == "the API token is not valid."
