"""Whose checkpoint directory is it: the submit-time rules that keep jobs out of each other's files.

The storage roots (``service/access/storage_roots.py``) fence jobs off from the rest of the machine; these
rules fence them off from each other inside the roots. Every job checkpoints into a directory of its
own (default ``<data-dir>/checkpoints/<job-id>``), and at submit:

* ``checkpoint.path`` may not overlap (equal, contain or lie inside) the checkpoint directory of an
  unfinished job: two jobs never write, prune or resume from one directory at once;
* a ``checkpoint.path`` that already holds checkpoints resumes from them only if this service
  committed every one (its signature verifies, ``etrain.workers.checkpoint_commit.read_manifest``) for a job the
  caller may see; anything else is a 422 before a rank could unpickle a stranger's ``.metadata``;
* a path into ``<data-dir>/checkpoints/<job-id>`` (to fine-tune from a job's export, say) must name a
  job the caller may see, and only the admin may name a folder that contains the whole tree.

What a running job may delete is the supervisor's rule (``etrain.workers.checkpoint_commit.prune(owner=...)``): only
step directories whose signed manifests name it.

The same rules hold for object storage: a ``checkpoint.path`` of ``s3://bucket/prefix`` is compared by
key components, and its step "directories" are listed and their manifests read through
``workers/storage.py``; the checkpoint tree is ``ETRAIN_CHECKPOINT_ROOT`` when the operator set one.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable

from etrain.service.errors import SpecRejected
from etrain.service.planning.spec import JobSpec, SpecProblem
from etrain.service.access.storage_roots import inside, resolve
from etrain.service.access.tenancy import Principal
from etrain.workers import storage
from etrain.workers.protocol.errors import CheckpointError, EtrainError
from etrain.workers.checkpoint_commit import list_steps, read_manifest
from etrain.workers.protocol.manifest import MANIFEST_NAME

__all__ = ["CheckpointDirectories"]

#: A submit claims its directory right before writing its job row (which then holds it): milliseconds.
#: A claim whose row never came (a later refusal: quota, idempotency race) lapses after this long.
CLAIM_TTL_S = 10.0
_PATH_FIELDS = (("model.hf", "model", "hf"), ("data.path", "data", "path"), ("data.tokenizer", "data", "tokenizer"),
                ("checkpoint.path", "checkpoint", "path"))


class CheckpointDirectories:
    """The rules above, over the job store's view of jobs (passed in as callables: no SQLite here)."""

    def __init__(self, *, tree: str, key: bytes, default_root: Callable[[str], str]):
        """``tree``: the folder (or ``s3://`` prefix) holding every job's default directory
        (``Settings.checkpoint_tree``: ``ETRAIN_CHECKPOINT_ROOT``, default ``<data_dir>/checkpoints``)."""
        self._tree = resolve(tree)
        self._key = key
        self._default_root = default_root
        self._lock = threading.Lock()
        self._claims: dict[str, tuple[str, float]] = {}  # job id -> (directory, monotonic time)

    def root_of(self, job_id: str, spec: dict | JobSpec) -> str:
        """The resolved checkpoint directory a job uses (its spec's path, else its default)."""
        path = spec.checkpoint.path if isinstance(spec, JobSpec) else (spec.get("checkpoint") or {}).get("path")
        return resolve(path) if path else self._default_root(job_id)

    def check_reach(self, spec: JobSpec, principal: Principal, *, tenant_of: Callable[[str], str | None]) -> None:
        """SpecRejected when a path of ``spec`` (pinned) reaches into the checkpoint directory of a job the
        caller cannot see. Called before anything looks at the files, so the answer does not say whether
        another tenant's files exist."""
        problems = []
        for field, section, name in _PATH_FIELDS:
            value = getattr(getattr(spec, section), name)
            if value:
                problem = self._tree_problem(field, resolve(value), principal, tenant_of)
                if problem is not None:
                    problems.append(problem)
        if problems:
            raise SpecRejected(problems)

    def claim(
        self,
        job_id: str,
        spec: JobSpec,
        principal: Principal,
        *,
        unfinished: Iterable[tuple[str, dict]],
        tenant_of: Callable[[str], str | None],
    ) -> None:
        """Check ``spec``'s ``checkpoint.path`` (pinned; :meth:`check_reach` passed) for ``principal`` and
        reserve the job's checkpoint directory for ``job_id``; :class:`~etrain.service.errors.SpecRejected` (422).

        ``unfinished``: (job id, stored spec) of every non-terminal job; ``tenant_of(job_id)``: the
        job's tenant, or None for an unknown job. Check and reservation happen under one lock, so two
        submits cannot both take a free directory.
        """
        problems: list[SpecProblem] = []
        path = spec.checkpoint.path
        with self._lock:
            now = time.monotonic()
            # A claim lasts until the job's row exists (it then holds the directory while unfinished).
            self._claims = {job: claim for job, claim in self._claims.items()
                            if now - claim[1] < CLAIM_TTL_S and tenant_of(job) is None}
            if path:
                problems += self._checkpoint_problems(resolve(path), principal, unfinished, tenant_of)
            if problems:
                raise SpecRejected(problems)
            self._claims[job_id] = (self.root_of(job_id, spec), now)

    def release(self, job_id: str) -> None:
        """Drop ``job_id``'s claim: its submit failed after :meth:`claim` (quota, a lost idempotency race),
        so no row will ever hold the directory."""
        with self._lock:
            self._claims.pop(job_id, None)

    # --- the rules ----------------------------------------------------------------------------

    def _visible(self, job_id: str | None, principal: Principal, tenant_of: Callable[[str], str | None]) -> bool:
        if principal.admin:
            return True
        tenant = tenant_of(job_id) if job_id else None
        return tenant is not None and principal.can_see(tenant)

    def _tree_problem(self, field: str, path: str, principal: Principal,
                      tenant_of: Callable[[str], str | None]) -> SpecProblem | None:
        """A path that reaches into the checkpoint tree: only the caller's jobs' directories."""
        if inside(self._tree, path) and not principal.admin:
            return SpecProblem(
                field=field,
                message=f"{field}={path!r} contains the service's checkpoint directory {self._tree}, which holds "
                        "other jobs' checkpoints.",
                fix=f"point {field} at a folder of your own",
            )
        if inside(path, self._tree) and path != self._tree:
            job_id = (path[len(self._tree) + 1:].split("/")[0] if storage.is_url(path)
                      else os.path.relpath(path, self._tree).split(os.sep)[0])
            if not self._visible(job_id, principal, tenant_of):
                return SpecProblem(
                    field=field,
                    message=f"{field}={path!r} is inside the checkpoint directory of a job you cannot access.",
                    fix=f"point {field} at one of your own jobs' checkpoint directories, or a folder of your own",
                )
        return None

    def _checkpoint_problems(self, path: str, principal: Principal, unfinished: Iterable[tuple[str, dict]],
                             tenant_of: Callable[[str], str | None]) -> list[SpecProblem]:
        field = "checkpoint.path"
        in_use = [self.root_of(job_id, spec) for job_id, spec in unfinished]
        in_use += [directory for directory, _when in self._claims.values()]
        if any(inside(path, other) or inside(other, path) for other in in_use):
            return [SpecProblem(
                field=field,
                message=f"checkpoint.path={path!r} overlaps the checkpoint directory of another job that has not "
                        "finished; a directory belongs to one job at a time.",
                fix="leave checkpoint.path unset (each job gets <data-dir>/checkpoints/<job-id>), or give a new folder",
            )]
        try:
            steps = list_steps(path)
        except (OSError, EtrainError) as err:  # an object store that refuses the listing (credentials)
            return [SpecProblem(
                field=field,
                message=f"checkpoint.path={path!r} cannot be listed: {getattr(err, 'message', None) or err}",
                fix="check that the service can read it (for s3://: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and "
                    "AWS_ENDPOINT_URL of the server), or give another folder",
            )]
        for step, directory in steps:
            if not storage.exists(storage.join(directory, MANIFEST_NAME)):
                continue  # an interrupted save: not a checkpoint, never loaded (replaced if the step is saved)
            try:
                manifest = read_manifest(directory, key=self._key)
            except CheckpointError as err:
                reason = err.message
            else:
                if self._visible(manifest.job_id, principal, tenant_of):
                    continue
                reason = f"it was committed by job {manifest.job_id!r}, which you cannot access"
            return [SpecProblem(
                field=field,
                message=f"checkpoint.path={path!r} holds step {step}, which this service did not commit for you, so "
                        f"the job may not resume from it: {reason}",
                fix="give a new or empty folder, or the checkpoint directory of one of your jobs on this service",
            )]
        return []

