"""JobStore on a real SQLite file: records in and out, history, durability, concurrency, migrations."""

from __future__ import annotations

import dataclasses
import math
import sqlite3
import threading

import pytest

from etrain.service.errors import JobConflict, JobNotFound, ServiceUnavailable
from etrain.service.store.job_store import JobStore
from etrain.service.store.records import EventRecord, JobRecord, JobStatus, StepRecord
from etrain.service.store.schema import MIGRATIONS, SCHEMA_VERSION, migrate

SPEC = {"name": "tiny", "model": {"preset": "gpt-tiny"}, "training": {"steps": 10, "global_batch": 4}}


class FakeClock:
    """Deterministic time: every reading advances by one second."""

    def __init__(self, start: float = 1_000.0):
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "data" / "etrain.db"


@pytest.fixture
def store(db_path):
    with JobStore(db_path, clock=FakeClock()) as store:
        yield store


def make_job(store: JobStore, job_id: str = "job-1", **kwargs) -> JobRecord:
    return store.create_job(
        job_id=job_id,
        name=kwargs.pop("name", "tiny"),
        spec=kwargs.pop("spec", SPEC),
        world_size=kwargs.pop("world_size", 2),
        **kwargs,
    )


def step(job_id: str, number: int, *, loss: float, attempt: int = 1) -> StepRecord:
    return StepRecord(
        job_id=job_id,
        step=number,
        loss=loss,
        tokens_per_s=1000.0,
        step_s=0.5,
        compute_s=0.4,
        comm_wait_s=0.1,
        ts=2_000.0 + number,
        attempt=attempt,
    )


# -- jobs ---------------------------------------------------------------------------------------------


def test_a_new_job_is_queued_with_its_spec_and_creation_time(store):
    job = make_job(store, layout="pp1·dp2·tp1 zero=0")

    assert job == JobRecord(
        id="job-1",
        name="tiny",
        status=JobStatus.QUEUED,
        spec=SPEC,
        step=0,
        loss=None,
        tokens_per_s=None,
        world_size=2,
        restarts=0,
        created_at=1_001.0,
        updated_at=1_001.0,
        error=None,
        layout="pp1·dp2·tp1 zero=0",
        last_checkpoint_step=None,
        stragglers=[],
        goodput=None,
        attempt=0,
    )
    assert store.get_job("job-1") == job
    assert not job.is_terminal


def test_records_are_frozen(store):
    job = make_job(store)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.status = JobStatus.RUNNING  # type: ignore[misc]


def test_unknown_job_is_none_on_read_and_not_found_on_write(store):
    assert store.get_job("nope") is None
    with pytest.raises(JobNotFound) as raised:
        store.update_job("nope", step=1)
    assert raised.value.job_id == "nope"
    with pytest.raises(JobNotFound):
        store.add_events("nope", [(1.0, "x", {})])
    with pytest.raises(JobNotFound):
        store.add_steps("nope", [step("nope", 1, loss=1.0)])


def test_a_duplicate_job_id_is_a_conflict(store):
    make_job(store)
    with pytest.raises(JobConflict, match="already exists"):
        make_job(store)


def test_update_changes_the_given_fields_and_bumps_updated_at(store):
    make_job(store)
    job = store.update_job(
        "job-1",
        status="RUNNING",
        step=7,
        loss=2.5,
        tokens_per_s=1234.5,
        restarts=1,
        last_checkpoint_step=5,
        stragglers=[{"rank": 3, "factor": 2.1}],
        goodput=0.8,
        attempt=2,
        layout="pp1·dp1·tp1 zero=0",
        world_size=1,
    )
    assert (job.status, job.step, job.loss, job.tokens_per_s) == (JobStatus.RUNNING, 7, 2.5, 1234.5)
    assert (job.restarts, job.last_checkpoint_step, job.goodput, job.attempt) == (1, 5, 0.8, 2)
    assert job.stragglers == [{"rank": 3, "factor": 2.1}]
    assert (job.world_size, job.layout) == (1, "pp1·dp1·tp1 zero=0")
    assert (job.created_at, job.updated_at) == (1_001.0, 1_002.0)
    assert store.get_job("job-1") == job


