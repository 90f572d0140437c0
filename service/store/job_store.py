"""Durable job state in one SQLite file: jobs (and the checkpoint directories they claim), their events,
per-step metrics, pump cursors.

Why SQLite: the control plane is one process, the data is small, and a file on a volume survives a
restart of the server (invariant 5: nothing lost on control-plane restart). WAL mode lets readers
(API threads) run while the manager's poller writes; ``busy_timeout`` makes a second process (a
second server on the same file, a debugging shell) wait instead of failing.

Thread safety: one connection guarded by a lock. FastAPI runs sync routes in a thread pool and the
manager's poller is another thread; statements are short, so serialising them costs nothing
measurable and keeps every write transaction (``BEGIN IMMEDIATE``) simple to reason about.

Records come out as frozen dataclasses (service/store/records.py), never row dicts. The schema and its
migrations are service/store/schema.py; opening a file applies the ones it has not seen yet.
"""

from __future__ import annotations

import enum
import json
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from etrain.service.errors import JobConflict, JobNotFound, ServiceUnavailable
from etrain.service.store import claims
from etrain.service.store.records import EventRecord, JobRecord, JobStatus, StepRecord
from etrain.service.store.schema import migrate, schema_version

# Fields update_job may change; id, name, spec origin and created_at are fixed at creation.
_UPDATABLE = frozenset(
    {
        "status",
        "spec",
        "step",
        "loss",
        "tokens_per_s",
        "mfu",
        "world_size",
        "restarts",
        "error",
        "layout",
        "last_checkpoint_step",
        "stragglers",
        "goodput",
        "goodput_breakdown",
        "granted_workers",
        "host_memory_gib",
        "attempt",
        "artifacts",
    }
)
_JSON_FIELDS = frozenset({"spec", "stragglers", "artifacts", "goodput_breakdown"})
_JOB_COLUMNS = (
    "id, name, status, spec, step, loss, tokens_per_s, world_size, restarts, created_at, updated_at, "
    "error, layout, last_checkpoint_step, stragglers, goodput, attempt, artifacts, tenant, priority, mfu, "
    "goodput_breakdown, granted_workers, host_memory_gib"
)


