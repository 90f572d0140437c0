"""A warm spare rank: a Ray actor process with torch and the engine already imported, no job yet.

Starting a rank cold costs a new Python interpreter, ``import torch`` and the engine's modules
(3-7 s on a 2-core machine, measured), on every first launch and every replacement. A spare pays
that once, ahead of time, while it holds nothing: it is created with ``num_cpus=0`` and no GPUs, so
it never counts against any job's resources, and it does not touch CUDA, so it holds no GPU memory.
When a job's placement group is ready, the worker group takes a spare on the node of each bundle
(``service/runtime/spares.py``) and :meth:`SpareRank.assign` turns it into that job's rank: the bundle's
reservation is what accounts for the rank's CPUs and GPUs, and the rank is pinned to the bundle's
GPUs through ``CUDA_VISIBLE_DEVICES`` (CUDA reads it on first use, which comes after this).
"""

from __future__ import annotations

import os
import time
from typing import Any

from etrain.workers.worker import TrainWorker


class SpareRank(TrainWorker):
    """A :class:`TrainWorker` whose process starts before its job exists."""

    def __init__(self) -> None:  # noqa: D107 -- the job comes later, in assign()
        started = time.monotonic()
        # What a rank needs before its first step; imported now so a replacement pays none of it.
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401

        import etrain.workers.checkpoint  # noqa: F401
        import etrain.workers.train  # noqa: F401

        _train_one_tiny_step()
        self.warmup_s = time.monotonic() - started
        self.assigned = False

    def ready(self) -> dict[str, Any]:
        """Where the spare runs and what its warm-up cost (answers once ``__init__`` is done)."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "warmup_s": round(self.warmup_s, 3)}

    def assign(self, *, job_id: str, rank: int, world_size: int, supervisor: Any,
               gpu_ids: list[str] | None = None) -> int:
        """Become rank ``rank`` of ``job_id``; ``gpu_ids``: the bundle's GPUs. Returns the rank.

        A spare is assigned once: a rank's process is never reused for another job or attempt.
        """
        if self.assigned:
            raise RuntimeError("this spare already serves a job")
        if gpu_ids:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        TrainWorker.__init__(self, job_id=job_id, rank=rank, world_size=world_size, supervisor=supervisor)
        self.assigned = True
        return rank


#: The warm-up model: the smallest GPT the engine builds (one layer, 8 wide), trained for one step.
WARMUP_MODEL = dict(n_layers=1, d_model=8, n_heads=2, vocab_size=16, seq_len=4)


def _train_one_tiny_step() -> None:
    """Build a one-process :class:`Trainer` on a tiny GPT on the CPU and train it one step.

    A first Trainer pays for what torch loads lazily, not at import: building a model under a device
    context imports ``torch._dynamo`` (0.5-0.7 s, measured), and the first forward, backward and
    AdamW step set up their kernels and caches. Measured on the 2-core machine, a rank's Trainer took
    1.4 s to build without this and 0.06-0.18 s after it (the rank log's start-up line). It runs on the CPU only (a spare never touches
    CUDA) in a single process (no process group), and leaves nothing behind: the job's Trainer seeds
    every generator it uses itself.
    """
    import torch

    from etrain.workers.protocol.run_config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainingConfig
    from etrain.workers.train import Trainer

    config = RunConfig(job_id="spare-warmup", model=ModelConfig(**WARMUP_MODEL), data=DataConfig(kind="synthetic"),
                       parallel=ParallelConfig(), training=TrainingConfig(steps=1, global_batch=1, micro_batch=1))
    threads = torch.get_num_threads()
    try:
        Trainer(config, rank=0, world_size=1, device=torch.device("cpu")).train_step(0)
    finally:
        torch.set_num_threads(threads)
