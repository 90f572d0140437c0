"""Peer: ``torchrun --nnodes=1 --nproc-per-node=2 --max-restarts=1`` (torch elastic agent) on the job.

:func:`run` launches ``torchrun --standalone`` (a c10d rendezvous on a free port: no fixed 29500 to
collide with) with this module as the script, in its own process group with a timeout
(``benchmarks.procs``). The script (``--worker``) is the plain elastic recipe: ``init_process_group``
from torchrun's environment, DDP, and every ``job.every`` steps rank 0 writes ``torch.save`` of model,
optimizer and step to a temporary file and renames it over ``ckpt.pt`` (atomic); on (re)start every
rank loads ``ckpt.pt`` if it exists. When rank ``job.kill_rank`` SIGKILLs itself at step
``job.kill_at``, the agent (monitoring every 0.1 s, torch's default) stops the surviving rank, and
restarts both with ``TORCHELASTIC_RESTART_COUNT`` = 1. Rank 0 logs each completed step with
``time.time()`` to a shared file. The launch sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the
rendezvous store shared (torch's default), a restarted rank can read the dead round's gloo address and
the restart fails with "Connection refused" (pytorch/pytorch#135712; seen here on torch 2.13).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.peers.common import Job, PlainDDP, StepLog, maybe_kill


def worker(job: Job, workdir: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = StepLog(workdir / "steps.jsonl")
    trainer = PlainDDP(job, rank, world_size, wrap=DistributedDataParallel)
    checkpoint = workdir / "ckpt.pt"
    start = trainer.load(torch.load(checkpoint, weights_only=True)) if checkpoint.exists() else 0
    for step in range(start, job.steps):
        maybe_kill(job, rank, step, workdir / "killed.json")
        loss = trainer.step(step)
        done = step + 1
        if rank == 0 and (done % job.every == 0 or done == job.steps):
            tmp = checkpoint.with_suffix(".tmp")
            torch.save(trainer.state(done), tmp)
            os.replace(tmp, checkpoint)
        if rank == 0:
            log.append(step=done, ts=time.time(), attempt=attempt, loss=loss)
    dist.destroy_process_group()


def run(job: Job, workdir: Path, *, timeout_s: float) -> dict:
    """One torchrun run of ``job`` in ``workdir``: launch time, the step log, the kill record."""
    from benchmarks.procs import RunFailed, child_env, run_group

    workdir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={job.dp}",
        "--max-restarts=1",
        "-m",
        "benchmarks.peers.torchrun_elastic",
        "--worker",
        "--job",
        json.dumps(job.as_dict()),
        "--workdir",
        str(workdir),
    ]
    # Without it the ranks of a restart share the rendezvous' TCP store with the previous round and can
    # read a dead rank's gloo address from it ("Connection refused"; pytorch/pytorch#135712).
    env = child_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    start_ts = time.time()
    finished = run_group(command, timeout_s=timeout_s, log_path=workdir / "torchrun.log", env=env)
    end_ts = time.time()
    killed = workdir / "killed.json"
    error = None
    if finished.returncode != 0:
        error = f"torchrun exited with {finished.returncode}:\n{finished.output_tail}"
    steps = StepLog(workdir / "steps.jsonl").rows()
    if not steps and error:
        raise RunFailed(error)
    return {
        "system": "torchrun_elastic",
        "start_ts": start_ts,
        "end_ts": end_ts,
        "error": error,
        "kill": json.loads(killed.read_text()) if killed.exists() else None,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run as one torchrun rank")
    parser.add_argument("--job", required=True, help="benchmarks.peers.common.Job as JSON")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    job = Job(**json.loads(args.job))
    if args.worker:
        worker(job, args.workdir)
    else:
        print(json.dumps(run(job, args.workdir, timeout_s=args.timeout)))


if __name__ == "__main__":
    main()
