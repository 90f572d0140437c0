"""How the CLI prints what the server says: jobs, job tables, events, steps and errors.

One place for the text formats, so ``status``, ``list``, ``watch``, ``events`` and ``demo`` print a job
or an event the same way, and every error reads as field + message + fix whichever command hit it.
``--json`` bypasses all of this (:func:`print_json`).
"""

from __future__ import annotations

import datetime
import json
from typing import Any, TextIO

from etrain.api.cli.client import ApiError, CliError


def _when(ts: float | None) -> str:
    return "-" if ts is None else datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _clock(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_json(body: Any, out: TextIO) -> None:
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


def total_steps(job: dict[str, Any]) -> Any:
    return (job.get("spec") or {}).get("training", {}).get("steps", "?")


def print_job(job: dict[str, Any], out: TextIO) -> None:
    rows = [
        ("id", job["id"]),
        ("name", job["name"]),
        ("status", job["status"]),
        ("step", f"{job['step']} / {total_steps(job)}"),
        ("loss", _num(job.get("loss"), ".4f")),
        ("tokens/s", _num(job.get("tokens_per_s"), ",.0f")),
        ("layout", f"{job.get('layout') or '-'} (world size {job['world_size']})"),
        ("restarts", f"{job['restarts']} (attempt {job.get('attempt', '-')})"),
        ("checkpoint", "-" if job.get("last_checkpoint_step") is None else f"step {job['last_checkpoint_step']}"),
        ("goodput", "-" if job.get("goodput") is None else f"{100 * job['goodput']:.1f}%"),
        ("time lost", _time_lost(job.get("goodput_breakdown"))),
        ("stragglers", ", ".join(str(s) for s in job.get("stragglers") or []) or "-"),
        ("host memory", _host_memory(job)),
        ("artifacts", ", ".join(f"{kind}: {path}" for kind, path in (job.get("artifacts") or {}).items()) or "-"),
        ("created", _when(job.get("created_at"))),
        ("updated", _when(job.get("updated_at"))),
    ]
    if job.get("error"):
        rows.append(("error", job["error"]))
    for label, value in rows:
        print(f"{label + ':':<12} {value}", file=out)


def _host_memory(job: dict[str, Any]) -> str:
    """What each rank reserves, and what the rank holding the most held at the latest sample."""
    held = job.get("host_memory_gib")
    reserved = ((job.get("spec") or {}).get("resources") or {}).get("host_memory_gb")
    said = f"{reserved:g} GiB reserved a rank" if reserved else "none reserved"
    return f"{said}; the largest rank holds {held:.2f} GiB (latest sample)" if held is not None else said


def _time_lost(breakdown: dict[str, float] | None, shown: int = 4) -> str:
    """The wall time that was not productive, by cause, largest first (the job's ``goodput_breakdown``)."""
    if not breakdown:
        return "-"
    lost = sorted(
        ((cause, seconds) for cause, seconds in breakdown.items() if cause != "productive" and seconds >= 0.05),
        key=lambda item: -item[1],
    )
    if not lost:
        return "none"
    text = ", ".join(f"{cause.replace('_', ' ')} {seconds:.1f}s" for cause, seconds in lost[:shown])
    return text + (f" (+{len(lost) - shown} more)" if len(lost) > shown else "")


def print_job_table(jobs: list[dict[str, Any]], out: TextIO) -> None:
    if not jobs:
        print("no jobs", file=out)
        return
    header = ("ID", "NAME", "STATUS", "STEP", "LOSS", "TOKENS/S", "WORLD", "RESTARTS", "CREATED")
    rows = [
        (
            job["id"],
            job["name"],
            job["status"],
            f"{job['step']}/{total_steps(job)}",
            _num(job.get("loss"), ".4f"),
            _num(job.get("tokens_per_s"), ",.0f"),
            str(job["world_size"]),
            str(job["restarts"]),
            _when(job.get("created_at")),
        )
        for job in jobs
    ]
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip(), file=out)


def event_line(event: dict[str, Any]) -> str:
    detail = event.get("detail") or {}
    text = detail.get("message") if set(detail) == {"message"} else (json.dumps(detail) if detail else "")
    return f"[{_clock(event['ts'])}] {event['kind']}" + (f": {text}" if text else "")


def step_line(step: dict[str, Any], total: Any) -> str:
    line = (
        f"step {step['step']}/{total}  loss {_num(step.get('loss'), '.4f')}  "
        f"{_num(step.get('tokens_per_s'), ',.0f')} tokens/s"
    )
    return line if step.get("mfu") is None else f"{line}  MFU {100 * step['mfu']:.1f}%"
