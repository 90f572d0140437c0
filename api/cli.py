"""``etrain``: a thin command-line client of the REST API, plus ``etrain serve`` to run the server.

Every command except ``serve`` and ``prepare-data`` (which tokenizes text here) talks HTTP only
(``ETRAIN_URL``, default http://127.0.0.1:8000, and ``ETRAIN_API_TOKEN``), so it works the same
against a laptop server or a cluster. Without ``--token`` / ``ETRAIN_API_TOKEN``, a command sent to a
server on this machine (loopback URL) uses the token that server generated into
``$ETRAIN_DATA_DIR/api-token`` (default ``./.etrain``); a remote server never gets that file's token. Server errors are printed as field + message + fix and exit
non-zero. Every wait has a timeout (``--timeout`` per HTTP request, ``--max-wait`` for ``watch`` and
``logs -f``, ``--wait`` for ``cancel``). ``watch`` follows the server's event stream (server-sent
events, resumed with Last-Event-ID when the connection drops); ``logs -f`` follows a rank's log file.

Exit codes: 0 success (``watch``: the job SUCCEEDED; ``plan``: feasible; ``cancel``: CANCELLED), 1 an
error or a job that FAILED / was CANCELLED / an infeasible plan, 2 bad usage, 124 ``watch``, ``logs -f``
or ``cancel`` gave up waiting, 130 ^C.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_INTERRUPTED = 0, 1, 2, 124, 130


class ApiError(Exception):
    """The server answered with an error status; ``body`` is its JSON error (or raw text)."""

    def __init__(self, status_code: int, body: Any):
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code
        self.body = body


class CliError(Exception):
    """A problem on this side (unreadable spec file, server unreachable): message and optional fix."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix


