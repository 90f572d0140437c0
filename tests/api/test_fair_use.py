"""Fair use (issue #17, item 8 and the API's low items): no one tenant can slow the others.

Per-tenant caps with defaults that are on (event streams, plan computations, unfinished jobs), each a 429
with ``Retry-After`` and the numbers; the worker quota on ``scale`` too; a priority range per tenant;
/healthz from a cache, minimal to anonymous callers; a minimum token length; a tenant's malformed drill
is 403 before 422; OPTIONS and 405 name every method of a path. Streams and plans run over a real uvicorn
server (a slot is held by an open connection); quotas and priorities through the real ``JobManager`` with
``FakeRuntime``; the rest in process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from etrain.api.app import create_app
from etrain.api.routes.health import HealthCache
from etrain.service.access.quotas import TenantQuotas, TenantSlots
from etrain.service.access.tenancy import ADMIN, Principal
from etrain.service.errors import QuotaExceeded, SettingsError
from etrain.service.planning.spec import JobSpec
from etrain.service.settings import Settings
from etrain.service.store.job_store import JobStore
from tests.fakes import FakeRuntime, InMemoryManager
from tests.service_harness import bearer, serve_app

ADMIN_TOKEN = "admin-token-fair-0123456789"
ALICE = "alice-token-fair-0123456789"
BOB = "bob-token-fair-0123456789"
TENANTS = {"alice": ALICE, "bob": BOB}


def spec(name: str = "fair", **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": name,
        "model": {"preset": "gpt-tiny"},
        "parallelism": {"dp": 1},
        "training": {"steps": 100_000, "global_batch": 8, "micro_batch": 2},
        "resources": {"min_dp": 1, "max_dp": 4},
    }
    body.update(overrides)
    return body


AUTO = {"auto": True, "max_workers": 4}


@pytest.fixture
def store(tmp_path):
    with JobStore(tmp_path / "etrain.db") as store:
        yield store


def client(url: str, token: str | None) -> httpx.Client:
    return httpx.Client(base_url=url, headers=bearer(token) if token else {}, timeout=10)


def assert_too_many(response: httpx.Response, quota: dict[str, Any], retry_after: int) -> dict[str, Any]:
    """A cap's 429: the Retry-After header, the body's quota numbers, a message and a fix naming the setting."""
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == str(retry_after)
    body = response.json()
    assert body["error"] == "quota_exceeded" and body["retry_after_s"] == retry_after
    assert body["quota"] == quota
    assert quota["setting"] in body["message"] and quota["setting"] in body["fix"]
    return body


# -- settings: the defaults are on, every cap is a setting, tokens have a minimum length ---------------------------


def test_the_fair_use_defaults_are_on():
    settings = Settings()
    assert (settings.tenant_max_jobs, settings.tenant_max_streams, settings.tenant_max_plans) == (20, 8, 2)
    assert (settings.tenant_min_priority, settings.tenant_max_priority, settings.health_cache_s) == (0, 100, 2.0)
    assert settings.plan_workers == 1  # plans run in a process of their own
    assert settings.tenant_max_workers is None  # depends on the cluster: the operator sets it


def test_the_caps_come_from_the_environment_and_empty_means_no_limit():
    settings = Settings.from_env(
        {
            "ETRAIN_TENANT_MAX_STREAMS": "3",
            "ETRAIN_TENANT_MAX_PLANS": "",
            "ETRAIN_TENANT_MAX_JOBS": "",
            "ETRAIN_TENANT_MIN_PRIORITY": "-5",
            "ETRAIN_TENANT_MAX_PRIORITY": "50",
            "ETRAIN_TENANT_PRIORITIES": " alice=0..500 , bob=-10..10,",
            "ETRAIN_HEALTH_CACHE_S": "0.5",
        }
    )
    assert (settings.tenant_max_streams, settings.tenant_max_plans, settings.tenant_max_jobs) == (3, None, None)
    assert settings.tenant_priorities == (("alice", 0, 500), ("bob", -10, 10))
    assert settings.priority_range("alice") == (0, 500, "ETRAIN_TENANT_PRIORITIES=alice=0..500")
    assert settings.priority_range("carol") == (-5, 50, "ETRAIN_TENANT_MIN_PRIORITY=-5, ETRAIN_TENANT_MAX_PRIORITY=50")
    assert settings.health_cache_s == 0.5


@pytest.mark.parametrize(
    ("env", "message", "field"),
    [
        (
            {"ETRAIN_API_TOKEN": "short-token"},
            "ETRAIN_API_TOKEN: the token has 11 characters; a token needs at least 16 (a short token can be guessed).",
            "ETRAIN_API_TOKEN",
        ),
        (
            {"ETRAIN_API_TOKENS": "alice=alice-token-ok-012345,bob=bob-short"},
            "ETRAIN_API_TOKENS: the token of tenant 'bob' has 9 characters; a token needs at least 16 (a short "
            "token can be guessed).",
            "ETRAIN_API_TOKENS",
        ),
        ({"ETRAIN_TENANT_MAX_STREAMS": "-1"}, "tenant_max_streams=-1 must be 0 or more.", "tenant_max_streams"),
        (
            {"ETRAIN_TENANT_MAX_PLANS": "two"},
            "ETRAIN_TENANT_MAX_PLANS='two' is not an integer.",
            "ETRAIN_TENANT_MAX_PLANS",
        ),
        (
            {"ETRAIN_TENANT_PRIORITIES": "alice=0-500"},
            "ETRAIN_TENANT_PRIORITIES entry 1 is not 'tenant=MIN..MAX'.",
            "ETRAIN_TENANT_PRIORITIES",
        ),
        (
            {"ETRAIN_TENANT_PRIORITIES": "alice=10..5"},
            "ETRAIN_TENANT_PRIORITIES entry 'alice': the priority range 10..5 is not MIN..MAX within -1000..1000.",
            "ETRAIN_TENANT_PRIORITIES",
        ),
        (
            {"ETRAIN_TENANT_PRIORITIES": "alice=0..1,alice=0..2"},
            "ETRAIN_TENANT_PRIORITIES names tenant 'alice' twice.",
            "ETRAIN_TENANT_PRIORITIES",
        ),
        (
            {"ETRAIN_TENANT_MAX_PRIORITY": "5000"},
            "ETRAIN_TENANT_MIN_PRIORITY..ETRAIN_TENANT_MAX_PRIORITY: the priority range 0..5000 is not MIN..MAX within "
            "-1000..1000.",
            "tenant_max_priority",
        ),
        ({"ETRAIN_HEALTH_CACHE_S": "-1"}, "health_cache_s=-1.0 must be 0..300 seconds.", "health_cache_s"),
        ({"ETRAIN_PLAN_WORKERS": "17"}, "plan_workers=17 must be 0..16.", "plan_workers"),
    ],
)
def test_bad_fair_use_settings_are_refused_by_name(env, message, field):
    with pytest.raises(SettingsError) as refused:
        Settings.from_env(env)
    assert (refused.value.message, refused.value.field) == (message, field)
    assert "short-token" not in str(refused.value) and "bob-short" not in str(refused.value)  # secrets stay out
    if "TOKEN" in field:
        assert "16 or more characters" in refused.value.fix and "secrets.token_hex" in refused.value.fix


def test_a_short_token_in_the_tokens_file_is_named_by_file_and_line(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice=alice-token-ok-012345\n# a comment\nbob=bob-short\n")
    with pytest.raises(SettingsError) as refused:
        Settings.from_env({"ETRAIN_API_TOKENS_FILE": str(tokens)})
    assert refused.value.message.startswith(f"{tokens}:3: the token of tenant 'bob' has 9 characters")
    assert refused.value.field == "ETRAIN_API_TOKENS_FILE"


# -- event streams: a tenant's cap, over a real server ------------------------------------------------------------


@pytest.fixture
def stream_server(tmp_path, store):
    manager = InMemoryManager(store, base_dir=str(tmp_path))  # no simulated progress: streams stay open
    app = create_app(
        Settings(data_dir=tmp_path, api_token=ADMIN_TOKEN, api_tokens=TENANTS, tenant_max_streams=2), manager=manager
    )
    with serve_app(app) as url:
        yield url, app


def open_stream(stack: ExitStack, http: httpx.Client, job_id: str) -> httpx.Response:
    response = stack.enter_context(
        http.stream("GET", f"/v1/jobs/{job_id}/events", params={"follow": "true", "timeout_s": 30})
    )
    if response.status_code == 200:
        response.lines = response.iter_lines()  # kept: a dropped line iterator closes the connection
        assert next(response.lines) == "retry: 2000"  # the stream is running on the server
    else:
        response.read()
    return response


def test_a_tenant_may_hold_only_its_cap_of_streams_and_others_are_unaffected(stream_server):
    url, app = stream_server
    with client(url, ALICE) as alice, client(url, BOB) as bob, client(url, ADMIN_TOKEN) as admin, ExitStack() as stack:
        alices = alice.post("/v1/jobs", json=spec("alices")).json()["id"]
        bobs = bob.post("/v1/jobs", json=spec("bobs")).json()["id"]
        assert [open_stream(stack, alice, alices).status_code for _ in range(2)] == [200, 200]
        refused = open_stream(stack, alice, alices)
        body = assert_too_many(
            refused,
            {
                "name": "max_streams",
                "setting": "ETRAIN_TENANT_MAX_STREAMS",
                "tenant": "alice",
                "limit": 2,
                "used": 2,
                "requested": 1,
            },
            retry_after=5,
        )
        assert body["message"] == (
            "tenant 'alice' may follow at most 2 event streams at once (ETRAIN_TENANT_MAX_STREAMS=2) and has 2 open."
        )
        assert app.state.fair_use.streams.held("alice") == 2
        # the cap is alice's: bob streams, the admin streams as much as it likes, alice's plain reads work
        assert open_stream(stack, bob, bobs).status_code == 200
        assert [open_stream(stack, admin, alices).status_code for _ in range(3)] == [200, 200, 200]
        assert alice.get(f"/v1/jobs/{alices}").status_code == 200
        assert alice.get(f"/v1/jobs/{alices}/events").status_code == 200  # no follow: not a stream
        # another tenant's job stays a 404 (the same answer as a missing job), never a 429 that tells it apart
        assert bob.get(f"/v1/jobs/{alices}/events", params={"follow": "true"}).status_code == 404
    # every stream closed by its client: alice's slots come back
    deadline = time.monotonic() + 5
    while app.state.fair_use.streams.held("alice"):
        assert time.monotonic() < deadline, "closed streams kept their slots"
        time.sleep(0.02)
    with client(url, ALICE) as alice, ExitStack() as stack:
        assert [open_stream(stack, alice, alices).status_code for _ in range(2)] == [200, 200]


def test_a_stream_that_ends_gives_its_slot_back(tmp_path, store):
    manager = InMemoryManager(store, base_dir=str(tmp_path))
    app = create_app(
        Settings(data_dir=tmp_path, api_token=ADMIN_TOKEN, api_tokens=TENANTS, tenant_max_streams=1), manager=manager
    )
    with serve_app(app) as url, client(url, ALICE) as alice:
        job_id = alice.post("/v1/jobs", json=spec("short")).json()["id"]
        for _ in range(3):  # each stream closes itself at its time limit; the next one is accepted
            response = alice.get(f"/v1/jobs/{job_id}/events", params={"follow": "true", "timeout_s": 0.2})
            assert response.status_code == 200 and response.text.startswith("retry: 2000")
        assert app.state.fair_use.streams.held("alice") == 0


# -- plans: a tenant's cap on planner work at once, over a real server ------------------------------------------------


class SlowPlans(InMemoryManager):
    """Plans of tenant alice wait for ``go``: the test holds them in flight."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.go = threading.Event()
        self.planning = 0
        self.submits_planned = 0

    def plan(self, spec: JobSpec, *, principal: Principal = ADMIN) -> dict[str, Any]:
        if principal.tenant == "alice":
            self.planning += 1
            assert self.go.wait(timeout=20)
        return super().plan(spec, principal=principal)


