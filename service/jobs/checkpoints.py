"""Finding a job's committed checkpoint by step, for ``etrain export`` (POST /v1/jobs/{id}/export).

Only a step whose signed manifest verifies is a checkpoint; when the asked-for step is not one, the
error lists the steps that are, so the user's next request can succeed.
"""

from __future__ import annotations

from typing import NamedTuple

from etrain.service.errors import JobConflict
from etrain.workers.checkpoints.checkpoint_commit import list_steps, step_dir, verify
from etrain.workers.protocol.errors import CheckpointError

__all__ = ["CommittedStep", "committed_step"]


class CommittedStep(NamedTuple):
    step: int
    directory: str
    #: The digest of the signed manifest verified here: the keyless export task loads only that manifest.
    digest: str


def committed_step(job_id: str, root: str, step: int | None, *, key: bytes) -> CommittedStep:
    """A committed checkpoint of the job (signature and sizes checked here; the export task checks that
    the manifest is this one and verifies the checksums as it reads), or JobConflict naming the
    committed steps there are. ``step`` None: the newest."""
    candidates = list_steps(root) if step is None else [(step, step_dir(root, step))]
    for number, directory in reversed(candidates):
        try:
            manifest = verify(directory, checksums=False, key=key)
        except CheckpointError:
            continue
        return CommittedStep(number, directory, manifest.digest)
    committed = (
        []
        if step is None
        else [  # step None: none of them verified just now
            number for number, directory in list_steps(root) if _verifies(directory, key)
        ]
    )
    what = "no committed checkpoint" if step is None else f"no committed checkpoint at step {step}"
    listing = f"committed steps: {committed}" if committed else "nothing is committed yet"
    raise JobConflict(
        f"job {job_id} has {what} under {root} ({listing}).",
        job_id=job_id,
        field="step",
        fix=(
            f"pass one of the committed steps ({committed[-1]} is the newest)"
            if committed
            else "wait for the job's first checkpoint (checkpoint.every_steps, or its end)"
        ),
    )


def _verifies(directory: str, key: bytes) -> bool:
    try:
        verify(directory, checksums=False, key=key)
    except CheckpointError:
        return False
    return True
