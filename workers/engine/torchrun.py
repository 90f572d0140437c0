"""``torchrun -m etrain.workers.engine.torchrun --config cfg.json``: one rank's Trainer without Ray or the service.

The reference path: the same ``Trainer`` the Ray rank actors run, started by torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) from a ``RunConfig`` JSON file, printing one JSON line per
step on rank 0. It is how a layout is checked against plain torch.distributed, and kept out of
``workers/engine/train.py`` so that module holds only the training step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from etrain.workers import families
from etrain.workers.engine.compile import use_node_cache
from etrain.workers.engine.mesh import backend_for
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.run_config import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)

__all__ = ["load_run_config", "main"]


def load_run_config(path: str) -> RunConfig:
    """A RunConfig from JSON: ``{"job_id", "model": {...}, "data", "parallel", "training", ...}``; a model of
    an unregistered ``arch`` is a ``ConfigError`` (field ``model.kind``) naming the registered families."""
    with open(path) as f:
        raw = json.load(f)
    sections = {
        "model": ModelConfig,
        "data": DataConfig,
        "parallel": ParallelConfig,
        "training": TrainingConfig,
        "checkpoint": CheckpointConfig,
    }
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"unknown config sections {sorted(unknown)} in {path}.", field=sorted(unknown)[0])
    kwargs = {k: (sections[k](**v) if k in sections else v) for k, v in raw.items()}
    if "model" in kwargs:
        families.family(kwargs["model"].arch)  # ConfigError naming the registered families
    kwargs.setdefault("job_id", os.path.splitext(os.path.basename(path))[0])
    return RunConfig(**kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """``torchrun -m etrain.workers.engine.torchrun --config cfg.json``: train and print one JSON line per
    step (rank 0)."""
    parser = argparse.ArgumentParser(prog="etrain.workers.engine.torchrun", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="RunConfig as JSON")
    parser.add_argument("--steps", type=int, default=None, help="override training.steps")
    parser.add_argument("--metrics-out", default=None, help="write all ranks' step metrics (rank 0) as JSON")
    args = parser.parse_args(argv)
    use_node_cache()  # before the Trainer's module imports torch._dynamo (workers/engine/compile.py says why)
    from etrain.workers.engine.train import Trainer

    config = load_run_config(args.config)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if config.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    initialized_here = False
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group(
            backend_for(device.type, cpu_offload=config.parallel.offload == "cpu"),
            timeout=timedelta(seconds=config.collective_timeout_s),
        )
        initialized_here = True
    try:
        trainer = Trainer(config, rank=rank, world_size=world_size, device=device)
        steps = args.steps if args.steps is not None else config.training.steps
        history = []
        for step in range(steps):
            metrics = trainer.train_step(step)
            history.append(dataclasses.asdict(metrics))
            if rank == 0:
                print(json.dumps(history[-1]), flush=True)
        if args.metrics_out and rank == 0:
            with open(args.metrics_out, "w") as f:
                json.dump(history, f)
    finally:
        if initialized_here:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
