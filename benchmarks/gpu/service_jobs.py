"""The whole service on one GPU, driven over REST as a user would: a clean job, then a killed one.

Run by ``benchmarks/gpu/run.sh`` once ``etrain serve`` answers (a Ray head holding the GPU, chaos on,
an admin token). Before each submit it waits until the service's warm spare pool is full (a service
at rest between jobs), notes the time, and submits:

* **clean**: the check's model (``measures.FULL``: ``preset: llama3-1b``, ``seq_len: 2048``, dp 1, bf16,
  global batch 8, micro-batch 4), 40 steps, ``checkpoint.every_steps: 20``;
* **kill**: the same model, 200 steps, ``checkpoint.every_steps: auto`` (a ``422`` for ``auto`` falls back
  to 50 and says so), and right after the submit a ``kill_rank`` order for rank 0 at step 25 (a ``503``
  before the supervisor runs is retried for up to 30 s, and counted): the rank SIGKILLs itself, the
  service repairs it in place from a warm spare;
* **kill-new-node** (not in the default ``GPU_CHECK_JOBS``): 60 steps, a checkpoint every 20, rank 0
  SIGKILLed at step 25 as above, but at step 10 the node's compile cache folder is deleted, so the
  replacement starts as on a node that never compiled this model: it loads the set the job's first rank
  shared through the checkpoint folder (``workers/engine/compile_artifacts.py``) instead of compiling.
  Its SIGKILL → next step beside the kill job's is what that sharing saves a rank on a new node.

Each job is polled to a terminal status within its time box (a job still running at its box's end is
cancelled and recorded as it stood); then its step rows (``/metrics``), events (``/events``) and rank 0's
log (``/logs?rank=0``) are read, the figures computed (``measures.job_figures``), the rank logs copied to
``--logs-dir`` and the job's checkpoint folder removed (a 1B job's checkpoint is ~15 GB; the GPU machine's
disk is 64 GiB). ``gpu_service.json`` is written after each job (``--results-dir`` and ``$OUT``). Stdlib
and Ray (for the spare pool) only: no HTTP client beyond urllib.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.gpu.measures import FULL, TINY, CheckSizes, job_figures, timeline
from benchmarks.gpu.probe import REPO, write_result

RESULT_NAME = "gpu_service.json"
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
CHAOS_RETRY_S = 30.0
FALLBACK_EVERY = 50
#: The service's warm spares per node: the first launch and one replacement (``ETRAIN_WARM_SPARES_PER_NODE``).
WARM_SPARES = 2


class Api:
    """Bearer-token JSON calls to the control plane; answers (status, body) and never raises on HTTP errors."""

    def __init__(self, url: str, token: str):
        self.url, self.token = url.rstrip("/"), token

    def call(self, method: str, path: str, body: Any = None, **params: Any) -> tuple[int, Any]:
        query = ("?" + urllib.parse.urlencode(params)) if params else ""
        request = urllib.request.Request(
            self.url + path + query,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"authorization": f"Bearer {self.token}", "content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                raw = answer.read()
                return answer.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as err:
            text = err.read().decode(errors="replace")
            try:
                return err.code, json.loads(text)
            except ValueError:
                return err.code, text[:2000]
        except (urllib.error.URLError, OSError) as err:
            return 0, f"{type(err).__name__}: {err}"

    def pages(self, path: str, key: str, since: int) -> list[dict[str, Any]]:
        """Every item of a ``since``-paged list (``/metrics``: steps, ``/events``: events)."""
        items: list[dict[str, Any]] = []
        for _ in range(10_000):
            status, body = self.call("GET", path, since=since)
            if status != 200 or not body or not body.get(key):
                return items
            items.extend(body[key])
            if body["next_since"] == since:
                return items
            since = body["next_since"]
        return items


def emit(**record: Any) -> None:
    print(json.dumps(record, default=str), flush=True)


def wait_for_spares(ray_address: str | None, count: int, timeout_s: float) -> dict[str, Any]:
    """Block until the service's warm spare pool holds ``count`` ready spares (``benchmarks.etrain_side``
    does the same for the suite); never raises: a pool that is not there or not full is recorded."""
    if not ray_address or count <= 0:
        return {"waited_s": 0.0, "ready": None}
    started = time.monotonic()
    try:
        import ray

        from benchmarks.etrain_side import wait_for_warm_spares

        ray.init(address=ray_address, log_to_driver=False, logging_level="ERROR")
        try:
            wait_for_warm_spares(count, timeout_s=timeout_s)
            return {"waited_s": round(time.monotonic() - started, 2), "ready": True}
        finally:
            ray.shutdown()
    except Exception as err:
        return {
            "waited_s": round(time.monotonic() - started, 2),
            "ready": False,
            "error": f"{type(err).__name__}: {err}"[:500],
        }


def job_spec(
    name: str, sizes: CheckSizes, *, steps: int, every: int | str, mtbf_hours: float | None = None
) -> dict[str, Any]:
    resources: dict[str, Any] = {"device": sizes.device, "cpus_per_worker": 2 if sizes.device == "cuda" else 1}
    if sizes.device == "cuda":
        resources["gpus_per_worker"] = 1
    return {
        "name": name,
        "model": {"preset": sizes.preset, "seq_len": sizes.seq_len},
        "data": {"kind": "synthetic"},
        "parallelism": {"dp": 1},
        "resources": resources,
        "training": {
            "steps": steps,
            "global_batch": sizes.global_batch,
            "micro_batch": sizes.micro_batch,
            "lr": 3e-4,
            "precision": sizes.precision,
        },
        "checkpoint": {"every_steps": every, "keep_last": 1},
        "fault_tolerance": {"max_restarts": 2, **({"mtbf_hours": mtbf_hours} if mtbf_hours else {})},
    }


def _refuses_auto(status: int, body: Any) -> bool:
    return status == 422 and "checkpoint.every_steps" in json.dumps(body)


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())


def _release_checkpoints(data_dir: Path | None, job_id: str, logs_dir: Path | None) -> dict[str, Any]:
    """Copy the job's rank logs to ``logs_dir``, then delete its checkpoint folder (default layout:
    ``<data-dir>/checkpoints/<job id>``); answers the folder's size before the delete."""
    if data_dir is None:
        return {}
    folder = data_dir / "checkpoints" / job_id
    if not folder.is_dir() or data_dir.resolve() not in folder.resolve().parents:
        return {"checkpoint_folder": None}
    if logs_dir is not None:
        for log in (folder / "logs" / job_id).glob("rank*.log"):
            target = logs_dir / f"{job_id}-{log.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, target)
    size = _folder_bytes(folder)
    shutil.rmtree(folder, ignore_errors=True)
    return {"checkpoint_folder_bytes": size}


