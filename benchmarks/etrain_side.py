"""etrain's side of the service-level figures: one session = a fresh local Ray + the real control plane.

Run as its own process by the suite (``python -m benchmarks.etrain_side --scenario recovery ...``), in
a new process group with a timeout (``benchmarks.procs``). The session is what ``etrain serve`` runs
and what the end-to-end tests use (``tests/service_harness.control_plane``): uvicorn, the real
``JobManager``, SQLite, bearer auth, chaos drills on, over a 4-CPU local Ray started here
(``address="local"``: never another Ray on this machine). Everything is driven over HTTP as a user
would, and every number is read back from the job's own step records and event log:

* ``recovery`` (figures 1 and 2): submit the job, arm ``kill_rank`` on rank ``kill_rank`` at
  ``kill_at`` (SIGKILL of the rank's process, ``workers/rank/worker.py``), wait for the end. Startup is
  the step-1 record's time minus the moment before the POST; the kill time is the ``chaos_fired``
  event (the rank waits for the supervisor to log it, then kills itself).
* ``goodput`` (figure 3): a long job; ``kill_rank`` rank 1 every ``interval`` seconds from submit,
  ``kills`` times; at ``(kills + 1) * interval`` the job's JSON and steps are read, then it is
  cancelled. Goodput = the step time of the steps kept (the records a later attempt did not replace)
  / the wall time since submit, computed here; the job's own ``goodput`` field is recorded beside it.
* ``hang`` (figure 5): ``hang_rank`` on rank 1 at ``kill_at`` with ``heartbeat_timeout_s`` =
  ``--heartbeat-timeout``: the drill's time, ``hang_detected``, the next completed step.
* ``resize`` (figure 9): ``scale`` to dp=1 and back on a running job: each request -> the first step
  at the new size, and whether the `resized` event says "in place".

The service runs as a service does between jobs: its warm spare pool (``--warm-spares``, by default the
job's ranks + 1: the first launch and one replacement) is full before each submit (the benchmark waits
for it), so start-up and recovery measure what a user of a running service sees.

Writes one JSON (``--out``) with every run's raw records: step rows, events, the job.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.peers.common import Job, etrain_spec, recovery_measures
from benchmarks.recovery import GOODPUT_EVERY_STEPS

NUM_CPUS = 4  # as the e2e tests' local Ray: two 1-CPU ranks plus room for the supervisor
JOB_TIMEOUT_S = 300.0
SPARES_READY_TIMEOUT_S = 120.0


def wait_for_warm_spares(count: int, timeout_s: float = SPARES_READY_TIMEOUT_S) -> float:
    """Block until the cluster's spare pool holds ``count`` ready spares (a service at rest between jobs);
    returns the seconds waited. A service that has been up for a few seconds is in this state; the
    benchmark waits for it so that every submit finds the same pool, whatever the previous run left."""
    import ray

    from etrain.service.runtime.spares import find_pool

    started = time.monotonic()
    pool = find_pool()
    if pool is None or count <= 0:
        return 0.0
    while len(ray.get(pool.stats.remote(), timeout=10)["ready_pids"]) < count:
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"the spare pool did not hold {count} ready spares within {timeout_s:g}s")
        time.sleep(0.1)
    return time.monotonic() - started


def all_steps(plane, job_id: str) -> list[dict[str, Any]]:
    """Every step record, paging through ``/metrics`` with ``since``."""
    rows: list[dict[str, Any]] = []
    since = -1
    while True:
        response = plane.client.get(f"/v1/jobs/{job_id}/metrics", params={"since": since})
        response.raise_for_status()
        body = response.json()
        if not body["steps"]:
            return rows
        rows.extend(body["steps"])
        since = body["next_since"]


def event_ts(events: list[dict[str, Any]], kind: str, after: float = 0.0) -> float | None:
    return next((e["ts"] for e in events if e["kind"] == kind and e["ts"] >= after), None)


def timeline(events: list[dict[str, Any]], origin: float) -> list[dict[str, Any]]:
    """The event log relative to ``origin`` (the kill): where the recovery's seconds go."""
    return [
        {
            "t": round(e["ts"] - origin, 3),
            "kind": e["kind"],
            "detail": str(e.get("detail", {}).get("message", ""))[:300],
        }
        for e in events
        if e["ts"] >= origin - 1.0
    ]