class JobStore:
    """Jobs, events, step metrics and cursors in one SQLite file (``":memory:"`` for a throwaway)."""

    def __init__(
        self,
        path: str | Path,
        *,
        busy_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        if self.path != ":memory:":
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.execute("PRAGMA synchronous = NORMAL")  # durable across process crashes in WAL
        self._conn.execute("PRAGMA foreign_keys = ON")
        self._closed = False
        migrate(self._conn)

    # -- plumbing ---------------------------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._check_open()
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._check_open()
            yield self._conn

    def _check_open(self) -> None:
        if self._closed:
            raise ServiceUnavailable("the job store is closed.", fix="the server is shutting down; retry shortly")

    @property
    def schema_version(self) -> int:
        with self._read() as conn:
            return schema_version(conn)

    @property
    def journal_mode(self) -> str:
        with self._read() as conn:
            return str(conn.execute("PRAGMA journal_mode").fetchone()[0])

    def ping(self) -> bool:
        """True when the database answers a query (for /healthz)."""
        try:
            with self._read() as conn:
                conn.execute("SELECT 1").fetchone()
            return True
        except (sqlite3.Error, ServiceUnavailable):
            return False

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- jobs -------------------------------------------------------------------------------------

    def create_job(
        self,
        *,
        job_id: str,
        name: str,
        spec: dict[str, Any],
        world_size: int,
        status: str = JobStatus.QUEUED,
        layout: str | None = None,
        tenant: str = "default",
        priority: int = 0,
        idempotency_key: str | None = None,
        request_hash: str | None = None,
        checkpoint_dir: str | None = None,
        granted_workers: int | None = None,
    ) -> JobRecord:
        """Insert a job. With ``idempotency_key``, a second job of the same tenant and key is a
        JobConflict (:meth:`find_idempotent` tells the caller which job holds the key). With
        ``checkpoint_dir`` (resolved), the job claims it in the same transaction:
        :class:`~etrain.service.store.claims.DirectoryTaken`, and no row, when an unfinished job holds an
        overlapping one."""
        status = JobStatus(status)
        now = self._clock()
        with self._write() as conn:
            try:
                conn.execute(
                    "INSERT INTO jobs (id, name, status, spec, world_size, created_at, updated_at, layout, "
                    "tenant, priority, idempotency_key, request_hash, checkpoint_dir, granted_workers) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        job_id,
                        name,
                        status.value,
                        _dumps(spec),
                        world_size,
                        now,
                        now,
                        layout,
                        tenant,
                        priority,
                        idempotency_key,
                        request_hash,
                        checkpoint_dir,
                        granted_workers,
                    ),
                )
            except sqlite3.IntegrityError:
                if idempotency_key is not None and self._idempotent(conn, tenant, idempotency_key) is not None:
                    raise JobConflict(
                        f"idempotency key {idempotency_key!r} is already used by another job.",
                        fix="send a new Idempotency-Key for a new job",
                    ) from None
                raise JobConflict(
                    f"a job with id {job_id!r} already exists.", job_id=job_id, fix="use a new job id"
                ) from None
            if checkpoint_dir is not None and not status.is_terminal:
                claims.claim(conn, path=checkpoint_dir, job_id=job_id, tenant=tenant)  # DirectoryTaken: rolled back
            return self._get(conn, job_id)

    def record_checkpoint_dirs(self, locate: Callable[[str, dict[str, Any]], str]) -> int:
        """Fill in the checkpoint directory of jobs written before it was recorded (``locate(job_id, spec)``)
        and claim it for the unfinished ones (an overlap among those is left as it was); how many."""
        with self._write() as conn:
            rows = conn.execute("SELECT id, spec, tenant, status FROM jobs WHERE checkpoint_dir IS NULL").fetchall()
            for job_id, spec, tenant, status in rows:
                path = locate(job_id, json.loads(spec))
                conn.execute("UPDATE jobs SET checkpoint_dir = ? WHERE id = ?", (path, job_id))
                if not JobStatus(status).is_terminal:
                    try:
                        claims.claim(conn, path=path, job_id=job_id, tenant=tenant)
                    except claims.DirectoryTaken:
                        pass
        return len(rows)

    def job_dirs(self, path: str, *, other_than: str | None = None) -> list[tuple[str, str, str]]:
        """(job id, tenant, checkpoint directory) of every job (any status) whose recorded directory overlaps
        ``path``; with ``other_than``, only other tenants' jobs."""
        with self._read() as conn:
            rows = claims.overlapping(
                conn,
                "jobs",
                "checkpoint_dir, id, tenant",
                path,
                where="tenant != :tenant" if other_than is not None else "1",
                tenant=other_than,
            )
        return [(job_id, tenant, directory) for directory, job_id, tenant in rows]

    def jobs_in_dir(self, path: str, *, tenant: str | None) -> list[str]:
        """The ids of the jobs (of ``tenant``; None: every tenant) that recorded exactly the directory ``path``."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT id FROM jobs WHERE checkpoint_dir = ? AND (? IS NULL OR tenant = ?)", (path, tenant, tenant)
            ).fetchall()
        return [row[0] for row in rows]

    def find_idempotent(self, tenant: str, key: str) -> tuple[JobRecord, str | None] | None:
        """The job ``tenant`` submitted with Idempotency-Key ``key`` and the hash of that request."""
        with self._read() as conn:
            return self._idempotent(conn, tenant, key)

    def _idempotent(self, conn: sqlite3.Connection, tenant: str, key: str) -> tuple[JobRecord, str | None] | None:
        row = conn.execute(
            f"SELECT {_JOB_COLUMNS}, request_hash FROM jobs WHERE tenant = ? AND idempotency_key = ?", (tenant, key)
        ).fetchone()
        return None if row is None else (_job(row[:-1]), row[-1])

    def get_job(self, job_id: str) -> JobRecord | None:
        with self._read() as conn:
            row = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def list_jobs(
        self,
        *,
        status: str | Collection[str] | None = None,
        limit: int = 100,
        offset: int = 0,
        tenant: str | None = None,
    ) -> list[JobRecord]:
        """Newest first. ``status`` is one status or a collection of them; ``tenant`` None is all tenants."""
        where, args = _status_filter(status)
        if tenant is not None:
            where = f"{where} AND tenant = ?" if where else "WHERE tenant = ?"
            args = (*args, tenant)
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs {where} ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?",
                (*args, limit, offset),
            ).fetchall()
        return [_job(row) for row in rows]

    def active_jobs(self) -> list[JobRecord]:
        """Jobs not yet in a terminal state, oldest first (the manager reattaches to these)."""
        active = [status for status in JobStatus if not status.is_terminal]
        where, args = _status_filter(active)
        with self._read() as conn:
            rows = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs {where} ORDER BY created_at, rowid", args).fetchall()
        return [_job(row) for row in rows]

    def count_by_status(self) -> dict[JobStatus, int]:
        """Every status with its number of jobs (zero included), for the etrain_jobs gauge."""
        counts = dict.fromkeys(JobStatus, 0)
        with self._read() as conn:
            for status, count in conn.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status"):
                counts[JobStatus(status)] = int(count)
        return counts

    def update_job(self, job_id: str, *, expect_status: Collection[str] | None = None, **fields: Any) -> JobRecord:
        """Change the given fields (and ``updated_at``) atomically; return the new record.

        ``expect_status``: only update when the job is currently in one of these statuses, else raise
        :class:`JobConflict` (so a cancel and the poller's SUCCEEDED cannot both win).
        """
        unknown = set(fields) - _UPDATABLE
        if unknown:
            raise TypeError(f"update_job cannot change {sorted(unknown)}; allowed: {sorted(_UPDATABLE)}")
        if "status" in fields:
            fields["status"] = JobStatus(fields["status"]).value
        values = {name: _dumps(value) if name in _JSON_FIELDS else value for name, value in fields.items()}
        values["updated_at"] = self._clock()
        assignments = ", ".join(f"{name} = ?" for name in values)
        with self._write() as conn:
            current = conn.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if current is None:
                raise JobNotFound(job_id)
            if expect_status is not None and current[0] not in {JobStatus(s).value for s in expect_status}:
                allowed = sorted(JobStatus(s).value for s in expect_status)
                raise JobConflict(
                    f"job {job_id!r} is {current[0]}; this change needs one of {allowed}.",
                    job_id=job_id,
                    status=current[0],
                )
            conn.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*values.values(), job_id))
            if "status" in fields and JobStatus(fields["status"]).is_terminal:
                claims.release(conn, job_id)  # its checkpoint directory is free from this commit on
            return self._get(conn, job_id)

    def _get(self, conn: sqlite3.Connection, job_id: str) -> JobRecord:
        row = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        return _job(row)

    # -- events -----------------------------------------------------------------------------------

    def add_events(
        self, job_id: str, events: Iterable[tuple[float, str, dict[str, Any]]], *, cursor: int | None = None
    ) -> list[EventRecord]:
        """Append events in order; each gets the job's next ``seq`` (1-based, gap-free).

        ``cursor``: also set the job's event-pump cursor (``set_cursor``) in the same transaction, so
        a control plane killed mid-pump never stores the same supervisor events twice.
        """
        events = list(events)
        if not events:
            return []
        with self._write() as conn:
            self._require_job(conn, job_id)
            if cursor is not None:
                conn.execute(
                    "INSERT INTO cursors (job_id, value) VALUES (?, ?) "
                    "ON CONFLICT (job_id) DO UPDATE SET value = excluded.value",
                    (job_id, int(cursor)),
                )
            (last,) = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE job_id = ?", (job_id,)).fetchone()
            records, rows = [], []
            for offset, (ts, kind, detail) in enumerate(events, start=1):
                text = _dumps(dict(detail or {}))
                records.append(
                    EventRecord(seq=last + offset, job_id=job_id, ts=float(ts), kind=str(kind), detail=json.loads(text))
                )
                rows.append((job_id, last + offset, float(ts), str(kind), text))
            conn.executemany("INSERT INTO events (job_id, seq, ts, kind, detail) VALUES (?, ?, ?, ?, ?)", rows)
        return records

    def events(self, job_id: str, *, since_seq: int = 0, limit: int = 1000) -> list[EventRecord]:
        """Events with ``seq > since_seq``, oldest first."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT seq, job_id, ts, kind, detail FROM events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                (job_id, since_seq, limit),
            ).fetchall()
        return [
            EventRecord(seq=seq, job_id=jid, ts=ts, kind=kind, detail=json.loads(detail))
            for seq, jid, ts, kind, detail in rows
        ]

    # -- steps ------------------------------------------------------------------------------------

    def add_steps(self, job_id: str, steps: Iterable[StepRecord]) -> int:
        """Record per-step metrics; return how many rows were written or replaced.

        Idempotent: a step already stored is replaced by a report from the same or a later attempt
        (a restarted run re-runs the steps after its checkpoint; the history keeps the run that
        continued) and left alone by a report from an earlier attempt (a late, stale message).
        """
        rows = []
        for record in steps:
            assert record.job_id == job_id, f"step record of job {record.job_id!r} added to {job_id!r}"
            rows.append(
                (
                    job_id,
                    record.step,
                    record.attempt,
                    _finite_or_none(record.loss),
                    _finite_or_none(record.tokens_per_s),
                    record.step_s,
                    record.compute_s,
                    record.comm_wait_s,
                    record.ts,
                    _finite_or_none(record.mfu),
                )
            )
        if not rows:
            return 0
        with self._write() as conn:
            self._require_job(conn, job_id)
            before = conn.total_changes
            conn.executemany(
                "INSERT INTO steps (job_id, step, attempt, loss, tokens_per_s, step_s, compute_s, comm_wait_s, ts, "
                "mfu) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (job_id, step) DO UPDATE SET attempt = excluded.attempt, loss = excluded.loss, "
                "tokens_per_s = excluded.tokens_per_s, step_s = excluded.step_s, compute_s = excluded.compute_s, "
                "comm_wait_s = excluded.comm_wait_s, ts = excluded.ts, mfu = excluded.mfu "
                "WHERE excluded.attempt >= steps.attempt",
                rows,
            )
            return conn.total_changes - before

    def steps(self, job_id: str, *, since_step: int = -1, limit: int = 10000) -> list[StepRecord]:
        """Step metrics with ``step > since_step``, in step order."""
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {_STEP_COLUMNS} FROM steps WHERE job_id = ? AND step > ? ORDER BY step LIMIT ?",
                (job_id, since_step, limit),
            ).fetchall()
        return [_step(row) for row in rows]

    def step_at_or_before(self, job_id: str, step: int) -> StepRecord | None:
        """The stored row of the highest step ``<= step`` (the job's current one: after a restart the
        rows past its resume point belong to the discarded attempt), or None (one index lookup)."""
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {_STEP_COLUMNS} FROM steps WHERE job_id = ? AND step <= ? ORDER BY step DESC LIMIT 1",
                (job_id, step),
            ).fetchone()
        return None if row is None else _step(row)

    # -- cursors ----------------------------------------------------------------------------------

    def set_cursor(self, job_id: str, value: int) -> None:
        """Remember how far the event pump of ``job_id`` has read (survives a server restart)."""
        with self._write() as conn:
            conn.execute(
                "INSERT INTO cursors (job_id, value) VALUES (?, ?) "
                "ON CONFLICT (job_id) DO UPDATE SET value = excluded.value",
                (job_id, int(value)),
            )

    def get_cursor(self, job_id: str) -> int:
        with self._read() as conn:
            row = conn.execute("SELECT value FROM cursors WHERE job_id = ?", (job_id,)).fetchone()
        return 0 if row is None else int(row[0])

    def _require_job(self, conn: sqlite3.Connection, job_id: str) -> None:
        if conn.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone() is None:
            raise JobNotFound(job_id)


