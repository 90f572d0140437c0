"""The Hugging Face export as a Ray task: the end of a job with ``checkpoint.export: hf``, and ``etrain export``.

The task runs in a Ray worker process, the only place torch is imported for it (the supervisor and the
control plane never load torch), reserves one CPU, and any node may run it (checkpoints live on shared
storage). Waiting for it has a timeout; a task that overruns is cancelled. Both the supervisor actor
(service/runtime/supervisor_actor.py, off its control thread) and the control plane
(service/runtime/cluster.py ``RayRuntime.export``) start it through :func:`submit_export`.

A job's ``hf-export`` sits in its checkpoint directory, which a tenant may be able to write: it is named
by :func:`job_export_dir` (never resolved, so a link there is seen as a link), and replaced with
:func:`etrain.workers.protocol.safe_paths.remove_tree`, which refuses a link rather than deleting the folder it
points at (outside the storage roots, perhaps) and writing the export there.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from etrain.workers.checkpoints import storage
from etrain.workers.protocol import safe_paths
from etrain.workers.protocol.errors import EtrainError
from etrain.workers.protocol.run_config import ExportDtype, ModelConfig

__all__ = [
    "EXPORT_NUM_CPUS",
    "HF_EXPORT_DIR",
    "ExportFailedError",
    "cancel_quietly",
    "job_export_dir",
    "run_export",
    "submit_export",
    "wait_export",
]

#: Where a job's end-of-run Hugging Face export goes, inside its checkpoint root.
HF_EXPORT_DIR = "hf-export"
#: CPUs the export task reserves: it is single-process and streams one output shard at a time.
EXPORT_NUM_CPUS = 1.0


class ExportFailedError(EtrainError):
    """An export task failed or timed out; the checkpoint it read from is untouched."""


def job_export_dir(checkpoint_root: str) -> str:
    """Where a job's end-of-run export goes: ``<checkpoint root>/hf-export``, joined, never resolved
    (resolving would follow a link planted there, and the export would replace what it points at)."""
    if storage.is_url(checkpoint_root):
        return storage.join(checkpoint_root, HF_EXPORT_DIR)
    return os.path.join(os.path.abspath(checkpoint_root), HF_EXPORT_DIR)


def _export_folder(
    step_dir: str,
    out_dir: str,
    model: ModelConfig,
    source_dir: str | None,
    replace_existing: bool,
    expect_digest: str | None = None,
    dtype: ExportDtype = "float32",
) -> str:
    """The body of the export task: runs in a Ray worker process, the only place torch is imported.

    ``replace_existing``: the job's own ``hf-export`` folder may be left by an earlier supervisor of the
    same job (recreated after a control-plane loss); it is that job's output, so it is replaced.
    A user's ``--out`` folder is never replaced (``export_hf`` refuses a non-empty one).
    ``expect_digest``: the digest of the manifest the caller verified with the service's key; this
    process has no key, so it loads nothing unless the manifest it reads is exactly that one.
    """
    from etrain.workers.checkpoints.hf_io import export_hf

    if replace_existing and storage.is_url(out_dir):
        storage.rmtree(out_dir)
    elif replace_existing:  # a link there is refused (UnsafePathError), never deleted through
        safe_paths.remove_tree(out_dir, field="checkpoint.path")
    return export_hf(step_dir, out_dir, model, source_dir=source_dir, expect_digest=expect_digest, dtype=dtype)


_export_task = ray.remote(num_cpus=EXPORT_NUM_CPUS, max_retries=0)(_export_folder)


def submit_export(
    *,
    step_dir: str,
    out_dir: str,
    model: ModelConfig,
    source_dir: str | None,
    expect_digest: str,
    dtype: ExportDtype,
    replace_existing: bool = False,
):
    """Start the export task (any node: checkpoints live on shared storage); returns its ObjectRef.
    ``expect_digest``: the digest of ``step_dir``'s manifest as verified with the key (required: the task
    unpickles DCP's ``.metadata`` and can check nothing signed by itself)."""
    return _export_task.options(name=f"etrain-export:{storage.basename(out_dir)}").remote(
        step_dir, out_dir, model, source_dir, replace_existing, expect_digest, dtype
    )


def wait_export(ref: Any, *, timeout_s: float) -> str:
    """The exported folder's absolute path, or the task's own :class:`EtrainError` (field + fix intact),
    or :class:`ExportFailedError` on a timeout (the task is cancelled) or any other failure."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        cancel_quietly(ref)
        raise ExportFailedError(
            f"the export task did not finish within {timeout_s:g}s (it needs {EXPORT_NUM_CPUS:g} free CPU "
            "and reads the whole checkpoint)",
            fix="check that the cluster has a free CPU (ray status) and that the checkpoint storage is readable",
        ) from None
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, EtrainError):
            raise cause from None
        raise ExportFailedError(
            f"the export task failed: {type(cause).__name__ if cause else 'error'}: "
            f"{cause if cause is not None else err}"
        ) from None
    except ray.exceptions.RayError as err:  # the task's worker or node died
        raise ExportFailedError(f"the export task was lost: {err}", fix="retry the export") from None


def run_export(
    *,
    step_dir: str,
    out_dir: str,
    model: ModelConfig,
    source_dir: str | None,
    expect_digest: str,
    timeout_s: float,
    dtype: ExportDtype,
) -> str:
    """Export one committed checkpoint and wait for it (the control plane's `etrain export`; ``RayRuntime.export``)."""
    ref = submit_export(
        step_dir=step_dir, out_dir=out_dir, model=model, source_dir=source_dir, expect_digest=expect_digest, dtype=dtype
    )
    return wait_export(ref, timeout_s=timeout_s)


def cancel_quietly(ref: Any) -> None:
    try:
        ray.cancel(ref, force=True)
    except Exception:  # already finished or gone
        pass