def recovery(plane, job: Job, name: str, *, warm_spares: int) -> dict[str, Any]:
    spec = etrain_spec(job, name)
    wait_for_warm_spares(warm_spares)
    submit_ts = time.time()
    job_id = plane.submit(spec)["id"]
    if job.kill_at is not None:
        plane.chaos(job_id, action="kill_rank", rank=job.kill_rank, at_step=job.kill_at)
    final = plane.wait_terminal(job_id, timeout_s=JOB_TIMEOUT_S)
    steps, events = all_steps(plane, job_id), plane.events(job_id)
    kill_ts = event_ts(events, "chaos_fired")
    measures = recovery_measures(steps, start_ts=submit_ts, kill_ts=kill_ts, kill_at=job.kill_at)
    return {
        "system": "etrain",
        "warm_spares": warm_spares,  # the pool this run waited for (the service's own under --as-installed)
        "job_id": job_id,
        "status": final["status"],
        "start_ts": submit_ts,
        "kill_ts": kill_ts,
        "measures": measures,
        "job": final,
        "timeline": timeline(events, kill_ts) if kill_ts else [],
        "steps": [{k: row[k] for k in ("step", "ts", "attempt", "step_s")} for row in steps],
        "events": [{"ts": e["ts"], "kind": e["kind"]} for e in events],
    }


def goodput(plane, job: Job, *, interval_s: float, kills: int, every_steps: int, warm_spares: int) -> dict[str, Any]:
    spec = etrain_spec(
        job,
        "bench-goodput",
        training={"steps": 10_000_000},
        fault_tolerance={"max_restarts": kills + 2},
        checkpoint={"every_steps": every_steps},
    )
    wait_for_warm_spares(warm_spares)
    submit_ts = time.time()
    job_id = plane.submit(spec)["id"]
    fired = []
    for k in range(1, kills + 1):
        time.sleep(max(0.0, submit_ts + k * interval_s - time.time()))
        fired.append(time.time())
        plane.chaos(job_id, action="kill_rank", rank=job.kill_rank)
    time.sleep(max(0.0, submit_ts + (kills + 1) * interval_s - time.time()))
    end_ts = time.time()
    snapshot = plane.job(job_id)
    steps = all_steps(plane, job_id)
    plane.client.post(f"/v1/jobs/{job_id}/cancel")
    final = plane.wait_terminal(job_id, timeout_s=120)
    events = plane.events(job_id)
    kept = [row for row in steps if row["ts"] <= end_ts]
    productive = sum(row["step_s"] or 0.0 for row in kept)
    wall = end_ts - submit_ts
    return {
        "system": "etrain",
        "job_id": job_id,
        "status": final["status"],
        "start_ts": submit_ts,
        "end_ts": end_ts,
        "interval_s": interval_s,
        "every_steps": every_steps,
        "kills_posted": fired,
        "kills_fired": [e["ts"] for e in events if e["kind"] == "chaos_fired"],
        "failures": [e["ts"] for e in events if e["kind"] == "worker_failed"],
        "restarts": snapshot["restarts"],
        "steps_kept": len(kept),
        "productive_s": productive,
        "wall_s": wall,
        "goodput": productive / wall if wall > 0 else None,
        "job_goodput": snapshot.get("goodput"),
        "steps": [{k: row[k] for k in ("step", "ts", "attempt", "step_s")} for row in steps],
        "events": [{"ts": e["ts"], "kind": e["kind"]} for e in events],
    }


def hang(plane, job: Job, *, heartbeat_timeout_s: float, warm_spares: int) -> dict[str, Any]:
    spec = etrain_spec(job, "bench-hang", fault_tolerance={"heartbeat_timeout_s": heartbeat_timeout_s})
    wait_for_warm_spares(warm_spares)
    submit_ts = time.time()
    job_id = plane.submit(spec)["id"]
    plane.chaos(job_id, action="hang_rank", rank=job.kill_rank, at_step=job.kill_at)
    final = plane.wait_terminal(job_id, timeout_s=JOB_TIMEOUT_S)
    steps, events = all_steps(plane, job_id), plane.events(job_id)
    fired = event_ts(events, "chaos_fired")
    detected = event_ts(events, "hang_detected", after=fired or 0.0)
    measures = recovery_measures(steps, start_ts=submit_ts, kill_ts=fired, kill_at=job.kill_at)
    return {
        "system": "etrain",
        "job_id": job_id,
        "status": final["status"],
        "start_ts": submit_ts,
        "hang_ts": fired,
        "detected_ts": detected,
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "detect_s": None if fired is None or detected is None else detected - fired,
        "measures": measures,
        "timeline": timeline(events, fired) if fired else [],
    }


