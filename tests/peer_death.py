"""What a rank's collective does when its peer's process dies in the middle of it: the premise of the
supervisor's repair in place (``JobPolicy.collectives_fail_on_peer_loss``, service/decisions/job_policy.py).

A repair in place keeps the survivors' processes, so each survivor's run of the failed attempt must end
by itself: its collective with the dead rank must fail. Two real ranks (separate processes, a real
process group) both finish one all-reduce; then rank 0 starts a second one at once, and rank 1, which
never joins it, SIGKILLs itself 1 s later (or, ``peer_dies=False``, stays alive: a peer that left the
attempt). Rank 0 reports how its collective ended within ``wait_s``, the host-side read included (where
an NCCL rank's host waits). With ``abort``, a collective still blocked then is aborted from the main
thread (``_abort_process_group``, what a repair in place on NCCL would do, as torchft does) and rank 0
reports whether that ended it. The processes are spawned (CUDA cannot be forked).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any

#: Rank 1 dies this long after both ranks finished their first all-reduce: rank 0 is inside the second.
DIE_AFTER_S = 1.0
#: The process group's timeout: well past any wait here, so NCCL's watchdog never ends rank 0 first.
GROUP_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, port: int, backend: str, wait_s: float, abort: float, peer_dies: bool, results) -> None:
    if abort:  # torch: an abort is for callers that handle the errors, not NCCL's watchdog (which would end us)
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    first = torch.ones(1, device=device)
    dist.all_reduce(first)
    assert first.item() == 2.0
    if rank == 1:
        time.sleep(DIE_AFTER_S)
        if peer_dies:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(wait_s + abort + 60.0)  # alive, and never in the collective: a peer that left the attempt
        os._exit(0)  # the parent ends it long before
    outcome: dict[str, Any] = {}

    def collective() -> None:
        value = torch.ones(1, device=device)
        try:
            dist.all_reduce(value)
            outcome["value"] = value.item()  # an NCCL rank's host waits here, behind the kernel
        except Exception as err:  # noqa: BLE001 - what failed, and how, is the finding
            outcome["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        outcome["seconds"] = time.monotonic() - started

    started = time.monotonic()
    thread = threading.Thread(target=collective, daemon=True)
    thread.start()
    thread.join(wait_s)
    report: dict[str, Any] = {"ended": not thread.is_alive()}
    if abort and thread.is_alive():
        aborted = time.monotonic()
        dist.distributed_c10d._abort_process_group()  # every group of this process
        thread.join(abort)
        report.update(ended_after_abort=not thread.is_alive(), after_abort_s=time.monotonic() - aborted)
    results.put({**report, **outcome})
    results.close()
    results.join_thread()
    os._exit(0)  # a blocked NCCL rank would hang in the group's teardown


def survivor_outcome(backend: str, wait_s: float, *, abort: float = 0.0, peer_dies: bool = True) -> dict[str, Any]:
    """Rank 0's collective after rank 1 died inside it: ``{"ended": bool, "error"?, "value"?, "seconds"?}``
    (``ended`` False: still blocked ``wait_s`` after it began); with ``abort`` (seconds) one still blocked
    is aborted and waited for that long more: ``ended_after_abort`` and ``after_abort_s``. With
    ``peer_dies=False`` rank 1 stays alive but never joins the collective (a peer that left the attempt)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    ranks = [
        context.Process(target=_rank, args=(rank, port, backend, wait_s, abort, peer_dies, results))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    try:
        limit_s = wait_s + abort + 90.0  # spawning and importing torch take seconds
        return results.get(timeout=limit_s)
    except queue.Empty:
        raise AssertionError(f"rank 0 reported nothing within {limit_s:.0f}s") from None
    finally:
        ranks[0].join(timeout=5)  # it exits once it reported
        for process in ranks:  # and a peer that stayed alive is ended here
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