def _job(row: tuple) -> JobRecord:
    (
        job_id,
        name,
        status,
        spec,
        step,
        loss,
        tokens_per_s,
        world_size,
        restarts,
        created_at,
        updated_at,
        error,
        layout,
        last_checkpoint_step,
        stragglers,
        goodput,
        attempt,
        artifacts,
        tenant,
        priority,
        mfu,
        breakdown,
        granted,
        host_memory_gib,
    ) = row
    return JobRecord(
        id=job_id,
        name=name,
        status=JobStatus(status),
        spec=json.loads(spec),
        step=step,
        loss=loss,
        tokens_per_s=tokens_per_s,
        world_size=world_size,
        restarts=restarts,
        created_at=created_at,
        updated_at=updated_at,
        error=error,
        layout=layout,
        last_checkpoint_step=last_checkpoint_step,
        stragglers=json.loads(stragglers),
        goodput=goodput,
        attempt=attempt,
        artifacts=json.loads(artifacts),
        tenant=tenant,
        priority=priority,
        mfu=mfu,
        goodput_breakdown=json.loads(breakdown) if breakdown else None,
        granted_workers=granted,
        host_memory_gib=host_memory_gib,
    )


def _status_filter(status: str | Collection[str] | None) -> tuple[str, tuple[str, ...]]:
    if status is None:
        return "", ()
    statuses = [status] if isinstance(status, str) else list(status)
    values = tuple(JobStatus(s).value for s in statuses)
    if not values:
        return "WHERE 0", ()
    return f"WHERE status IN ({', '.join('?' for _ in values)})", values


_STEP_COLUMNS = "job_id, step, loss, tokens_per_s, step_s, compute_s, comm_wait_s, ts, attempt, mfu"


def _step(row: tuple) -> StepRecord:
    jid, step, loss, tps, step_s, compute_s, comm_wait_s, ts, attempt, mfu = row
    return StepRecord(
        job_id=jid,
        step=step,
        loss=loss,
        tokens_per_s=tps,
        step_s=step_s,
        compute_s=compute_s,
        comm_wait_s=comm_wait_s,
        ts=ts,
        attempt=attempt,
        mfu=mfu,
    )


def _finite_or_none(value: float | None) -> float | None:
    """SQLite stores NaN as NULL anyway; say so explicitly (a NaN loss is reported as an event)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _dumps(value: Any) -> str:
    return json.dumps(value, default=_json_default, allow_nan=True, separators=(",", ":"))


def _json_default(value: Any) -> Any:
    """Values that show up in details from the workers: numpy scalars/arrays, paths, enums."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (Path, enum.Enum)):
        return str(value.value if isinstance(value, enum.Enum) else value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"cannot store a {type(value).__name__} in a job record: {value!r}")
