"""The job every recovery/startup run trains, and the arithmetic that turns a run into samples.

One :class:`Job` describes it for all three systems: etrain gets it as a JobSpec over HTTP
(:func:`etrain_spec`); the peers run :class:`PlainDDP` on the same model (``etrain.workers.engine.init.build_model``
of the ``gpt-tiny`` preset, same seed), the same synthetic token stream and the same global sampler
(``etrain.workers.engine.data``), the same global batch split the same way over the same DP2 world, the same AdamW,
and checkpoint at the same cadence. What differs is only what is being compared: who launches the
ranks, notices a death, and brings training back.

The kill is the same everywhere: at the start of step index ``kill_at`` (after ``kill_at`` completed
steps), rank ``kill_rank`` SIGKILLs its own process, once per run (a marker file remembers; etrain's
chaos drill remembers the fired order the same way). Every system's rank 0 logs each completed step
with a wall-clock timestamp and its attempt; :func:`recovery_measures` reads the same numbers out of
all of them.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Job", "PlainDDP", "StepLog", "etrain_spec", "maybe_kill", "recovery_measures"]


@dataclass(frozen=True)
class Job:
    """DP2 on the gpt-tiny preset; 40 steps, a checkpoint every 10, rank 1 killed at step 19 (issue #9)."""

    steps: int = 40
    every: int = 10
    kill_at: int | None = 19
    kill_rank: int = 1
    dp: int = 2
    preset: str = "gpt-tiny"
    global_batch: int = 8
    micro_batch: int = 2
    lr: float = 1e-3
    seed: int = 5
    data_seed: int = 3

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def model_config(self):
        from etrain.workers.families import MODEL_PRESETS
        from etrain.workers.protocol.run_config import ModelConfig

        return ModelConfig(**MODEL_PRESETS[self.preset])


def etrain_spec(job: Job, name: str, **sections: Any) -> dict[str, Any]:
    """The JobSpec etrain gets for ``job`` (defaults everywhere else, as a user would submit it);
    ``sections`` are merged into the spec's sections (e.g. ``fault_tolerance={...}``)."""
    body: dict[str, Any] = {
        "name": name,
        "model": {"preset": job.preset},
        "data": {"kind": "synthetic", "seed": job.data_seed},
        "parallelism": {"dp": job.dp},
        "resources": {"cpus_per_worker": 1},
        "training": {
            "steps": job.steps,
            "global_batch": job.global_batch,
            "micro_batch": job.micro_batch,
            "lr": job.lr,
            "seed": job.seed,
        },
        "checkpoint": {"every_steps": job.every, "keep_last": 3},
    }
    for key, value in sections.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return body


class PlainDDP:
    """What a user writes for the peers: DDP over the job's model, AdamW, gradient accumulation with
    ``no_sync`` on all but the last micro-batch, torch.save-able state. ``wrap`` puts the model under
    DDP (``ray.train.torch.prepare_model`` for Ray Train, ``DistributedDataParallel`` for torchrun)."""

    def __init__(self, job: Job, rank: int, world_size: int, wrap: Callable[[Any], Any]):
        import torch

        from etrain.workers.engine.data import GlobalSampler, build_dataset
        from etrain.workers.engine.init import build_model
        from etrain.workers.protocol.run_config import DataConfig

        torch.set_num_threads(int(os.environ.get("ETRAIN_TORCH_THREADS", "1")))
        config = job.model_config()
        self.job, self.rank, self.world_size = job, rank, world_size
        self.inner = build_model(config, seed=job.seed)
        self.model = wrap(self.inner)
        self.optimizer = torch.optim.AdamW(self.inner.parameters(), lr=job.lr)
        self.dataset = build_dataset(DataConfig(kind="synthetic", seed=job.data_seed), config)
        self.sampler = GlobalSampler(len(self.dataset), job.global_batch, seed=job.seed)

    def step(self, step: int) -> float:
        from etrain.workers.families.model import cross_entropy_loss

        micro = self.sampler.local_micro_batches(step, self.rank, self.world_size, self.job.micro_batch)
        total = 0.0
        for i, indices in enumerate(micro):
            inputs, targets = self.dataset.batch(indices)
            last = i == len(micro) - 1
            with nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync():
                loss = cross_entropy_loss(self.model(inputs), targets) / len(micro)
                loss.backward()
            total += float(loss.detach())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def state(self, step: int) -> dict[str, Any]:
        return {"model": self.inner.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step}

    def load(self, state: dict[str, Any]) -> int:
        self.inner.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        return int(state["step"])


class StepLog:
    """Append-only JSON lines shared by the processes of one run (``O_APPEND`` writes of one line each)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def append(self, **row: Any) -> None:
        line = (json.dumps(row) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def maybe_kill(job: Job, rank: int, step: int, marker: str | os.PathLike) -> None:
    """At the start of step index ``job.kill_at`` on ``job.kill_rank``, once per run: note the time in
    ``marker``, then SIGKILL this process (no cleanup, no exit handlers: a segfault or an OOM kill)."""
    if job.kill_at is None or rank != job.kill_rank or step != job.kill_at:
        return
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # exactly one kill per run
    except FileExistsError:
        return
    os.write(fd, json.dumps({"ts": time.time(), "step": step, "rank": rank, "pid": os.getpid()}).encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def recovery_measures(
    steps: list[dict[str, Any]], *, start_ts: float, kill_ts: float | None, kill_at: int | None
) -> dict[str, float | int | None]:
    """Startup and recovery of one run from its step rows (``{"step", "ts", "attempt"}``; step = completed
    steps, 1-based) — the same arithmetic for etrain and every peer.

    * ``startup_s``: first completed step (step 1, first attempt) minus ``start_ts`` (submit / fit() /
      torchrun launch);
    * ``recovery_s``: the kill to the first step completed by a later attempt (the first sign of life);
    * ``resumed_from``: the step that attempt started after (its first step - 1);
    * ``recomputed``: ``kill_at - resumed_from``, steps done twice (the kill lands after ``kill_at`` steps);
    * ``progress_s``: the kill to step ``kill_at + 1`` completed, i.e. back where the kill stopped it.

    etrain's step store keeps one row per step, the latest attempt's: a kill before the first checkpoint
    (the next attempt starts over) leaves no row of the killed attempt. The killed attempt is then the
    oldest one still seen after the kill when several are, else the one before the only attempt seen,
    and there is no start-up figure (step 1's row is the next attempt's).
    """
    out: dict[str, float | int | None] = {
        "startup_s": None,
        "recovery_s": None,
        "resumed_from": None,
        "recomputed": None,
        "progress_s": None,
    }
    firsts = [row for row in steps if row["step"] == 1 and (kill_ts is None or row["ts"] <= kill_ts)]
    if firsts:
        first = min(firsts, key=lambda row: row["ts"])
        out["startup_s"] = first["ts"] - start_ts
    if kill_ts is None or kill_at is None or not steps:
        return out
    before = [row["attempt"] for row in steps if row["ts"] <= kill_ts]
    seen = sorted({row["attempt"] for row in steps})
    killed = max(before) if before else seen[0] if len(seen) > 1 else seen[0] - 1
    later = [row for row in steps if row["attempt"] > killed and row["ts"] > kill_ts]
    if not later:
        return out
    resumed = min(later, key=lambda row: row["ts"])
    out["recovery_s"] = resumed["ts"] - kill_ts
    out["resumed_from"] = resumed["step"] - 1
    out["recomputed"] = kill_at - out["resumed_from"]
    back = [row["ts"] for row in later if row["step"] == kill_at + 1]
    out["progress_s"] = min(back) - kill_ts if back else None
    return out
