"""Pipeline parallelism: cut the GPT into stages and run them with a ``torch.distributed.pipelining``
schedule.

Why it looks the way it does:

* **A stage is the whole model with parts deleted** (torchtitan's convention). Each stage module is a
  deep copy of the full :class:`~etrain.workers.families.model.GPT` with the layers it does not own removed (the kept
  ones stay under their *global* keys) and the embeddings / final norm / output set to ``None`` where
  they do not belong. Parameter names (FQNs) are therefore identical to the unsharded model's, so a
  DCP checkpoint saved under one layout loads under any other.
* **The rules are elsewhere.** Layer splits, which stages a rank holds and what each schedule needs
  are plain functions over ints in ``etrain.workers.protocol.layout_rules`` (and whether the model's family
  runs pipelined, ``etrain.workers.families.layout.pipeline_problems``; the planner checks the same ones
  at submit time); :func:`build_pipeline` is the only place that touches torch distributed, and it
  takes the ``pp`` mesh axis as an argument (no process-group globals).
* **Exact loss scaling.** The trainer wants the gradient of the *mean* loss over a rank's local batch,
  i.e. of the mean of the micro-batch (mean) losses. Each micro-batch loss is divided by
  ``n_microbatches`` *before* its backward (and the schedule's own ``scale_grads``, which divides
  the summed ``.grad`` afterwards, is off). Both give the same gradient mathematically, but only the
  first performs the same float operations as the non-pipelined trainer's gradient accumulation
  (``(loss / n).backward()`` per micro-step); with a micro-batch count that is not a power of two
  the two orders differ by an ulp, and AdamW's ``g / (|g| + eps)`` magnifies that to ~1e-4 in
  parameters whose gradients are ~1e-9. DP averaging is left to the engine's DP wrapper. Gradient
  accumulation under PP *is* the micro-batches: ``n_microbatches = training.grad_accum_steps(dp)``.
* **Measured bubble.** Each stage's forward, loss and backward calls are timed, so a step splits into
  busy time (``compute_s``) and the rest (waiting on neighbours, ``comm_wait_s``); the idle fraction
  tracks the schedule's bubble, ``(P-1)/(M+P-1)`` for GPipe and 1F1B.
* **No zero-bubble schedules (yet).** torch 2.13's ``ScheduleInterleavedZeroBubble`` and
  ``ScheduleZBVZeroBubble`` train exactly with PP alone or PP×TP, but with DP (DDP or FSDP2) their
  split input/weight backward leaves the gradients wrong: 1.8% (DDP) to 4% (FSDP2) loss error and
  2.7e-2 parameter error after 8 steps at dp2·pp2. They stay out until that composes exactly.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.nn.parallel import DistributedDataParallel

from etrain.workers.families.layout import pipeline_problems
from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.layout_rules import split_layers, stage_ids_for_rank
from etrain.workers.protocol.run_config import ParallelConfig

__all__ = [
    "PipelineRunner",
    "StepTiming",
    "build_pipeline",
    "stage_module",
]

#: The torch class of each schedule (which schedules exist, and what each needs, is
#: ``etrain.workers.protocol.layout_rules``'s: ``PIPELINE_SCHEDULES``, ``schedule_problems``).
_SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


# -- stage modules --------------------------------------------------------------------------------


def stage_module(model: nn.Module, stage_index: int, num_stages: int) -> nn.Module:
    """A copy of ``model`` holding only stage ``stage_index``'s parts, under unchanged names.

    The layers outside the stage are deleted from the ``layers`` ModuleDict (the kept ones keep their
    global keys); embeddings live on the first stage only, the final norm and output on the last.
    Parts the stage drops are never copied (the deepcopy memo maps them to ``None``), so building a
    stage costs the stage's memory, not the whole model's.
    """
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index={stage_index} is out of range for {num_stages} stages")
    owned = split_layers(model.config.n_layers, num_stages)[stage_index]
    dropped = [layer for key, layer in model.layers.items() if int(key) not in owned]
    if stage_index != 0:
        dropped += [model.tok_embeddings, getattr(model, "pos_embeddings", None)]
    if stage_index != num_stages - 1:
        dropped += [model.norm, model.output]
    stage = copy.deepcopy(model, memo={id(module): None for module in dropped if module is not None})
    for key in [key for key, layer in stage.layers.items() if layer is None]:
        del stage.layers[key]
    if stage_index != 0:
        stage.tok_embeddings = None
        if hasattr(stage, "pos_embeddings"):  # the GPT's learned positions; RoPE models have none
            stage.pos_embeddings = None
    if stage_index != num_stages - 1:
        stage.norm = None
        stage.output = None
    return stage


# -- timing ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StepTiming:
    """Wall time of one pipeline step and the part of it this rank's stages spent computing."""

    step_s: float
    forward_s: float  # stage forwards, plus the loss on the last stage
    backward_s: float

    @property
    def busy_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def wait_s(self) -> float:
        """Everything that is not compute: waiting on neighbours (the bubble) and p2p transfers."""
        return max(0.0, self.step_s - self.busy_s)

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy_s / self.step_s if self.step_s > 0 else 0.0


