"""Finding a job's committed checkpoint by step, for ``etrain export`` (POST /v1/jobs/{id}/export).

Only a step whose signed manifest verifies is a checkpoint; when the asked-for step is not one, the
error lists the steps that are, so the user's next request can succeed.
"""

from __future__ import annotations

from etrain.service.errors import JobConflict
from etrain.workers.checkpoint_commit import latest_committed, list_steps, step_dir, verify
from etrain.workers.protocol.errors import CheckpointError

__all__ = ["committed_step"]


def committed_step(job_id: str, root: str, step: int | None, *, key: bytes) -> tuple[int, str]:
    """``(step, step_dir)`` of a committed checkpoint of the job (signature and sizes checked here; the
    export task verifies the checksums as it reads), or JobConflict naming the committed steps there are."""
    if step is None:
        found = latest_committed(root, checksums=False, key=key)
        if found is not None:
            return found
    else:
        directory = step_dir(root, step)
        try:
            verify(directory, checksums=False, key=key)
            return step, directory
        except CheckpointError:
            pass
    committed = []
    for number, directory in list_steps(root):
        try:
            verify(directory, checksums=False, key=key)
        except CheckpointError:
            continue
        committed.append(number)
    what = "no committed checkpoint" if step is None else f"no committed checkpoint at step {step}"
    listing = f"committed steps: {committed}" if committed else "nothing is committed yet"
    raise JobConflict(
        f"job {job_id} has {what} under {root} ({listing}).",
        job_id=job_id, field="step",
        fix=(f"pass one of the committed steps ({committed[-1]} is the newest)" if committed
             else "wait for the job's first checkpoint (checkpoint.every_steps, or its end)"),
    )