def test_a_tenant_may_compute_only_its_cap_of_plans_at_once(tmp_path, store):
    manager = SlowPlans(store, base_dir=str(tmp_path))
    app = create_app(
        Settings(data_dir=tmp_path, api_token=ADMIN_TOKEN, api_tokens=TENANTS, tenant_max_plans=2), manager=manager
    )
    with serve_app(app) as url, client(url, ALICE) as alice, client(url, BOB) as bob, client(url, ADMIN_TOKEN) as admin:
        answers: list[httpx.Response] = []
        threads = [
            threading.Thread(target=lambda: answers.append(alice.post("/v1/plan", json=spec()))) for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while manager.planning < 2:
            assert time.monotonic() < deadline, "the two plans never started"
            time.sleep(0.01)
        third = alice.post("/v1/plan", json=spec())
        body = assert_too_many(
            third,
            {
                "name": "max_plans",
                "setting": "ETRAIN_TENANT_MAX_PLANS",
                "tenant": "alice",
                "limit": 2,
                "used": 2,
                "requested": 1,
            },
            retry_after=1,
        )
        assert body["message"] == (
            "tenant 'alice' may have at most 2 plans computed at once (ETRAIN_TENANT_MAX_PLANS=2) and has 2 running."
        )
        # refused before the body is read: a refusal costs the server no parsing (this one is not even JSON)
        unread = alice.post("/v1/plan", content=b"{not json", headers={"content-type": "application/json"})
        assert unread.status_code == 429 and unread.json()["quota"]["name"] == "max_plans"
        # a submit whose layout the planner must search takes a plan slot too; an explicit layout does not
        auto = alice.post("/v1/jobs", json=spec("auto", parallelism=AUTO, resources={}))
        assert auto.status_code == 429 and auto.json()["quota"]["name"] == "max_plans"
        assert alice.post("/v1/jobs", json=spec("explicit")).status_code == 201
        # other tenants and the admin are not held up by alice's plans
        assert bob.post("/v1/plan", json=spec()).status_code == 200
        assert admin.post("/v1/plan", json=spec()).status_code == 200
        manager.go.set()
        for thread in threads:
            thread.join(timeout=20)
        assert [r.status_code for r in answers] == [200, 200]
        assert app.state.fair_use.plans.held("alice") == 0
        assert alice.post("/v1/plan", json=spec()).status_code == 200
        assert alice.post("/v1/jobs", json=spec("auto", parallelism=AUTO, resources={})).status_code == 201


def test_plans_run_in_a_planner_process_and_a_dead_one_is_replaced():
    manager_module = pytest.importorskip("etrain.service.manager")
    processes = manager_module.PlannerProcesses(1)
    processes.warm()  # started without waiting (`etrain serve` does it at start-up)
    worker = processes.run(os.getpid)
    assert worker != os.getpid()  # off the API's process: a plan never holds its interpreter
    assert processes.run(os.getpid) == worker  # one process, kept
    os.kill(worker, signal.SIGINT)  # Ctrl-C at a terminal reaches the whole process group: ignored
    time.sleep(0.2)
    assert processes.run(os.getpid) == worker
    os.kill(worker, signal.SIGKILL)  # as the kernel's OOM killer would
    assert processes.run(os.getpid) == os.getpid()  # the pool is broken: this one call runs here
    replacement = processes.run(os.getpid)
    assert replacement not in (worker, os.getpid())
    processes.close()
    in_process = manager_module.PlannerProcesses(0)
    assert in_process.run(os.getpid) == os.getpid()  # ETRAIN_PLAN_WORKERS=0
    in_process.close()


def test_a_planner_process_runs_below_the_api_and_ends_with_the_process_that_started_it(tmp_path):
    """Its parent SIGKILLed (no clean-up runs), the worker exits too instead of lingering."""
    code = (
        "import multiprocessing, os, sys\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "from etrain.service.planning import planner\n"
        "context = multiprocessing.get_context('spawn')\n"
        "pool = ProcessPoolExecutor(1, mp_context=context, initializer=planner.worker_init)\n"
        "print(pool.submit(os.getpid).result(), pool.submit(os.nice, 0).result(), os.nice(0), flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    worker, worker_nice, parent_nice = (int(word) for word in done.stdout.split())
    assert worker_nice == parent_nice + 10
    deadline = time.monotonic() + 10
    while Path(f"/proc/{worker}").exists() and "Z" not in _state(worker):
        assert time.monotonic() < deadline, "the planner process outlived the process that started it"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return "gone"


def test_tenant_slots_are_per_tenant_released_once_and_free_for_the_admin():
    slots = TenantSlots("max_plans", 1)
    alice = Principal("alice")
    release = slots.acquire(alice)
    with pytest.raises(QuotaExceeded) as refused:
        slots.acquire(alice)
    assert (refused.value.quota, refused.value.used, refused.value.retry_after_s) == ("max_plans", 1, 1)
    with slots.slot(Principal("bob")):
        assert slots.held("bob") == 1
    for _ in range(10):
        slots.acquire(ADMIN)  # never counted
    release()
    release()  # a second call gives nothing back twice
    assert slots.held("alice") == 0
    with slots.slot(alice):
        assert slots.held("alice") == 1
    assert TenantSlots("max_streams", None).acquire(alice) is not None  # no limit


# -- quotas through the real JobManager: jobs (checked before planning), workers on scale, priorities -----------------


@pytest.fixture
def real(tmp_path):
    manager_module = pytest.importorskip("etrain.service.manager")  # imports Ray (never started: FakeRuntime)

    def make(**settings: Any):
        values = {
            "data_dir": tmp_path,
            "api_token": ADMIN_TOKEN,
            "api_tokens": TENANTS,
            "poll_interval_s": 0.05,
            **settings,
        }
        manager = manager_module.JobManager(
            Settings(**values), runtime=FakeRuntime(steps_per_update=0), base_dir=str(tmp_path)
        )
        made.append(manager)
        app = create_app(manager.settings, manager=manager)
        return manager, {
            who: TestClient(app, headers=bearer(token), raise_server_exceptions=False)
            for who, token in {"admin": ADMIN_TOKEN, **TENANTS}.items()
        }

    made: list[Any] = []
    yield make
    for manager in made:
        manager.close()


def test_scale_counts_against_the_worker_quota(real):
    manager, clients = real(tenant_max_workers=3)
    alice, admin = clients["alice"], clients["admin"]
    big = alice.post("/v1/jobs", json=spec("big", parallelism={"dp": 2})).json()["id"]
    small = alice.post("/v1/jobs", json=spec("small")).json()["id"]  # 3 of 3 workers

    refused = alice.post(f"/v1/jobs/{small}/scale", json={"dp": 2})
    body = assert_too_many(
        refused,
        {
            "name": "max_workers",
            "setting": "ETRAIN_TENANT_MAX_WORKERS",
            "tenant": "alice",
            "limit": 3,
            "used": 3,
            "requested": 1,
        },
        retry_after=30,
    )
    assert body["message"] == (
        f"tenant 'alice' may hold at most 3 workers (ETRAIN_TENANT_MAX_WORKERS=3); its "
        f"unfinished jobs hold 3 and dp=2 adds 1 ranks to job {small}, 4 in all."
    )
    assert body["detail"][0]["field"] == "dp" and body["fix"].startswith("scale to at most dp=1 ")
    assert "scale_requested" not in [e["kind"] for e in alice.get(f"/v1/jobs/{small}/events").json()["events"]]

    # shrinking is always allowed, and frees the room once the job runs at its new size
    assert alice.post(f"/v1/jobs/{big}/scale", json={"dp": 1}).status_code == 202
    deadline = time.monotonic() + 10
    while alice.get(f"/v1/jobs/{big}").json()["world_size"] != 1:
        assert time.monotonic() < deadline, "the scale never reached the job"
        time.sleep(0.05)
    assert alice.post(f"/v1/jobs/{small}/scale", json={"dp": 2}).status_code == 202
    # the admin is not held to the tenant's quota
    assert admin.post(f"/v1/jobs/{big}/scale", json={"dp": 4}).status_code == 202


def test_an_elastic_job_that_shrank_still_counts_at_its_grant_and_grows_back_only_to_it(real):
    """A tenant's elastic job that lost capacity runs smaller than it was admitted at: the quota keeps
    counting its grant (it grows back to it by itself), so another submit cannot take those ranks; and its
    supervisor starts with the grant as its ceiling, so capacity alone never takes it past the quota."""
    manager, clients = real(tenant_max_workers=3)
    alice, admin = clients["alice"], clients["admin"]
    elastic = alice.post("/v1/jobs", json=spec("elastic", parallelism={"dp": 2})).json()["id"]  # may grow to 4
    policy = manager.runtime.jobs[elastic]["policy"]
    assert (policy.max_dp, policy.grow_limit_dp) == (4, 2)  # the quota's grant, not max_dp
    manager.store.update_job(elastic, world_size=1)  # capacity went: the supervisor shrank it to dp=1
    refused = alice.post("/v1/jobs", json=spec("more", parallelism={"dp": 2}))
    assert refused.status_code == 429 and refused.json()["quota"]["used"] == 2, refused.text
    assert alice.post("/v1/jobs", json=spec("one")).status_code == 201  # 2 granted + 1 = 3 of 3
    # an accepted scale moves the grant; the supervisor gets the new target with the scale itself
    assert alice.post(f"/v1/jobs/{elastic}/scale", json={"dp": 1}).status_code == 202
    assert manager.store.get_job(elastic).granted_workers == 1
    # the admin's jobs are not held to a tenant's quota: no ceiling below max_dp
    unlimited = admin.post("/v1/jobs", json=spec("admins", parallelism={"dp": 2})).json()["id"]
    assert manager.runtime.jobs[unlimited]["policy"].grow_limit_dp is None


def test_without_a_worker_quota_an_elastic_job_grows_to_max_dp(real):
    manager, clients = real()
    job = clients["alice"].post("/v1/jobs", json=spec("free", parallelism={"dp": 2})).json()["id"]
    assert manager.runtime.jobs[job]["policy"].grow_limit_dp is None


def test_concurrent_scales_cannot_both_take_the_last_workers(tmp_path, store):
    quotas = TenantQuotas(max_jobs=None, max_workers=4)
    for job_id in ("a", "b"):
        store.create_job(job_id=job_id, name=job_id, spec={}, world_size=1, layout="dp1", tenant="alice", priority=0)
    alice = Principal("alice")
    quotas.admit_scale(alice, store.get_job("a"), 3, 1, store)  # 3 + 1 = 4: let through; the row still says 1
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit_scale(alice, store.get_job("b"), 2, 1, store)
    assert (refused.value.used, refused.value.requested, refused.value.dp_fits) == (4, 1, 1)
    with pytest.raises(QuotaExceeded):  # a submit counts the pending scale too
        quotas.admit(alice, "c", 1, store)
    quotas.admit_scale(Principal("bob"), store.get_job("b"), 2, 1, store)  # not alice's quota


def test_a_tenant_at_its_job_cap_is_refused_before_its_spec_is_planned(real, monkeypatch):
    manager, clients = real(tenant_max_jobs=2)
    alice = clients["alice"]
    for name in ("one", "two"):
        assert alice.post("/v1/jobs", json=spec(name)).status_code == 201
    searched: list[Any] = []
    monkeypatch.setattr(manager._planner, "run", lambda *a, **k: searched.append(a) or pytest.fail("planned"))
    refused = alice.post("/v1/jobs", json=spec("three", parallelism=AUTO, resources={}))
    assert_too_many(
        refused,
        {
            "name": "max_jobs",
            "setting": "ETRAIN_TENANT_MAX_JOBS",
            "tenant": "alice",
            "limit": 2,
            "used": 2,
            "requested": 1,
        },
        retry_after=30,
    )
    # an invalid spec is not even validated: the cap answers first
    bad = alice.post("/v1/jobs", json=spec("bad", training={"steps": 5, "global_batch": 7, "micro_batch": 2}))
    assert bad.status_code == 429
    assert searched == [] and len(alice.get("/v1/jobs").json()["jobs"]) == 2


def test_the_default_job_cap_holds_a_tenant_to_20_unfinished_jobs(real):
    manager, clients = real()  # no quota given: the default
    alice, bob = clients["alice"], clients["bob"]
    assert [alice.post("/v1/jobs", json=spec(f"j{n}")).status_code for n in range(20)] == [201] * 20
    assert alice.post("/v1/jobs", json=spec("j20")).json()["quota"]["limit"] == 20
    assert bob.post("/v1/jobs", json=spec("bobs")).status_code == 201


def test_a_tenant_sets_priority_only_within_its_range(real):
    manager, clients = real(tenant_priorities={"bob": (-10, 500)})
    alice, bob, admin = clients["alice"], clients["bob"], clients["admin"]
    refused = alice.post("/v1/jobs", json=spec("urgent", priority=1000))
    assert refused.status_code == 403
    setting = "ETRAIN_TENANT_MIN_PRIORITY=0, ETRAIN_TENANT_MAX_PRIORITY=100"
    assert refused.json() == {
        "error": "priority_not_allowed",
        "message": f"priority=1000 is outside the range tenant 'alice' may use: 0..100 ({setting}).",
        "fix": "submit with a priority in 0..100 (omitted: 0), or ask the operator to widen the range "
        "(ETRAIN_TENANT_PRIORITIES=alice=MIN..MAX)",
        "detail": [{"field": "priority", "message": refused.json()["message"], "fix": refused.json()["fix"]}],
        "priority": {"tenant": "alice", "requested": 1000, "min": 0, "max": 100, "setting": setting},
    }
    assert alice.post("/v1/jobs", json=spec("low", priority=-1)).status_code == 403
    assert alice.post("/v1/jobs", json=spec("top", priority=100)).json()["priority"] == 100
    # bob's own range, and the admin may use any priority the spec allows
    assert bob.post("/v1/jobs", json=spec("b1", priority=500)).status_code == 201
    over = bob.post("/v1/jobs", json=spec("b2", priority=501))
    assert over.status_code == 403 and over.json()["priority"]["setting"] == "ETRAIN_TENANT_PRIORITIES=bob=-10..500"
    assert admin.post("/v1/jobs", json=spec("ops", priority=1000)).json()["priority"] == 1000
    assert sorted(job["name"] for job in admin.get("/v1/jobs").json()["jobs"]) == ["b1", "ops", "top"]


# -- /healthz: cached, and minimal without a token ---------------------------------------------------------------------


class CountingHealth(InMemoryManager):
    """A health report that takes ``delay_s`` (or waits for ``gate``) and names a node's IP in Ray's
    resources, as Ray's does."""

    delay_s = 0.0

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.probes = 0
        self.healthy = True
        self.gate: threading.Event | None = None

    def health(self) -> dict[str, Any]:
        self.probes += 1
        time.sleep(self.delay_s)
        if self.gate is not None:
            assert self.gate.wait(timeout=20)
        return {
            "db": "ok",
            "ray": "ok" if self.healthy else "unavailable: 10.1.2.3:6379 refused",
            "nodes": 1,
            "resources": {"CPU": 4.0, "node:10.1.2.3": 1.0},
        }


def test_anonymous_healthz_says_only_ok_and_a_token_sees_the_report(tmp_path, store):
    manager = CountingHealth(store, base_dir=str(tmp_path))
    app = create_app(
        Settings(data_dir=tmp_path, api_token=ADMIN_TOKEN, api_tokens=TENANTS, health_cache_s=0), manager=manager
    )
    anonymous = TestClient(app).get("/healthz")
    assert (anonymous.status_code, anonymous.json()) == (200, {"ok": True, "status": "ok"})
    for token in (ALICE, ADMIN_TOKEN):
        full = TestClient(app, headers=bearer(token)).get("/healthz").json()
        assert full["resources"] == {"CPU": 4.0, "node:10.1.2.3": 1.0} and full["ok"] is True
    wrong = TestClient(app, headers=bearer("not-a-token-0123456789")).get("/healthz")
    assert (wrong.status_code, wrong.json()["error"]) == (401, "unauthorized")
    manager.healthy = False
    down = TestClient(app).get("/healthz")
    assert (down.status_code, down.json()) == (503, {"ok": False, "status": "unavailable"})
    assert "10.1.2.3" not in down.text


def test_healthz_probes_once_per_interval_however_many_ask(tmp_path, store):
    manager = CountingHealth(store, base_dir=str(tmp_path))
    manager.delay_s = 0.2  # a slow Ray
    app = create_app(Settings(data_dir=tmp_path, api_token=ADMIN_TOKEN, health_cache_s=0.5), manager=manager)
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=5) as anonymous:
        answers: list[int] = []
        threads = [
            threading.Thread(target=lambda: answers.append(anonymous.get("/healthz").status_code)) for _ in range(20)
        ]  # they all wait for the first probe, and share it
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        assert answers == [200] * 20 and manager.probes == 1
        time.sleep(0.6)  # stale now
        manager.gate = threading.Event()  # the next probe hangs, as on a Ray that does not answer
        assert [anonymous.get("/healthz").status_code for _ in range(5)] == [200] * 5  # none waits for it
        deadline = time.monotonic() + 5
        while manager.probes < 2:
            assert time.monotonic() < deadline, "the stale report was never refreshed"
            time.sleep(0.01)
        assert manager.probes == 2  # one probe in flight for all of them
        manager.gate.set()


def test_health_cache_serves_fresh_then_stale_and_reports_a_stuck_probe():
    now = [100.0]
    probes: list[float] = []
    release = threading.Event()

    def probe() -> dict[str, Any]:
        probes.append(now[0])
        if len(probes) > 1:
            release.wait(timeout=10)  # the second probe hangs until the test lets it go
        return {"ok": True, "db": "ok", "ray": "ok", "n": len(probes)}

    cache = HealthCache(probe, ttl_s=2.0, stuck_s=30.0, clock=lambda: now[0])

    async def scenario() -> None:
        first = await asyncio.gather(*(cache.get() for _ in range(20)))
        assert {report["n"] for report, _ in first} == {1} and len(probes) == 1
        now[0] += 1.0
        assert (await cache.get()) == ({"ok": True, "db": "ok", "ray": "ok", "n": 1}, 1.0) and len(probes) == 1
        now[0] += 2.0  # stale: the old report at once, one probe started (it hangs)
        assert (await cache.get())[0]["n"] == 1
        await asyncio.sleep(0.05)
        assert len(probes) == 2
        assert (await cache.get())[0]["n"] == 1 and len(probes) == 2  # no second probe while one is in flight
        now[0] += 40.0  # the probe still hangs: a failure, not the old "ok"
        stuck, age = await cache.get()
        assert stuck["ok"] is False and "no answer from the health probe for 43 s" in stuck["health"] and age == 43.0

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    release.set()


# -- low items: a tenant's malformed drill is 403; OPTIONS and 405 name every method ----------------------------------


@pytest.fixture
def tenant_app(tmp_path, store):
    manager = InMemoryManager(store, base_dir=str(tmp_path), enable_chaos=True)
    app = create_app(
        Settings(data_dir=tmp_path, api_token=ADMIN_TOKEN, api_tokens=TENANTS, enable_chaos=True), manager=manager
    )
    return app, manager


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe", b"[]", b'{"action": 5}'])
def test_a_tenants_malformed_drill_is_403_before_any_validation(tenant_app, body):
    app, manager = tenant_app
    alice, bob, admin = (
        TestClient(app, headers=bearer(t), raise_server_exceptions=False) for t in (ALICE, BOB, ADMIN_TOKEN)
    )
    job_id = alice.post("/v1/jobs", json=spec()).json()["id"]
    headers = {"content-type": "application/json"}
    own = alice.post(f"/v1/jobs/{job_id}/chaos", content=body, headers=headers)
    assert (own.status_code, own.json()["error"]) == (403, "admin_only")
    theirs = bob.post(f"/v1/jobs/{job_id}/chaos", content=body, headers=headers)
    assert (theirs.status_code, theirs.json()["error"]) == (404, "job_not_found")
    assert theirs.text == bob.post("/v1/jobs/nosuch-00000000/chaos", content=body, headers=headers).text.replace(
        "nosuch-00000000", job_id
    )
    assert admin.post(f"/v1/jobs/{job_id}/chaos", content=body, headers=headers).status_code == 422  # validation
    assert manager.chaos_orders == []


def test_a_malformed_drill_on_a_server_without_chaos_is_403_for_everyone(tmp_path, store):
    app = create_app(
        Settings(data_dir=tmp_path, api_token=ADMIN_TOKEN, api_tokens=TENANTS),
        manager=InMemoryManager(store, base_dir=str(tmp_path)),
    )
    for token in (ALICE, ADMIN_TOKEN):
        response = TestClient(app, headers=bearer(token)).post(
            "/v1/jobs/any-job/chaos", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert (response.status_code, response.json()["error"]) == (403, "chaos_disabled")


@pytest.mark.parametrize(
    ("path", "allow"),
    [
        ("/v1/jobs", "GET, OPTIONS, POST"),
        ("/v1/jobs/some-job", "GET, OPTIONS"),
        ("/v1/jobs/some-job/scale", "OPTIONS, POST"),
        ("/v1/plan", "OPTIONS, POST"),
    ],
)
def test_options_and_405_name_every_method_of_the_path(tenant_app, path, allow):
    app, _ = tenant_app
    alice = TestClient(app, headers=bearer(ALICE), raise_server_exceptions=False)
    options = alice.options(path)
    assert (options.status_code, options.headers["allow"], options.content) == (204, allow, b"")
    refused = alice.delete(path)
    assert (refused.status_code, refused.headers["allow"], refused.json()["error"]) == (
        405,
        allow,
        "method_not_allowed",
    )
    assert refused.json()["message"] == f"DELETE is not allowed on {path}; allowed: {allow}"
    assert TestClient(app).options(path).status_code == 401  # still behind the token


def test_the_openapi_document_declares_the_new_answers(tenant_app):
    app, _ = tenant_app
    paths = app.openapi()["paths"]
    for path, method in (
        ("/v1/plan", "post"),
        ("/v1/jobs/{job_id}/events", "get"),
        ("/v1/jobs/{job_id}/scale", "post"),
        ("/v1/jobs", "post"),
    ):
        answer = paths[path][method]["responses"]["429"]
        assert "Retry-After" in answer["headers"], (path, method)
    assert "403" in paths["/v1/jobs"]["post"]["responses"] and "401" in paths["/healthz"]["get"]["responses"]


def test_the_fair_use_errors_survive_pickling():
    import pickle

    from etrain.service.errors import PriorityNotAllowed

    scale = pickle.loads(
        pickle.dumps(
            QuotaExceeded("max_workers", tenant="alice", limit=4, used=4, requested=2, job_id="job-1", dp=3, dp_fits=1)
        )
    )
    assert (scale.job_id, scale.dp, scale.dp_fits, scale.field) == ("job-1", 3, 1, "dp")
    refused = pickle.loads(pickle.dumps(PriorityNotAllowed(tenant="bob", priority=7, low=0, high=5, setting="S")))
    assert refused.to_dict() == {"tenant": "bob", "requested": 7, "min": 0, "max": 5, "setting": "S"}
