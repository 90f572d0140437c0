"""Run a function on N real torch.distributed ranks (separate processes, no Ray); collect results.

Use it for multi-process tests (mesh groups, parallel equivalence, checkpoint resharding)::

    def _all_reduce_rank(rank: int, world_size: int, scale: float) -> float:
        total = torch.tensor([rank * scale])
        dist.all_reduce(total)
        return total.item()

    def test_sum():
        assert run_distributed(_all_reduce_rank, 4, 1.0) == [6.0] * 4

Rules for ``fn``: a module-level function (it is pickled into freshly spawned processes), called
as ``fn(rank, world_size, *args)`` with the default process group already initialized; its return
value must be picklable (tensors are copied by value). Children run with one intra-op thread.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["RankFailedError", "run_distributed"]

_HOST = "127.0.0.1"
_FAILURE_GRACE_S = 2.0  # after a first failure, how long to gather the other ranks' reports
_STOP_GRACE_S = 5.0  # how long terminated children get to exit before they are killed


class RankFailedError(RuntimeError):
    """A rank raised, died, or did not finish in time.

    ``rank`` is the rank that failed first (the likely root cause; ``None`` on a timeout) and
    ``failures`` maps every failed rank to its traceback; the message carries them all.
    """

    def __init__(self, message: str, *, rank: int | None = None, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.failures = failures or {}


class _Report(NamedTuple):
    rank: int
    ok: bool
    payload: Any  # pickled result when ok, else the traceback text
    at: float  # wall-clock time of the result or the failure; orders failures by cause


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results by rank.

    ``timeout_s`` bounds the whole run, process start-up included, and is also the process
    group's collective timeout. A failing rank stops the run: the others get a moment to report
    (a peer's crash usually makes them fail too), then all are terminated and ``RankFailedError``
    is raised, leading with the traceback of the rank that failed first.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(f"run_distributed needs a module-level function and picklable args, got {fn!r}: {exc}") from exc

    # The parent hosts the rendezvous store on a port the OS picks: no free-port race.
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    ctx = _context()
    reports = ctx.Queue()
    processes = [
        ctx.Process(
            target=_child_main,
            args=(rank, world_size, fn, args, store.port, backend, timeout_s, reports, dict(os.environ), os.getcwd()),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        return _collect(processes, reports, timeout_s)
    finally:
        _stop(processes)
        reports.close()
        reports.join_thread()


#: Imported once by the fork server, so every rank starts with them loaded: a spawned rank imported torch and
#: its distributed packages afresh (5-9 s of CPU each on the 2-core CI machine, most of the suite's
#: multi-process time). Names that do not exist are skipped by multiprocessing.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "tests.dist_utils",
    "tests.equivalence_utils",
    "tests.state_utils",
    "etrain.workers.engine.train",
]


def _context() -> Any:
    """``forkserver`` with torch preloaded: each rank is a fork of a process that has imported torch and
    started no threads (so forking it is safe, unlike forking the test process), not a fresh interpreter.
    ``ETRAIN_TEST_START_METHOD=spawn`` restores fresh interpreters."""
    method = os.environ.get("ETRAIN_TEST_START_METHOD", "forkserver")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _child_main(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    store_port: int,
    backend: str,
    timeout_s: float,
    reports: Any,
    environ: dict[str, str],
    cwd: str,
) -> None:
    # A fork of the fork server has the server's environment and folder, from whenever it started: a rank
    # gets the test's own (a fixture's AWS endpoint, a monkeypatched variable), as a spawned one did.
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    try:
        torch.set_num_threads(1)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(_HOST, store_port, is_master=False, timeout=timeout)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except BaseException:
        reports.put(_Report(rank, False, traceback.format_exc(), time.time()))
        return
    try:
        # Pickle here, not in the queue's feeder thread, so an unpicklable result is reported.
        payload = pickle.dumps(fn(rank, world_size, *args))
    except BaseException:
        # Report before tearing the group down: tearing it down makes the peers fail too.
        reports.put(_Report(rank, False, traceback.format_exc(), time.time()))
    else:
        reports.put(_Report(rank, True, payload, time.time()))
    finally:
        dist.destroy_process_group()


def _collect(processes: list[Any], reports: Any, timeout_s: float) -> list[Any]:
    world_size = len(processes)
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    failures: dict[int, _Report] = {}

    def record(report: _Report) -> None:
        if report.ok:
            results[report.rank] = pickle.loads(report.payload)
        else:
            failures[report.rank] = report

    while len(results) + len(failures) < world_size:
        now = time.monotonic()
        if now >= deadline:
            break
        try:
            record(reports.get(timeout=min(deadline - now, 0.5)))
        except queue.Empty:
            _record_silent_exits(processes, reports, results.keys() | failures.keys(), record)
        if failures:  # a first failure: wait briefly for the others, not for the full timeout
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)

    if failures:
        raise _failure_error(failures, world_size)
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - results.keys())
        raise RankFailedError(
            f"ranks {missing} of {world_size} did not finish within {timeout_s:g} s "
            f"(a hang in a collective, or a rank waiting for one that never came)"
        )
    return [results[rank] for rank in range(world_size)]


def _record_silent_exits(
    processes: list[Any], reports: Any, reported: set[int], record: Callable[[_Report], None]
) -> None:
    """Turn a rank that exited without a report (killed, segfault, ``os._exit``) into a failure."""
    exited = [r for r, p in enumerate(processes) if r not in reported and p.exitcode is not None]
    if not exited:
        return
    # A rank flushes its report before it exits; let any report still in the pipe land first.
    try:
        while True:
            report = reports.get(timeout=1.0)
            record(report)
            reported.add(report.rank)
    except queue.Empty:
        pass
    for rank in exited:
        if rank not in reported:
            message = f"exited with code {processes[rank].exitcode} without a report\n"
            record(_Report(rank, False, message, time.time()))


def _failure_error(failures: dict[int, _Report], world_size: int) -> RankFailedError:
    ordered = sorted(failures.values(), key=lambda report: report.at)
    first, *rest = ordered
    parts = [f"rank {first.rank} of {world_size} failed first:\n{first.payload}"]
    parts += [
        f"then rank {report.rank} failed (often only a consequence of the first):\n{report.payload}" for report in rest
    ]
    return RankFailedError(
        "\n".join(parts),
        rank=first.rank,
        failures={report.rank: report.payload for report in ordered},
    )


def _stop(processes: list[Any]) -> None:
    """Terminate every child still running, then kill those that ignore it; reap all."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for process in processes:
        if process.pid is None:
            continue  # never started
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(timeout=_STOP_GRACE_S)