class _Stopwatch:
    """Accumulates compute intervals of a rank's stages over one step, and the step's span.

    On CUDA the intervals are CUDA events, read only when someone asks for :meth:`totals` (no
    per-chunk synchronisation, which would serialise the p2p streams, and no synchronisation at the
    end of the step either: the trainer asks after its one host read of the step, when the events
    are complete and reading them is free); on CPU they are ``perf_counter`` spans.

    With ``waits`` (``etrain.workers.engine.collective_waits.CollectiveWaitClock``), the collective waits inside a
    compute interval (TP all-reduces, FSDP2 all-gathers, while the trainer has the clock armed) are
    subtracted from it: waiting for a slow TP / FSDP2 peer is not this stage's compute.
    """

    def __init__(self, device: torch.device, waits: Any = None):
        self._cuda = device.type == "cuda"
        self._device = device
        self._waits = waits
        self._align: torch.Tensor | None = None
        self.reset()

    def reset(self) -> None:
        self._seconds = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._events: list[tuple[str, Any, Any]] = []
        self._wait_spans: list[tuple[str, Any, Any]] = []  # (kind, clock mark at start, at end)
        self._step_start: Any = None

    def begin_step(self) -> None:
        if self._cuda:
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record()
        else:
            self._step_start = time.perf_counter()

    def end_step(self) -> None:
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append(("step", self._step_start, end))
        else:
            self._seconds["step"] += time.perf_counter() - self._step_start

    def timed(self, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # Marks only while the trainer has the clock armed (timing-sync steps): on other steps no wait
        # is recorded, so there is nothing to subtract and no per-chunk bookkeeping to do.
        first = self._waits.mark() if self._waits is not None and self._waits.armed_now else None
        try:
            if self._cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                result = fn(*args, **kwargs)
                end.record()
                self._events.append((kind, start, end))
                return result
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._seconds[kind] += time.perf_counter() - started
        finally:
            if first is not None:
                self._wait_spans.append((kind, first, self._waits.mark()))

    def align(self, group: dist.ProcessGroup) -> None:
        """On a timing-sync step, meet the stage's DP peers before the last backward chunk, untimed.

        DDP's gradient all-reduce runs inside that chunk and is waited for in C++ (the collective-wait
        clock cannot see it), so without this a DP peer of a slow rank would count the slow rank's
        whole lead as its own backward. Every DP rank of the stage reaches this point in the same
        schedule order (the all-reduce right after already synchronises them there), so it adds a
        meeting, not a new dependency; on other steps it does nothing.
        """
        if self._waits is not None and self._waits.armed_now:
            if self._align is None:
                self._align = torch.zeros(1, device=self._device)
            dist.all_reduce(self._align, group=group)

    def totals(self) -> dict[str, float]:
        if self._events:
            self._events[-1][2].synchronize()  # the last recorded; returns at once if already done
            for kind, start, end in self._events:
                self._seconds[kind] += start.elapsed_time(end) / 1000.0
            self._events.clear()
        for kind, first, last in self._wait_spans:
            self._seconds[kind] = max(0.0, self._seconds[kind] - self._waits.between(first, last))
        self._wait_spans.clear()
        return dict(self._seconds)


class _Stage(PipelineStage):
    """A ``PipelineStage`` that times its compute and keeps a DDP-wrapped stage module consistent.

    Timing here (not in module hooks) catches exactly what the schedule runs as compute: the stage
    forward, the full / input / weight backward, and nothing of the p2p waits, which the schedules
    do outside these calls.
    """

    def __init__(self, *args: Any, stopwatch: _Stopwatch, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._stopwatch = stopwatch

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._stopwatch.timed("forward", super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("last_backward") and isinstance(self.submod, DistributedDataParallel):
            self._stopwatch.align(self.submod.process_group)
        return self._stopwatch.timed("backward", super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._stopwatch.timed("backward", super().backward_weight_one_chunk, *args, **kwargs)

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        """Shape inference (first step only) with a DDP module's gradient sync off.

        torch calls the module directly here, outside ``no_sync``, and then differentiates only
        with respect to the inputs. A DDP reducer armed by that forward records its bucket order
        twice in the first real step and fails on the next forward ("rebuilt parameter indices
        size is not same as original model parameters size").
        """
        sync_off = self.submod.no_sync() if isinstance(self.submod, DistributedDataParallel) else nullcontext()
        with sync_off:
            return super()._forward_metadata_inference(*args, **kwargs)


class _MicroBatchLoss:
    """The loss the schedule differentiates: ``loss_fn(logits, targets) / n_microbatches``.

    Scaling before backward makes the accumulated gradient the gradient of the mean micro-batch
    loss with the same float operations as the trainer's non-pipelined accumulation (see the module
    docstring). The unscaled losses are kept for the step's reported loss; the schedule also calls
    this once during its first step to infer shapes, so a step reads only the last
    ``n_microbatches`` entries.
    """

    def __init__(
        self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], n_microbatches: int, stopwatch: _Stopwatch
    ):
        self._loss_fn = loss_fn
        self._n_microbatches = n_microbatches
        self._stopwatch = stopwatch
        self.recorded: list[torch.Tensor] = []

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Under TP the last stage's output is the vocab-sharded logits DTensor (``apply_tp``). The
        # stage hands it over untouched: torch's PipelineStage validates and sends only non-last
        # stages' outputs, and keeps the last stage's as they are for the loss. It is not
        # converted here on purpose: ``loss_fn`` (``cross_entropy_loss``) computes the loss on it
        # vocab-parallel, under the ``loss_parallel()`` context the trainer holds around the whole
        # schedule (forward and backward), and returns a plain tensor, so what the schedule
        # backpropagates and what is recorded below are ordinary tensors.
        loss = self._stopwatch.timed("forward", self._loss_fn, output, target)
        self.recorded.append(loss.detach())
        return loss / self._n_microbatches

    def step_mean(self) -> torch.Tensor:
        """Mean of this step's micro-batch losses, summed in micro-batch order like the trainer."""
        losses = self.recorded[-self._n_microbatches :]
        total = torch.zeros((), dtype=torch.float32, device=losses[0].device)
        for loss in losses:
            total += loss.float()
        return total / self._n_microbatches


# -- the runner -----------------------------------------------------------------------------------


class PipelineRunner:
    """This rank's stages and the schedule that drives them; one :meth:`step` per optimizer step."""

    def __init__(
        self,
        *,
        schedule: Any,
        stages: list[PipelineStage],
        n_microbatches: int,
        stopwatch: _Stopwatch,
        loss: _MicroBatchLoss,
        group: dist.ProcessGroup,
        device: torch.device,
        targets_to_stage: bool = False,
    ):
        self._schedule = schedule
        self._targets_to_stage = targets_to_stage
        self._stages = stages
        self._stopwatch = stopwatch
        self._loss = loss
        self._group = group
        self._step_end = torch.zeros(1, device=device)
        self.n_microbatches = n_microbatches
        self.stage_ids: tuple[int, ...] = tuple(stage.stage_index for stage in stages)
        self.model_parts: list[nn.Module] = [stage.submod for stage in stages]
        self.is_first = any(stage.is_first for stage in stages)
        self.is_last = any(stage.is_last for stage in stages)
        self._last_timing: StepTiming | None = None
        self._timing_pending = False

    @property
    def last_step_timing(self) -> StepTiming | None:
        """The last step's timing (None before the first); on CUDA, reading it waits for that step's
        events (free once the caller has read the step's loss)."""
        if self._timing_pending:
            totals = self._stopwatch.totals()
            self._last_timing = StepTiming(
                step_s=totals["step"], forward_s=totals["forward"], backward_s=totals["backward"]
            )
            self._timing_pending = False
        return self._last_timing

    @property
    def busy_s(self) -> float:
        """Compute seconds of this rank's stages in the last step (0 before the first)."""
        timing = self.last_step_timing
        return timing.busy_s if timing else 0.0

    def parameters(self) -> Iterable[nn.Parameter]:
        for part in self.model_parts:
            yield from part.parameters()

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward and backward of one local batch through the pipeline; gradients land in ``.grad``.

        ``inputs`` (``[n_microbatches * micro_batch, seq]`` tokens) is required on the rank holding
        the first stage, ``targets`` on the one holding the last; other ranks may pass them too and
        they are ignored. Gradients are reset first: a step's ``.grad`` is exactly the gradient of
        this batch's mean loss, never an accumulation across calls. Returns the mean of the
        micro-batch losses on the last stage's rank, ``None`` elsewhere.

        The step ends with a one-element all-reduce over the pp group, inside the timed window, so
        every stage's ``step_s`` spans the whole pipeline step: the last stage finishes its own work
        early and then waits for the first stage's final backward, and that wait is bubble too.
        Without it the last stage would report (P-1)·t_f / (M·(t_f+t_b) + (P-1)·t_f) instead of
        (P-1)/(M+P-1), and its tail wait would surface as an unexplained collective wait later.
        """
        if self.is_first:
            self._check_batch("inputs", inputs)
        if self.is_last:
            self._check_batch("targets", targets)
        for part in self.model_parts:
            part.zero_grad(set_to_none=True)
        self._stopwatch.reset()
        self._loss.recorded.clear()
        args = (inputs,) if self.is_first else ()
        self._stopwatch.begin_step()
        # With targets_to_stage the last stage's forward takes the targets (split per micro-batch like the
        # inputs) and returns the loss itself: the chunked head + loss (workers/families/head_loss.py).
        to_stage = {"targets": targets} if self.is_last and self._targets_to_stage else {}
        self._schedule.step(*args, target=targets if self.is_last else None, return_outputs=False, **to_stage)
        dist.all_reduce(self._step_end, group=self._group)
        self._stopwatch.end_step()
        self._timing_pending = True
        return self._loss.step_mean() if self.is_last else None

    def _check_batch(self, name: str, batch: torch.Tensor | None) -> None:
        if batch is None:
            raise ValueError(f"PipelineRunner.step needs {name} on this rank (stages {self.stage_ids})")
        if batch.shape[0] % self.n_microbatches:
            raise ValueError(
                f"{name} batch of {batch.shape[0]} rows does not split into {self.n_microbatches} equal micro-batches"
            )


def build_pipeline(
    model: nn.Module,
    *,
    pp_mesh: DeviceMesh,
    pp_rank: int,
    parallel: ParallelConfig,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device | str,
    stage_transform: Callable[[nn.Module], nn.Module] = lambda module: module,
    wait_clock: Any = None,
    targets_to_stage: bool = False,
) -> PipelineRunner:
    """Cut ``model`` into this rank's stages, apply ``stage_transform`` to each, build the schedule.

    ``model`` is the full model, either with initialised weights (identical on every rank) or on
    the ``meta`` device (``stage_transform`` then materialises each stage's shards); it is not
    modified. ``pp_mesh`` is the 1-D ``pp`` axis of the device mesh (its group carries the p2p
    traffic). ``loss_fn(logits, targets)`` returns the *mean* over one micro-batch; the pipeline
    backpropagates ``loss / n_microbatches`` per micro-batch, so ``.grad`` ends as the gradient of the
    mean over the local batch (DP averaging is the DP wrapper's). ``stage_transform`` is the engine's per-stage
    TP → activation checkpointing → DP/FSDP step; the modules it returns are the ``model_parts``.
    ``wait_clock`` (a :class:`etrain.workers.engine.collective_waits.CollectiveWaitClock`): collective waits inside
    the stages' forward / backward (TP, FSDP2) are subtracted from their busy time while it is armed.
    ``targets_to_stage``: the last stage's forward is called with ``targets=`` and returns the micro-batch's
    mean loss, which ``loss_fn(loss, targets)`` then passes on (the trainer's chunked loss).
    """
    layout_rules.check(
        pipeline_problems(
            n_layers=model.config.n_layers,
            tie_embeddings=getattr(model.config, "tie_embeddings", False),
            pp=parallel.pp,
            virtual_stages=parallel.virtual_stages,
            microbatches=n_microbatches,
            schedule=parallel.pp_schedule,
            model=model.config,
        )
    )
    group = pp_mesh.get_group()
    if dist.get_world_size(group) != parallel.pp:
        raise ValueError(f"pp_mesh has {dist.get_world_size(group)} ranks but parallelism.pp={parallel.pp}")
    if dist.get_rank(group) != pp_rank:
        raise ValueError(f"pp_rank={pp_rank} but this rank is {dist.get_rank(group)} on the pp mesh")
    device = torch.device(device)
    num_stages = parallel.num_stages
    stopwatch = _Stopwatch(device, waits=wait_clock)

    def placed(stage: nn.Module) -> nn.Module:
        # A meta-device model is materialised by stage_transform, shard by shard.
        return stage if any(p.is_meta for p in stage.parameters()) else stage.to(device)

    stages = [
        _Stage(
            stage_transform(placed(stage_module(model, stage_index, num_stages))),
            stage_index,
            num_stages,
            device,
            group=group,
            stopwatch=stopwatch,
        )
        for stage_index in stage_ids_for_rank(pp_rank, parallel.pp, parallel.virtual_stages, parallel.pp_schedule)
    ]

    loss = _MicroBatchLoss(loss_fn, n_microbatches, stopwatch)
    # scale_grads=False: the loss is already divided by n_microbatches (see _MicroBatchLoss). A
    # single-stage schedule takes its one stage, the interleaved one the list.
    single = parallel.pp_schedule in layout_rules.SINGLE_STAGE_SCHEDULES
    schedule = _SCHEDULE_CLASSES[parallel.pp_schedule](
        stages[0] if single else stages, n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False
    )
    return PipelineRunner(
        schedule=schedule,
        stages=stages,
        n_microbatches=n_microbatches,
        stopwatch=stopwatch,
        loss=loss,
        group=group,
        device=device,
        targets_to_stage=targets_to_stage,
    )
