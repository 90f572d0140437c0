"""The job spec: what a user POSTs, validated once at the boundary.

Pydantic v2 models with unknown fields rejected (a typo must not silently fall back to a default).
Field-level rules (types, ranges) live on the fields; rules that tie fields together (divisibility,
data paths, which layouts this build can run) are in :func:`check_spec`, which returns every problem
at once as :class:`SpecProblem` (field + message + fix) so the API can answer one 422 listing them all.

Downstream code never sees this module's types: :meth:`JobSpec.to_run_config` turns a valid spec into
the frozen dataclasses of ``workers/config.py``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

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
from workers.errors import ConfigError
from workers.hf_config import model_config_from_hf, read_hf_config

PositiveInt = Annotated[int, Field(ge=1)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ModelSpec(_Section):
    """The model: a Hugging Face folder (``hf``), or a ``preset`` and/or explicit sizes (explicit sizes win).

    ``kind`` is ``gpt`` (the built-in GPT decoder) or ``llama`` (the Llama family); a llama preset or
    ``hf`` implies ``llama``, anything else ``gpt``. With ``hf`` the sizes come from the folder's
    ``config.json`` (and its safetensors are the step-0 weights), so only ``seq_len`` may be given:
    default ``min(max_position_embeddings, 4096)``.
    """

    kind: Literal["gpt", "llama"] | None = Field(
        default=None, description="default: llama for model.hf and llama presets, else gpt"
    )
    hf: str | None = Field(default=None, description="Hugging Face model folder (config.json + *.safetensors)")
    preset: str | None = Field(default=None, description=f"one of {sorted(MODEL_PRESETS)}")
    n_layers: PositiveInt | None = None
    d_model: PositiveInt | None = None
    n_heads: PositiveInt | None = None
    n_kv_heads: PositiveInt | None = Field(default=None, description="llama: grouped-query attention; default n_heads")
    vocab_size: PositiveInt | None = None
    seq_len: PositiveInt | None = None
    d_ff: PositiveInt | None = Field(default=None, description="MLP width; default 4 * d_model")

    @model_validator(mode="before")
    @classmethod
    def _default_kind(cls, data: object) -> object:
        """Pin ``kind`` when it is not given, so the stored spec says which model family runs."""
        if isinstance(data, dict) and data.get("kind") is None:
            preset = MODEL_PRESETS.get(data.get("preset") or "", {})
            llama = data.get("hf") is not None or preset.get("arch") == "llama"
            data = {**data, "kind": "llama" if llama else "gpt"}
        return data

    @model_validator(mode="after")
    def _sizes_known(self) -> "ModelSpec":
        if self.preset is not None and self.preset not in MODEL_PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; use one of {sorted(MODEL_PRESETS)}")
        if self.hf is not None:
            return self  # sizes come from the folder; check_spec reads it (once paths are resolved)
        missing = [name for name in _MODEL_SIZE_FIELDS if self.resolved().get(name) is None]
        if missing:
            raise ValueError(f"set a preset (e.g. 'gpt-tiny'), model.hf, or give {', '.join(missing)}")
        return self

    def resolved(self) -> dict[str, Any]:
        """The model's sizes (and, for presets, its other settings); with ``hf`` read from config.json."""
        if self.hf is not None:
            config = self.to_config()
            return {"n_layers": config.n_layers, "d_model": config.d_model, "n_heads": config.n_heads,
                    "n_kv_heads": config.kv_heads, "vocab_size": config.vocab_size, "seq_len": config.seq_len,
                    "d_ff": config.ffn_dim, "arch": config.arch}
        sizes: dict[str, Any] = dict(MODEL_PRESETS.get(self.preset or "", {}))
        for name in (*_MODEL_SIZE_FIELDS, "d_ff", "n_kv_heads"):
            value = getattr(self, name)
            if value is not None:
                sizes[name] = value
        if self.kind == "llama":
            sizes["arch"] = "llama"
        return sizes

    def to_config(self) -> ModelConfig:
        """The workers' ModelConfig. With ``hf`` this reads ``<hf>/config.json`` (stdlib only) and raises
        :class:`~workers.errors.ConfigError` naming ``model.hf`` when the folder cannot be trained."""
        if self.hf is None:
            return ModelConfig(**self.resolved())
        folder = os.path.abspath(os.path.expanduser(self.hf))
        config = model_config_from_hf(read_hf_config(folder), seq_len=self.seq_len)
        return dataclasses.replace(config, hf_path=folder)


