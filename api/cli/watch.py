"""Following a job until it ends (``watch``, ``submit --watch``, ``demo``): status, steps and events.

It follows the server's event stream (``GET /v1/jobs/{id}/events?follow=true``, server-sent events),
reconnecting with ``Last-Event-ID`` when the connection drops or goes silent, so nothing is printed
twice or skipped; against a server without a stream it polls instead. Every wait is bounded by
``--max-wait`` (exit 124). What it shows goes to a display (``progress.py``): a live bar on a
terminal, plain lines elsewhere. Ctrl-C stops following with one line (exit 130); the job goes on.
Another thread may stop a watch through :class:`WatchControl` (``demo`` does, when its server stops).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

import httpx

from etrain.api.cli.client import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TIMEOUT, TERMINAL, Client
from etrain.api.cli.output import total_steps
from etrain.api.cli.progress import Display, make_display

#: How long ``watch`` waits for a byte of the event stream before it reconnects (the server sends a
#: keepalive every 15 s, so a silent minute means the connection is gone).
STREAM_READ_TIMEOUT_S = 60.0


class WatchControl:
    """Stops a watch from another thread: :meth:`stop` sets the flag and shuts the socket of the open
    event stream, so a read blocked on it returns at once (and the server's stream ends with it, rather
    than holding the server's shutdown for its grace period)."""

    def __init__(self) -> None:
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def attach(self, response: httpx.Response) -> None:
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        with self._lock:
            self._sock = sock
            if self.stopped:
                self._shut()

    def detach(self) -> None:
        with self._lock:
            self._sock = None

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; True (at once) if the watch is stopped meanwhile."""
        return self._stopped.wait(timeout_s)

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()
            self._shut()

    def _shut(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed


class _Watch:
    """What ``watch`` has shown so far: where to resume the stream, and the display it shows things on."""

    def __init__(self, out: TextIO, display: Display, every: int):
        self.out, self.display, self.every = out, display, every
        self.since_event, self.since_step, self.status, self.total = 0, -1, None, "?"
        self.job: dict[str, Any] | None = None

    def on_job(self, job: dict[str, Any]) -> None:
        self.job, self.total = job, total_steps(job)
        changed = job["status"] != self.status
        self.status = job["status"]
        self.display.job(job, changed=changed)

    def on_step(self, step: dict[str, Any]) -> None:
        self.since_step = max(self.since_step, step["step"])
        shown = self.every <= 1 or step["step"] % self.every == 0 or step["step"] == self.total
        self.display.step(step, shown=shown)

    def on_event(self, event: dict[str, Any]) -> None:
        self.since_event = max(self.since_event, event["seq"])
        self.display.event(event)

    def finish(self, job_id: str, job: dict[str, Any]) -> int:
        self.display.close()
        summary = f"job {job_id} {job['status']} at step {job['step']}/{total_steps(job)}"
        if job.get("loss") is not None:
            summary += f", loss {job['loss']:.4f}"
        if job.get("error"):
            summary += f": {job['error']}"
        print(summary, file=self.out)
        self.out.flush()
        return EXIT_OK if job["status"] == "SUCCEEDED" else EXIT_FAILED


class _NoStream(Exception):
    """The server answered GET /events?follow=true with JSON: it has no event stream (an older server)."""


def sse_messages(lines: Iterator[str]) -> Iterator[tuple[str, str | None, str]]:
    """``(event, id, data)`` per server-sent event (``event`` "message" by default); a comment line
    (the keepalive) yields ``("comment", None, text)``."""
    event, event_id, data = None, None, []
    for line in lines:
        if not line:
            if data or event:
                yield event or "message", event_id, "\n".join(data)
            event, event_id, data = None, None, []
        elif line.startswith(":"):
            yield "comment", None, line[1:].strip()
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data.append(value)
            elif name == "event":
                event = value
            elif name == "id":
                event_id = value


def _follow_stream(
    client: Client, job_id: str, watch: _Watch, deadline: float, control: WatchControl
) -> dict[str, Any] | None:
    """Show what one event-stream connection brings; the final job once the stream says ``end``,
    None when it closed or went silent first (the caller reconnects where it left off)."""
    params = {"follow": "true", "steps": "true", "steps_since": watch.since_step}
    headers = {"Accept": "text/event-stream", "Last-Event-ID": str(watch.since_event)}
    read_s = max(0.05, min(STREAM_READ_TIMEOUT_S, deadline - time.monotonic()))
    with client.stream(f"/v1/jobs/{job_id}/events", params=params, headers=headers, read_timeout_s=read_s) as response:
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            raise _NoStream()
        control.attach(response)
        try:
            for event, _, data in sse_messages(response.iter_lines()):
                if control.stopped:
                    return None
                if event == "message":
                    watch.on_event(json.loads(data))
                elif event == "step":
                    watch.on_step(json.loads(data))
                elif event == "status":
                    watch.on_job(json.loads(data))
                elif event == "end":
                    return json.loads(data)
                if time.monotonic() >= deadline:
                    return None
        except (httpx.ReadTimeout, httpx.RemoteProtocolError, httpx.ReadError):
            return None  # silent, dropped or stopped: reconnect (or give up at the deadline, or stop)
        finally:
            control.detach()
    return None


def watch_job(
    client: Client,
    job_id: str,
    *,
    interval_s: float,
    max_wait_s: float,
    out: TextIO,
    err: TextIO | None = None,
    every: int = 1,
    display: Display | None = None,
    control: WatchControl | None = None,
    plain: bool = False,
) -> int:
    """Follow a job until it ends: its status, step metrics and events as they happen, from the server's
    event stream (GET /v1/jobs/{id}/events?follow=true; reconnects with Last-Event-ID when the
    connection drops), shown on ``display`` (default: a bar on a terminal, else plain lines). Exit code
    by outcome; EXIT_TIMEOUT after ``max_wait_s``; EXIT_INTERRUPTED on Ctrl-C (one line says the job
    goes on) or when ``control`` is stopped (silently: whoever stopped it says why)."""
    err = err or sys.stderr
    control = control or WatchControl()
    display = display or make_display(out, plain=plain)
    watch = _Watch(out, display, every)
    try:
        return _watch(client, job_id, watch, control, interval_s=interval_s, max_wait_s=max_wait_s, err=err)
    except KeyboardInterrupt:
        display.close()
        print(
            f"interrupted: stopped following job {job_id}; the job goes on (`etrain watch {job_id}` follows it "
            f"again, `etrain cancel {job_id}` stops it)",
            file=err,
        )
        return EXIT_INTERRUPTED
    finally:
        display.close()


def _watch(
    client: Client,
    job_id: str,
    watch: _Watch,
    control: WatchControl,
    *,
    interval_s: float,
    max_wait_s: float,
    err: TextIO,
) -> int:
    deadline = time.monotonic() + max_wait_s
    while True:
        try:
            final = _follow_stream(client, job_id, watch, deadline, control)
        except _NoStream:
            return _watch_polling(
                client, job_id, watch, control, interval_s=interval_s, deadline=deadline, max_wait_s=max_wait_s, err=err
            )
        if control.stopped:
            return EXIT_INTERRUPTED
        if final is not None:
            watch.on_job(final)
            return watch.finish(job_id, final)
        if not _wait_a_little(
            job_id,
            watch.status,
            deadline=deadline,
            interval_s=interval_s,
            max_wait_s=max_wait_s,
            err=err,
            control=control,
        ):
            return EXIT_INTERRUPTED if control.stopped else EXIT_TIMEOUT


def _wait_a_little(
    job_id: str,
    status: str,
    *,
    deadline: float,
    interval_s: float,
    max_wait_s: float,
    err: TextIO,
    control: WatchControl,
) -> bool:
    """Sleep until the next poll; False once ``deadline`` has passed (after saying so) or the watch was stopped."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        print(
            f"gave up waiting after {max_wait_s:g}s; job {job_id} is still {status} "
            f"(`etrain watch {job_id}` to keep following)",
            file=err,
        )
        return False
    return not control.wait(min(interval_s, remaining))


