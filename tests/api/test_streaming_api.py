"""The event stream, the logs route and the CLI commands on them, over the named fakes: the REAL
streaming code (api/sse.py) against ``InMemoryManager``, the REAL ``JobManager.logs`` against real
rank log files, and ``etrain watch / logs / cancel`` against a real uvicorn server."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from etrain.api import sse
from etrain.api.app import create_app
from etrain.api.cli import watch as cli_watch
from etrain.api.cli.watch import sse_messages
from etrain.service.access.tenancy import ADMIN
from etrain.service.settings import Settings
from etrain.service.store.job_store import JobStore
from etrain.service.store.records import JobStatus
from etrain.workers.rank.rank_log import RankLog, rank_log_path
from tests.api.test_cli import etrain as etrain_as
from tests.api.test_cli import serving, submitted_id, write_spec
from tests.fakes import FakeRuntime, InMemoryManager, simulated_loss

TOKEN = "stream-test-token"
SPEC = {
    "name": "tiny",
    "model": {"preset": "gpt-tiny"},
    "parallelism": {"dp": 2},
    "training": {"steps": 10, "global_batch": 8, "micro_batch": 2},
}


@pytest.fixture
def store(tmp_path):
    with JobStore(tmp_path / "etrain.db") as store:
        yield store


def client_for(tmp_path, manager) -> TestClient:
    app = create_app(Settings(data_dir=tmp_path, api_token=TOKEN), manager=manager)
    return TestClient(app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {TOKEN}"})


def stream(client: TestClient, job_id: str, **params) -> list[tuple[str, str | None, str]]:
    headers = {k.replace("_", "-"): str(v) for k, v in params.pop("headers", {}).items()}
    with client.stream(
        "GET", f"/v1/jobs/{job_id}/events", params={"follow": "true", **params}, headers=headers
    ) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        return list(sse_messages(response.iter_lines()))


def test_the_stream_sends_status_events_steps_and_ends_with_the_job(tmp_path, store):
    manager = InMemoryManager(store, base_dir=str(tmp_path), steps_per_poll=4)  # each poll trains 4 steps
    client = client_for(tmp_path, manager)
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    messages = stream(client, job_id, steps="true")
    kinds = [kind for kind, _, _ in messages]
    assert kinds[0] == "status" and kinds[-1] == "end" and kinds.count("end") == 1
    events = [json.loads(data) for kind, _, data in messages if kind == "message"]
    assert events == client.get(f"/v1/jobs/{job_id}/events").json()["events"]
    assert [int(i) for kind, i, _ in messages if kind == "message"] == [e["seq"] for e in events]
    steps = [json.loads(data) for kind, _, data in messages if kind == "step"]
    assert [(s["step"], s["loss"]) for s in steps] == [(n, simulated_loss(n)) for n in range(1, 11)]
    end = json.loads(messages[-1][2])
    assert (end["id"], end["status"], end["step"]) == (job_id, "SUCCEEDED", 10)


def test_last_event_id_overrides_since_and_a_bad_one_is_422(tmp_path, store):
    manager = InMemoryManager(store, base_dir=str(tmp_path))
    client = client_for(tmp_path, manager)
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    manager.advance(job_id, 10)  # finished: 5 events (submitted, started, 2 checkpoints, succeeded)
    resumed = stream(client, job_id, since=1, headers={"Last_Event_ID": 3})
    assert [int(i) for kind, i, _ in resumed if kind == "message"] == [4, 5]
    bad = client.get(f"/v1/jobs/{job_id}/events", params={"follow": "true"}, headers={"Last-Event-ID": "x"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "Last-Event-ID"
    too_long = client.get(f"/v1/jobs/{job_id}/events", params={"follow": "true", "timeout_s": 3601})
    assert too_long.status_code == 422 and too_long.json()["detail"][0]["field"] == "timeout_s"


def test_an_idle_stream_sends_keepalives_and_closes_at_its_time_limit(tmp_path, store):
    manager = InMemoryManager(store, base_dir=str(tmp_path))  # no simulated progress: the job stays RUNNING
    job_id = manager.submit(
        __import__("etrain.service.planning.spec", fromlist=["JobSpec"]).JobSpec.model_validate(SPEC)
    ).id

    async def collect() -> list[str]:
        chunks = []
        async for chunk in sse.job_event_stream(manager, job_id, ADMIN, poll_s=0.01, keepalive_s=0.05, max_s=0.3):
            chunks.append(chunk)
        return chunks

    chunks = asyncio.run(asyncio.wait_for(collect(), timeout=10))
    text = "".join(chunks)
    assert chunks[0] == "retry: 2000\n\n"
    assert text.count(": keepalive\n\n") >= 3 and "event: end" not in text
    assert text.count("event: status") == 1 and "id: 2\n" in text


def test_another_tenants_job_is_404_for_the_stream_too(tmp_path, store):
    manager = InMemoryManager(store, base_dir=str(tmp_path))
    app = create_app(
        Settings(data_dir=tmp_path, api_token=TOKEN, api_tokens={"alice": "alice-token-0123456789"}), manager=manager
    )
    alice = TestClient(app, headers={"Authorization": "Bearer alice-token-0123456789"})
    job_id = TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}).post("/v1/jobs", json=SPEC).json()["id"]
    response = alice.get(f"/v1/jobs/{job_id}/events", params={"follow": "true"})
    assert response.status_code == 404 and response.json()["error"] == "job_not_found"
    assert alice.get(f"/v1/jobs/{job_id}/logs").status_code == 404


# -- logs: the real JobManager reading real rank log files ------------------------------------------------


@pytest.fixture
def real_manager(tmp_path):
    manager_module = pytest.importorskip("etrain.service.manager")  # imports Ray (not started)
    # The poller sleeps for the whole test: jobs stay exactly as the test leaves them in the store.
    settings = Settings(data_dir=tmp_path, api_token=TOKEN, poll_interval_s=3600)
    manager = manager_module.JobManager(settings, runtime=FakeRuntime(), base_dir=str(tmp_path))
    yield manager
    manager.close()


def stored_job(manager, job_id: str, *, attempt: int) -> str:
    manager.store.create_job(job_id=job_id, name="logged", spec=SPEC, world_size=2)
    manager.store.update_job(job_id, attempt=attempt, status=JobStatus.RUNNING if attempt else JobStatus.QUEUED)
    return job_id


def test_logs_are_read_from_the_rank_log_file(tmp_path, real_manager):
    job_id = stored_job(real_manager, "logged-1", attempt=1)
    root = real_manager._checkpoint_path(real_manager.store.get_job(job_id))
    assert root == str((tmp_path / "checkpoints" / job_id).resolve())
    log = RankLog(rank_log_path(root, job_id, 1))
    for n in range(1, 6):
        log.write(f"step {n}/10 loss {simulated_loss(n):.4f}")
    log.close()
    client = client_for(tmp_path, real_manager)
    body = client.get(f"/v1/jobs/{job_id}/logs", params={"rank": 1, "tail": 2}).json()
    assert [line.split(" ", 1)[1] for line in body["lines"]] == [
        f"step 4/10 loss {simulated_loss(4):.4f}",
        f"step 5/10 loss {simulated_loss(5):.4f}",
    ]
    assert body["next_offset"] == (tmp_path / "checkpoints" / job_id / "logs" / job_id / "rank1.log").stat().st_size
    assert (
        client.get(f"/v1/jobs/{job_id}/logs", params={"rank": 1, "offset": body["next_offset"]}).json()["lines"] == []
    )
    # rank 0 ran but wrote nothing yet: an empty answer, not an error
    assert client.get(f"/v1/jobs/{job_id}/logs").json() == {"job_id": job_id, "rank": 0, "lines": [], "next_offset": 0}


def test_logs_of_an_unknown_rank_are_404_and_of_a_job_not_started_409(tmp_path, real_manager):
    started = stored_job(real_manager, "logged-2", attempt=1)
    queued = stored_job(real_manager, "logged-3", attempt=0)
    client = client_for(tmp_path, real_manager)
    unknown = client.get(f"/v1/jobs/{started}/logs", params={"rank": 2})
    assert (unknown.status_code, unknown.json()["error"]) == (404, "rank_not_found")
    assert unknown.json()["message"] == f"job {started} has no rank 2: its world has 2 rank(s)."
    waiting = client.get(f"/v1/jobs/{queued}/logs")
    assert waiting.status_code == 409
    assert waiting.json()["message"] == f"job {queued} has not started yet (QUEUED): no rank has written a log."
    assert waiting.json()["detail"][0] == {
        "field": "rank",
        "message": waiting.json()["message"],
        "fix": f"wait until it runs (`etrain watch {queued}`)",
    }
    for params, field in (
        ({"tail": 0}, "tail"),
        ({"tail": 10_001}, "tail"),
        ({"rank": -1}, "rank"),
        ({"offset": -1}, "offset"),
    ):
        response = client.get(f"/v1/jobs/{started}/logs", params=params)
        assert response.status_code == 422 and response.json()["detail"][0]["field"] == field


# -- the CLI ------------------------------------------------------------------------------------------------


@pytest.fixture
def url(tmp_path, store):
    manager = InMemoryManager(store, base_dir=str(tmp_path), steps_per_poll=4)
    with serving(manager, tmp_path, api_token=TOKEN) as url:
        yield url


def etrain(url: str, *args: str):
    return etrain_as(url, *args, token=TOKEN)


def test_etrain_logs_prints_the_tail_and_follows_to_the_end(url, tmp_path):
    job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))
    tail = etrain(url, "logs", job_id, "--tail", "2")
    assert tail.code == 0 and tail.out.splitlines() == [
        "attempt 1: rank 0/2 on 127.0.0.1, layout pp1·dp2·tp1 zero=0, fresh start"
    ]
    followed = etrain(url, "logs", job_id, "--rank", "1", "-f", "--interval", "0.05")
    lines = followed.out.splitlines()
    assert followed.code == 0, followed
    assert lines[0].startswith("attempt 1: rank 1/2") and len(lines) == 11
    assert [line.split()[1] for line in lines[1:]] == [f"{n}/10" for n in range(1, 11)]
    missing = etrain(url, "logs", job_id, "--rank", "7")
    assert missing.code == 1 and missing.err.splitlines()[0] == ("error (HTTP 404, rank_not_found):")
    assert "fix: ask for a rank in 0..1" in missing.err


def test_etrain_cancel_waits_for_the_end_unless_told_not_to(url, tmp_path):
    job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))
    assert etrain(url, "cancel", job_id).out == f"{job_id}: CANCELLED\n"
    other = submitted_id(etrain(url, "submit", str(write_spec(tmp_path, "other"))))
    quick = etrain(url, "--json", "cancel", other, "--no-wait")
    assert quick.code == 0 and json.loads(quick.out)["status"] == "CANCELLED"


def test_etrain_watch_follows_the_event_stream(url, tmp_path):
    job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))
    watched = etrain(url, "watch", job_id, "--every", "5")
    lines = watched.out.splitlines()
    assert watched.code == 0, watched
    assert lines[0] == "status: RUNNING"
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["5/10", "10/10"]
    assert [line.split("] ", 1)[1] for line in lines if line.startswith("[")] == [
        "submitted: accepted",
        "started: attempt 1 running",
        "checkpoint: committed step 5",
        "checkpoint: committed step 10",
        "succeeded: finished 10 steps",
    ]
    assert [line for line in lines if line.startswith("status: ")] == ["status: RUNNING", "status: SUCCEEDED"]
    assert lines[-1] == f"job {job_id} SUCCEEDED at step 10/10, loss {simulated_loss(10):.4f}"


def test_watch_falls_back_to_polling_a_server_without_a_stream(url, tmp_path, monkeypatch):
    job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))

    def no_stream(*args, **kwargs):
        raise cli_watch._NoStream()

    monkeypatch.setattr(cli_watch, "_follow_stream", no_stream)
    watched = etrain(url, "watch", job_id, "--interval", "0.05")
    assert watched.code == 0 and watched.out.splitlines()[-1].startswith(f"job {job_id} SUCCEEDED at step 10/10")
