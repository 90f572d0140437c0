"""Control requests (cancel, scale, chaos before start) handed to supervisors off the HTTP threads.

``POST /v1/jobs/{id}/cancel`` and ``/scale`` answer 202 at once: the manager records the request as an
event and puts it here. One thread, ``etrain-control``, delivers each request (a Ray call with its own
timeout, see ``etrain.service.runtime.cluster``), so no request thread ever waits on Ray and a slow or unreachable
supervisor delays only other control requests, never reads. A delivery that fails is retried with
backoff and, when it keeps failing, reported through ``on_give_up`` (the manager records an event the
user sees).

A chaos order (``POST /v1/jobs/{id}/chaos``) for a job whose supervisor does not exist yet (QUEUED, or
STARTING before its actor is created) cannot be delivered and must not be refused either: the
:class:`ChaosHandOver` keeps it and the manager hands it to the supervisor as part of its start
(``JobPolicy.chaos_requests``), so it rides in the first launch plan. A request that arrives during that
hand-over waits for it to end (bounded) and then goes to the supervisor directly: none falls between.

Pure threading, no Ray: the manager supplies ``deliver`` and says whether a supervisor exists.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

from etrain.service.errors import ServiceUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ControlRequest:
    job_id: str
    action: Literal["cancel", "scale"]
    dp: int | None = None  # scale only
    tries: int = 0  # failed deliveries so far
    deferrals: int = 0  # times ``deliver`` said "not yet"


class NotYet(Exception):
    """``deliver`` cannot act yet (the job's supervisor is still being created): try again shortly."""


class ControlQueue:
    """Deliver :class:`ControlRequest` s on one background thread, with retries; every wait is bounded."""

    def __init__(
        self,
        deliver: Callable[[ControlRequest], None],
        *,
        on_give_up: Callable[[ControlRequest, BaseException], None],
        retry_delay_s: float = 1.0,
        max_tries: int = 5,
        defer_delay_s: float = 0.2,
        max_deferrals: int = 600,
        name: str = "etrain-control",
    ):
        self._deliver = deliver
        self._on_give_up = on_give_up
        self._retry_delay_s = retry_delay_s
        self._max_tries = max_tries
        self._defer_delay_s = defer_delay_s
        self._max_deferrals = max_deferrals
        self._inbox: queue.Queue[ControlRequest | None] = queue.Queue()
        self._later: list[tuple[float, int, ControlRequest]] = []  # (due, order, request): retries
        self._order = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, request: ControlRequest) -> None:
        self._inbox.put(request)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = 0.5
            if self._later:
                wait = max(0.0, min(wait, self._later[0][0] - time.monotonic()))
            try:
                item = self._inbox.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is not None:
                self._attempt(item)
            now = time.monotonic()
            while self._later and self._later[0][0] <= now and not self._stop.is_set():
                self._attempt(heapq.heappop(self._later)[2])

    def _attempt(self, request: ControlRequest) -> None:
        try:
            self._deliver(request)
        except NotYet as err:
            if request.deferrals >= self._max_deferrals:
                self._give_up(request, err)
            else:
                self._retry(replace(request, deferrals=request.deferrals + 1), self._defer_delay_s)
        except Exception as err:  # a Ray timeout, a dead supervisor: retried, then reported
            tries = request.tries + 1
            if tries >= self._max_tries:
                self._give_up(request, err)
            else:
                log.info("delivering %s to job %s failed (try %d): %s", request.action, request.job_id, tries, err)
                self._retry(replace(request, tries=tries), self._retry_delay_s * 2 ** (tries - 1))

    def _retry(self, request: ControlRequest, delay_s: float) -> None:
        heapq.heappush(self._later, (time.monotonic() + delay_s, next(self._order), request))

    def _give_up(self, request: ControlRequest, err: BaseException) -> None:
        try:
            self._on_give_up(request, err)
        except Exception:  # reporting must not kill the thread that serves every other job
            log.exception("reporting a failed %s of job %s failed", request.action, request.job_id)


class ChaosHandOver:
    """Chaos requests kept for jobs whose supervisor has not started, handed to it as it starts.

    The manager reads and changes a job's kept requests only inside :meth:`settled` (no hand-over of that
    job in progress), and starts a supervisor only inside :meth:`handing_over`; both take one lock, so a
    request is either kept before the hand-over takes the list, or sees the supervisor that the hand-over
    created. ``wait_s`` bounds how long a request waits for a hand-over (a supervisor's start is itself
    bounded by the runtime's call timeout).
    """

    def __init__(self, *, wait_s: float):
        self._wait_s = wait_s
        self._changed = threading.Condition()
        self._kept: dict[str, list[dict[str, Any]]] = {}  # job -> requests, in the order they came
        self._starting: set[str] = set()  # jobs whose supervisor is being started with their requests

    @contextmanager
    def settled(self, job_id: str) -> Iterator[list[dict[str, Any]]]:
        """The job's kept requests (append to keep one), while no hand-over of the job runs or can begin.

        ServiceUnavailable when a hand-over of the job does not end within ``wait_s``.
        """
        with self._changed:
            if not self._changed.wait_for(lambda: job_id not in self._starting, timeout=self._wait_s):
                raise ServiceUnavailable(
                    f"the supervisor of job {job_id} is still starting after {self._wait_s:.0f}s; the order was "
                    "not taken",
                    fix="retry in a few seconds; if it persists, check the cluster (ray status)",
                )
            kept = self._kept.setdefault(job_id, [])
            try:
                yield kept
            finally:
                if not kept:
                    del self._kept[job_id]

    @contextmanager
    def handing_over(self, job_id: str) -> Iterator[tuple[dict[str, Any], ...]]:
        """The job's kept requests, taken for its supervisor's start (the block): they are the start's
        to deliver (or lose with it, when it fails); requests that come meanwhile wait for the block's end."""
        with self._changed:
            self._starting.add(job_id)
            requests = tuple(self._kept.pop(job_id, ()))
        try:
            yield requests
        finally:
            with self._changed:
                self._starting.discard(job_id)
                self._changed.notify_all()

    def drop(self, job_id: str) -> None:
        """Forget the job's kept requests (it was cancelled before it started)."""
        with self._changed:
            self._kept.pop(job_id, None)