_MODEL_SIZE_FIELDS = ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len")
#: Fields ``model.hf`` replaces (only ``seq_len`` may be given beside it).
_HF_EXCLUSIVE_FIELDS = ("preset", "n_layers", "d_model", "n_heads", "n_kv_heads", "vocab_size", "d_ff")


class DataSpec(_Section):
    kind: Literal["text", "tokens", "synthetic"] = "synthetic"
    path: str | None = Field(default=None, description="file or folder (text), .bin file (tokens)")
    seed: int = 0
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    tokenizer: str | None = Field(
        default=None,
        description="text only: a Hugging Face tokenizer.json (or its folder); the text is tokenized once "
        "into a cached .bin beside the data (`etrain prepare-data`). Default: byte tokens",
    )


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
        default=None, gt=0,
        description="memory per rank (GiB) the planner checks against; default: what the cluster offers (the GPU "
        "memory its Ray nodes report, or the operator's ETRAIN_DEVICE_MEMORY_GB), else 80 (cuda) / 8 (cpu); "
        "a job may lower it, never raise it"
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
    timing_sync_every: PositiveInt = Field(
        default=10,
        description="every this many steps the ranks meet in a barrier so that the step's compute time "
        "excludes waiting on peers; straggler detection reads only those steps (1 = every step)",
    )


class CheckpointSpec(_Section):
    every_steps: int = Field(default=0, ge=0, description="0: only at the end")
    keep_last: PositiveInt = 3
    path: str | None = Field(default=None, description="default: <data-dir>/checkpoints/<job-id>")
    async_save: bool = Field(default=False, alias="async")
    export: Literal["hf", "none"] | None = Field(
        default=None,
        description="hf: when the job succeeds, write its final weights as a Hugging Face folder "
        "(default for jobs started from model.hf); none: checkpoints only (default otherwise)",
    )


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
    priority: int = Field(
        default=0, ge=-1000, le=1000,
        description="queue order: higher starts first, then oldest first (-1000..1000)",
    )

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
    def export_format(self) -> Literal["hf", "none"]:
        """What a successful job writes besides its checkpoints: ``checkpoint.export`` or its default."""
        if self.checkpoint.export is not None:
            return self.checkpoint.export
        return "hf" if self.model.hf is not None else "none"

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
                kind=self.data.kind, path=self.data.path, seed=self.data.seed, token_dtype=self.data.token_dtype,
                tokenizer=self.data.tokenizer,
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
    """Make model.hf, data and checkpoint paths absolute against the server's working directory.

    Workers run in Ray's own working directories, so a relative path must be pinned at submit time.
    """
    updates = {}
    if spec.model.hf:
        hf = os.path.expanduser(spec.model.hf)
        resolved_hf = hf if os.path.isabs(hf) else str((Path(base_dir) / hf).resolve())
        if resolved_hf != spec.model.hf:
            updates["model"] = spec.model.model_copy(update={"hf": resolved_hf})
    if spec.data.path and not os.path.isabs(os.path.expanduser(spec.data.path)):
        updates["data"] = spec.data.model_copy(update={"path": str((Path(base_dir) / spec.data.path).resolve())})
    elif spec.data.path:
        updates["data"] = spec.data.model_copy(update={"path": os.path.expanduser(spec.data.path)})
    if spec.data.tokenizer:
        tokenizer = os.path.expanduser(spec.data.tokenizer)
        tokenizer = tokenizer if os.path.isabs(tokenizer) else str((Path(base_dir) / tokenizer).resolve())
        updates["data"] = updates.get("data", spec.data).model_copy(update={"tokenizer": tokenizer})
    if spec.checkpoint.path and not os.path.isabs(os.path.expanduser(spec.checkpoint.path)):
        resolved = str((Path(base_dir) / spec.checkpoint.path).resolve())
        updates["checkpoint"] = spec.checkpoint.model_copy(update={"path": resolved})
    return spec.model_copy(update=updates) if updates else spec