def test_update_refuses_fields_outside_the_whitelist_and_unknown_statuses(store):
    make_job(store)
    for field in ("id", "name", "created_at", "updated_at", "bogus"):
        with pytest.raises(TypeError, match="cannot change"):
            store.update_job("job-1", **{field: "x"})
    with pytest.raises(ValueError):
        store.update_job("job-1", status="EXPLODED")
    assert store.get_job("job-1").status == JobStatus.QUEUED


def test_expect_status_makes_an_update_conditional(store):
    make_job(store)
    store.update_job("job-1", status=JobStatus.SUCCEEDED)
    with pytest.raises(JobConflict) as raised:
        store.update_job("job-1", status=JobStatus.CANCELLED, expect_status=[JobStatus.RUNNING, JobStatus.QUEUED])
    assert raised.value.status == "SUCCEEDED"
    assert store.get_job("job-1").status == JobStatus.SUCCEEDED


def test_list_is_newest_first_filters_by_status_and_pages(store):
    for number in range(5):
        make_job(store, f"job-{number}")
    store.update_job("job-1", status="RUNNING")
    store.update_job("job-3", status="FAILED")

    assert [job.id for job in store.list_jobs()] == ["job-4", "job-3", "job-2", "job-1", "job-0"]
    assert [job.id for job in store.list_jobs(limit=2, offset=1)] == ["job-3", "job-2"]
    assert [job.id for job in store.list_jobs(status="RUNNING")] == ["job-1"]
    assert [job.id for job in store.list_jobs(status="running")] == ["job-1"]
    assert [job.id for job in store.list_jobs(status=["RUNNING", "FAILED"])] == ["job-3", "job-1"]
    assert store.list_jobs(status=[]) == []


def test_active_jobs_are_the_non_terminal_ones_oldest_first(store):
    statuses = ["QUEUED", "STARTING", "RUNNING", "RECOVERING", "RESIZING", "SUCCEEDED", "FAILED", "CANCELLED"]
    for number, status in enumerate(statuses):
        make_job(store, f"job-{number}")
        store.update_job(f"job-{number}", status=status)
    assert [job.status for job in store.active_jobs()] == statuses[:5]
    assert {status for status in JobStatus if status.is_terminal} == {"SUCCEEDED", "FAILED", "CANCELLED"}


def test_count_by_status_lists_every_status(store):
    make_job(store, "a")
    make_job(store, "b")
    store.update_job("b", status="RUNNING")
    counts = store.count_by_status()
    assert counts[JobStatus.QUEUED] == 1 and counts[JobStatus.RUNNING] == 1
    assert set(counts) == set(JobStatus) and sum(counts.values()) == 2


def test_a_nan_loss_is_stored_as_unknown(store):
    make_job(store)
    assert store.update_job("job-1", loss=math.nan).loss is None


# -- events ---------------------------------------------------------------------------------------------


def test_events_are_numbered_per_job_and_read_back_since_a_sequence_number(store):
    make_job(store, "a")
    make_job(store, "b")
    first = store.add_events("a", [(1.0, "submitted", {"message": "hi"}), (2.0, "started", {"attempt": 1})])
    store.add_events("b", [(3.0, "submitted", {})])
    later = store.add_events("a", [(4.0, "checkpoint", {"step": 5})])

    assert [e.seq for e in first + later] == [1, 2, 3]
    assert store.events("b") == [EventRecord(seq=1, job_id="b", ts=3.0, kind="submitted", detail={})]
    assert store.events("a", since_seq=1) == [
        EventRecord(seq=2, job_id="a", ts=2.0, kind="started", detail={"attempt": 1}),
        EventRecord(seq=3, job_id="a", ts=4.0, kind="checkpoint", detail={"step": 5}),
    ]
    assert [e.seq for e in store.events("a", limit=2)] == [1, 2]
    assert store.add_events("a", []) == []


def test_event_details_must_be_json(store):
    make_job(store)
    with pytest.raises(TypeError, match="cannot store"):
        store.add_events("job-1", [(1.0, "x", {"object": object()})])
    assert store.events("job-1") == []  # the failed batch left nothing behind