class Client:
    """The REST API over httpx; every request has a timeout."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 30.0, transport=None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, *, json_body: Any = None, params: dict | None = None,
                timeout_s: float | None = None) -> Any:
        extra = {} if timeout_s is None else {"timeout": timeout_s}
        try:
            response = self._http.request(method, path, json=json_body, params=params, **extra)
        except httpx.TimeoutException as err:
            raise CliError(f"the server at {self.url} did not answer in time ({type(err).__name__}).",
                           fix="retry, or raise --timeout") from err
        except httpx.TransportError as err:
            raise CliError(f"cannot reach the etrain server at {self.url}: {err}",
                           fix="start it with `etrain serve`, or set ETRAIN_URL / --url") from err
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = response.text
            raise ApiError(response.status_code, body)
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None} or None)

    @contextmanager
    def stream(self, path: str, *, params: dict[str, Any], headers: dict[str, str],
               read_timeout_s: float) -> Iterator[httpx.Response]:
        """GET a streaming response (server-sent events); ``read_timeout_s`` bounds each wait for data."""
        timeout = httpx.Timeout(self.timeout_s, read=read_timeout_s)
        try:
            with self._http.stream("GET", path, params=params, headers=headers, timeout=timeout) as response:
                if response.status_code >= 400:
                    response.read()
                    try:
                        body = response.json()
                    except ValueError:
                        body = response.text
                    raise ApiError(response.status_code, body)
                yield response
        except httpx.ConnectError as err:
            raise CliError(f"cannot reach the etrain server at {self.url}: {err}",
                           fix="start it with `etrain serve`, or set ETRAIN_URL / --url") from err

    def post(self, path: str, body: Any = None, *, timeout_s: float | None = None) -> Any:
        return self.request("POST", path, json_body=body, timeout_s=timeout_s)


# -- output -----------------------------------------------------------------------------------------


def _when(ts: float | None) -> str:
    return "-" if ts is None else datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _clock(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _print_json(body: Any, out: TextIO) -> None:
    print(json.dumps(body, indent=2, ensure_ascii=False), file=out)


def print_error(err: ApiError | CliError, out: TextIO) -> None:
    if isinstance(err, CliError):
        print(f"error: {err.message}", file=out)
        if err.fix:
            print(f"  fix: {err.fix}", file=out)
        return
    body = err.body
    if not isinstance(body, dict) or "message" not in body:
        text = body if isinstance(body, str) else json.dumps(body)
        print(f"error (HTTP {err.status_code}): {text[:2000]}", file=out)
        return
    code = body.get("error", "error")
    details = body.get("detail") or []
    if details:
        print(f"error (HTTP {err.status_code}, {code}):", file=out)
        for item in details:
            field, message = item.get("field", ""), item.get("message", "")
            print(f"  {message}" if message.startswith(field) else f"  {field}: {message}", file=out)
            if item.get("fix"):
                print(f"    fix: {item['fix']}", file=out)
        if body.get("fix") and all(body["fix"] != item.get("fix") for item in details):
            print(f"  fix: {body['fix']}", file=out)
    else:
        print(f"error (HTTP {err.status_code}, {code}): {body['message']}", file=out)
        if body.get("fix"):
            print(f"  fix: {body['fix']}", file=out)


def _total_steps(job: dict[str, Any]) -> Any:
    return (job.get("spec") or {}).get("training", {}).get("steps", "?")


def print_job(job: dict[str, Any], out: TextIO) -> None:
    rows = [
        ("id", job["id"]),
        ("name", job["name"]),
        ("status", job["status"]),
        ("step", f"{job['step']} / {_total_steps(job)}"),
        ("loss", _num(job.get("loss"), ".4f")),
        ("tokens/s", _num(job.get("tokens_per_s"), ",.0f")),
        ("layout", f"{job.get('layout') or '-'} (world size {job['world_size']})"),
        ("restarts", f"{job['restarts']} (attempt {job.get('attempt', '-')})"),
        ("checkpoint", "-" if job.get("last_checkpoint_step") is None else f"step {job['last_checkpoint_step']}"),
        ("goodput", "-" if job.get("goodput") is None else f"{100 * job['goodput']:.1f}%"),
        ("stragglers", ", ".join(str(s) for s in job.get("stragglers") or []) or "-"),
        ("artifacts", ", ".join(f"{kind}: {path}" for kind, path in (job.get("artifacts") or {}).items()) or "-"),
        ("created", _when(job.get("created_at"))),
        ("updated", _when(job.get("updated_at"))),
    ]
    if job.get("error"):
        rows.append(("error", job["error"]))
    for label, value in rows:
        print(f"{label + ':':<12} {value}", file=out)


def print_job_table(jobs: list[dict[str, Any]], out: TextIO) -> None:
    if not jobs:
        print("no jobs", file=out)
        return
    header = ("ID", "NAME", "STATUS", "STEP", "LOSS", "TOKENS/S", "WORLD", "RESTARTS", "CREATED")
    rows = [
        (
            job["id"], job["name"], job["status"], f"{job['step']}/{_total_steps(job)}", _num(job.get("loss"), ".4f"),
            _num(job.get("tokens_per_s"), ",.0f"), str(job["world_size"]), str(job["restarts"]),
            _when(job.get("created_at")),
        )
        for job in jobs
    ]
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip(), file=out)


def _event_line(event: dict[str, Any]) -> str:
    detail = event.get("detail") or {}
    text = detail.get("message") if set(detail) == {"message"} else (json.dumps(detail) if detail else "")
    return f"[{_clock(event['ts'])}] {event['kind']}" + (f": {text}" if text else "")


def _step_line(step: dict[str, Any], total: Any) -> str:
    return (
        f"step {step['step']}/{total}  loss {_num(step.get('loss'), '.4f')}  "
        f"{_num(step.get('tokens_per_s'), ',.0f')} tokens/s"
    )


# -- commands ---------------------------------------------------------------------------------------


def load_spec(path: str) -> dict[str, Any]:
    """A job spec from a YAML or JSON file ("-": standard input)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise CliError(f"cannot read the spec file {path}: {err.strerror or err}.") from err
    try:
        if path.endswith(".json"):
            spec = json.loads(text)
        else:
            import yaml  # YAML is a superset of JSON: any other file is read as YAML

            spec = yaml.safe_load(text)
    except Exception as err:  # json.JSONDecodeError, yaml.YAMLError
        raise CliError(f"{path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {err}") from err
    if not isinstance(spec, dict):
        raise CliError(f"{path} must hold one job spec (a mapping with name, model, training, ...).")
    return spec


#: On Ctrl-C the server waits this long for open requests, then cancels them: an event stream
#: (``watch``) would otherwise hold the shutdown until its job ends.
SHUTDOWN_GRACE_S = 5.0
#: How long ``watch`` waits for a byte of the event stream before it reconnects (the server sends a
#: keepalive every 15 s, so a silent minute means the connection is gone).
STREAM_READ_TIMEOUT_S = 60.0


class _Watch:
    """What ``watch`` has shown so far: where to resume the stream and what to print next."""

    def __init__(self, out: TextIO, every: int):
        self.out, self.every = out, every
        self.since_event, self.since_step, self.status, self.total = 0, -1, None, "?"
        self.job: dict[str, Any] | None = None

    def on_job(self, job: dict[str, Any]) -> None:
        self.job, self.total = job, _total_steps(job)
        if job["status"] != self.status:
            self.status = job["status"]
            print(f"status: {self.status}", file=self.out)

    def on_step(self, step: dict[str, Any]) -> None:
        self.since_step = max(self.since_step, step["step"])
        if self.every <= 1 or step["step"] % self.every == 0 or step["step"] == self.total:
            print(_step_line(step, self.total), file=self.out)

    def on_event(self, event: dict[str, Any]) -> None:
        self.since_event = max(self.since_event, event["seq"])
        print(_event_line(event), file=self.out)

    def finish(self, job_id: str, job: dict[str, Any]) -> int:
        self.out.flush()
        summary = f"job {job_id} {job['status']} at step {job['step']}/{_total_steps(job)}"
        if job.get("loss") is not None:
            summary += f", loss {job['loss']:.4f}"
        if job.get("error"):
            summary += f": {job['error']}"
        print(summary, file=self.out)
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