def _watch_polling(
    client: Client,
    job_id: str,
    watch: _Watch,
    control: WatchControl,
    *,
    interval_s: float,
    deadline: float,
    max_wait_s: float,
    err: TextIO,
) -> int:
    """``watch`` against a server without an event stream: poll the job, its metrics and events."""
    while True:
        job = client.get(f"/v1/jobs/{job_id}")
        steps = client.get(f"/v1/jobs/{job_id}/metrics", since=watch.since_step)
        events = client.get(f"/v1/jobs/{job_id}/events", since=watch.since_event)
        if control.stopped:
            return EXIT_INTERRUPTED
        watch.on_job(job)  # the state at the start of this poll, before what happened since
        lines = [(step["ts"], watch.on_step, step) for step in steps["steps"]]
        lines += [(event["ts"], watch.on_event, event) for event in events["events"]]
        for _, show, item in sorted(lines, key=lambda line: line[0]):  # stable: steps keep their order on ties
            show(item)
        if job["status"] in TERMINAL:
            return watch.finish(job_id, job)
        if not _wait_a_little(
            job_id,
            job["status"],
            deadline=deadline,
            interval_s=interval_s,
            max_wait_s=max_wait_s,
            err=err,
            control=control,
        ):
            return EXIT_INTERRUPTED if control.stopped else EXIT_TIMEOUT
