"""Control requests (cancel, scale) handed to supervisors off the HTTP threads.

``POST /v1/jobs/{id}/cancel`` and ``/scale`` answer 202 at once: the manager records the request as an
event and puts it here. One thread, ``etrain-control``, delivers each request (a Ray call with its own
timeout, see ``etrain.service.runtime.cluster``), so no request thread ever waits on Ray and a slow or unreachable
supervisor delays only other control requests, never reads. A delivery that fails is retried with
backoff and, when it keeps failing, reported through ``on_give_up`` (the manager records an event the
user sees).

Pure threading, no Ray: the manager supplies ``deliver``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

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
