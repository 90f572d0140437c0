"""Bounded child processes for the benchmark suite: every run has a timeout and leaves nothing behind.

Each measured run (an etrain session with its own local Ray, Ray Train with its own, ``torchrun`` with
its elastic agent) is a child in a **new session**, so it and everything it starts (Ray's daemons and
workers, torchrun's ranks) share one process group: on a timeout or any error the whole group gets
SIGTERM, then SIGKILL. Ray's own daemons are also fate-shared with the driver that started them
(they die when it dies), so a driver killed here takes its Ray instance with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 10.0


class RunFailed(RuntimeError):
    """A child exited non-zero, timed out, or wrote no result."""


@dataclass(frozen=True)
class Finished:
    returncode: int
    seconds: float
    output_tail: str


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child: this repository importable, one torch thread per process (as etrain's
    ranks run), unbuffered output, and no inherited Ray address (a child always starts its own Ray)."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("ETRAIN_TORCH_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_group(command: list[str], *, timeout_s: float, log_path: Path, env: dict[str, str] | None = None) -> Finished:
    """Run ``command`` in its own session; kill its whole process group after ``timeout_s`` or on error.

    Output goes to ``log_path`` (kept for a failed run's post-mortem); the last lines come back.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        child = subprocess.Popen(
            command, cwd=REPO, env=env or child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # also on KeyboardInterrupt: the group never outlives the suite
            kill_group(child)
    tail = _tail(log_path)
    if timed_out:
        raise RunFailed(f"{' '.join(command[:4])} … timed out after {timeout_s:.0f} s; log {log_path}:\n{tail}")
    return Finished(returncode=child.returncode, seconds=time.monotonic() - started, output_tail=tail)


def kill_group(child: subprocess.Popen) -> None:
    """SIGTERM the child's process group, then SIGKILL whatever is left of it (the group outlives the
    leader: Ray workers, torchrun ranks)."""
    try:
        pgid = os.getpgid(child.pid)
    except ProcessLookupError:
        pgid = child.pid  # the leader is gone; its group id is still its pid
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.2)
        if not _group_alive(pgid):
            break
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_json(
    module: str, args: list[str], *, out: Path, timeout_s: float, log_path: Path, env: dict[str, str] | None = None
) -> Any:
    """``python -m module args --out out`` in its own group; the JSON it wrote to ``out``."""
    out.unlink(missing_ok=True)
    finished = run_group(
        [sys.executable, "-m", module, *args, "--out", str(out)], timeout_s=timeout_s, log_path=log_path, env=env
    )
    if finished.returncode != 0 or not out.exists():
        raise RunFailed(
            f"{module} exited with {finished.returncode} and {'a' if out.exists() else 'no'} result; "
            f"log {log_path}:\n{finished.output_tail}"
        )
    return json.loads(out.read_text())


class LoadSampler:
    """Samples the 1-minute load average every ``period_s`` on a daemon thread (the machine is shared)."""

    def __init__(self, period_s: float = 5.0):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), name="load-sampler", daemon=True)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self, period_s: float) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(round(os.getloadavg()[0], 2))
            except OSError:
                return
            self._stop.wait(period_s)