def _forget_node_cache(step: int) -> dict[str, Any]:
    """Delete the node's compile cache folder (the ranks' and the spares': the check runs them all on
    this machine, as this user), so the next rank to start compiles as on a new node."""
    from etrain.workers.engine.compile import node_cache_folder

    folder = Path(node_cache_folder())
    size = _folder_bytes(folder) if folder.is_dir() else 0
    shutil.rmtree(folder, ignore_errors=True)
    return {"at_step": step, "folder": str(folder), "bytes": size, "gone": not folder.exists()}


def run_job(
    api: Api,
    *,
    label: str,
    sizes: CheckSizes,
    steps: int,
    every: int | str,
    kill_at: int | None,
    timeout_s: float,
    ray_address: str | None,
    data_dir: Path | None,
    logs_dir: Path | None,
    mtbf_hours: float | None = None,
    forget_cache_at: int | None = None,
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "job": label,
        "steps": steps,
        "every_steps_asked": every,
        "kill_at": kill_at,
        "time_box_s": round(timeout_s, 1),
    }
    record["spares"] = wait_for_spares(ray_address, WARM_SPARES, timeout_s=60.0)
    spec = job_spec(
        f"gpu-check-{label}", sizes, steps=steps, every=every, mtbf_hours=mtbf_hours if every == "auto" else None
    )
    submit_ts = time.time()
    status, job = api.call("POST", "/v1/jobs", spec)
    if every == "auto" and _refuses_auto(status, job):
        record["every_steps_note"] = (
            f"the server refused every_steps: auto (422: {json.dumps(job)[:300]}); used {FALLBACK_EVERY}"
        )
        spec["checkpoint"]["every_steps"] = FALLBACK_EVERY
        submit_ts = time.time()
        status, job = api.call("POST", "/v1/jobs", spec)
    record.update(spec=spec, every_steps=spec["checkpoint"]["every_steps"], submit_ts=submit_ts)
    if status != 201:
        record.update(status=f"submit refused: {status}", error=str(job)[:2000])
        emit(job=label, submit=status, error=str(job)[:500])
        return record
    job_id = record["job_id"] = job["id"]
    emit(job=label, submitted=job_id, every_steps=record["every_steps"], spares=record["spares"])
    if kill_at is not None:
        tries, deadline = 0, time.monotonic() + CHAOS_RETRY_S
        while True:
            tries += 1
            chaos_status, answer = api.call(
                "POST", f"/v1/jobs/{job_id}/chaos", {"action": "kill_rank", "rank": 0, "at_step": kill_at}
            )
            if chaos_status != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        record["chaos"] = {
            "status": chaos_status,
            "tries": tries,
            "answer": str(answer)[:500],
            "posted_after_submit_s": round(time.time() - submit_ts, 3),
        }
        emit(job=label, chaos=record["chaos"])
    ends = time.monotonic() + timeout_s
    last_print = 0.0
    while True:
        status, job = api.call("GET", f"/v1/jobs/{job_id}")
        if status == 200 and job["status"] in TERMINAL:
            break
        if time.monotonic() > ends:
            record["timed_out"] = {
                "status": job.get("status") if isinstance(job, dict) else status,
                "step": job.get("step") if isinstance(job, dict) else None,
            }
            api.call("POST", f"/v1/jobs/{job_id}/cancel")
            for _ in range(30):
                status, job = api.call("GET", f"/v1/jobs/{job_id}")
                if status == 200 and job["status"] in TERMINAL:
                    break
                time.sleep(1)
            break
        if forget_cache_at is not None and "forgot_node_cache" not in record and status == 200:
            if job["step"] >= forget_cache_at:
                record["forgot_node_cache"] = _forget_node_cache(job["step"])
                emit(job=label, forgot_node_cache=record["forgot_node_cache"])
        if time.monotonic() - last_print > 15 and status == 200:
            last_print = time.monotonic()
            emit(
                job=label,
                t=round(time.time() - submit_ts, 1),
                status=job["status"],
                step=job["step"],
                restarts=job["restarts"],
            )
        time.sleep(0.5)
    steps_rows = api.pages(f"/v1/jobs/{job_id}/metrics", "steps", -1)
    events = api.pages(f"/v1/jobs/{job_id}/events", "events", 0)
    log_status, logs = api.call("GET", f"/v1/jobs/{job_id}/logs", rank=0, tail=5000)
    lines = logs.get("lines", []) if log_status == 200 and isinstance(logs, dict) else []
    final = job if isinstance(job, dict) else {"status": f"unreadable: {status}"}
    record["figures"] = job_figures(
        submit_ts=submit_ts, job=final, steps=steps_rows, events=events, log_lines=lines, kill_at=kill_at
    )
    if record.get("timed_out"):
        record["figures"]["status"] = f"TIMED OUT at {record['timed_out']} (then {final.get('status')})"
    record["checkpoint_async"] = (final.get("spec") or {}).get("checkpoint", {}).get("async")
    record["timeline"] = timeline(events, submit_ts)
    if kill_at is not None and record["figures"].get("kill_ts"):
        record["timeline_after_kill"] = timeline(
            [e for e in events if e["ts"] >= record["figures"]["kill_ts"] - 1], record["figures"]["kill_ts"]
        )
    record["steps_rows"] = [{k: row.get(k) for k in ("step", "ts", "attempt", "step_s", "loss")} for row in steps_rows]
    record["rank0_log"] = [line for line in lines if "attempt" in line or "checkpoint" in line][-60:] + lines[-20:]
    record["job_final"] = {
        k: final.get(k)
        for k in (
            "id",
            "status",
            "error",
            "restarts",
            "attempt",
            "goodput",
            "step",
            "created_at",
            "updated_at",
            "last_checkpoint_step",
            "host_memory_gib",
        )
    }
    # The largest rank's host memory at the latest sample (its anonymous pages, every 10 s) against what it reserved, and
    # whether the job said a rank held more: the GPU figure's first check against a real GPU rank
    record["host_memory"] = {
        "held_gib": final.get("host_memory_gib"),
        "reserved_gib": ((final.get("spec") or {}).get("resources") or {}).get("host_memory_gb"),
        "events": [e for e in events if e.get("kind") == "host_memory"],
    }
    record.update(_release_checkpoints(data_dir, job_id, logs_dir))
    figures = record["figures"]
    emit(
        job=label,
        **{
            k: figures.get(k)
            for k in (
                "status",
                "error",
                "submit_to_first_step_s",
                "step_s_median",
                "goodput",
                "restarts",
                "save_blocking_median_s",
                "kill_to_next_step_s",
                "detect_s",
                "resumed_from",
            )
            if k in figures
        },
        host_memory=record["host_memory"],
        startup=[s["line"] for s in figures["startup"]],
        saves=[(s["step"], round(s["blocked_s"], 3)) for s in figures["save_blocking"]],
    )
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", default=os.environ.get("ETRAIN_API_TOKEN"))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--jobs", default=os.environ.get("GPU_CHECK_JOBS") or "clean,kill", help="which jobs, in order (GPU_CHECK_JOBS)"
    )
    parser.add_argument(
        "--mtbf-hours",
        type=float,
        default=float(os.environ.get("GPU_CHECK_MTBF_HOURS") or 0),
        help="fault_tolerance.mtbf_hours of the auto job (GPU_CHECK_MTBF_HOURS; default: the service's)",
    )
    parser.add_argument("--ray-address", help="to wait for the warm spare pool before each submit")
    parser.add_argument(
        "--data-dir", type=Path, help="the server's data directory (checkpoints removed after each job)"
    )
    parser.add_argument("--logs-dir", type=Path, help="where the rank logs are copied")
    parser.add_argument("--deadline", type=float, help="unix time by which everything must have ended")
    parser.add_argument("--device-name", default=os.environ.get("GPU_CHECK_DEVICE", ""))
    parser.add_argument("--torch-version", default=os.environ.get("GPU_CHECK_TORCH", ""))
    parser.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()

    from benchmarks.figures import machine_info

    sizes = TINY if args.tiny else FULL
    api = Api(args.url, args.token)
    begun = time.time()
    deadline = args.deadline or begun + 420
    _, cluster = api.call("GET", "/v1/cluster")
    document: dict[str, Any] = {
        "file": RESULT_NAME,
        "kind": "service on one device",
        "tiny": args.tiny,
        "device": args.device_name,
        "torch": args.torch_version,
        "sizes": sizes.as_dict(),
        "cluster": cluster,
        "jobs": [],
        "machine": machine_info(note="make gpu-check" + (" --tiny" if args.tiny else "")),
    }
    emit(cluster_nodes=(cluster or {}).get("nodes") if isinstance(cluster, dict) else cluster)
    plans = {
        "clean": dict(steps=40, every=20, kill_at=None, cap_s=150.0),
        "kill": dict(steps=200 if not args.tiny else 120, every="auto", kill_at=25, cap_s=300.0),
        "kill-new-node": dict(steps=60, every=20, kill_at=25, cap_s=150.0, forget_cache_at=10),
    }
    paths: list[str] = []
    for label in args.jobs.split(","):
        plan = plans[label]
        left = deadline - time.time() - 25  # reading back the results and the clean-up
        if left < 30:
            document["jobs"].append({"job": label, "skipped": f"only {left:.0f} s left in the time box"})
            emit(job=label, skipped="no time left")
            continue
        document["jobs"].append(
            run_job(
                api,
                label=label,
                sizes=sizes,
                steps=plan["steps"],
                every=plan["every"],
                kill_at=plan["kill_at"],
                timeout_s=min(plan["cap_s"], left),
                ray_address=args.ray_address,
                data_dir=args.data_dir,
                logs_dir=args.logs_dir,
                mtbf_hours=args.mtbf_hours or None,
                forget_cache_at=plan.get("forget_cache_at"),
            )
        )
        document["elapsed_s"] = time.time() - begun
        paths = write_result(document, args.results_dir)
    emit(service_written=paths, elapsed_s=round(time.time() - begun, 1))


if __name__ == "__main__":
    main()
