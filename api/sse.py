"""Server-sent events for ``GET /v1/jobs/{id}/events?follow=true``: a job's events as they happen.

The stream (``text/event-stream``), message by message:

* ``retry: 2000`` first: how long a browser's EventSource waits before it reconnects;
* every job event as a plain message, ``id: <seq>`` and ``data: <the event's JSON>`` (as in GET
  /events): a client that reconnects with ``Last-Event-ID`` (or ``?since=``) resumes after it;
* ``event: status`` with the job's JSON whenever its status changes (the first one is the status at
  connect time); it carries no ``id``, so resuming is by event seq only;
* with ``steps=true``, ``event: step`` with each new per-step metrics row (as in GET /metrics);
* ``: keepalive`` comment lines when nothing was sent for KEEPALIVE_S, so proxies keep the connection;
* ``event: end`` with the job's final JSON once the job is terminal and every event of it was sent,
  then the stream closes. A stream that closes without ``end`` (MAX_STREAM_S, a restart) should be
  resumed with ``Last-Event-ID``.

Why polling the store: every event reaches SQLite through the manager's poller anyway, and the store is
what survives a control-plane restart, so a stream shows exactly what GET /events shows. The generator
is a coroutine that sleeps with ``asyncio.sleep`` between polls and reads through the thread pool only
for the few milliseconds a read takes: an idle client holds no thread (thousands may wait at once).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool

from etrain.api.schemas import EventOut, JobOut, StepOut
from etrain.service.access.tenancy import Principal
from etrain.service.errors import JobNotFound
from etrain.service.ports import JobManagerPort
from etrain.service.store.records import EventRecord, StepRecord

MEDIA_TYPE = "text/event-stream"
POLL_S = 0.5  # how often the store is read for news
KEEPALIVE_S = 15.0  # a comment line after this long without a message
MAX_STREAM_S = 3600.0  # the longest one stream lasts; the client resumes with Last-Event-ID
RETRY_MS = 2000
PAGE = 1000  # the store's page of events per read


def message(data: Any, *, event: str | None = None, event_id: int | None = None) -> str:
    """One SSE message; ``data`` is sent as compact JSON on one line."""
    head = (f"event: {event}\n" if event else "") + (f"id: {event_id}\n" if event_id is not None else "")
    return f"{head}data: {json.dumps(data, separators=(',', ':'), allow_nan=False)}\n\n"


async def job_event_stream(
    manager: JobManagerPort,
    job_id: str,
    principal: Principal,
    *,
    since: int = 0,
    steps: bool = False,
    steps_since: int = -1,
    max_s: float = MAX_STREAM_S,
    poll_s: float = POLL_S,
    keepalive_s: float = KEEPALIVE_S,
) -> AsyncIterator[str]:
    """The SSE messages of one client (see the module docstring); the job must exist for ``principal``."""
    started = last_sent = time.monotonic()
    seq, step_cursor = since, steps_since
    status = None
    terminal_seen = False
    yield f"retry: {RETRY_MS}\n\n"
    while True:
        try:
            job = await run_in_threadpool(manager.get, job_id, principal=principal)
        except JobNotFound:
            return
        out: list[str] = []
        if job.status != status:
            status = job.status
            out.append(message(JobOut.of(job).model_dump(mode="json"), event="status"))
        events = []
        while True:  # read the status first, then the events: none written before the end is missed
            batch = await run_in_threadpool(manager.events, job_id, seq, principal=principal)
            events += batch
            seq = batch[-1].seq if batch else seq
            if len(batch) < PAGE:
                break
        rows = []
        if steps:
            rows = await run_in_threadpool(manager.steps, job_id, step_cursor, principal=principal)
            step_cursor = rows[-1].step if rows else step_cursor
        out += _merged(events, rows)
        fresh = len(events)
        if out:
            yield "".join(out)
            last_sent = time.monotonic()
        if job.is_terminal:
            # End on the poll after the one that saw the end, if it brought nothing new: an event
            # written just after the terminal status (some paths write the status first) still goes out.
            if terminal_seen and fresh == 0:
                yield message(JobOut.of(job).model_dump(mode="json"), event="end")
                return
            terminal_seen = True
        now = time.monotonic()
        if now - started >= max_s:
            return
        if now - last_sent >= keepalive_s:
            yield ": keepalive\n\n"
            last_sent = now
        await asyncio.sleep(min(poll_s, max(0.0, max_s - (now - started))))


def _merged(events: list[EventRecord], rows: list[StepRecord]) -> list[str]:
    """Events (in seq order, never reordered: their ids must only grow) and step rows, interleaved by time."""
    out: list[str] = []
    i = 0
    for event in events:
        while i < len(rows) and rows[i].ts < event.ts:
            out.append(message(StepOut.of(rows[i]).model_dump(mode="json"), event="step"))
            i += 1
        out.append(message(EventOut.of(event).model_dump(mode="json"), event_id=event.seq))
    out += [message(StepOut.of(row).model_dump(mode="json"), event="step") for row in rows[i:]]
    return out