def resize(plane, job: Job, *, warm_spares: int) -> dict[str, Any]:
    """``scale`` dp -> 1 -> dp on a running job: each request -> the first completed step of the attempt
    at the new size, and what the `resized` event says (in place or relaunched)."""
    spec = etrain_spec(job, "bench-resize", resources={"min_dp": 1, "max_dp": job.dp}, training={"steps": 100000})
    wait_for_warm_spares(warm_spares)
    job_id = plane.submit(spec)["id"]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while plane.job(job_id)["step"] < (job.kill_at or 5):
        assert time.monotonic() < deadline, "the resize job never reached its first steps"
        time.sleep(0.1)
    runs: list[dict[str, Any]] = []
    for dp in (1, job.dp):
        wait_for_warm_spares(warm_spares)  # the pool refills after a take: a grow finds a spare ready
        before = max(row["attempt"] for row in all_steps(plane, job_id))
        asked = time.time()
        plane.client.post(f"/v1/jobs/{job_id}/scale", json={"dp": dp}).raise_for_status()
        first = None
        while first is None:
            assert time.monotonic() < deadline, f"no step at dp={dp}"
            time.sleep(0.05)
            newer = [row["ts"] for row in all_steps(plane, job_id) if row["attempt"] > before]
            first = min(newer) if newer else None
        events = plane.events(job_id)
        said = [e for e in events if e["kind"] == "resized" and e["ts"] >= asked]
        runs.append(
            {
                "dp": dp,
                "resize_s": first - asked,
                "resized": str(said[-1].get("detail", {}).get("message", "")) if said else None,
                "timeline": timeline(events, asked),
            }
        )
    plane.client.post(f"/v1/jobs/{job_id}/cancel")
    plane.wait_terminal(job_id, timeout_s=JOB_TIMEOUT_S)
    return {"system": "etrain", "job_id": job_id, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", action="append", required=True, choices=["recovery", "goodput", "hang", "resize"])
    parser.add_argument("--job", default="{}", help="benchmarks.peers.common.Job fields as JSON")
    parser.add_argument("--name", default="bench-recovery")
    parser.add_argument("--interval", type=float, default=60.0, help="goodput: seconds between kills")
    parser.add_argument("--kills", type=int, default=4, help="goodput: how many kills")
    parser.add_argument(
        "--goodput-every", type=int, default=GOODPUT_EVERY_STEPS, help="goodput: checkpoint every N steps"
    )
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, help="hang: heartbeat_timeout_s")
    parser.add_argument("--hang-repeats", type=int, default=1)
    parser.add_argument(
        "--warm-spares",
        type=int,
        default=None,
        help="the service's warm_spares_per_node (default: the job's ranks + 1, so the first launch "
        "and a replacement both find a ready spare); each submit waits until they are ready",
    )
    parser.add_argument(
        "--as-installed",
        action="store_true",
        help="the service's own default pool (ETRAIN_WARM_SPARES_PER_NODE=auto), as `etrain serve` starts it: "
        "no pool sized for the job; each submit waits until that default pool is ready",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    job = Job(**json.loads(args.job))
    if args.as_installed:
        from etrain.service.decisions.capacity import spares_for_node

        warm = spares_for_node({"CPU": NUM_CPUS}, None)  # what auto keeps on this one CPU node
        pool: dict[str, Any] = {"warm_spares_per_node": None}  # auto, as `etrain serve` starts
    else:
        warm = job.dp + 1 if args.warm_spares is None else args.warm_spares
        pool = {"warm_spares_per_node": warm}

    import ray

    from tests.service_harness import control_plane

    out: dict[str, Any] = {}
    ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, namespace="etrain", log_to_driver=False)
    try:
        with (
            tempfile.TemporaryDirectory(prefix="etrain-bench-") as data_dir,
            control_plane(Path(data_dir), **pool) as plane,
        ):
            for scenario in args.scenario:
                if scenario == "recovery":
                    out["recovery"] = recovery(plane, job, args.name, warm_spares=warm)
                elif scenario == "goodput":
                    out["goodput"] = goodput(
                        plane,
                        job,
                        interval_s=args.interval,
                        kills=args.kills,
                        every_steps=args.goodput_every,
                        warm_spares=warm,
                    )
                elif scenario == "resize":
                    out["resize"] = resize(plane, job, warm_spares=warm)
                else:
                    out["hang"] = [
                        hang(plane, job, heartbeat_timeout_s=args.heartbeat_timeout, warm_spares=warm)
                        for _ in range(args.hang_repeats)
                    ]
    finally:
        ray.shutdown()
    args.out.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