def _follow_stream(client: Client, job_id: str, watch: _Watch, deadline: float) -> dict[str, Any] | None:
    """Print what one event-stream connection brings; the final job once the stream says ``end``,
    None when it closed or went silent first (the caller reconnects where it left off)."""
    params = {"follow": "true", "steps": "true", "steps_since": watch.since_step}
    headers = {"Accept": "text/event-stream", "Last-Event-ID": str(watch.since_event)}
    read_s = max(0.05, min(STREAM_READ_TIMEOUT_S, deadline - time.monotonic()))
    with client.stream(f"/v1/jobs/{job_id}/events", params=params, headers=headers, read_timeout_s=read_s) as response:
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            raise _NoStream()
        try:
            for event, _, data in sse_messages(response.iter_lines()):
                if event == "message":
                    watch.on_event(json.loads(data))
                elif event == "step":
                    watch.on_step(json.loads(data))
                elif event == "status":
                    watch.on_job(json.loads(data))
                elif event == "end":
                    return json.loads(data)
                watch.out.flush()
                if time.monotonic() >= deadline:
                    return None
        except (httpx.ReadTimeout, httpx.RemoteProtocolError, httpx.ReadError):
            return None  # silent or dropped: reconnect (or give up at the deadline)
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
) -> int:
    """Follow a job until it ends: its status, step metrics and events as they happen, from the server's
    event stream (GET /v1/jobs/{id}/events?follow=true; reconnects with Last-Event-ID when the
    connection drops). Exit code by outcome; EXIT_TIMEOUT after ``max_wait_s``."""
    deadline = time.monotonic() + max_wait_s
    watch = _Watch(out, every)
    while True:
        try:
            final = _follow_stream(client, job_id, watch, deadline)
        except _NoStream:
            return _watch_polling(client, job_id, watch, interval_s=interval_s, deadline=deadline,
                                  max_wait_s=max_wait_s, err=err)
        if final is not None:
            watch.on_job(final)
            return watch.finish(job_id, final)
        if not _wait_a_little(job_id, watch.status, deadline=deadline, interval_s=interval_s,
                              max_wait_s=max_wait_s, err=err):
            return EXIT_TIMEOUT


