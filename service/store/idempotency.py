"""Idempotent submit: a client retry with the same ``Idempotency-Key`` gets the job it already created.

Pure rules shared by the real manager and the API's fake (no Ray): what a key may be, the hash that
says whether two requests are "the same", and what a stored key answers. The store's unique index on
``(tenant, idempotency_key)`` is what makes it race-safe: of two concurrent submissions with one key
exactly one INSERT wins; the loser looks the winner up with :func:`replay` (see
``etrain.service.manager.JobManager.submit``).

"The same request" is the same *spec*, not the same bytes: the hash is over the canonical JSON of the
parsed :class:`~etrain.service.planning.spec.JobSpec` (fields at their defaults left out, keys sorted), so a client
that re-serialises its body differently (key order, whitespace, an explicit default) still replays, while any
change of meaning is a 409. Keys are per tenant: two tenants may use the same key for different jobs. A key stored
by a version before 2026-12-07 holds that version's hash (every default written out), which
:func:`earlier_hashes` recomputes, so a retry spanning that upgrade replays too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re

from etrain.service.errors import JobConflict, SpecRejected
from etrain.service.planning.spec import JobSpec, SpecProblem
from etrain.service.store.job_store import JobStore
from etrain.service.store.records import JobRecord

#: Longest key accepted (UUIDs are 36; the IETF draft suggests a UUID, clients sometimes add a prefix).
MAX_KEY_LENGTH = 200
#: Printable ASCII (inner spaces allowed, none at either end: HTTP strips those from header values).
KEY_PATTERN = r"^[\x21-\x7E]([\x20-\x7E]*[\x21-\x7E])?$"
_KEY = re.compile(KEY_PATTERN)
HEADER = "Idempotency-Key"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayedJob(JobRecord):
    """The job an earlier submission with the same key and body created (the API answers 200, not 201)."""

    @classmethod
    def of(cls, record: JobRecord) -> ReplayedJob:
        return cls(**{field.name: getattr(record, field.name) for field in dataclasses.fields(JobRecord)})


def check_key(key: str) -> str:
    """The key as given, or SpecRejected naming the header and the fix."""
    if not 1 <= len(key) <= MAX_KEY_LENGTH or not _KEY.fullmatch(key):
        shown = key if len(key) <= 40 else key[:37] + "..."
        raise SpecRejected(
            [
                SpecProblem(
                    field=HEADER,
                    message=f"{HEADER} {shown!r} must be 1..{MAX_KEY_LENGTH} printable ASCII characters, not starting "
                    f"or ending with a space (got {len(key)} characters).",
                    fix="send a UUID (e.g. `uuidgen`) per logical submission, and the same one on retries",
                )
            ]
        )
    return key


def request_hash(spec: JobSpec) -> str:
    """SHA-256 of the spec's canonical JSON, as the client sent it (before paths are pinned), without the fields at
    their defaults: a default written out is the same request as one left out, and a retry spanning an upgrade
    that adds a field with a default (as ``checkpoint.export_dtype`` was) is still the same request."""
    sent = spec.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    canonical = json.dumps(sent, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def earlier_hashes(spec: JobSpec) -> tuple[str, ...]:
    """The hashes versions before 2026-12-07 stored for this request: the canonical JSON with every default written
    out, with ``checkpoint.export_dtype`` (the builds of 2026-12-06 that had the field) and without it (those
    before it)."""
    dumped = spec.model_dump(mode="json", by_alias=True)

    def digest(body: dict) -> str:
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    with_dtype = digest(dumped)
    if dumped["checkpoint"].pop("export_dtype") != "float32":
        return (with_dtype,)  # a request the versions without the field could not have taken
    return (with_dtype, digest(dumped))


def replay(store: JobStore, tenant: str, key: str, digest: str, *, earlier: tuple[str, ...] = ()) -> ReplayedJob | None:
    """The job ``tenant`` created with ``key`` if the request is the same (``digest``, or one of the ``earlier``
    hashes of it, :func:`earlier_hashes`); None if the key is new; JobConflict (409) if the key was used for a
    different request."""
    found = store.find_idempotent(tenant, key)
    if found is None:
        return None
    record, stored = found
    if stored != digest and stored not in earlier:
        raise JobConflict(
            f"{HEADER} {key!r} was already used for job {record.id} with a different request body.",
            job_id=record.id,
            field=HEADER,
            fix=f"send the original body to get job {record.id} back, or a new {HEADER} for a new job",
        )
    return ReplayedJob.of(record)