def check_spec(spec: JobSpec) -> list[SpecProblem]:
    """Cross-field rules of the spec itself (the planner adds layout and memory rules)."""
    problems = _model_problems(spec)
    model = {} if problems else spec.model.resolved()  # the model-dependent rules need a readable model
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
    problems += _tokenizer_problems(spec, model.get("vocab_size"))
    if model and spec.data.kind == "text" and not spec.data.tokenizer and (model.get("vocab_size") or 0) < 256:
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


def _tokenizer_problems(spec: JobSpec, vocab_size: int | None) -> list[SpecProblem]:
    """``data.tokenizer``: text data only, a readable tokenizer.json, and ids the model can embed.

    Reading the tokenizer needs ``tokenizers`` (no torch); the tokenizing itself happens at submit
    (``JobManager``), bounded, or ahead of it with ``etrain prepare-data``.
    """
    data = spec.data
    if not data.tokenizer:
        return []
    if data.kind != "text":
        return [SpecProblem(field="data.tokenizer",
                            message=f"data.tokenizer applies to data.kind='text' only, not {data.kind!r}.",
                            fix="remove data.tokenizer, or set data.kind: text")]
    from workers.errors import DataError
    from workers.tokenized import tokenizer_info

    try:
        info = tokenizer_info(data.tokenizer)
    except DataError as err:
        return [SpecProblem(field="data.tokenizer", message=err.message, fix=err.fix)]
    if vocab_size is not None and info.vocab_size > vocab_size:
        return [SpecProblem(
            field="data.tokenizer",
            message=f"data.tokenizer {info.path} has {info.vocab_size} token ids but model.vocab_size={vocab_size}: "
                    f"ids >= {vocab_size} have no embedding.",
            fix=f"set model.vocab_size to at least {info.vocab_size} (e.g. {-(-info.vocab_size // 64) * 64}), "
                "or use the tokenizer the model was trained with",
        )]
    return []


def _model_problems(spec: JobSpec) -> list[SpecProblem]:
    """``model`` (and ``checkpoint.export``, which depends on it): exclusive fields, kind vs preset, and
    what the ``model.hf`` folder's config.json allows. Reading the folder happens here, after
    :func:`resolve_paths`, so a bad folder is one 422 naming ``model.hf``, never a 500."""
    model = spec.model
    problems: list[SpecProblem] = []
    if model.hf is not None:
        for name in _HF_EXCLUSIVE_FIELDS:
            if getattr(model, name) is not None:
                problems.append(SpecProblem(
                    field=f"model.{name}",
                    message=f"model.hf and model.{name} are exclusive: the model's sizes come from "
                            f"{model.hf}/config.json.",
                    fix=f"remove model.{name} (only model.seq_len may be given with model.hf)",
                ))
        if model.kind != "llama":
            problems.append(SpecProblem(
                field="model.kind",
                message=f"model.kind={model.kind!r} but model.hf loads a Llama-family model.",
                fix="remove model.kind (or set it to 'llama')",
            ))
        if problems:
            return problems
    elif model.preset is not None:
        preset_kind = MODEL_PRESETS[model.preset].get("arch", "gpt")
        if preset_kind != model.kind:
            problems.append(SpecProblem(
                field="model.kind",
                message=f"model.kind={model.kind!r} but model.preset={model.preset!r} is a {preset_kind} model.",
                fix=f"remove model.kind, or choose a {model.kind} preset",
            ))
    if model.kind == "gpt" and model.n_kv_heads is not None:
        problems.append(SpecProblem(
            field="model.n_kv_heads",
            message="model.n_kv_heads (grouped-query attention) applies to model.kind='llama' only.",
            fix="remove model.n_kv_heads, or set model.kind: llama",
        ))
    if problems:
        return problems
    try:
        config = model.to_config()
    except ConfigError as err:
        return [SpecProblem(field=err.field or "model", message=err.message, fix=err.fix)]
    if spec.export_format == "hf" and config.arch != "llama":
        problems.append(SpecProblem(
            field="checkpoint.export",
            message="checkpoint.export='hf' writes a transformers LlamaForCausalLM-family folder; "
                    "the built-in GPT (model.kind='gpt') has no Hugging Face equivalent.",
            fix="set checkpoint.export: none, or train a Llama-family model (model.hf or a llama preset)",
        ))
    return problems
