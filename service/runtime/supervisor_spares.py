"""Pre-started job supervisors: the next job's supervisor is already running when the job starts.

Why: a job's supervisor is a new Ray actor on the head node, and creating one costs an interpreter,
``import ray`` and these modules before its first decision (0.4-0.7 s of actor start on the 2-core
machine, 1.2 s from ``admitted`` to ``launching`` in the start-up benchmark's event log). The control
plane keeps ``ETRAIN_SUPERVISOR_SPARES`` (default 1) supervisors started without a job and gives one to
each job it starts (:meth:`JobSupervisor.begin`); the job then starts at the speed of one actor call.

A pre-started supervisor is a detached actor like a job's own, named ``etrain/supervisor-spare/<id>``:
Ray names cannot change, so which job it took is kept by the supervisor itself (``job()``), and
``find_supervisor`` asks the pre-started actors it has not placed yet (a restarted control plane does
that once each). Idle ones left by a previous control plane are adopted, extra ones killed; the control
plane kills its idle ones when it closes. Each costs one idle process on the head node with Ray and the
service's modules loaded (~140 MB resident, measured on the 2-core machine) and no logical resources.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import ray

from etrain.service.runtime.supervisor_actor import (
    PRE_STARTED_PREFIX,
    JobSupervisor,
    jobs_of_pre_started,
    pre_started_supervisors,
    supervisor_options,
)
from etrain.service.runtime.worker_group import NAMESPACE

log = logging.getLogger(__name__)

#: A spare is replaced this long after one was taken, not at once: its start (an interpreter and ``import
#: ray``, about a core-second) would compete with the launch that just took one (as for spare ranks,
#: ``service/runtime/spares.py``).
REFILL_DELAY_S = 5.0


@dataclass(frozen=True)
class PreStarted:
    """One pre-started supervisor: its actor and its name (what ``find_supervisor`` looks for)."""

    actor: Any
    name: str


class SupervisorSpares:
    """Keeps ``count`` supervisors started without a job, for the control plane's next job starts."""

    def __init__(self, count: int):
        self.count = max(0, int(count))
        self._lock = threading.Lock()
        self._ready: deque[PreStarted] = deque()
        self._closed = False
        self._refill_timer: threading.Timer | None = None
        if self.count:
            # Off the caller's thread: adopting asks every pre-started actor on the cluster which job it has.
            threading.Thread(target=self._adopt_then_fill, name="supervisor-spares", daemon=True).start()

    def take(self) -> PreStarted | None:
        """The oldest pre-started supervisor (None when there is none), replaced after ``REFILL_DELAY_S``."""
        with self._lock:
            spare = self._ready.popleft() if self._ready else None
            if self.count and not self._closed and (self._refill_timer is None or not self._refill_timer.is_alive()):
                self._refill_timer = threading.Timer(REFILL_DELAY_S, self._fill)
                self._refill_timer.daemon = True
                self._refill_timer.start()
        return spare

    def ready(self) -> int:
        with self._lock:
            return len(self._ready)

    def close(self) -> None:
        """Kill the idle ones (a job's supervisor, pre-started or not, outlives the control plane)."""
        with self._lock:
            self._closed = True
            if self._refill_timer is not None:
                self._refill_timer.cancel()
            idle, self._ready = list(self._ready), deque()
        for spare in idle:
            try:
                ray.kill(spare.actor, no_restart=True)
            except Exception:  # already gone, or Ray is shutting down
                pass

    # --- filling ---------------------------------------------------------------------------------

    def _adopt_then_fill(self) -> None:
        try:
            answers = jobs_of_pre_started(pre_started_supervisors())
            idle = sorted(name for name, job in answers.items() if job is None)
            for name in idle:
                actor = ray.get_actor(name, namespace=NAMESPACE)
                with self._lock:
                    keep = not self._closed and len(self._ready) < self.count
                    if keep:
                        self._ready.append(PreStarted(actor=actor, name=name))
                if not keep:
                    ray.kill(actor, no_restart=True)
            if idle:
                log.info("adopted %d idle pre-started supervisor(s)", min(len(idle), self.count))
        except Exception as err:  # never fatal: jobs then get supervisors started for them, as before
            log.warning("could not adopt pre-started supervisors: %s", err)
        self._fill()

    def _fill(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed or len(self._ready) >= self.count:
                        return
                name = PRE_STARTED_PREFIX + uuid.uuid4().hex[:12]
                actor = ray.remote(JobSupervisor).options(**supervisor_options(name)).remote()
                with self._lock:
                    closed = self._closed
                    if not closed:
                        self._ready.append(PreStarted(actor=actor, name=name))
                if closed:  # closed while it was being created
                    ray.kill(actor, no_restart=True)
                    return
        except Exception as err:  # never fatal: as above
            log.warning("could not pre-start a supervisor: %s", err)
