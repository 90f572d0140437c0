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


#: The survivors' ranks report how long their attempt took to fail, then stay alive this long: a peer whose
#: connections stayed open would keep the others waiting about that long.
SURVIVOR_STAYS_S = 60.0


def _hsdp_rank(rank: int, port: int, results) -> None:
    """One rank of dp4 ZeRO-3 under HSDP (shard groups {0,1} and {2,3}, replica pairs {0,2} and {1,3}), the
    Trainer of the service, two steps, then rank 3 SIGKILLs itself and the others train on until their
    collectives fail; each survivor leaves its attempt as a rank process does (its groups destroyed, its
    objects dropped, ``release_failed_attempt``) and stays alive."""
    import torch
    import torch.distributed as dist

    from etrain.workers.engine.train import Trainer
    from etrain.workers.protocol.run_config import ParallelConfig
    from etrain.workers.rank.leave_attempt import release_failed_attempt
    from tests.equivalence_utils import small_config

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=4,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    config = small_config(steps=40, parallel=ParallelConfig(dp=4, zero=3, dp_replicate=2))
    trainer = Trainer(config, rank=rank, world_size=4, device=torch.device("cpu"))
    trainer.run(0, 2)
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    failure = None
    try:
        for step in range(2, 40):
            trainer.train_step(step)
    except Exception as err:  # noqa: BLE001 - the collective failure this is about
        failure = err
    failed_s = time.monotonic() - started
    dist.destroy_process_group()
    trainer = None
    released = release_failed_attempt(failure) if failure is not None else False
    results.put({"rank": rank, "failed": failure is not None, "failed_s": failed_s, "released": released})
    results.close()
    results.join_thread()
    time.sleep(SURVIVOR_STAYS_S)
    os._exit(0)


def hsdp_survivors_leave() -> list[dict[str, Any]]:
    """Each survivor's report (rank order) of the HSDP attempt above: whether its attempt failed, how long
    after rank 3's death (its ``failed_s``), and whether it released its groups."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    ranks = [context.Process(target=_hsdp_rank, args=(rank, port, results)) for rank in range(4)]
    for process in ranks:
        process.start()
    try:
        reports = [results.get(timeout=120) for _ in range(3)]
    except queue.Empty:
        raise AssertionError("the survivors did not all report within 120 s") from None
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    return sorted(reports, key=lambda report: report["rank"])