# -- steps ----------------------------------------------------------------------------------------------


def test_steps_are_read_back_in_order_since_a_step(store):
    make_job(store)
    store.add_steps("job-1", [step("job-1", n, loss=10.0 - n) for n in (3, 1, 2)])
    assert [(s.step, s.loss) for s in store.steps("job-1")] == [(1, 9.0), (2, 8.0), (3, 7.0)]
    assert [s.step for s in store.steps("job-1", since_step=1)] == [2, 3]
    assert store.steps("job-1")[0] == step("job-1", 1, loss=9.0)


def test_steps_are_idempotent_and_a_restarted_attempt_replaces_what_it_re_ran(store):
    make_job(store)
    store.add_steps("job-1", [step("job-1", n, loss=float(n), attempt=1) for n in range(1, 6)])
    assert store.add_steps("job-1", [step("job-1", 5, loss=5.0, attempt=1)]) == 1  # a replayed report: same row

    # attempt 2 restored the checkpoint of step 3 and re-ran steps 4 and 5, then went on to 6
    store.add_steps("job-1", [step("job-1", n, loss=n + 0.5, attempt=2) for n in (4, 5, 6)])
    # a late message of attempt 1 must not overwrite what attempt 2 reported
    assert store.add_steps("job-1", [step("job-1", 5, loss=99.0, attempt=1)]) == 0

    history = store.steps("job-1")
    assert [(s.step, s.loss, s.attempt) for s in history] == [
        (1, 1.0, 1),
        (2, 2.0, 1),
        (3, 3.0, 1),
        (4, 4.5, 2),
        (5, 5.5, 2),
        (6, 6.5, 2),
    ]


def test_a_steps_mfu_is_kept_with_its_row_and_the_current_row_is_found_by_index(store):
    make_job(store)
    store.add_steps("job-1", [dataclasses.replace(step("job-1", n, loss=float(n)), mfu=0.1 * n) for n in (1, 2, 3)])
    store.add_steps("job-1", [dataclasses.replace(step("job-1", 2, loss=2.5, attempt=2), mfu=math.nan)])
    assert [(s.step, s.mfu) for s in store.steps("job-1")] == [
        (1, pytest.approx(0.1)),
        (2, None),
        (3, pytest.approx(0.3)),
    ]
    # after a restart that resumed at step 2, the job's step is 2: step 3's row is the discarded attempt's
    assert store.step_at_or_before("job-1", 2).attempt == 2
    assert store.step_at_or_before("job-1", 9).step == 3
    assert store.step_at_or_before("job-1", 0) is None


# -- cursors ----------------------------------------------------------------------------------------------


def test_cursors_default_to_zero_and_keep_the_last_value(store):
    assert store.get_cursor("job-1") == 0
    store.set_cursor("job-1", 17)
    store.set_cursor("job-1", 42)
    assert store.get_cursor("job-1") == 42


def test_events_and_their_cursor_are_written_together(store):
    make_job(store)
    store.add_events("job-1", [(1.0, "started", {})], cursor=7)
    assert store.get_cursor("job-1") == 7
    with pytest.raises(JobNotFound):  # nothing is half-written for a missing job
        store.add_events("nope", [(1.0, "x", {})], cursor=3)
    assert store.get_cursor("nope") == 0
    assert store.add_events("job-1", [], cursor=9) == [] and store.get_cursor("job-1") == 7


# -- durability and the file ---------------------------------------------------------------------------


