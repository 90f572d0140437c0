"""Peer: Ray Train v2 ``TorchTrainer.fit`` on the benchmark job, with ``FailureConfig(max_failures=1)``.

Run as its own process (``python -m benchmarks.peers.ray_train --job '<json>' --workdir D --out F``): it
starts its **own** local Ray (``address="local"``, never etrain's), so the two never share daemons,
ports or CPUs; ``benchmarks.procs`` runs it in a new process group with a timeout.

The train function is what the Ray Train docs show for PyTorch: ``prepare_model`` (DDP over gloo on
CPU), every ``job.every`` steps ``ray.train.report`` of the metrics with a checkpoint from rank 0
(``torch.save`` into a directory handed to ``Checkpoint.from_directory``), and on start
``ray.train.get_checkpoint()`` to resume. Reports go only with checkpoints: a worker's report queue
holds one result, and the controller drains it once per ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (2 s by
default), so reporting every step would hold this job's ~50 ms steps to one per 2 s (measured: step
times of exactly 2.02 s) and the comparison would be about that throttle, not about start-up or recovery. Rank ``job.kill_rank`` SIGKILLs itself at step ``job.kill_at``
(``common.maybe_kill``); Ray Train notices the dead worker, tears the group down and starts a new one,
which resumes from the last reported checkpoint. Rank 0 appends every completed (reported) step to a
shared log with ``time.time()``; the driver records when it called ``fit()``.

RAY_TRAIN_V2_ENABLED=1 is set before Ray Train is imported (it is v2's switch; 2.60 defaults to v2).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

from benchmarks.peers.common import Job, PlainDDP, StepLog, maybe_kill  # noqa: E402


def _attempt(directory: Path, rank: int) -> int:
    """How many times this rank's train function started before (0 on the first attempt)."""
    path = directory / f"rank{rank}"
    with open(path, "a") as handle:
        handle.write("x")
    return path.stat().st_size - 1


def train_func(config: dict) -> None:
    import ray.train
    import torch
    from ray.train import Checkpoint
    from ray.train.torch import prepare_model

    job = Job(**config["job"])
    workdir = Path(config["workdir"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    attempt = _attempt(workdir / "attempts", rank)
    log = StepLog(workdir / "steps.jsonl")
    trainer = PlainDDP(job, rank, world_size, wrap=prepare_model)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            start = trainer.load(torch.load(Path(directory) / "state.pt", weights_only=True))
    for step in range(start, job.steps):
        maybe_kill(job, rank, step, workdir / "killed.json")
        loss = trainer.step(step)
        done = step + 1
        if done % job.every == 0 or done == job.steps:
            metrics = {"step": done, "loss": loss}
            with tempfile.TemporaryDirectory(dir=workdir) as directory:
                if rank == 0:
                    torch.save(trainer.state(done), Path(directory) / "state.pt")
                    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))
                else:
                    ray.train.report(metrics)
        if rank == 0:
            log.append(step=done, ts=time.time(), attempt=attempt, loss=loss)


def run(job: Job, workdir: Path, num_cpus: int) -> dict:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    (workdir / "attempts").mkdir(parents=True, exist_ok=True)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        trainer = TorchTrainer(
            train_func,
            train_loop_config={"job": job.as_dict(), "workdir": str(workdir)},
            scaling_config=ScalingConfig(num_workers=job.dp, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(
                name="etrain-bench-peer",
                storage_path=str(workdir / "storage"),
                failure_config=FailureConfig(max_failures=1),
                checkpoint_config=CheckpointConfig(num_to_keep=3),
            ),
        )
        fit_ts = time.time()
        error = None
        try:
            trainer.fit()
        except Exception as exc:  # noqa: BLE001 - recorded; the suite reports a failed peer run
            error = f"{type(exc).__name__}: {exc}"[:2000]
        end_ts = time.time()
    finally:
        ray.shutdown()
    killed = workdir / "killed.json"
    return {
        "system": "ray_train_v2",
        "start_ts": fit_ts,
        "end_ts": end_ts,
        "error": error,
        "kill": json.loads(killed.read_text()) if killed.exists() else None,
        "steps": StepLog(workdir / "steps.jsonl").rows(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="benchmarks.peers.common.Job as JSON")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--num-cpus", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = run(Job(**json.loads(args.job)), args.workdir, args.num_cpus)
    args.out.write_text(json.dumps(result))  # a failed fit is in "error": the caller reports it


if __name__ == "__main__":
    main()
