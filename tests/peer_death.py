"""What a rank's collective does when its peer's process dies in the middle of it: the premise of the
supervisor's repair in place (``JobPolicy.collectives_fail_on_peer_loss``, service/decisions/job_policy.py).

A repair in place keeps the survivors' processes, so each survivor's run of the failed attempt must end
by itself: its collective with the dead rank must fail. Two real ranks (separate processes, a real
process group): both finish one all-reduce, then rank 1 starts a second one and SIGKILLs itself while
rank 0 is inside it; rank 0 reports how its collective ended within ``wait_s`` (the host-side read
included, which is where an NCCL rank's host waits). The processes are spawned (CUDA cannot be forked).
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


def _rank(rank: int, port: int, backend: str, wait_s: float, results) -> None:
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
        os.kill(os.getpid(), signal.SIGKILL)
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
    results.put({"ended": not thread.is_alive(), **outcome})
    results.close()
    results.join_thread()
    os._exit(0)  # a blocked NCCL rank would hang in the group's teardown


def survivor_outcome(backend: str, wait_s: float) -> dict[str, Any]:
    """Rank 0's collective after rank 1 died inside it: ``{"ended": bool, "error"?, "value"?, "seconds"?}``
    (``ended`` False: still blocked ``wait_s`` after it began)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, backend, wait_s, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        return results.get(timeout=wait_s + 90.0)  # spawning and importing torch take seconds
    except queue.Empty:
        raise AssertionError(f"rank 0 reported nothing within {wait_s + 90.0:.0f}s") from None
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
