"""The training loop of one rank: used by the Ray worker, by tests, and under ``torchrun``.

``Trainer`` wires the pieces in a fixed order — topology → DeviceMesh → model → (pipeline split) →
``parallelize_stage`` (TP → AC → DP) → AdamW → data — and ``train_step(step)`` runs one optimizer
step over the global batch of that step. Everything a step does is a function of the step number
(sample indices, learning rate), so a restored or resized run continues exactly.

Timing is measured, not estimated, because straggler detection depends on it: ``compute_s`` is the
wall time of forward/backward (and of the ``on_compute`` callbacks, where a chaos "slow rank"
sleeps); just before the last micro-step's backward every rank enters a timed scalar all-reduce
over the world (the *sync point*), so a slow rank shows a high ``compute_s`` while its peers show
the wait as ``comm_wait_s``, together with the optimizer-side collectives (gradient norm, loss).

Run as the reference path::

    torchrun --nproc-per-node 4 -m workers.train --config cfg.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from workers import metrics as throughput
from workers.config import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)
from workers.data import GlobalSampler, build_dataset
from workers.errors import ConfigError, NonFiniteLossError
from workers.mesh import backend_for, build_device_mesh
from workers.init import materialize
from workers.model import build_model_skeleton, cross_entropy_loss
from workers.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr
from workers.parallelize import ParallelDims, gradient_sync, parallelize_stage, unwrap
from workers.topology import Topology

__all__ = ["StepMetrics", "Trainer", "TrainerCallback", "load_run_config", "main"]


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """What one optimizer step reports; ``loss`` is the global-batch mean, equal on every rank."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    step_s: float
    compute_s: float
    comm_wait_s: float
    tokens: int  # tokens of the global batch
    tokens_per_s: float
    flops_per_s: float
    mfu: float | None
    peak_mem_bytes: int


class TrainerCallback(Protocol):
    """Hooks for cross-cutting work (metrics, checkpoint triggers, chaos); all optional."""

    def on_step_start(self, trainer: "Trainer", step: int) -> None: ...

    def on_compute(self, trainer: "Trainer", step: int, micro_step: int) -> None: ...

    def on_step_end(self, trainer: "Trainer", metrics: StepMetrics) -> None: ...


