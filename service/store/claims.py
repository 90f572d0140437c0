"""Checkpoint-directory claims: the rows that let exactly one unfinished job hold a directory.

A claim is taken in the write transaction that inserts its job (``JobStore.create_job``; ``BEGIN
IMMEDIATE`` holds SQLite's write lock, so concurrent submits, threads or processes, are serialised): it is
refused when the directory overlaps (is, contains or lies inside, by path components) one that another
unfinished job holds, and the ``path`` primary key is the last word on equal paths. It is released in the
transaction that gives its job a terminal status (and goes with the job's row). An in-memory claim
checked against a snapshot of unfinished jobs taken before its lock accepted 10 to 18 of 30 concurrent
submits of one directory (issue #17); this cannot.
"""

from __future__ import annotations

import sqlite3

from etrain.service.access.storage_roots import inside

__all__ = ["DirectoryTaken", "claim", "overlapping", "release"]


class DirectoryTaken(Exception):
    """``path`` overlaps ``held``, the directory of unfinished job ``holder`` (of ``tenant``)."""

    def __init__(self, path: str, *, holder: str, tenant: str, held: str):
        super().__init__(f"{path} overlaps {held}, held by job {holder}")
        self.path, self.holder, self.tenant, self.held = path, holder, tenant, held


# A string-prefix superset of "overlaps by components", in SQL; `inside` then decides exactly.
_NEAR = "(substr(:path, 1, length({column})) = {column} OR substr({column}, 1, length(:path)) = :path)"


def overlapping(
    conn: sqlite3.Connection, table: str, columns: str, path: str, *, where: str = "1", **args: object
) -> list[tuple]:
    """``columns`` of the rows of ``table`` whose directory (the first column, resolved) overlaps ``path``;
    ``where`` narrows them with named ``args``."""
    column = columns.split(",")[0].strip()
    rows = conn.execute(
        f"SELECT {columns} FROM {table} WHERE {column} IS NOT NULL AND ({where}) AND " + _NEAR.format(column=column),
        {**args, "path": path},
    ).fetchall()
    return [row for row in rows if inside(path, row[0]) or inside(row[0], path)]


def claim(conn: sqlite3.Connection, *, path: str, job_id: str, tenant: str) -> None:
    """Claim ``path`` for ``job_id``, inside the caller's write transaction; DirectoryTaken when another job
    holds an overlapping directory."""
    for held, holder, owner in overlapping(
        conn, "checkpoint_claims", "path, job_id, tenant", path, where="job_id != :job", job=job_id
    ):
        raise DirectoryTaken(path, holder=holder, tenant=owner, held=held)
    try:
        conn.execute("INSERT INTO checkpoint_claims (path, job_id, tenant) VALUES (?, ?, ?)", (path, job_id, tenant))
    except sqlite3.IntegrityError:  # equal paths: caught above unless the rows changed under a foreign writer
        row = conn.execute("SELECT job_id, tenant FROM checkpoint_claims WHERE path = ?", (path,)).fetchone()
        raise DirectoryTaken(path, holder=row[0] if row else "?", tenant=row[1] if row else "?", held=path) from None


def release(conn: sqlite3.Connection, job_id: str) -> None:
    """The job ended: its directory is free (inside the transaction that records its terminal status)."""
    conn.execute("DELETE FROM checkpoint_claims WHERE job_id = ?", (job_id,))