def _wait_a_little(job_id: str, status: str, *, deadline: float, interval_s: float, max_wait_s: float,
                   err: TextIO | None) -> bool:
    """Sleep until the next poll; False (after saying so) once ``deadline`` has passed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        print(f"gave up waiting after {max_wait_s:g}s; job {job_id} is still {status} "
              f"(`etrain watch {job_id}` to keep following)", file=err or sys.stderr)
        return False
    time.sleep(min(interval_s, remaining))
    return True


def _watch_polling(client: Client, job_id: str, watch: _Watch, *, interval_s: float, deadline: float,
                   max_wait_s: float, err: TextIO | None) -> int:
    """``watch`` against a server without an event stream: poll the job, its metrics and events."""
    while True:
        job = client.get(f"/v1/jobs/{job_id}")
        steps = client.get(f"/v1/jobs/{job_id}/metrics", since=watch.since_step)
        events = client.get(f"/v1/jobs/{job_id}/events", since=watch.since_event)
        watch.on_job(job)  # the state at the start of this poll, before what happened since
        lines = [(step["ts"], watch.on_step, step) for step in steps["steps"]]
        lines += [(event["ts"], watch.on_event, event) for event in events["events"]]
        for _, show, item in sorted(lines, key=lambda line: line[0]):  # stable: steps keep their order on ties
            show(item)
        watch.out.flush()
        if job["status"] in TERMINAL:
            return watch.finish(job_id, job)
        if not _wait_a_little(job_id, job["status"], deadline=deadline, interval_s=interval_s,
                              max_wait_s=max_wait_s, err=err):
            return EXIT_TIMEOUT


def _cmd_submit(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    job = client.post("/v1/jobs", load_spec(args.file))
    if args.json:
        _print_json(job, out)
    else:
        print(f"submitted {job['id']}: {job['status']}, layout {job.get('layout') or '-'} "
              f"(world size {job['world_size']})", file=out)
    if args.watch:
        return watch_job(client, job["id"], interval_s=args.interval, max_wait_s=args.max_wait, out=out, err=err)
    return EXIT_OK


def _cmd_list(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    body = client.get("/v1/jobs", status=args.status, limit=args.limit, offset=args.offset)
    if args.json:
        _print_json(body, out)
    else:
        print_job_table(body["jobs"], out)
    return EXIT_OK


def _cmd_status(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    job = client.get(f"/v1/jobs/{args.job_id}")
    if args.json:
        _print_json(job, out)
    else:
        print_job(job, out)
    return EXIT_OK


def _cmd_watch(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    return watch_job(
        client, args.job_id, interval_s=args.interval, max_wait_s=args.max_wait, out=out, err=err, every=args.every
    )


def _cmd_cancel(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """POST cancel (the server answers 202 at once), then poll the job until it is terminal, printing
    each status it passes through (``--no-wait``: do not wait; ``--wait S``: give up after S, exit 124)."""
    job = client.post(f"/v1/jobs/{args.job_id}/cancel")
    if args.json and (args.no_wait or job["status"] in TERMINAL):
        _print_json(job, out)
        return EXIT_OK
    if job["status"] in TERMINAL or args.no_wait:
        print(f"{job['id']}: {job['status']}" + ("" if job["status"] in TERMINAL else " (cancel requested)"),
              file=out)
        return EXIT_OK
    if not args.json:
        print(f"{job['id']}: cancel requested ({job['status']})", file=out)
        out.flush()
    deadline = time.monotonic() + args.wait
    status = job["status"]
    while job["status"] not in TERMINAL:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            print(f"gave up waiting after {args.wait:g}s; job {job['id']} is still {job['status']} "
                  f"(the cancel stays requested: `etrain status {job['id']}`)", file=err)
            return EXIT_TIMEOUT
        time.sleep(min(args.interval, remaining))
        job = client.get(f"/v1/jobs/{args.job_id}")
        if job["status"] != status and not args.json:
            status = job["status"]
            print(f"{job['id']}: {status}", file=out)
            out.flush()
    if args.json:
        _print_json(job, out)
    return EXIT_OK if job["status"] == "CANCELLED" else EXIT_FAILED


def _cmd_scale(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    job = client.post(f"/v1/jobs/{args.job_id}/scale", {"dp": args.dp})
    if args.json:
        _print_json(job, out)
    else:
        print(f"{job['id']}: resize to dp={args.dp} requested; now {job['status']}, "
              f"layout {job.get('layout') or '-'} (world size {job['world_size']})", file=out)
    return EXIT_OK


def _cmd_logs(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Print a rank's recent log lines; ``-f`` keeps printing new ones (GET /logs?offset=) until the job
    ends, or ``--max-wait``. A job that has not started yet is waited for under ``-f``."""
    path = f"/v1/jobs/{args.job_id}/logs"
    deadline = time.monotonic() + args.max_wait
    offset, waiting_said, job_over = None, False, False
    while True:
        try:
            body = client.get(path, rank=args.rank, tail=args.tail, offset=offset)
        except ApiError as error:
            if not (args.follow and error.status_code == 409):
                raise
            body = None  # not started yet: wait for it
            if not waiting_said:
                print(f"waiting for job {args.job_id} to start ...", file=err)
                waiting_said = True
        if body is not None:
            if args.json:
                _print_json(body, out)
            else:
                for line in body["lines"]:
                    print(line, file=out)
            out.flush()
            offset = body["next_offset"]
        if not args.follow:
            return EXIT_OK
        if job_over and (body is None or not body["lines"]):
            return EXIT_OK  # the job ended and its last lines are printed
        if body is not None and len(body["lines"]) >= args.tail:
            continue  # more is waiting: read on at once
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            print(f"gave up following after {args.max_wait:g}s", file=err)
            return EXIT_TIMEOUT
        time.sleep(min(args.interval, remaining))
        job_over = client.get(f"/v1/jobs/{args.job_id}")["status"] in TERMINAL


