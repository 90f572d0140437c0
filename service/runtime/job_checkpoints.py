"""One job's checkpoints as its supervisor actor handles them: find, verify, commit, prune, export.

The state machine (service/decisions/supervisor.py) decides *when* a step is committed, resumed from or
exported; this is the storage side of those decisions, for a local folder or an ``s3://`` root alike
(workers/checkpoints/storage.py). It lives apart from the actor (service/runtime/supervisor_actor.py) because it is
the one part that touches checkpoint files and signatures, and the parts that take long (pruning, the
export task) run here off the actor's control thread.

Trust: every manifest is signed with the service's key at commit and verified with it before a launch
resumes from it; a step whose signature does not verify is refused and moved aside, never loaded.
What this deletes, moves or replaces in a local checkpoint folder (the ``hf-export``, a refused step) is
reached without following symbolic links (``workers/protocol/safe_paths.py``): the folder may be the tenant's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from etrain.service.access.checkpoint_dirs import may_resume
from etrain.service.decisions.supervisor_events import CommitFailed, CommitSucceeded, Event, Exported, ExportFailed
from etrain.service.runtime.hf_export import cancel_quietly, job_export_dir, submit_export, wait_export
from etrain.workers.checkpoints import storage
from etrain.workers.checkpoints.checkpoint_commit import commit, list_steps, prune, resolve_latest, step_dir, verify
from etrain.workers.protocol import safe_paths
from etrain.workers.protocol.errors import CheckpointError, UnsafePathError
from etrain.workers.protocol.manifest import ManifestSignatureError
from etrain.workers.protocol.run_config import ExportDtype, ModelConfig

log = logging.getLogger(__name__)

__all__ = ["JobCheckpoints"]


class JobCheckpoints:
    """The checkpoints of one job under ``root``. ``record(kind, detail)`` appends a job event.

    :meth:`commit`, :meth:`verified_resume_step` and :meth:`export` run on the actor's control thread;
    pruning and the export's wait run on threads of their own.
    """

    def __init__(
        self,
        *,
        job_id: str,
        root: str,
        key: bytes,
        keep_last: int,
        record: Callable[[str, str], None],
        resume_owners: frozenset[str] = frozenset(),
    ):
        self.job_id = job_id
        self._resume_owners = resume_owners  # other jobs whose steps it may load (checkpoint_dirs.may_resume)
        self.root = root  # a resolved local folder or an ``s3://`` URL: the name shown and sent to other processes
        # Opened once, without links (made if missing): every file this reads, commits, moves or prunes goes
        # through the folder that passed, so the folder swapped for a link after submit redirects nothing.
        self._held = storage.hold_dir(root)
        self._io = self._held.path  # root itself for a URL
        self._key = key
        self._keep_last = keep_last
        self._record = record
        self._digests: dict[int, str] = {}  # step -> digest of the manifest verified (or written) here
        self._reports: dict[int, dict[int, Any]] = {}  # step -> rank -> ShardReport
        self._pruner: threading.Thread | None = None
        self._prune_lock = threading.Lock()
        self._prune_wanted = False  # a commit since the running prune started: it prunes once more
        self._hashed: dict[str, str] = {}  # prune's memo: directory -> manifest digest its files were hashed against
        self._export_ref: Any = None  # the export task in flight (cancelled if the job ends otherwise)

    def latest(self) -> int | None:
        """The newest committed step at start-up (signatures checked; the launch re-verifies fully), after
        refusing the forged or unsigned ones newer than it: a step this job never believes it has."""
        found = resolve_latest(self._io, checksums=False, key=self._key)
        for skipped in found.skipped:
            if skipped.refused:
                self._refuse(skipped.step, skipped.step_dir, skipped.reason)
        return found.step

    def resume_from(self, step: int | None) -> tuple[str | None, str | None]:
        """``(step directory, manifest digest)`` a launch plan names for ``step`` (``(None, None)``: fresh)."""
        if not step:
            return None, None
        return step_dir(self.root, step), self._digests.get(step)

    def reported(self, step: int, rank: int, report: Any) -> None:
        """Rank ``rank`` saved its shards of ``step``: its report goes into the manifest at commit."""
        self._reports.setdefault(step, {})[rank] = report

    def verified_resume_step(self, wanted: int | None) -> int | None:
        """The newest checkpoint at or below ``wanted`` whose signature, manifest and checksums verify.

        The state machine remembers what was committed; a file can rot (or be corrupted by a drill,
        or a manifest be forged) afterwards, so every launch verifies and falls back to the previous
        good step. This is the one full verification of a restore: the ranks then check that the
        manifest is the one verified here (its digest travels in the launch plan), the sizes, and
        the hash of DCP's ``.metadata`` before unpickling it. A manifest whose signature does not
        verify is refused (``checkpoint_refused``) and moved aside, never loaded.
        """
        if wanted is None:
            return None
        for step, directory in reversed(list_steps(self._io)):
            if step > wanted:
                continue
            try:
                manifest = verify(directory, key=self._key)
            except ManifestSignatureError as err:
                self._refuse(step, directory, self._held.shown(str(err)))
            except CheckpointError as err:
                self._record("checkpoint_skipped", self._held.shown(f"step {step}: {err}"))
            else:
                if not may_resume(manifest.job_id, self.job_id, self._resume_owners):
                    self._record("checkpoint_skipped", f"step {step}: committed by a job this one may not resume from")
                    continue
                self._digests[step] = manifest.digest
                return step
        self._record("checkpoint_skipped", f"no verifying checkpoint under {self.root}; starting fresh")
        return None

    def commit(self, step: int, *, parallel: Any, world_size: int) -> CommitSucceeded | CommitFailed:
        """Write the manifest of ``step`` (atomically, last) for the layout ``parallel``; the outcome is the
        state machine's next event: only CommitSucceeded makes the step a checkpoint anything resumes from."""
        reports = self._reports.pop(step, {})
        directory = step_dir(self._io, step)
        try:
            manifest = commit(
                directory,
                step=step,
                layout=parallel.describe(),
                world_size=world_size,
                reports=list(reports.values()),
                key=self._key,
                job_id=self.job_id,
            )
        except Exception as err:  # the step does not count; restore uses the previous one
            return CommitFailed(step=step, error=self._held.shown(f"{type(err).__name__}: {err}"))
        self._digests[step] = manifest.digest  # written and signed here: its digest is known
        for stale in [s for s in self._reports if s < step]:
            self._reports.pop(stale)
        self._prune_in_background()
        return CommitSucceeded(step=step)

    def wait_for_prune(self, timeout_s: float) -> None:
        """Give the prune in flight up to ``timeout_s`` to finish (an ended job's last one)."""
        pruner = self._pruner
        if pruner is not None:
            pruner.join(timeout=timeout_s)

    def pruning(self) -> bool:
        """Whether a prune is under way or asked for (a commit during one makes it prune once more)."""
        with self._prune_lock:
            return self._pruner is not None

    def export(
        self, step: int, *, model: ModelConfig, dtype: ExportDtype, timeout_s: float, answer: Callable[[Event], None]
    ) -> None:
        """Write committed ``step`` as a Hugging Face folder in a Ray task; ``answer`` gets Exported or
        ExportFailed. The task runs off the control thread (and off this process: torch is imported only
        there); its timeout is ``timeout_s``, and the state machine keeps its own as a backstop."""
        directory = step_dir(self.root, step)
        out = job_export_dir(self.root)  # joined, never resolved: a link planted there is refused by the task
        try:
            digest = self._digests.get(step) or verify(step_dir(self._io, step), checksums=False, key=self._key).digest
            # The task has no key: it exports only the manifest verified here (its digest), so a manifest
            # swapped in before the task reads it (it may wait for a CPU) is refused, not unpickled.
            ref = submit_export(
                step_dir=directory,
                out_dir=out,
                model=model,
                source_dir=model.hf_path,
                expect_digest=digest,
                dtype=dtype,
                replace_existing=True,
            )
        except Exception as err:
            answer(
                ExportFailed(
                    step=step,
                    checkpoint_dir=directory,
                    error=self._held.shown(f"could not start the export task: {err}"),
                )
            )
            return
        self._export_ref = ref

        def wait() -> None:
            try:
                path = wait_export(ref, timeout_s=timeout_s)
            except Exception as err:  # EtrainError from the task, a timeout, a lost worker
                answer(ExportFailed(step=step, checkpoint_dir=directory, error=str(err)))
            else:
                answer(Exported(step=step, path=path))

        threading.Thread(target=wait, name=f"export-{self.job_id}-{step}", daemon=True).start()

    def end_export(self, *, succeeded: bool) -> None:
        """The job ended: an export still running is cancelled unless the job succeeded (which it only does
        once the export is done); a cancel or the state machine's export timeout lands here."""
        if not succeeded and self._export_ref is not None:
            cancel_quietly(self._export_ref)
        self._export_ref = None

    def _refuse(self, step: int, directory: str, reason: str) -> None:
        """A step directory whose manifest is unsigned or forged: an event, and the directory moved
        aside (``<dir>.refused-<time>``, kept for inspection) so nothing ever considers it again and
        the job can save that step afresh. It stays inside this job's own checkpoint directory."""
        aside = f"{directory}.refused-{int(time.time())}"
        try:
            if storage.is_url(directory):
                storage.replace(directory, aside)
            else:  # through the checkpoint folder's descriptor, reached without links
                safe_paths.rename_inside(
                    os.path.dirname(directory),
                    os.path.basename(directory),
                    os.path.basename(aside),
                    field="checkpoint.path",
                )
            where = f"moved to {storage.basename(aside)}"
        except (OSError, UnsafePathError) as err:
            where = self._held.shown(f"could not be moved aside ({err})")
        self._record("checkpoint_refused", f"step {step}: {reason}; not loaded, {where}")

    def _prune_in_background(self) -> None:
        """Drop checkpoints beyond ``keep_last`` off the control thread.

        Pruning hashes each checkpoint it keeps once, in the first prune after its commit (so a rotten
        newest step never causes the good one before it to be deleted; ``prune``'s ``hashed`` memo spares
        the later ones); on large checkpoints that takes long enough to stall heartbeat handling if done
        there. One prune at a time; a commit during one makes it prune once more when
        it is done (otherwise the last commit of a job, landing while the previous prune still hashes,
        e.g. on an object store, would never be pruned).
        """
        with self._prune_lock:
            self._prune_wanted = True
            if self._pruner is not None:
                return

            def prune_now() -> None:
                while True:
                    with self._prune_lock:
                        if not self._prune_wanted:
                            self._pruner = None
                            return
                        self._prune_wanted = False
                    try:
                        # Only step directories whose signed manifests name this job are ever deleted.
                        prune(
                            self._io, keep_last=self._keep_last, key=self._key, owner=self.job_id, hashed=self._hashed
                        )
                    except Exception as err:  # never fatal: old checkpoints just stay on disk a while longer
                        log.warning("pruning %s failed: %s", self.root, err)

            self._pruner = threading.Thread(target=prune_now, name=f"prune-{self.job_id}", daemon=True)
            self._pruner.start()
