"""The commands that are requests to the REST API: submit, list, status, watch, cancel, logs, scale,
events, export, chaos, plot, and the cluster and plan views.

Each is ``cmd(client, args, out, err) -> exit code``: a request or two through ``client.Client``,
the answer printed as text (``output.py``) or, with ``--json``, as the server sent it. The waits
(``cancel``, ``logs -f``) poll with a deadline; ``watch`` is ``watch.py``, ``plot`` is ``plot.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from etrain.api.cli.client import EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT, TERMINAL, ApiError, Client, CliError
from etrain.api.cli.output import event_line, print_job, print_job_table, print_json
from etrain.api.cli.watch import watch_job


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


def cmd_submit(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    job = client.post("/v1/jobs", load_spec(args.file))
    if args.json:
        print_json(job, out)
    else:
        print(
            f"submitted {job['id']}: {job['status']}, layout {job.get('layout') or '-'} "
            f"(world size {job['world_size']})",
            file=out,
        )
    if args.watch:
        return watch_job(
            client, job["id"], interval_s=args.interval, max_wait_s=args.max_wait, out=out, err=err, plain=args.plain
        )
    return EXIT_OK


def cmd_list(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    body = client.get("/v1/jobs", status=args.status, limit=args.limit, offset=args.offset)
    if args.json:
        print_json(body, out)
    else:
        print_job_table(body["jobs"], out)
    return EXIT_OK


def cmd_status(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    job = client.get(f"/v1/jobs/{args.job_id}")
    if args.json:
        print_json(job, out)
    else:
        print_job(job, out)
    return EXIT_OK


def cmd_watch(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    return watch_job(
        client,
        args.job_id,
        interval_s=args.interval,
        max_wait_s=args.max_wait,
        out=out,
        err=err,
        every=args.every,
        plain=args.plain,
    )


def cmd_cancel(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """POST cancel (the server answers 202 at once), then poll the job until it is terminal, printing
    each status it passes through (``--no-wait``: do not wait; ``--wait S``: give up after S, exit 124)."""
    job = client.post(f"/v1/jobs/{args.job_id}/cancel")
    if args.json and (args.no_wait or job["status"] in TERMINAL):
        print_json(job, out)
        return EXIT_OK
    if job["status"] in TERMINAL or args.no_wait:
        print(f"{job['id']}: {job['status']}" + ("" if job["status"] in TERMINAL else " (cancel requested)"), file=out)
        return EXIT_OK
    if not args.json:
        print(f"{job['id']}: cancel requested ({job['status']})", file=out)
        out.flush()
    deadline = time.monotonic() + args.wait
    status = job["status"]
    while job["status"] not in TERMINAL:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            print(
                f"gave up waiting after {args.wait:g}s; job {job['id']} is still {job['status']} "
                f"(the cancel stays requested: `etrain status {job['id']}`)",
                file=err,
            )
            return EXIT_TIMEOUT
        time.sleep(min(args.interval, remaining))
        job = client.get(f"/v1/jobs/{args.job_id}")
        if job["status"] != status and not args.json:
            status = job["status"]
            print(f"{job['id']}: {status}", file=out)
            out.flush()
    if args.json:
        print_json(job, out)
    return EXIT_OK if job["status"] == "CANCELLED" else EXIT_FAILED


def cmd_scale(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    job = client.post(f"/v1/jobs/{args.job_id}/scale", {"dp": args.dp})
    if args.json:
        print_json(job, out)
    else:
        print(
            f"{job['id']}: resize to dp={args.dp} requested; now {job['status']}, "
            f"layout {job.get('layout') or '-'} (world size {job['world_size']})",
            file=out,
        )
    return EXIT_OK


def cmd_logs(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
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
                print_json(body, out)
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


def cmd_events(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    body = client.get(f"/v1/jobs/{args.job_id}/events", since=args.since)
    if args.json:
        print_json(body, out)
    else:
        for event in body["events"]:
            print(event_line(event), file=out)
    return EXIT_OK


def cmd_cluster(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    body = client.get("/v1/cluster")
    if args.json:
        print_json(body, out)
        return EXIT_OK
    totals = body["totals"]
    print(
        f"nodes {totals['alive_nodes']}/{totals['nodes']} alive   CPUs {totals['free_cpus']:g} free of "
        f"{totals['cpus']:g}   GPUs {totals['free_gpus']:g} free of {totals['gpus']:g}   "
        f"memory {totals['free_memory_gib']:g} GiB free of {totals['memory_gib']:g}   jobs {totals['running_jobs']} started, {totals['queued_jobs']} queued",
        file=out,
    )
    for node in body["nodes"]:
        print(
            f"  node {node['node_id'][:12]}  {'alive' if node['alive'] else 'DEAD '}  CPUs {node['free_cpus']:g}/"
            f"{node['cpus']:g} free  GPUs {node['free_gpus']:g}/{node['gpus']:g} free  "
            f"memory {node['free_memory_gib']:g}/{node['memory_gib']:g} GiB free",
            file=out,
        )
    if body["jobs"]:
        print("holding:", file=out)
        for job in body["jobs"]:
            print(
                f"  {job['job_id']:<28} {job['status']:<10} prio {job['priority']:>4}  {job['world_size']} ranks  "
                f"{job['cpus']:g} CPUs  {job['gpus']:g} GPUs  {job['memory_gib']:g} GiB",
                file=out,
            )
    if body["queue"]:
        print("queue:", file=out)
        for entry in body["queue"]:
            print(
                f"  {entry['position']:>3}. {entry['job_id']:<28} prio {entry['priority']:>4}  {entry['reason']}",
                file=out,
            )
    return EXIT_OK


def cmd_plan(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    report = client.post("/v1/plan", load_spec(args.file))
    if args.json:
        print_json(report, out)
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


def cmd_export(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """POST /v1/jobs/{id}/export and print the folder. ``--out`` is made absolute here, against the
    directory the command runs in: the server writes it, so both must see the same filesystem."""
    body = {"step": args.step, "out": os.path.abspath(os.path.expanduser(args.out))}
    if args.dtype:
        body["dtype"] = args.dtype
    result = client.post(f"/v1/jobs/{args.job_id}/export", body, timeout_s=args.max_wait)
    if args.json:
        print_json(result, out)
    else:
        print(result["hf"], file=out)
    return EXIT_OK


def cmd_plot(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from etrain.api.cli.plot import cmd_plot as plot  # matplotlib loads only for this command

    return plot(client, args, out, err)


def cmd_chaos(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    request = {
        "action": args.action,
        "rank": args.rank,
        "factor": args.factor,
        "gib": args.gib,
        "step": args.step,
        "at_step": args.at_step,
    }
    order = client.post(f"/v1/jobs/{args.job_id}/chaos", {k: v for k, v in request.items() if v is not None})
    print_json(order, out)
    return EXIT_OK


#: ``etrain COMMAND`` -> its function, for every command that needs only a client.
COMMANDS = {
    "submit": cmd_submit,
    "list": cmd_list,
    "status": cmd_status,
    "watch": cmd_watch,
    "cancel": cmd_cancel,
    "logs": cmd_logs,
    "scale": cmd_scale,
    "events": cmd_events,
    "cluster": cmd_cluster,
    "plan": cmd_plan,
    "export": cmd_export,
    "chaos": cmd_chaos,
    "plot": cmd_plot,
}
