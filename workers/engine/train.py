"""The training loop of one rank: used by the Ray worker, by tests, and under ``torchrun``.

``Trainer`` wires the pieces in a fixed order — topology → DeviceMesh → model → (pipeline split) →
``parallelize_stage`` (TP → AC → DP) → AdamW → data — and ``train_step(step)`` runs one optimizer
step over the global batch of that step. Everything a step does is a function of the step number
(sample indices, learning rate), so a restored or resized run continues exactly.

A step never makes the host wait for the device more than once: the loss and the gradient norm are
read together, in one ``.tolist()`` of a stacked tensor, and nothing else synchronises (no
per-micro-step ``cuda.synchronize``, no world-wide barrier on ordinary steps).

Timing is measured, not estimated, because straggler detection depends on it: ``compute_s`` is the
time of forward/backward (and of the ``on_compute`` callbacks, where a chaos "slow rank" sleeps):
``perf_counter`` spans on CPU, CUDA events on GPU (read after the step's one host read, when they
are complete, so reading them is free); ``comm_wait_s`` is the rest of the step (collectives,
waiting on peers or pipeline neighbours, the optimizer). Inside forward/backward a fast rank also
waits for a slow one (DDP's all-reduce, TP's all-reduces, FSDP2's all-gathers), which span time
cannot tell apart. So every ``training.timing_sync_every`` steps (a *timing-sync step*,
``StepMetrics.timing_synced``) two things happen, and the supervisor's straggler detector reads only
those steps: every rank enters a scalar all-reduce over the world just before the last micro-step's
backward (after the schedule under PP), outside the compute spans, which absorbs the wait that built
up before it (all of it under DDP); and the waits *inside* collectives in forward/backward (TP,
FSDP2) are timed and subtracted from the spans (``workers/engine/collective_waits.py``). There a slow rank
shows a high ``compute_s`` while its peers show the wait as ``comm_wait_s``.

``compute_s`` is measured by ``workers/engine/compute_timer.py``; ``workers/engine/torchrun.py`` runs this Trainer
under ``torchrun`` without Ray (the reference path).
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from etrain.workers.engine import metrics as throughput
from etrain.workers.engine.collective_waits import CollectiveWaitClock
from etrain.workers.engine.compute_timer import ComputeTimer
from etrain.workers.engine.data import GlobalSampler, build_dataset
from etrain.workers.engine.host_read import read_on_host
from etrain.workers.engine.init import materialize
from etrain.workers.engine.mesh import build_device_mesh
from etrain.workers.engine.optim import build_optimizer, clip_grad_norm_, lr_at, materialize_state, set_lr
from etrain.workers.engine.parallelize import (
    ParallelDims,
    expert_parameters,
    gradient_sync,
    loss_context,
    parallelize_stage,
    reduce_expert_grads,
    shards_experts,
    unwrap,
    uses_fsdp,
    validate_data_parallel,
)
from etrain.workers.families.layout import cp_problems, ep_problems
from etrain.workers.families.model import build_model_skeleton
from etrain.workers.families.ring_attention import shard_sequence
from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.errors import ConfigError, NonFiniteLossError
from etrain.workers.protocol.messages import StepMetrics
from etrain.workers.protocol.run_config import ModelConfig, RunConfig
from etrain.workers.protocol.topology import Topology

__all__ = ["Trainer", "TrainerCallback"]


class TrainerCallback(Protocol):
    """Hooks for cross-cutting work (metrics, checkpoint triggers, chaos); all optional."""

    def on_step_start(self, trainer: Trainer, step: int) -> None: ...

    def on_compute(self, trainer: Trainer, step: int, micro_step: int) -> None: ...

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None: ...


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
        load_pretrained: bool = True,
    ):
        parallel = config.parallel
        layout_rules.check(
            layout_rules.world_size_problems(
                pp=parallel.pp, dp=parallel.dp, tp=parallel.tp, cp=parallel.cp, world=world_size
            )
        )
        layout_rules.check(
            cp_problems(
                config.model,
                cp=parallel.cp,
                tp=parallel.tp,
                pp=parallel.pp,
                ep=parallel.ep,
                zero=parallel.zero,
                dp_replicate=parallel.dp_replicate,
            )
        )
        layout_rules.check(
            ep_problems(
                config.model,
                ep=parallel.ep,
                dp=parallel.dp,
                zero=parallel.zero,
                dp_replicate=parallel.dp_replicate,
                offload=parallel.offload,
                cp=parallel.cp,
            )
        )
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.callbacks = list(callbacks)
        self.topology = Topology(pp=parallel.pp, dp=parallel.dp, tp=parallel.tp, cp=parallel.cp)
        self.coords = self.topology.coords(rank)
        self.distributed = dist.is_available() and dist.is_initialized()
        if not self.distributed and world_size > 1:
            raise RuntimeError("Trainer with world_size > 1 needs an initialized default process group")
        validate_data_parallel(parallel)
        if config.training.timing_sync_every < 1:
            raise ConfigError(
                f"training.timing_sync_every={config.training.timing_sync_every} must be >= 1 step.",
                field="training.timing_sync_every",
                fix="use 1 to separate compute from waiting on every step, or e.g. 10",
            )
        mesh = (
            build_device_mesh(
                self.topology,
                self.device.type,
                dp_replicate=parallel.dp_replicate,
                ep=parallel.ep,
                experts_sharded=shards_experts(config),  # FSDP2's mesh for the experts
            )
            if self.distributed
            else None
        )
        self.dims = ParallelDims.build(
            self.topology, mesh, world_size, dp_replicate=parallel.dp_replicate, ep=parallel.ep
        )
        self.grad_accum_steps = config.grad_accum_steps
        self._plan_cache: str | None = None  # DCP's save-plan cache generation (workers/checkpoints/checkpoint_io.py)
        self._sync_tensor = torch.zeros(1, device=self.device)
        #: Times waits inside TP / FSDP2 collectives on timing-sync steps (workers/engine/collective_waits.py).
        self._waits = CollectiveWaitClock(self.device) if self.distributed and world_size > 1 else None

        # Meta-device init: nothing is allocated until each rank's shards are materialised inside
        # parallelize_stage (after FSDP2 sharding), initialised per parameter from its FQN.
        with torch.device("meta"):
            model = build_model_skeleton(config.model)
        # FSDP2's CPU offload keeps the shards in host memory: allocate them there. The initial values
        # are drawn on the compute device either way, so every layout of a CUDA job starts alike.
        init_device = torch.device("cpu") if parallel.offload == "cpu" else self.device
        materialize_local = partial(
            materialize,
            device=init_device,
            seed=config.training.seed,
            n_layers=config.model.n_layers,
            rng_device=self.device,
        )
        transform = partial(
            parallelize_stage, dims=self.dims, config=config, materialize=materialize_local, device=self.device
        )
        self.pipeline = None
        if self.dims.pp_enabled:
            from etrain.workers.engine.pipeline import build_pipeline

            self.pipeline = build_pipeline(
                model,
                pp_mesh=self.dims.axis("pp"),
                pp_rank=self.coords.pp,
                parallel=parallel,
                n_microbatches=self.grad_accum_steps,
                loss_fn=_loss_from_stage,
                targets_to_stage=True,
                device=self.device,
                stage_transform=transform,
                wait_clock=self._waits,
            )
            self.modules: list[nn.Module] = list(self.pipeline.model_parts)
        else:
            self.modules = [transform(model)]
        #: The stage modules with their original FQNs (DDP wrappers removed): what DCP saves.
        self.model_parts: list[nn.Module] = [unwrap(m) for m in self.modules]
        if load_pretrained:
            self._load_pretrained(config.model)

        # ZeRO-1 shards the optimizer state over the ranks that average the gradients: dp, or dp·cp
        zero_group = self.dims.group("dp_cp" if self.dims.cp_enabled else "dp") if parallel.zero == 1 else None
        params = [p for m in self.model_parts for p in m.parameters()]
        experts = {p for m in self.model_parts for p in expert_parameters(m)} if self.dims.ep_enabled else set()
        if zero_group is not None and experts:
            # ZeRO-1 over the dense weights only: its step broadcasts each parameter from its owner to every
            # dp rank, and the ep ranks hold different experts. The experts get an AdamW of their own (their
            # state is already split over ep; their gradients are averaged over edp by reduce_expert_grads).
            dense = [p for p in params if p not in experts]
            self.optimizers = [
                build_optimizer(dense, config.training, zero=1, dp_group=zero_group),
                build_optimizer([p for p in params if p in experts], config.training),
            ]
        else:
            self.optimizers = [build_optimizer(params, config.training, zero=parallel.zero, dp_group=zero_group)]
        self.dataset = build_dataset(config.data, config.model)
        self.sampler = GlobalSampler(len(self.dataset), config.training.global_batch, config.training.seed)
        self.flops_per_token = throughput.flops_per_token(config.model)
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.peak_flops = throughput.peak_flops_per_s(device_name, config.training.precision)
        self.next_step = 0

    def _load_pretrained(self, model: ModelConfig) -> None:
        """Step-0 weights from ``model.hf_path`` when that folder has safetensors (collective).

        Each rank reads only the slices it owns into its (already sharded) parts. A caller that is
        about to restore a checkpoint passes ``load_pretrained=False`` so the weights are not read
        only to be overwritten. A folder with only a config.json trains from the seeded
        initialisation.
        """
        if not model.hf_path:
            return
        from etrain.workers.checkpoints.hf_config import weight_files

        if weight_files(model.hf_path):
            from etrain.workers.checkpoints.hf_io import load_hf_weights

            load_hf_weights(self.model_parts, model.hf_path, model)

    # -- the step ------------------------------------------------------------------------------

    def train_step(self, step: int) -> StepMetrics:
        """One optimizer step over the global batch of ``step``; collective over the world.

        The host waits for the device exactly once: the stacked ``[loss, grad_norm]`` is read with
        one ``.tolist()`` after clipping and before the optimizer step, so a non-finite loss stops
        the run before it can touch the weights, and the step's CUDA timing events are complete by
        then. The optimizer's kernels run on while the next step is being enqueued.
        """
        training = self.config.training
        for callback in self.callbacks:
            _call(callback, "on_step_start", self, step)
        step_start = time.perf_counter()
        synced = self._is_timing_sync_step(step)
        timer = ComputeTimer(self.device, waits=self._waits if synced else None)
        lr = lr_at(step, training)
        for optimizer in self.optimizers:
            set_lr(optimizer, lr)
            optimizer.zero_grad(set_to_none=True)

        micro_batches = self.sampler.local_micro_batches(step, self.coords.dp, self.dims.dp, training.micro_batch)
        with self._waits.armed(synced) if self._waits is not None else contextlib.nullcontext():
            if self.pipeline is not None:
                loss_sum, has_loss = self._pipeline_forward_backward(step, micro_batches, timer, synced)
            else:
                loss_sum, has_loss = self._forward_backward(step, micro_batches, timer, synced)

        loss_t = self._global_loss(loss_sum, has_loss)
        reduce_expert_grads(self.model_parts, self.dims)  # expert parallelism: averaged over their holders
        grad_norm_t = clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            training.grad_clip,
            pp_group=self.dims.group("pp"),
        )
        # The step's one host read (CPU offload leaves the norm on the host: bring it over).
        loss, grad_norm = read_on_host(torch.stack([loss_t, grad_norm_t.to(loss_t.device)]))
        if not math.isfinite(loss):
            raise NonFiniteLossError(
                f"the loss is {loss} at step {step}; the run cannot continue from this state.",
                field="training.lr",
                fix="lower training.lr, enable training.grad_clip, or check the data",
            )
        for optimizer in self.optimizers:
            optimizer.step()
        compute_s = timer.seconds()
        step_s = time.perf_counter() - step_start

        tokens = training.global_batch * self.config.model.seq_len
        flops_per_s = self.flops_per_token * tokens / step_s if step_s > 0 else 0.0
        metrics = StepMetrics(
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            step_s=step_s,
            compute_s=compute_s,
            comm_wait_s=max(0.0, step_s - compute_s),
            tokens=tokens,
            tokens_per_s=throughput.tokens_per_s(tokens, step_s),
            flops_per_s=flops_per_s,
            mfu=throughput.mfu(flops_per_s, self.world_size, self.peak_flops),
            peak_mem_bytes=self._peak_mem_bytes(),
            timing_synced=synced or self.world_size == 1,
        )
        self.next_step = step + 1
        for callback in self.callbacks:
            _call(callback, "on_step_end", self, metrics)
        return metrics

    def _forward_backward(
        self, step: int, micro_batches: list[list[int]], timer: ComputeTimer, synced: bool
    ) -> tuple[torch.Tensor, bool]:
        """Micro-steps without a pipeline: loss / grad_accum so the gradients sum to the mean.

        The DP wrapper averages over dp, so the result is exactly the gradient of the mean loss
        over the global batch. Gradients are synchronised only on the last micro-step, whose
        backward (on a timing-sync step) follows the sync point.
        """
        (module,) = self.modules
        num_micro = len(micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro_step, indices in enumerate(micro_batches):
            inputs, targets = (t.to(self.device) for t in self.dataset.batch(indices))
            if self.dims.cp_enabled:  # every cp rank read the same samples; it keeps its two chunks of each
                inputs, targets = (shard_sequence(t, self.dims.cp, self.coords.cp) for t in (inputs, targets))
            last = micro_step == num_micro - 1
            with gradient_sync(self.modules, enabled=last), self._loss_context():
                with timer.span():
                    for callback in self.callbacks:
                        _call(callback, "on_compute", self, step, micro_step)
                    with self._autocast():
                        # The model computes its own loss: the head and the loss run in chunks of tokens
                        # (training.loss_chunk_tokens; workers/families/head_loss.py).
                        loss = module(inputs, targets=targets)
                if last and synced:
                    self._sync_point()
                with timer.span():
                    (loss / num_micro).backward()
            loss_sum += loss.detach().float()
        return loss_sum / num_micro, True

    def _pipeline_forward_backward(
        self, step: int, micro_batches: list[list[int]], timer: ComputeTimer, synced: bool
    ) -> tuple[torch.Tensor, bool]:
        """The whole pipeline schedule over the local batch (micro-batches = grad_accum steps).

        The schedule interleaves stages, so the sync point comes after it; the pipeline's own
        ``busy_s`` (its stages' compute, CUDA events on GPU) separates compute from waiting on
        neighbours, and is read only once the step's host read has made it free.
        """
        indices = [i for micro in micro_batches for i in micro]
        inputs, targets = (t.to(self.device) for t in self.dataset.batch(indices))
        if self.dims.cp_enabled:  # every cp rank read the same samples; it keeps its two chunks of each
            inputs, targets = (shard_sequence(t, self.dims.cp, self.coords.cp) for t in (inputs, targets))
        start = time.perf_counter()
        for callback in self.callbacks:
            _call(callback, "on_compute", self, step, 0)
        timer.add(time.perf_counter() - start)
        with self._autocast(), self._loss_context():
            loss = self.pipeline.step(inputs, targets)
        if synced:
            self._sync_point()
        timer.add_later(lambda: self.pipeline.busy_s)
        has_loss = loss is not None
        loss_mean = loss.detach().float() if has_loss else torch.zeros((), device=self.device)
        return loss_mean, has_loss

    def _autocast(self):
        """bf16 compute with fp32 parameters, gradients and optimizer state (``training.precision``).

        Autocast keeps the master weights fp32, so the optimizer and the gradient reductions are
        unchanged; the loss reduction is done in fp32 by ``cross_entropy_loss``. Under FSDP2
        (ZeRO-2/3 with dp > 1) it is off: FSDP2's ``MixedPrecisionPolicy`` already computes with
        bf16 copies of the fp32 shards (``etrain.workers.engine.parallelize.fsdp_policies``), and autocast on top
        would only re-cast what is already bf16.
        """
        enabled = self.config.training.precision == "bf16" and not uses_fsdp(self.dims, self.config.parallel)
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _loss_context(self):
        """Vocab-parallel loss under TP (``loss_parallel``), around forward and backward alike."""
        return loss_context(self.dims)

    def _is_timing_sync_step(self, step: int) -> bool:
        """Whether ``step`` is a timing-sync step: a pure function of the step, so every rank agrees."""
        return self.distributed and self.world_size > 1 and step % self.config.training.timing_sync_every == 0

    def _sync_point(self) -> None:
        """A scalar all-reduce over the world, outside the compute spans: fast ranks wait here
        for the slowest, so that wait lands in ``comm_wait_s`` and not in ``compute_s``."""
        dist.all_reduce(self._sync_tensor)

    def _global_loss(self, local_mean: torch.Tensor, has_loss: bool) -> torch.Tensor:
        """Mean loss over the global batch, identical on every rank (a 0-d fp32 tensor, not read).

        Ranks that hold a loss (all, or the last pipeline stage) each carry the mean over their
        micro-batches; TP ranks of one dp replica carry the same value, so the world sum divided by
        the number of holders is the mean over dp replicas. A cp rank carries the mean over its
        ``S / cp`` tokens of each sequence (equal counts on every cp rank), so the mean over cp is the
        mean over every token.
        """
        if not self.distributed or self.world_size == 1:
            return local_mean.detach().float().reshape(())
        holders = self.dims.dp * self.dims.cp * self.dims.tp
        value = local_mean.detach().float().reshape(1) if has_loss else torch.zeros(1, device=self.device)
        dist.all_reduce(value)
        return value[0] / holders

    def _peak_mem_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB

    # -- loops ---------------------------------------------------------------------------------

    def run(self, start_step: int, end_step: int) -> list[StepMetrics]:
        """Train steps ``start_step`` .. ``end_step - 1``; returns their metrics."""
        return [self.train_step(step) for step in range(start_step, end_step)]

    # -- state ---------------------------------------------------------------------------------

    def materialize_optimizer_state(self) -> bool:
        """Give every optimizer its state before the first step (what that step would create, so the
        training is the same); True when all of them have it. Lets a save's host buffers be sized and
        pinned while the first step runs (``workers/rank/rank_saves.py``)."""
        return all([materialize_state(optimizer) for optimizer in self.optimizers])  # a list: each is made

    def state_for_checkpoint(self) -> tuple[list[nn.Module], list[torch.optim.Optimizer], dict[str, Any]]:
        """What a checkpoint holds: stage modules (original FQNs), optimizers, and ``extra``.

        ``extra`` carries the next step, which fully determines the data position (the sampler is
        a pure function of the step), and the RNG states, all as plain types that
        ``torch.load(weights_only=True)`` reads back.
        """
        from etrain.workers.checkpoints.checkpoint_state import capture_rng_state

        extra = {
            "step": self.next_step,
            "data": {
                "next_step": self.next_step,
                "sampler_seed": self.sampler.seed,
                "num_samples": self.sampler.num_samples,
                "global_batch": self.sampler.global_batch,
            },
            "rng": capture_rng_state(),
            "layout": self.config.parallel.describe(),
        }
        return self.model_parts, self.optimizers, extra

    def save(self, step_dir: str) -> Any:
        """Save this rank's shards of a DCP checkpoint (collective); returns its ``ShardReport``.

        The checkpoint is usable only once the supervisor commits every rank's report.
        """
        from etrain.workers.checkpoints.checkpoint import save_checkpoint
        from etrain.workers.checkpoints.checkpoint_io import new_plan_cache

        if self._plan_cache is None:  # one per Trainer: every rank builds a new one for each attempt
            self._plan_cache = new_plan_cache()
        model_parts, optimizers, extra = self.state_for_checkpoint()
        return save_checkpoint(
            step_dir, model_parts, optimizers, extra, plan_cache=self._plan_cache, owner=self.config.job_id
        )

    def restore(self, step_dir: str, *, verify_checksums: bool = True, expect_digest: str | None = None) -> int:
        """Load a committed checkpoint saved under any layout (DCP reshards by FQN).

        Restores parameters, optimizer state and RNG; returns the step to run next. The manifest and
        file sizes are always checked; ``verify_checksums=False`` skips re-hashing when the caller
        (the supervisor, right before launch) has just verified the checksums itself.
        ``expect_digest``: the digest of the manifest the supervisor verified; the manifest read here
        must be that one (see ``etrain.workers.checkpoints.checkpoint.load_checkpoint``).
        """
        from etrain.workers.checkpoints.checkpoint import load_checkpoint
        from etrain.workers.checkpoints.checkpoint_state import restore_rng_state

        extra = load_checkpoint(
            step_dir, self.model_parts, self.optimizers, checksums=verify_checksums, expect_digest=expect_digest
        )
        restore_rng_state(extra.get("rng") or {})
        self.next_step = int(extra["step"])
        return self.next_step


def _loss_from_stage(loss: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The pipeline's loss function when the last stage computes the loss itself (``targets_to_stage``)."""
    return loss


def _call(callback: Any, hook: str, *args: Any) -> None:
    method = getattr(callback, hook, None)
    if method is not None:
        method(*args)
