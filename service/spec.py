"""The job spec: what a user POSTs, validated once at the boundary.

Pydantic v2 models with unknown fields rejected (a typo must not silently fall back to a default).
Field-level rules (types, ranges) live on the fields; rules that tie fields together (divisibility,
data paths, which layouts this build can run) are in :func:`check_spec`, which returns every problem
at once as :class:`SpecProblem` (field + message + fix) so the API can answer one 422 listing them all.

Downstream code never sees this module's types: :meth:`JobSpec.to_run_config` turns a valid spec into
the frozen dataclasses of ``workers/config.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.config import (
    MODEL_PRESETS,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)

PositiveInt = Annotated[int, Field(ge=1)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ModelSpec(_Section):
    """The built-in GPT decoder. Give a ``preset`` and/or explicit sizes (explicit sizes win)."""

    kind: Literal["gpt"] = "gpt"
    preset: str | None = Field(default=None, description=f"one of {sorted(MODEL_PRESETS)}")
    n_layers: PositiveInt | None = None
    d_model: PositiveInt | None = None
    n_heads: PositiveInt | None = None
    vocab_size: PositiveInt | None = None
    seq_len: PositiveInt | None = None
    d_ff: PositiveInt | None = Field(default=None, description="MLP width; default 4 * d_model")

    @model_validator(mode="after")
    def _sizes_known(self) -> "ModelSpec":
        if self.preset is not None and self.preset not in MODEL_PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; use one of {sorted(MODEL_PRESETS)}")
        missing = [name for name in _MODEL_SIZE_FIELDS if self.resolved().get(name) is None]
        if missing:
            raise ValueError(f"set a preset (e.g. 'gpt-tiny') or give {', '.join(missing)}")
        return self

    def resolved(self) -> dict[str, int | None]:
        sizes: dict[str, int | None] = dict(MODEL_PRESETS.get(self.preset or "", {}))
        for name in (*_MODEL_SIZE_FIELDS, "d_ff"):
            value = getattr(self, name)
            if value is not None:
                sizes[name] = value
        return sizes

    def to_config(self) -> ModelConfig:
        return ModelConfig(**self.resolved())


_MODEL_SIZE_FIELDS = ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len")


class DataSpec(_Section):
    kind: Literal["text", "tokens", "synthetic"] = "synthetic"
    path: str | None = Field(default=None, description="file or folder (text), .bin file (tokens)")
    seed: int = 0
    token_dtype: Literal["uint16", "uint32"] = "uint16"


class ParallelismSpec(_Section):
    dp: PositiveInt = 1
    tp: PositiveInt = 1
    pp: PositiveInt = 1
    zero: Literal[0, 1, 2, 3] = 0
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    microbatches: PositiveInt | None = Field(
        default=None,
        description="pipeline micro-batches per step; derived as global_batch / (dp * micro_batch) "
        "and, when given, must equal that",
    )
    virtual_stages: PositiveInt = 1
    sequence_parallel: bool = False
    dp_replicate: PositiveInt = Field(
        default=1,
        description="HSDP: dp ranks form dp_replicate groups that each shard the model (FSDP2, zero 2/3), "
        "replicated across groups; must divide dp",
    )
    offload: Literal["none", "cpu"] = Field(
        default="none", description="cpu: FSDP2 keeps parameters, gradients and optimizer states in host memory"
    )


class AutoParallelismSpec(_Section):
    """Let the planner choose (dp, tp, pp, zero) within a worker budget."""

    auto: Literal[True] = True
    max_workers: PositiveInt = Field(description="how many ranks (GPUs or CPU workers) the job may use")


class ResourcesSpec(_Section):
    device: Literal["cpu", "cuda"] = "cpu"
    cpus_per_worker: float = Field(default=1.0, gt=0, description="may be fractional so ranks share a machine")
    gpus_per_worker: float = Field(default=0.0, ge=0)
    device_memory_gb: float | None = Field(
        default=None, gt=0, description="memory per rank the planner checks against; default: 80 (cuda), 8 (cpu)"
    )
    min_dp: PositiveInt | None = Field(default=None, description="elastic floor; default: parallelism.dp")
    max_dp: PositiveInt | None = Field(default=None, description="elastic ceiling; default: parallelism.dp")
    placement_strategy: Literal["PACK", "SPREAD"] = "PACK"


class TrainingSpec(_Section):
    steps: PositiveInt
    global_batch: PositiveInt
    micro_batch: PositiveInt = 1
    lr: float = Field(default=3e-4, gt=0)
    warmup_steps: int = Field(default=0, ge=0)
    grad_clip: float | None = Field(default=1.0, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    seed: int = 0
    precision: Literal["fp32", "bf16"] = "fp32"
    activation_checkpointing: bool = False


class CheckpointSpec(_Section):
    every_steps: int = Field(default=0, ge=0, description="0: only at the end")
    keep_last: PositiveInt = 3
    path: str | None = Field(default=None, description="default: <data-dir>/checkpoints/<job-id>")
    async_save: bool = Field(default=False, alias="async")


class FaultToleranceSpec(_Section):
    max_restarts: int = Field(default=3, ge=0)
    heartbeat_timeout_s: float = Field(default=60.0, gt=0)
    backoff_base_s: float = Field(default=1.0, ge=0)
    backoff_max_s: float = Field(default=60.0, ge=0)


class StragglerSpec(_Section):
    enabled: bool = True
    window: PositiveInt = 10
    threshold: float = Field(default=1.5, gt=1.0)
    patience: PositiveInt = 2
    action: Literal["report", "evict"] = "report"


class ElasticSpec(_Section):
    check_interval_s: float = Field(default=30.0, gt=0)


class JobSpec(_Section):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: ModelSpec
    data: DataSpec = DataSpec()
    parallelism: Union[ParallelismSpec, AutoParallelismSpec, Literal["auto"]] = ParallelismSpec()
    resources: ResourcesSpec = ResourcesSpec()
    training: TrainingSpec
    checkpoint: CheckpointSpec = CheckpointSpec()
    fault_tolerance: FaultToleranceSpec = FaultToleranceSpec()
    stragglers: StragglerSpec = StragglerSpec()
    elastic: ElasticSpec = ElasticSpec()

    @property
    def is_auto(self) -> bool:
        return not isinstance(self.parallelism, ParallelismSpec)

    @property
    def layout(self) -> ParallelismSpec:
        """The explicit layout; an auto spec must be resolved by the planner first."""
        if not isinstance(self.parallelism, ParallelismSpec):
            raise ValueError("parallelism is 'auto': resolve it with service.planner.resolve_auto first")
        return self.parallelism

    @property
    def min_dp(self) -> int:
        return self.resources.min_dp or self.layout.dp

    @property
    def max_dp(self) -> int:
        return self.resources.max_dp or self.layout.dp

    def with_layout(self, layout: ParallelismSpec) -> "JobSpec":
        return self.model_copy(update={"parallelism": layout})

    def to_run_config(self, *, job_id: str, checkpoint_root: str) -> RunConfig:
        layout = self.layout
        return RunConfig(
            job_id=job_id,
            model=self.model.to_config(),
            data=DataConfig(
                kind=self.data.kind, path=self.data.path, seed=self.data.seed, token_dtype=self.data.token_dtype
            ),
            parallel=ParallelConfig(
                dp=layout.dp,
                tp=layout.tp,
                pp=layout.pp,
                zero=layout.zero,
                pp_schedule=layout.pp_schedule,
                virtual_stages=layout.virtual_stages,
                sequence_parallel=layout.sequence_parallel,
                dp_replicate=layout.dp_replicate,
                offload=layout.offload,
            ),
            training=TrainingConfig(**self.training.model_dump()),
            checkpoint=CheckpointConfig(
                every_steps=self.checkpoint.every_steps,
                keep_last=self.checkpoint.keep_last,
                path=self.checkpoint.path or checkpoint_root,
                async_save=self.checkpoint.async_save,
            ),
            device=self.resources.device,
        )


@dataclass(frozen=True, kw_only=True)
class SpecProblem:
    """One reason a spec cannot run: the dotted field, what is wrong (with the numbers), the fix."""

    field: str
    message: str
    fix: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return {"field": self.field, "message": self.message, "fix": self.fix}


def resolve_paths(spec: JobSpec, base_dir: str | os.PathLike) -> JobSpec:
    """Make data/checkpoint paths absolute against the server's working directory.

    Workers run in Ray's own working directories, so a relative path must be pinned at submit time.
    """
    updates = {}
    if spec.data.path and not os.path.isabs(os.path.expanduser(spec.data.path)):
        updates["data"] = spec.data.model_copy(update={"path": str((Path(base_dir) / spec.data.path).resolve())})
    elif spec.data.path:
        updates["data"] = spec.data.model_copy(update={"path": os.path.expanduser(spec.data.path)})
    if spec.checkpoint.path and not os.path.isabs(os.path.expanduser(spec.checkpoint.path)):
        resolved = str((Path(base_dir) / spec.checkpoint.path).resolve())
        updates["checkpoint"] = spec.checkpoint.model_copy(update={"path": resolved})
    return spec.model_copy(update=updates) if updates else spec


def check_spec(spec: JobSpec) -> list[SpecProblem]:
    """Cross-field rules of the spec itself (the planner adds layout and memory rules)."""
    problems: list[SpecProblem] = []
    model = spec.model.resolved()
    if spec.data.kind in ("text", "tokens"):
        if not spec.data.path:
            problems.append(
                SpecProblem(
                    field="data.path",
                    message=f"data.kind={spec.data.kind!r} needs a data.path.",
                    fix="give a file or folder path readable by the workers, or use data.kind='synthetic'",
                )
            )
        elif not os.path.exists(spec.data.path):
            problems.append(
                SpecProblem(
                    field="data.path",
                    message=f"data.path {spec.data.path!r} does not exist.",
                    fix="give an existing file or folder (relative paths are relative to the server's directory)",
                )
            )
    if spec.data.kind == "text" and (model.get("vocab_size") or 0) < 256:
        problems.append(
            SpecProblem(
                field="model.vocab_size",
                message=f"data.kind='text' uses byte tokens (256 values) but model.vocab_size={model.get('vocab_size')}.",
                fix="set model.vocab_size to at least 256",
            )
        )
    if spec.is_auto:
        return problems
    layout = spec.layout
    training = spec.training
    per_step = layout.dp * training.micro_batch
    if training.global_batch % per_step:
        problems.append(
            SpecProblem(
                field="training.global_batch",
                message=(
                    f"training.global_batch={training.global_batch} is not divisible by "
                    f"parallelism.dp * training.micro_batch = {layout.dp} * {training.micro_batch} = {per_step}."
                ),
                fix=f"use a multiple of {per_step} (e.g. {per_step * max(1, training.global_batch // per_step)})",
            )
        )
    elif layout.microbatches is not None and layout.microbatches != training.global_batch // per_step:
        derived = training.global_batch // per_step
        problems.append(
            SpecProblem(
                field="parallelism.microbatches",
                message=(
                    f"parallelism.microbatches={layout.microbatches} but global_batch / (dp * micro_batch) = "
                    f"{training.global_batch} / ({layout.dp} * {training.micro_batch}) = {derived}."
                ),
                fix=f"omit parallelism.microbatches or set it to {derived}",
            )
        )
    if training.warmup_steps > training.steps:
        problems.append(
            SpecProblem(
                field="training.warmup_steps",
                message=f"training.warmup_steps={training.warmup_steps} exceeds training.steps={training.steps}.",
                fix="use warmup_steps <= steps",
            )
        )
    min_dp, max_dp = spec.min_dp, spec.max_dp
    if not min_dp <= layout.dp <= max_dp:
        problems.append(
            SpecProblem(
                field="resources.min_dp",
                message=f"need resources.min_dp <= parallelism.dp <= resources.max_dp, got {min_dp} <= {layout.dp} <= {max_dp}.",
                fix="set min_dp at most dp and max_dp at least dp",
            )
        )
    if spec.resources.device == "cuda" and spec.resources.gpus_per_worker <= 0:
        problems.append(
            SpecProblem(
                field="resources.gpus_per_worker",
                message="resources.device='cuda' needs resources.gpus_per_worker > 0.",
                fix="set gpus_per_worker: 1 (one GPU per rank)",
            )
        )
    return problems