def _cmd_events(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    body = client.get(f"/v1/jobs/{args.job_id}/events", since=args.since)
    if args.json:
        _print_json(body, out)
    else:
        for event in body["events"]:
            print(_event_line(event), file=out)
    return EXIT_OK


def _cmd_cluster(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    body = client.get("/v1/cluster")
    if args.json:
        _print_json(body, out)
        return EXIT_OK
    totals = body["totals"]
    print(f"nodes {totals['alive_nodes']}/{totals['nodes']} alive   CPUs {totals['free_cpus']:g} free of "
          f"{totals['cpus']:g}   GPUs {totals['free_gpus']:g} free of {totals['gpus']:g}   "
          f"jobs {totals['running_jobs']} started, {totals['queued_jobs']} queued", file=out)
    for node in body["nodes"]:
        print(f"  node {node['node_id'][:12]}  {'alive' if node['alive'] else 'DEAD '}  CPUs {node['free_cpus']:g}/"
              f"{node['cpus']:g} free  GPUs {node['free_gpus']:g}/{node['gpus']:g} free", file=out)
    if body["jobs"]:
        print("holding:", file=out)
        for job in body["jobs"]:
            print(f"  {job['job_id']:<28} {job['status']:<10} prio {job['priority']:>4}  {job['world_size']} ranks  "
                  f"{job['cpus']:g} CPUs  {job['gpus']:g} GPUs", file=out)
    if body["queue"]:
        print("queue:", file=out)
        for entry in body["queue"]:
            print(f"  {entry['position']:>3}. {entry['job_id']:<28} prio {entry['priority']:>4}  {entry['reason']}",
                  file=out)
    return EXIT_OK


def _cmd_plan(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    report = client.post("/v1/plan", load_spec(args.file))
    if args.json:
        _print_json(report, out)
        return EXIT_OK if report.get("feasible") else EXIT_FAILED
    feasible = bool(report.get("feasible"))
    print(f"feasible: {'yes' if feasible else 'no'}", file=out)
    if report.get("layout"):
        print(f"layout:   {report['layout']}", file=out)
    for problem in report.get("problems") or []:
        print(f"  {problem['field']}: {problem['message']}", file=out)
        if problem.get("fix"):
            print(f"    fix: {problem['fix']}", file=out)
    estimate = report.get("estimate") or {}
    memory = (estimate.get("memory") or {}).get("gib") or {}
    if memory:
        parts = ", ".join(f"{k} {v:g}" for k, v in memory.items() if k != "total")
        print(f"memory per rank: {memory.get('total', '?')} GiB ({parts})", file=out)
    if "bubble_fraction" in estimate:
        print(f"pipeline bubble: {100 * estimate['bubble_fraction']:.1f}%", file=out)
    step_time = estimate.get("step_time") or {}
    if "total_s" in step_time:
        print(f"estimated step time: {step_time['total_s']:.4g}s", file=out)
    return EXIT_OK if feasible else EXIT_FAILED


def _cmd_export(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """POST /v1/jobs/{id}/export and print the folder. ``--out`` is made absolute here, against the
    directory the command runs in: the server writes it, so both must see the same filesystem."""
    body = {"step": args.step, "out": os.path.abspath(os.path.expanduser(args.out))}
    result = client.post(f"/v1/jobs/{args.job_id}/export", body, timeout_s=args.max_wait)
    if args.json:
        _print_json(result, out)
    else:
        print(result["hf"], file=out)
    return EXIT_OK


def _cmd_chaos(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    request = {"action": args.action, "rank": args.rank, "factor": args.factor, "step": args.step,
               "at_step": args.at_step}
    order = client.post(f"/v1/jobs/{args.job_id}/chaos", {k: v for k, v in request.items() if v is not None})
    _print_json(order, out)
    return EXIT_OK


class ProgressBar:
    """``etrain prepare-data``'s progress: one line on ``stream`` (stderr) redrawn in place, at most every
    ``interval_s`` seconds and always at 100%; a new stage (hashing, then tokenizing) starts a new line."""

    WIDTH = 30

    def __init__(self, stream: TextIO, *, interval_s: float = 0.2):
        self.stream = stream
        self.interval_s = interval_s
        self._stage: str | None = None
        self._started = self._drawn = 0.0

    def __call__(self, stage: str, done: int, total: int, tokens: int) -> None:
        now = time.monotonic()
        if stage != self._stage:
            if self._stage is not None:
                self.stream.write("\n")
            self._stage, self._started, self._drawn = stage, now, 0.0
        elif done < total and now - self._drawn < self.interval_s:
            return
        self._drawn = now
        fraction = done / total if total else 1.0
        filled = min(self.WIDTH, int(fraction * self.WIDTH))
        mib = 1 << 20
        rate = done / mib / max(now - self._started, 1e-6)
        line = (f"{stage:<10} {100 * fraction:5.1f}% |{'#' * filled}{'.' * (self.WIDTH - filled)}| "
                f"{done / mib:.1f}/{total / mib:.1f} MiB  {rate:.1f} MiB/s")
        if stage == "tokenizing":
            line += f"  {tokens:,} tokens"
        self.stream.write("\r" + line)
        self.stream.flush()

    def close(self) -> None:
        if self._stage is not None:
            self.stream.write("\n")
            self.stream.flush()
            self._stage = None


def _cmd_prepare_data(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Tokenize text with a tokenizer.json into the cache a ``data: {kind: text, tokenizer: ...}`` job reads
    (or into ``--out``), here, with no server and no time limit; print the file and its token count."""
    from etrain.workers.protocol.errors import EtrainError
    from etrain.workers.tokenized import tokenize_text

    bar = ProgressBar(err)
    try:
        cache = tokenize_text(args.path, args.tokenizer, out=args.out, progress=bar)
    except EtrainError as error:
        bar.close()
        print_error(CliError(error.message, error.fix), err)
        return EXIT_FAILED
    except KeyboardInterrupt:
        bar.close()
        return EXIT_INTERRUPTED
    bar.close()
    if args.json:
        _print_json({**cache.sidecar(), "reused": cache.reused}, out)
        return EXIT_OK
    eos = f"EOS {cache.eos_token!r}" if cache.eos_token else "no EOS"
    print(f"cache:  {cache.path} ({'reused' if cache.reused else 'written'})", file=out)
    print(f"tokens: {cache.num_tokens} {cache.dtype} ({cache.documents} documents, {eos}, "
          f"tokenizer vocab {cache.vocab_size})", file=out)
    return EXIT_OK


def _server_settings(args: argparse.Namespace, out: TextIO):
    """Settings from the environment and the flags; with no token configured at all, the admin token
    from ``<data-dir>/api-token`` (generated at the first start, mode 0600), and a line saying where."""
    import dataclasses

    from etrain.service.settings import Settings

    settings = Settings.from_env(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        ray_address=args.ray_address,
        enable_chaos=True if args.enable_chaos else None,
    )
    if settings.auth_configured:
        return settings
    from etrain.service.access.api_token import ensure_api_token

    provisioned = ensure_api_token(settings.data_dir)
    print(f"API token:      {provisioned.path.resolve()} ({'generated' if provisioned.created else 'existing'}, "
          "mode 0600; the admin token: `etrain` reads it for a server on this machine when ETRAIN_DATA_DIR "
          "points at this data directory, other clients send it as 'Authorization: Bearer <token>')", file=out)
    return dataclasses.replace(settings, api_token=provisioned.token)


def _is_local(url: str) -> bool:
    import ipaddress
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_token(url: str, token: str | None) -> str | None:
    """``--token`` / ETRAIN_API_TOKEN; else, for a server on this machine, the token it generated into
    ``$ETRAIN_DATA_DIR/api-token`` (default ./.etrain). Never that file's token for a remote URL."""
    if token:
        return token
    if not _is_local(url):
        return None
    from etrain.service.access.api_token import read_api_token, token_path

    try:
        return read_api_token(token_path(os.environ.get("ETRAIN_DATA_DIR") or ".etrain"))
    except FileNotFoundError:
        return None  # the server answers 401 with the fix
    except Exception as error:  # an unsafe token file (SettingsError): say why, never use it
        from etrain.workers.protocol.errors import EtrainError

        if not isinstance(error, EtrainError):
            raise
        raise CliError(error.message, error.fix) from None


def _announce(settings: Any, out: TextIO):
    """``on_ready`` callback: print where everything is once the manager (and Ray) is up."""

    def ready(manager: Any) -> None:
        runtime = getattr(manager, "runtime", None)
        dashboard = getattr(runtime, "dashboard_url", None) or (
            settings.dashboard_url if settings.ray_address is None else f"see the Ray cluster at {settings.ray_address}"
        )
        print(f"etrain API:     {settings.api_url}  (docs: {settings.api_url}/docs)", file=out)
        print(f"Ray dashboard:  {dashboard}", file=out)
        hint = getattr(runtime, "dashboard_token_hint", None)
        if hint:
            print(f"                {hint}", file=out)
        print(f"data directory: {settings.data_dir.resolve()}", file=out)
        if settings.enable_chaos:
            print("fault injection (chaos) is ENABLED", file=out)
        out.flush()

    print(f"starting etrain on {settings.api_url} (Ray: {settings.ray_address or 'a new local instance'}) ...",
          file=out)
    out.flush()
    return ready


def _cmd_serve(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import uvicorn

    from etrain.api.app import create_app

    settings = _server_settings(args, out)
    app = create_app(settings, on_ready=_announce(settings, out))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level,
                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Server (local Ray, API, dashboard) and a job in one process: ``make run``.

    The server runs on the main thread, so Ctrl-C shuts it down the normal way (workers stopped, Ray
    shut down); a helper thread waits for it, submits the spec and follows the job.
    """
    import threading

    import uvicorn

    from etrain.api.app import create_app

    spec = load_spec(args.file)  # a broken file fails before Ray starts
    settings = _server_settings(args, out)
    app = create_app(settings, on_ready=_announce(settings, out))
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    outcome: dict[str, int] = {}

    def drive() -> None:
        deadline = time.monotonic() + args.start_timeout
        while not server.started:
            if server.should_exit or time.monotonic() > deadline:
                if not server.should_exit:
                    print(f"error: the server did not start within {args.start_timeout:g}s", file=err)
                    outcome["code"] = EXIT_TIMEOUT
                    server.should_exit = True
                return
            time.sleep(0.1)
        client = Client(settings.api_url, token=settings.api_token, timeout_s=args.timeout)
        try:
            job = client.post("/v1/jobs", spec)
            print(f"submitted {job['id']}: layout {job.get('layout') or '-'} (world size {job['world_size']})",
                  file=out)
            outcome["code"] = watch_job(client, job["id"], interval_s=args.interval, max_wait_s=args.max_wait,
                                        out=out, err=err)
            if args.exit_when_done:
                server.should_exit = True
            else:
                print(f"the API ({settings.api_url}) and the Ray dashboard stay up; Ctrl-C stops everything",
                      file=out)
                out.flush()
        except (ApiError, CliError) as error:
            if not server.should_exit:  # errors while shutting down are expected; stay quiet
                print_error(error, err)
                outcome["code"] = EXIT_FAILED
                server.should_exit = True
        finally:
            client.close()

    driver = threading.Thread(target=drive, name="etrain-demo", daemon=True)
    driver.start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shut down cleanly, then re-raised the signal
        return outcome.get("code", EXIT_INTERRUPTED)
    finally:
        server.should_exit = True
        driver.join(timeout=5)
    if server.started is False and "code" not in outcome:
        return EXIT_FAILED  # the server never came up (uvicorn has logged why)
    return outcome.get("code", EXIT_INTERRUPTED)


# -- argument parsing -------------------------------------------------------------------------------


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="etrain", description="Elastic training service client and server.")
    parser.add_argument("--url", default=os.environ.get("ETRAIN_URL", DEFAULT_URL),
                        help="API URL (env ETRAIN_URL; default %(default)s)")
    parser.add_argument("--token", default=os.environ.get("ETRAIN_API_TOKEN"),
                        help="API token (env ETRAIN_API_TOKEN; default for a server on this machine: "
                             "$ETRAIN_DATA_DIR/api-token, ETRAIN_DATA_DIR default ./.etrain)")
    parser.add_argument("--timeout", type=_positive, default=30.0, help="seconds per HTTP request (default 30)")
    parser.add_argument("--json", action="store_true", help="print the server's JSON instead of text")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_server_options(command: argparse.ArgumentParser, *, log_level: str) -> None:
        command.add_argument("--host", help="bind address (env ETRAIN_HOST; default 127.0.0.1)")
        command.add_argument("--port", type=int, help="port (env ETRAIN_PORT; default 8000)")
        command.add_argument("--data-dir",
                             help="jobs database and checkpoints (env ETRAIN_DATA_DIR; default ./.etrain)")
        command.add_argument("--ray-address", help="existing Ray cluster (env ETRAIN_RAY_ADDRESS; default: start one)")
        command.add_argument("--enable-chaos", action="store_true",
                             help="allow fault injection (env ETRAIN_ENABLE_CHAOS=1)")
        command.add_argument("--log-level", default=log_level,
                             choices=["trace", "debug", "info", "warning", "error", "critical"])

    def add_wait_options(command: argparse.ArgumentParser) -> None:
        command.add_argument("--interval", type=_positive, default=1.0, help="seconds between polls (default 1)")
        command.add_argument("--max-wait", type=_positive, default=24 * 3600.0,
                             help="give up (exit 124) after this many seconds (default 86400)")

    serve = commands.add_parser("serve", help="run the API server (starts or joins Ray)")
    add_server_options(serve, log_level="info")

    demo = commands.add_parser("demo", help="serve (local Ray + API + dashboard) and run one job: `make run`")
    demo.add_argument("file", help="job spec (YAML or JSON)")
    add_server_options(demo, log_level="warning")
    add_wait_options(demo)
    demo.add_argument("--start-timeout", type=_positive, default=300.0,
                      help="seconds to wait for the server and Ray to come up (default 300)")
    demo.add_argument("--exit-when-done", action="store_true",
                      help="stop the server when the job ends (default: keep serving until Ctrl-C)")

    submit = commands.add_parser("submit", help="submit a job spec (YAML or JSON file, '-' for stdin)")
    submit.add_argument("file")
    submit.add_argument("--watch", action="store_true", help="follow the job until it ends")
    add_wait_options(submit)

    listing = commands.add_parser("list", help="list jobs, newest first")
    listing.add_argument("--status", help="only jobs in this status (e.g. RUNNING)")
    listing.add_argument("--limit", type=int, default=100)
    listing.add_argument("--offset", type=int, default=0)

    commands.add_parser("status", help="show one job").add_argument("job_id")

    watch = commands.add_parser("watch", help="follow a job: steps, loss, tokens/s, events; exit 0 on success")
    watch.add_argument("job_id")
    watch.add_argument("--every", type=int, default=1, help="print every Nth step (default: all)")
    add_wait_options(watch)

    cancel = commands.add_parser("cancel", help="cancel a job and wait until it has stopped")
    cancel.add_argument("job_id")
    cancel.add_argument("--no-wait", action="store_true", help="return once the cancel is requested")
    cancel.add_argument("--wait", type=_positive, default=120.0,
                        help="give up waiting (exit 124) after this many seconds (default 120)")
    cancel.add_argument("--interval", type=_positive, default=0.5, help="seconds between polls (default 0.5)")

    logs = commands.add_parser("logs", help="print a rank's recent log lines (-f: keep following)")
    logs.add_argument("job_id")
    logs.add_argument("--rank", type=int, default=0, help="the rank (default 0)")
    logs.add_argument("--tail", type=int, default=200, help="how many recent lines (default 200, at most 10000)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    add_wait_options(logs)

    scale = commands.add_parser("scale", help="resize a job's data parallelism")
    scale.add_argument("job_id")
    scale.add_argument("--dp", type=int, required=True, help="the new data-parallel degree")

    events = commands.add_parser("events", help="print a job's events")
    events.add_argument("job_id")
    events.add_argument("--since", type=int, default=0, help="only events after this sequence number")

    commands.add_parser("cluster", help="show nodes, free CPUs/GPUs, what each job holds and the queue")

    plan = commands.add_parser("plan", help="check a spec and show the planner's estimate; starts nothing")
    plan.add_argument("file")

    export = commands.add_parser(
        "export", help="write a committed checkpoint as a Hugging Face folder (from_pretrained loads it)"
    )
    export.add_argument("job_id")
    export.add_argument("--step", type=int, help="a committed checkpoint step (default: the newest)")
    export.add_argument("--out", required=True, help="a new or empty folder to write")
    export.add_argument("--max-wait", type=_positive, default=3600.0,
                        help="seconds to wait for the export (default 3600)")

    chaos = commands.add_parser("chaos", help="inject a fault (servers started with --enable-chaos)")
    chaos.add_argument("job_id")
    chaos.add_argument("action", choices=["kill_rank", "kill_actor", "slow_rank", "hang_rank", "corrupt_checkpoint"])
    chaos.add_argument("--rank", type=int)
    chaos.add_argument("--factor", type=float)
    chaos.add_argument("--step", type=int, help="corrupt_checkpoint: the checkpoint step")
    chaos.add_argument("--at-step", type=int, help="inject when the job reaches this step")

    prepare = commands.add_parser(
        "prepare-data",
        help="tokenize text once with a tokenizer.json into the cache `data: {kind: text, tokenizer: ...}` "
             "reads (runs here; no server)",
    )
    prepare.add_argument("path", help="a UTF-8 text file or a folder of text files (data.path)")
    prepare.add_argument("--tokenizer", required=True,
                         help="a Hugging Face tokenizer.json, or the folder holding one (data.tokenizer)")
    prepare.add_argument("--out", help="write the .bin here instead of the cache beside the data "
                                       "(then train with data.kind: tokens)")
    return parser


_COMMANDS = {
    "submit": _cmd_submit,
    "list": _cmd_list,
    "status": _cmd_status,
    "watch": _cmd_watch,
    "cancel": _cmd_cancel,
    "logs": _cmd_logs,
    "scale": _cmd_scale,
    "events": _cmd_events,
    "cluster": _cmd_cluster,
    "plan": _cmd_plan,
    "export": _cmd_export,
    "chaos": _cmd_chaos,
}


def main(argv: list[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    for stream in (out, err):
        if hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="replace")  # layout strings use "·"; never crash on a C locale
            except (ValueError, OSError):
                pass
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if args.command in ("serve", "demo"):
        try:
            return (_cmd_serve if args.command == "serve" else _cmd_demo)(args, out, err)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except Exception as error:  # a settings error or Ray failing to start: say so, no traceback
            from etrain.workers.protocol.errors import EtrainError

            if not isinstance(error, EtrainError):
                raise
            print_error(CliError(error.message, error.fix), err)
            return EXIT_FAILED
        except CliError as error:
            print_error(error, err)
            return EXIT_FAILED
    if args.command == "prepare-data":
        return _cmd_prepare_data(args, out, err)
    try:
        token = client_token(args.url, args.token)
    except CliError as error:
        print_error(error, err)
        return EXIT_FAILED
    client = Client(args.url, token=token, timeout_s=args.timeout)
    try:
        return _COMMANDS[args.command](client, args, out, err)
    except (ApiError, CliError) as error:
        print_error(error, err)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