def test_the_database_runs_in_wal_mode(store, db_path):
    assert store.journal_mode == "wal"
    with sqlite3.connect(db_path) as other:  # WAL is a property of the file, seen by every connection
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_reopening_the_file_keeps_jobs_events_steps_and_cursors(db_path):
    with JobStore(db_path) as first:
        make_job(first)
        first.update_job("job-1", status="RUNNING", step=3, stragglers=[2])
        first.add_events("job-1", [(1.0, "submitted", {"message": "hello"})])
        first.add_steps("job-1", [step("job-1", 1, loss=4.0)])
        first.set_cursor("job-1", 9)
        before = first.get_job("job-1")

    with JobStore(db_path) as second:
        assert second.get_job("job-1") == before
        assert second.events("job-1") == [
            EventRecord(seq=1, job_id="job-1", ts=1.0, kind="submitted", detail={"message": "hello"})
        ]
        assert second.steps("job-1") == [step("job-1", 1, loss=4.0)]
        assert second.get_cursor("job-1") == 9
        assert second.add_events("job-1", [(2.0, "restarted", {})])[0].seq == 2  # numbering continues
        assert [job.id for job in second.active_jobs()] == ["job-1"]


def test_a_closed_store_says_so(db_path):
    store = JobStore(db_path)
    store.close()
    store.close()  # idempotent
    with pytest.raises(ServiceUnavailable):
        store.get_job("job-1")
    assert store.ping() is False


def test_a_fresh_file_has_the_latest_schema_version(store, db_path):
    assert store.schema_version == SCHEMA_VERSION == len(MIGRATIONS)
    with sqlite3.connect(db_path) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"jobs", "events", "steps", "cursors", "schema_version"} <= tables


def test_an_older_file_is_migrated_in_order_and_keeps_its_data(db_path):
    db_path.parent.mkdir(parents=True)
    conn = sqlite3.connect(db_path, isolation_level=None)
    assert migrate(conn, MIGRATIONS[:1]) == 1  # a database written by the first release
    conn.execute(
        "INSERT INTO jobs (id, name, status, spec, world_size, created_at, updated_at) "
        "VALUES ('old', 'old', 'RUNNING', '{}', 1, 1.0, 1.0)"
    )
    conn.close()

    with JobStore(db_path) as store:
        assert store.schema_version == SCHEMA_VERSION
        assert store.get_job("old").status == JobStatus.RUNNING
        store.add_steps("old", [step("old", 1, loss=1.0)])  # a table the later migration added
        assert len(store.steps("old")) == 1


def test_a_release_2_file_gains_empty_artifacts_and_stores_new_ones(db_path):
    db_path.parent.mkdir(parents=True)
    conn = sqlite3.connect(db_path, isolation_level=None)
    assert migrate(conn, MIGRATIONS[:2]) == 2  # jobs, events, steps and cursors; no artifacts column yet
    conn.execute(
        "INSERT INTO jobs (id, name, status, spec, world_size, created_at, updated_at) "
        "VALUES ('old', 'old', 'SUCCEEDED', '{}', 1, 1.0, 1.0)"
    )
    conn.close()

    with JobStore(db_path) as store:
        assert store.schema_version == SCHEMA_VERSION == 10
        assert store.get_job("old").artifacts == {}
        assert store.get_job("old").granted_workers is None  # older rows: counted at their world size
        assert store.get_job("old").host_memory_gib is None  # never sampled
        assert store.update_job("old", host_memory_gib=0.27).host_memory_gib == 0.27
        assert (store.get_job("old").tenant, store.get_job("old").priority) == ("default", 0)
        updated = store.update_job("old", artifacts={"hf": "/ckpt/old/hf-export"})
        assert updated.artifacts == {"hf": "/ckpt/old/hf-export"}
    with JobStore(db_path) as store:  # durable across a reopen
        assert store.get_job("old").artifacts == {"hf": "/ckpt/old/hf-export"}


def test_a_release_5_file_gains_an_empty_mfu_column(db_path):
    db_path.parent.mkdir(parents=True)
    conn = sqlite3.connect(db_path, isolation_level=None)
    assert migrate(conn, MIGRATIONS[:5]) == 5
    conn.execute(
        "INSERT INTO jobs (id, name, status, spec, world_size, created_at, updated_at) "
        "VALUES ('old', 'old', 'RUNNING', '{}', 1, 1.0, 1.0)"
    )
    conn.execute("INSERT INTO steps (job_id, step, loss, ts) VALUES ('old', 1, 2.5, 3.0)")
    conn.close()
    with JobStore(db_path) as store:
        assert [(s.step, s.loss, s.mfu) for s in store.steps("old")] == [(1, 2.5, None)]


