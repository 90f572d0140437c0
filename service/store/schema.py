"""The job store's schema: its migrations, and applying the ones a database file has not seen.

Schema changes are appended to ``MIGRATIONS`` (never edited in place); opening a file applies the ones
it has not seen yet, each in its own transaction, and a file written by a newer etrain is refused. Kept
apart from the queries (service/store/job_store.py) because a release changes one without the other.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from etrain.service.errors import ServiceUnavailable

# Each entry moves the schema from version i to i + 1. Append; never edit a released entry.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE jobs (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            status TEXT NOT NULL,
            spec TEXT NOT NULL,
            step INTEGER NOT NULL DEFAULT 0,
            loss REAL,
            tokens_per_s REAL,
            world_size INTEGER NOT NULL,
            restarts INTEGER NOT NULL DEFAULT 0,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            error TEXT,
            layout TEXT,
            last_checkpoint_step INTEGER,
            stragglers TEXT NOT NULL DEFAULT '[]',
            goodput REAL,
            attempt INTEGER NOT NULL DEFAULT 0
        )""",
        "CREATE INDEX jobs_by_status ON jobs (status)",
        "CREATE INDEX jobs_by_created ON jobs (created_at)",
        """CREATE TABLE events (
            job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
            seq INTEGER NOT NULL,
            ts REAL NOT NULL,
            kind TEXT NOT NULL,
            detail TEXT NOT NULL DEFAULT '{}',
            PRIMARY KEY (job_id, seq)
        ) WITHOUT ROWID""",
    ),
    (
        """CREATE TABLE steps (
            job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
            step INTEGER NOT NULL,
            attempt INTEGER NOT NULL DEFAULT 0,
            loss REAL,
            tokens_per_s REAL,
            step_s REAL,
            compute_s REAL,
            comm_wait_s REAL,
            ts REAL NOT NULL,
            PRIMARY KEY (job_id, step)
        ) WITHOUT ROWID""",
        """CREATE TABLE cursors (
            job_id TEXT PRIMARY KEY,
            value INTEGER NOT NULL
        )""",
    ),
    ("ALTER TABLE jobs ADD COLUMN artifacts TEXT NOT NULL DEFAULT '{}'",),
    (
        # Tenants (the submitting token's tenant), the queue's priority, idempotent submit.
        "ALTER TABLE jobs ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default'",
        "ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN idempotency_key TEXT",
        "ALTER TABLE jobs ADD COLUMN request_hash TEXT",
        "CREATE INDEX jobs_by_tenant ON jobs (tenant, created_at)",
        "CREATE UNIQUE INDEX jobs_by_idempotency_key ON jobs (tenant, idempotency_key) "
        "WHERE idempotency_key IS NOT NULL",
    ),
    (
        # Every job's resolved checkpoint directory (the reach rule: no tenant reads another's; the rows of
        # older jobs are filled in by the manager at start, JobStore.record_checkpoint_dirs), and the claims
        # that let one unfinished job hold a directory (service/store/claims.py).
        "ALTER TABLE jobs ADD COLUMN checkpoint_dir TEXT",
        "CREATE INDEX jobs_by_checkpoint_dir ON jobs (checkpoint_dir) WHERE checkpoint_dir IS NOT NULL",
        """CREATE TABLE checkpoint_claims (
            path TEXT PRIMARY KEY,
            job_id TEXT NOT NULL UNIQUE REFERENCES jobs (id) ON DELETE CASCADE,
            tenant TEXT NOT NULL
        )""",
    ),
    # The model FLOPs utilisation of each step (etrain plot, the progress bar, etrain_mfu); NULL before.
    ("ALTER TABLE steps ADD COLUMN mfu REAL",),
    # The job's latest step's MFU (the job JSON's ``mfu``); NULL before or where the device's peak is unknown.
    ("ALTER TABLE jobs ADD COLUMN mfu REAL",),
    # Where the job's wall time went, seconds by cause (service/decisions/goodput_breakdown.py); NULL before.
    ("ALTER TABLE jobs ADD COLUMN goodput_breakdown TEXT",),
    # The ranks the tenant's worker quota granted the job: its size at submit, then each accepted scale's
    # (service/access/quotas.py counts a job at no less; an elastic job grows back only up to it); NULL before.
    ("ALTER TABLE jobs ADD COLUMN granted_workers INTEGER",),
    # The most host memory a rank of the job held at the latest sample, GiB (the job JSON's ``host_memory_gib``,
    # service/decisions/host_memory_watch.py); NULL before.
    ("ALTER TABLE jobs ADD COLUMN host_memory_gib REAL",),
)

SCHEMA_VERSION = len(MIGRATIONS)


def schema_version(conn: sqlite3.Connection) -> int:
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = conn.execute("SELECT version FROM schema_version").fetchone()
    return 0 if row is None else int(row[0])


def migrate(conn: sqlite3.Connection, migrations: Sequence[Sequence[str]] = MIGRATIONS) -> int:
    """Apply the migrations this database has not seen, each in its own transaction; return the version.

    ``conn`` must be in autocommit mode (``isolation_level=None``). A database written by a newer
    etrain (a higher version than we know) is refused rather than guessed at.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        current = schema_version(conn)
        if current == 0 and conn.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == 0:
            conn.execute("INSERT INTO schema_version (version) VALUES (0)")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    if current > len(migrations):
        raise ServiceUnavailable(
            f"the database has schema version {current} but this etrain knows only up to {len(migrations)}.",
            field="data_dir",
            fix="run a newer etrain on this data directory, or point ETRAIN_DATA_DIR at another one",
        )
    for version in range(current, len(migrations)):
        conn.execute("BEGIN IMMEDIATE")
        try:
            if schema_version(conn) == version:  # another process may have migrated meanwhile
                for statement in migrations[version]:
                    conn.execute(statement)
                conn.execute("UPDATE schema_version SET version = ?", (version + 1,))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return schema_version(conn)
