"""Whose checkpoint directory it is: the rules that keep jobs out of each other's checkpoints.

The storage roots (``service/access/storage_roots.py``) fence jobs off from the rest of the machine, and the
reach rule (``service/access/reach.py``) tenants off from each other's roots and job directories; these
rules are about the checkpoint directory itself. Every job checkpoints into a directory of its own
(default ``<data-dir>/checkpoints/<job-id>``), and:

* at most one unfinished job holds a directory, and no two unfinished jobs' directories overlap (equal,
  contain or lie inside): a claim row in SQLite, taken in the transaction that inserts the job
  (``service/store/claims.py``); :func:`taken_conflict` is the 409 the loser gets;
* at submit, a ``checkpoint.path`` that already holds checkpoints resumes from them only if this service
  committed every one (its signature verifies, ``etrain.workers.checkpoints.checkpoint_commit.read_manifest``) for a
  job the caller may see; anything else is a 422 before a rank could unpickle a stranger's ``.metadata``;
* when the job runs, its supervisor loads only steps whose signed manifest names the job itself or a job
  of the same tenant that recorded the same directory (:func:`may_resume`), so a directory shared by
  mistake (or by a race) never hands one job another's state.

What a running job may delete is the supervisor's rule
(``etrain.workers.checkpoints.checkpoint_commit.prune(owner=...)``): only step directories whose signed
manifests name it.

The same rules hold for object storage: a ``checkpoint.path`` of ``s3://bucket/prefix`` is compared by
key components, and its step "directories" are listed and their manifests read through
``workers/checkpoints/storage.py``; the checkpoint tree is ``ETRAIN_CHECKPOINT_ROOT`` when the operator set one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from etrain.service.access.storage_roots import resolve
from etrain.service.access.tenancy import Principal
from etrain.service.errors import JobConflict, SpecRejected
from etrain.service.planning.spec import JobSpec, SpecProblem
from etrain.workers.checkpoints import storage
from etrain.workers.checkpoints.checkpoint_commit import list_steps, read_manifest
from etrain.workers.protocol.errors import CheckpointError, EtrainError
from etrain.workers.protocol.manifest import MANIFEST_NAME

__all__ = ["CheckpointDirectories", "may_resume", "taken_conflict"]


class CheckpointDirectories:
    """The rules above, over the job store's view of jobs (passed in as callables: no SQLite here)."""

    def __init__(self, *, key: bytes, default_root: Callable[[str], str]):
        """``key``: the service's checkpoint signing key; ``default_root(job_id)``: a job's default directory
        (``Settings.checkpoint_location``: under ``ETRAIN_CHECKPOINT_ROOT``, default ``<data_dir>/checkpoints``)."""
        self._key = key
        self._default_root = default_root

    def root_of(self, job_id: str, spec: dict | JobSpec) -> str:
        """The resolved checkpoint directory a job uses (its spec's path, else its default)."""
        path = spec.checkpoint.path if isinstance(spec, JobSpec) else (spec.get("checkpoint") or {}).get("path")
        return resolve(path) if path else self._default_root(job_id)

    def check_resume(self, spec: JobSpec, principal: Principal, *, tenant_of: Callable[[str], str | None]) -> None:
        """SpecRejected (422) unless ``spec``'s ``checkpoint.path`` (pinned; the reach rule passed) is new, empty,
        or holds only checkpoints this service committed for jobs ``principal`` may see.
        ``tenant_of(job_id)``: the job's tenant, or None for an unknown job."""
        if spec.checkpoint.path:
            problems = self._checkpoint_problems(resolve(spec.checkpoint.path), principal, tenant_of)
            if problems:
                raise SpecRejected(problems)

    # --- the rules ----------------------------------------------------------------------------

    def _visible(self, job_id: str | None, principal: Principal, tenant_of: Callable[[str], str | None]) -> bool:
        if principal.admin:
            return True
        tenant = tenant_of(job_id) if job_id else None
        return tenant is not None and principal.can_see(tenant)

    def _checkpoint_problems(
        self, path: str, principal: Principal, tenant_of: Callable[[str], str | None]
    ) -> list[SpecProblem]:
        field = "checkpoint.path"
        try:
            steps = list_steps(path)
        except (OSError, EtrainError) as err:  # an object store that refuses the listing (credentials)
            return [
                SpecProblem(
                    field=field,
                    message=f"checkpoint.path={path!r} cannot be listed: {getattr(err, 'message', None) or err}",
                    fix="check that the service can read it (for s3://: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and "
                    "AWS_ENDPOINT_URL of the server), or give another folder",
                )
            ]
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
            return [
                SpecProblem(
                    field=field,
                    message=f"checkpoint.path={path!r} holds step {step}, which this service did not commit for you, so "
                    f"the job may not resume from it: {reason}",
                    fix="give a new or empty folder, or the checkpoint directory of one of your jobs on this service",
                )
            ]
        return []


def taken_conflict(path: str, *, holder: str, holder_tenant: str, held: str, principal: Principal) -> JobConflict:
    """The 409 for a submit whose ``checkpoint.path`` overlaps the directory ``held`` of the unfinished job
    ``holder``: named to its own tenant (and the admin), anonymous to another tenant."""
    named = principal.can_see(holder_tenant)
    return JobConflict(
        f"checkpoint.path={path!r} overlaps the checkpoint directory of another job that has not finished"
        + (f" ({holder}, in {held!r})" if named else "")
        + "; a directory belongs to one job at a time.",
        job_id=holder if named else None,
        field="checkpoint.path",
        fix="leave checkpoint.path unset (each job gets <data-dir>/checkpoints/<job-id>), give a new folder, or "
        + (f"wait until {holder} has finished (or cancel it)" if named else "wait until that job has finished"),
    )


def may_resume(committed_by: str | None, job_id: str, owners: Collection[str]) -> bool:
    """Whether job ``job_id`` may load a step whose signed manifest names ``committed_by``: its own steps,
    and those of ``owners`` (the jobs of its tenant that recorded the same directory, the manager's
    ``JobPolicy.resume_owners``)."""
    return committed_by is not None and (committed_by == job_id or committed_by in owners)