def test_a_file_from_a_newer_etrain_is_refused(db_path):
    with JobStore(db_path):
        pass
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(ServiceUnavailable, match="schema version"):
        JobStore(db_path)


# -- concurrency -------------------------------------------------------------------------------------------


def _run_threads(target, count: int) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def guarded(index: int) -> None:
        try:
            start.wait(timeout=10)
            target(index)
        except BaseException as err:  # collected and asserted on below
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a writer thread hung"
    return errors


def test_concurrent_writer_threads_lose_nothing(store):
    make_job(store)
    per_thread = 40

    def writer(index: int) -> None:
        for n in range(per_thread):
            store.add_events("job-1", [(float(n), "tick", {"thread": index, "n": n})])
            store.add_steps("job-1", [step("job-1", index * per_thread + n, loss=1.0)])
            store.update_job("job-1", step=index * per_thread + n)
            store.get_job("job-1")

    assert _run_threads(writer, 8) == []
    events = store.events("job-1", limit=10_000)
    assert [e.seq for e in events] == list(range(1, 8 * per_thread + 1))
    assert sorted((e.detail["thread"], e.detail["n"]) for e in events) == [
        (t, n) for t in range(8) for n in range(per_thread)
    ]
    assert len(store.steps("job-1")) == 8 * per_thread


def test_two_stores_on_one_file_number_events_without_gaps_or_duplicates(db_path):
    with JobStore(db_path) as first, JobStore(db_path) as second:
        make_job(first)
        stores = [first, second]

        def writer(index: int) -> None:
            for n in range(25):
                stores[index % 2].add_events("job-1", [(float(n), "tick", {"writer": index})])

        assert _run_threads(writer, 4) == []
        assert [e.seq for e in second.events("job-1")] == list(range(1, 101))


def test_lists_filter_by_tenant_and_keep_the_priority(store):
    store.create_job(job_id="a1", name="a1", spec={}, world_size=1, tenant="alice", priority=5)
    store.create_job(job_id="b1", name="b1", spec={}, world_size=1, tenant="bob")
    store.create_job(job_id="a2", name="a2", spec={}, world_size=1, tenant="alice", priority=-3)
    assert [job.id for job in store.list_jobs(tenant="alice")] == ["a2", "a1"]
    assert [job.id for job in store.list_jobs(tenant="bob")] == ["b1"]
    assert [job.id for job in store.list_jobs(tenant="carol")] == []
    assert len(store.list_jobs()) == 3
    assert [job.id for job in store.list_jobs(tenant="alice", status="QUEUED", limit=1)] == ["a2"]
    assert (store.get_job("a1").tenant, store.get_job("a1").priority) == ("alice", 5)


def test_an_idempotency_key_is_unique_per_tenant(store):
    store.create_job(
        job_id="j1", name="j", spec={}, world_size=1, tenant="alice", idempotency_key="k", request_hash="h1"
    )
    found = store.find_idempotent("alice", "k")
    assert found is not None and found[0].id == "j1" and found[1] == "h1"
    assert store.find_idempotent("bob", "k") is None
    with pytest.raises(JobConflict, match="idempotency key 'k'"):
        store.create_job(job_id="j2", name="j", spec={}, world_size=1, tenant="alice", idempotency_key="k")
    # Another tenant may use the same key; jobs without a key never collide.
    store.create_job(job_id="j3", name="j", spec={}, world_size=1, tenant="bob", idempotency_key="k")
    store.create_job(job_id="j4", name="j", spec={}, world_size=1, tenant="alice")
    store.create_job(job_id="j5", name="j", spec={}, world_size=1, tenant="alice")
    assert store.get_job("j2") is None


def test_a_job_keeps_the_ranks_it_was_granted_and_a_scale_changes_them(store):
    store.create_job(job_id="j", name="j", spec={}, world_size=4, granted_workers=4)
    assert store.update_job("j", world_size=2).granted_workers == 4  # it shrank: the grant stays
    assert store.update_job("j", granted_workers=6).granted_workers == 6
    assert store.create_job(job_id="k", name="k", spec={}, world_size=1).granted_workers is None