class Trainer:
    """One rank's model, optimizer and data, and the step that trains them.

    The default process group must already be initialized by the caller (gloo on CPU, nccl on
    CUDA, with a timeout) unless ``world_size == 1``, where a plain single process is allowed.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        callbacks: Sequence[Any] = (),
    ):
        parallel = config.parallel
        if parallel.world_size != world_size:
            raise ConfigError(
                f"parallel layout pp={parallel.pp} × dp={parallel.dp} × tp={parallel.tp} = "
                f"{parallel.world_size} ranks, but the world size is {world_size}.",
                field="parallel",
                fix=f"choose degrees whose product is {world_size}",
            )
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.callbacks = list(callbacks)
        self.topology = Topology(pp=parallel.pp, dp=parallel.dp, tp=parallel.tp)
        self.coords = self.topology.coords(rank)
        self.distributed = dist.is_available() and dist.is_initialized()
        if not self.distributed and world_size > 1:
            raise RuntimeError("Trainer with world_size > 1 needs an initialized default process group")
        mesh = build_device_mesh(self.topology, self.device.type) if self.distributed else None
        self.dims = ParallelDims.build(self.topology, mesh, world_size)
        self.grad_accum_steps = config.grad_accum_steps

        # Meta-device init: nothing is allocated until each rank's shards are materialised inside
        # parallelize_stage (after FSDP2 sharding), initialised per parameter from its FQN.
        with torch.device("meta"):
            model = build_model_skeleton(config.model)
        materialize_local = partial(materialize, device=self.device, seed=config.training.seed,
                                    n_layers=config.model.n_layers)
        transform = partial(parallelize_stage, dims=self.dims, config=config, materialize=materialize_local)
        self.pipeline = None
        if self.dims.pp_enabled:
            from workers.pipeline import build_pipeline

            self.pipeline = build_pipeline(
                model,
                pp_mesh=self.dims.axis("pp"),
                pp_rank=self.coords.pp,
                parallel=parallel,
                n_microbatches=self.grad_accum_steps,
                loss_fn=cross_entropy_loss,
                device=self.device,
                stage_transform=transform,
            )
            self.modules: list[nn.Module] = list(self.pipeline.model_parts)
        else:
            self.modules = [transform(model)]
        #: The stage modules with their original FQNs (DDP wrappers removed): what DCP saves.
        self.model_parts: list[nn.Module] = [unwrap(m) for m in self.modules]

        zero_group = self.dims.group("dp") if parallel.zero == 1 else None
        self.optimizers = [
            build_optimizer([p for m in self.model_parts for p in m.parameters()], config.training,
                            zero=parallel.zero, dp_group=zero_group)
        ]
        self.dataset = build_dataset(config.data, config.model)
        self.sampler = GlobalSampler(len(self.dataset), config.training.global_batch, config.training.seed)
        self.flops_per_token = throughput.flops_per_token(config.model)
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.peak_flops = throughput.peak_flops_per_s(device_name, config.training.precision)
        self.next_step = 0

    # -- the step ------------------------------------------------------------------------------

    def train_step(self, step: int) -> StepMetrics:
        """One optimizer step over the global batch of ``step``; collective over the world."""
        training = self.config.training
        for callback in self.callbacks:
            _call(callback, "on_step_start", self, step)
        step_start = time.perf_counter()
        lr = lr_at(step, training)
        for optimizer in self.optimizers:
            set_lr(optimizer, lr)
            optimizer.zero_grad(set_to_none=True)

        micro_batches = self.sampler.local_micro_batches(step, self.coords.dp, self.dims.dp, training.micro_batch)
        if self.pipeline is not None:
            loss_sum, has_loss, compute_s, comm_wait_s = self._pipeline_forward_backward(step, micro_batches)
        else:
            loss_sum, has_loss, compute_s, comm_wait_s = self._forward_backward(step, micro_batches)

        comm_start = time.perf_counter()
        loss = self._global_loss(loss_sum, has_loss)
        if not math.isfinite(loss):
            raise NonFiniteLossError(
                f"the loss is {loss} at step {step}; the run cannot continue from this state.",
                field="training.lr",
                fix="lower training.lr, enable training.grad_clip, or check the data",
            )
        grad_norm = clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], training.grad_clip,
            pp_group=self.dims.group("pp"),
        )
        for optimizer in self.optimizers:
            optimizer.step()
        self._sync_device()
        comm_wait_s += time.perf_counter() - comm_start
        step_s = time.perf_counter() - step_start

        tokens = training.global_batch * self.config.model.seq_len
        flops_per_s = self.flops_per_token * tokens / step_s if step_s > 0 else 0.0
        metrics = StepMetrics(
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=float(grad_norm),
            step_s=step_s,
            compute_s=compute_s,
            comm_wait_s=comm_wait_s,
            tokens=tokens,
            tokens_per_s=throughput.tokens_per_s(tokens, step_s),
            flops_per_s=flops_per_s,
            mfu=throughput.mfu(flops_per_s, self.world_size, self.peak_flops),
            peak_mem_bytes=self._peak_mem_bytes(),
        )
        self.next_step = step + 1
        for callback in self.callbacks:
            _call(callback, "on_step_end", self, metrics)
        return metrics

    def _forward_backward(self, step: int, micro_batches: list[list[int]]) -> tuple[torch.Tensor, bool, float, float]:
        """Micro-steps without a pipeline: loss / grad_accum so the gradients sum to the mean.

        The DP wrapper averages over dp, so the result is exactly the gradient of the mean loss
        over the global batch. Gradients are synchronised only on the last micro-step.
        """
        (module,) = self.modules
        num_micro = len(micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        compute_s = comm_wait_s = 0.0
        for micro_step, indices in enumerate(micro_batches):
            inputs, targets = (t.to(self.device) for t in self.dataset.batch(indices))
            last = micro_step == num_micro - 1
            start = time.perf_counter()
            for callback in self.callbacks:
                _call(callback, "on_compute", self, step, micro_step)
            with gradient_sync(self.modules, enabled=last):
                with self._autocast():
                    loss = cross_entropy_loss(module(inputs), targets)
                if last:
                    self._sync_device()
                    compute_s += time.perf_counter() - start
                    comm_wait_s += self._sync_point()
                    start = time.perf_counter()
                (loss / num_micro).backward()
            self._sync_device()
            compute_s += time.perf_counter() - start
            loss_sum += loss.detach().float()
        return loss_sum / num_micro, True, compute_s, comm_wait_s

    def _pipeline_forward_backward(
        self, step: int, micro_batches: list[list[int]]
    ) -> tuple[torch.Tensor, bool, float, float]:
        """The whole pipeline schedule over the local batch (micro-batches = grad_accum steps).

        The schedule interleaves stages, so the sync point comes after it; the pipeline's own
        ``busy_s`` separates compute from waiting on neighbours.
        """
        indices = [i for micro in micro_batches for i in micro]
        inputs, targets = (t.to(self.device) for t in self.dataset.batch(indices))
        start = time.perf_counter()
        for callback in self.callbacks:
            _call(callback, "on_compute", self, step, 0)
        callbacks_s = time.perf_counter() - start
        with self._autocast():
            loss = self.pipeline.step(inputs, targets)
        self._sync_device()
        wall_s = time.perf_counter() - start
        busy_s = float(getattr(self.pipeline, "busy_s", wall_s - callbacks_s))
        compute_s = callbacks_s + busy_s
        comm_wait_s = max(0.0, wall_s - compute_s) + self._sync_point()
        has_loss = loss is not None
        loss_mean = loss.detach().float() if has_loss else torch.zeros((), device=self.device)
        return loss_mean, has_loss, compute_s, comm_wait_s

    def _autocast(self):
        """bf16 compute with fp32 parameters, gradients and optimizer state (``training.precision``).

        Autocast keeps the master weights fp32, so the optimizer and the gradient reductions are
        unchanged; the loss reduction is done in fp32 by ``cross_entropy_loss``.
        """
        enabled = self.config.training.precision == "bf16"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _sync_point(self) -> float:
        """A timed scalar all-reduce over the world: the time a fast rank waits for the slowest."""
        if not self.distributed:
            return 0.0
        start = time.perf_counter()
        dist.all_reduce(torch.zeros(1, device=self.device))
        return time.perf_counter() - start

    def _global_loss(self, local_mean: torch.Tensor, has_loss: bool) -> float:
        """Mean loss over the global batch, identical on every rank.

        Ranks that hold a loss (all, or the last pipeline stage) each carry the mean over their
        micro-batches; TP ranks of one dp replica carry the same value, so the world sum divided by
        the number of holders is the mean over dp replicas.
        """
        if not self.distributed or self.world_size == 1:
            return float(local_mean)
        holders = self.dims.dp * self.dims.tp
        value = local_mean.detach().float().reshape(1) if has_loss else torch.zeros(1, device=self.device)
        dist.all_reduce(value)
        return float(value[0] / holders)

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _peak_mem_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB

    # -- loops ---------------------------------------------------------------------------------

    def run(self, start_step: int, end_step: int) -> list[StepMetrics]:
        """Train steps ``start_step`` .. ``end_step - 1``; returns their metrics."""
        return [self.train_step(step) for step in range(start_step, end_step)]

    # -- state ---------------------------------------------------------------------------------

    def state_for_checkpoint(self) -> tuple[list[nn.Module], list[torch.optim.Optimizer], dict[str, Any]]:
        """What a checkpoint holds: stage modules (original FQNs), optimizers, and ``extra``.

        ``extra`` carries the next step, which fully determines the data position (the sampler is
        a pure function of the step), and the RNG states, all as plain types that
        ``torch.load(weights_only=True)`` reads back.
        """
        from workers.checkpoint import capture_rng_state

        extra = {
            "step": self.next_step,
            "data": {"next_step": self.next_step, "sampler_seed": self.sampler.seed,
                     "num_samples": self.sampler.num_samples, "global_batch": self.sampler.global_batch},
            "rng": capture_rng_state(),
            "layout": self.config.parallel.describe(),
        }
        return self.model_parts, self.optimizers, extra

    def save(self, step_dir: str) -> Any:
        """Save this rank's shards of a DCP checkpoint (collective); returns its ``ShardReport``.

        The checkpoint is usable only once the supervisor commits every rank's report.
        """
        from workers.checkpoint import save_checkpoint

        model_parts, optimizers, extra = self.state_for_checkpoint()
        return save_checkpoint(step_dir, model_parts, optimizers, extra)

    def restore(self, step_dir: str, *, verify_checksums: bool = True) -> int:
        """Load a committed checkpoint saved under any layout (DCP reshards by FQN).

        Restores parameters, optimizer state and RNG; returns the step to run next. The manifest and
        file sizes are always checked; ``verify_checksums=False`` skips re-hashing when the caller
        (the supervisor, right before launch) has just verified the checksums itself.
        """
        from workers.checkpoint import load_checkpoint, restore_rng_state

        extra = load_checkpoint(step_dir, self.model_parts, self.optimizers, checksums=verify_checksums)
        restore_rng_state(extra.get("rng") or {})
        self.next_step = int(extra["step"])
        return self.next_step

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded, of every stage, on every rank (CPU tensors; a collective).

        For tests that compare a layout's parameters with one process'. DCP's state-dict API
        gathers FSDP and TP shards; stages are then exchanged over the pp group.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state: dict[str, torch.Tensor] = {}
        for part in self.model_parts:
            if self.distributed:
                part_state = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
            else:
                part_state = part.state_dict()
            state.update({k: v.detach().cpu().clone() for k, v in part_state.items()})
        pp_group = self.dims.group("pp")
        if pp_group is not None:
            gathered: list[dict[str, torch.Tensor] | None] = [None] * self.dims.pp
            dist.all_gather_object(gathered, state, group=pp_group)
            state = {k: v for stage_state in gathered for k, v in stage_state.items()}
        return state


def _call(callback: Any, hook: str, *args: Any) -> None:
    method = getattr(callback, hook, None)
    if method is not None:
        method(*args)


# -- torchrun entry point --------------------------------------------------------------------------


def load_run_config(path: str) -> RunConfig:
    """A RunConfig from JSON: ``{"job_id", "model": {...}, "data", "parallel", "training", ...}``."""
    with open(path) as f:
        raw = json.load(f)
    sections = {"model": ModelConfig, "data": DataConfig, "parallel": ParallelConfig,
                "training": TrainingConfig, "checkpoint": CheckpointConfig}
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"unknown config sections {sorted(unknown)} in {path}.", field=sorted(unknown)[0])
    kwargs = {k: (sections[k](**v) if k in sections else v) for k, v in raw.items()}
    kwargs.setdefault("job_id", os.path.splitext(os.path.basename(path))[0])
    return RunConfig(**kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """``torchrun -m workers.train --config cfg.json``: train and print one JSON line per step (rank 0)."""
    parser = argparse.ArgumentParser(prog="workers.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="RunConfig as JSON")
    parser.add_argument("--steps", type=int, default=None, help="override training.steps")
    parser.add_argument("--metrics-out", default=None, help="write all ranks' step metrics (rank 0) as JSON")
    args = parser.parse_args(argv)

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
        dist.init_process_group(backend_for(device.type), timeout=timedelta(seconds=config.collective_timeout_s))
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
