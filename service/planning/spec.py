"""The job spec: what a user POSTs, as pydantic models, and what a problem with it looks like.

Pydantic v2 models with unknown fields rejected (a typo must not silently fall back to a default).
Field-level rules (types, ranges) live on the fields here; rules that tie fields together (the batch,
data paths, the model folder, the supervisor's settings) are in ``service/planning/spec_checks.py``
(``check_spec``), the layout rules in ``etrain.workers.protocol.layout_rules`` and
``etrain.workers.families.layout`` (through the planner), and the path pinning in
``service/planning/spec_paths.py``. Every problem is a :class:`SpecProblem` (field + message + fix) so the
API can answer one 422 listing them all.

Downstream code never sees this module's types: :meth:`JobSpec.to_run_config` turns a valid spec into
the frozen dataclasses of ``workers/protocol/run_config.py``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from etrain.service.planning.bounds import (
    MAX_AUX_LOSS_COEF,
    MAX_CPUS_PER_WORKER,
    MAX_D_FF,
    MAX_D_MODEL,
    MAX_DEVICE_MEMORY_GB,
    MAX_EXPERTS,
    MAX_GLOBAL_BATCH,
    MAX_GPUS_PER_WORKER,
    MAX_HEADS,
    MAX_HOST_MEMORY_GB,
    MAX_LAYERS,
    MAX_LOSS_CHUNK_TOKENS,
    MAX_LR,
    MAX_PATH,
    MAX_RESTARTS,
    MAX_SECONDS,
    MAX_SEED,
    MAX_SEQ_LEN,
    MAX_STEPS,
    MAX_VOCAB,
    MAX_WORKERS,
    MIN_RESOURCE,
    NO_NUL,
)
from etrain.workers import families
from etrain.workers.checkpoints.hf_config import model_config_from_hf, read_hf_config
from etrain.workers.families import MODEL_PRESETS
from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.run_config import (
    ActivationCheckpointing,
    CheckpointConfig,
    DataConfig,
    ExportDtype,
    ModelConfig,
    ParallelConfig,
    PipelineSchedule,
    RunConfig,
    TrainingConfig,
)


def _integer_only(value: Any) -> Any:
    """JSON integers only. JSON Schema's "integer" includes 3.0, so 3.0 is 3; "3" and true are not."""
    if isinstance(value, (str, bytes, bool)):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def json_int(lower: int | None = None, upper: int | None = None) -> Any:
    """An integer field of a strict model as the OpenAPI document defines one (3 and 3.0, never "3"),
    within ``lower..upper``. The bounds sit before the validator so the document shows them."""
    return Annotated[int, Field(strict=False, ge=lower, le=upper), BeforeValidator(_integer_only)]


PositiveInt = json_int(1)


def _checkpointing_mode(value: Any) -> Any:
    """``training.activation_checkpointing`` as it was first spelled, a boolean, stays accepted."""
    if value is True:
        return "full"
    if value is False:
        return "none"
    return value


def _upto(upper: int, lower: int = 1) -> Any:
    """An integer in ``lower..upper`` (the bounds are service/planning/bounds.py's, shown in the OpenAPI document)."""
    return json_int(lower, upper)


#: A filesystem path as a client may give it: not empty, at most PATH_MAX, no NUL byte.
PathText = Annotated[str, Field(min_length=1, max_length=MAX_PATH, pattern=NO_NUL)]
#: A data-parallel degree: ``parallelism.dp``, the elastic range, a scale request's dp (api/schemas.py).
DataParallel = _upto(MAX_WORKERS)
Seed = json_int(0, MAX_SEED)


class _Section(BaseModel):
    # strict: a JSON string is not a number and 1 is not true; the document's types are the rules.
    # allow_inf_nan=False: NaN and Infinity (which Python's JSON parser accepts) are never a size or a rate.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, strict=True, allow_inf_nan=False)


_MODEL_SIZE_FIELDS = ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len")


class ModelSpec(_Section):
    """The model: a Hugging Face folder (``hf``), or a ``preset`` and/or explicit sizes (explicit sizes win).

    ``kind`` is a registered model family (``etrain.workers.families``), e.g. ``gpt`` (the built-in GPT
    decoder) or ``llama`` (the Llama family). A preset implies its family, explicit
    sizes ``gpt``; with ``hf`` the folder's ``config.json`` says (``pin_paths`` pins it once the path is
    allowed). With ``hf`` the sizes come from the folder's ``config.json`` (and its safetensors are the
    step-0 weights), so only ``seq_len`` may be given: default ``min(max_position_embeddings, 4096)``.
    """

    # The document states the rule _sizes_known enforces: model.hf, a preset, or all five sizes.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["hf"], "properties": {"hf": {"type": "string"}}},
                {"required": ["preset"], "properties": {"preset": {"type": "string"}}},
                {
                    "required": list(_MODEL_SIZE_FIELDS),
                    "properties": {name: {"type": "integer"} for name in _MODEL_SIZE_FIELDS},
                },
            ]
        }
    )

    kind: Literal[families.family_names()] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="the model family; default: the family of model.hf's config.json or of the preset, else gpt",
    )
    hf: PathText | None = Field(default=None, description="Hugging Face model folder (config.json + *.safetensors)")
    preset: str | None = Field(
        default=None,
        description=f"one of {sorted(MODEL_PRESETS)}",
        json_schema_extra={"enum": [*sorted(MODEL_PRESETS), None]},
    )
    n_layers: _upto(MAX_LAYERS) | None = None
    d_model: _upto(MAX_D_MODEL) | None = None
    n_heads: _upto(MAX_HEADS) | None = None
    n_kv_heads: _upto(MAX_HEADS) | None = Field(
        default=None, description="llama: grouped-query attention; default n_heads"
    )
    vocab_size: _upto(MAX_VOCAB) | None = None
    seq_len: _upto(MAX_SEQ_LEN) | None = None
    d_ff: _upto(MAX_D_FF) | None = Field(default=None, description="MLP width; default 4 * d_model")
    n_experts: _upto(MAX_EXPERTS) | None = Field(
        default=None, description="mixture of experts (qwen3_moe): experts per block"
    )
    experts_per_token: _upto(MAX_EXPERTS) | None = Field(
        default=None, description="mixture of experts: experts each token is routed to (the router's top-k)"
    )
    moe_d_ff: _upto(MAX_D_FF) | None = Field(
        default=None, description="mixture of experts: each expert's MLP width; default d_ff"
    )
    router_aux_loss_coef: float | None = Field(
        default=None,
        ge=0,
        le=MAX_AUX_LOSS_COEF,
        description="mixture of experts: weight of the load-balancing loss added to the training loss "
        "(0: none); also allowed with model.hf, whose config.json gives the default",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_kind(cls, data: object) -> object:
        """Pin ``kind`` when it is not given, so the stored spec says which model family runs (with ``hf``,
        :func:`~etrain.service.planning.spec_paths.pin_paths` pins it from the folder)."""
        if isinstance(data, dict) and data.get("kind") is None and data.get("hf") is None:
            name = data.get("preset")  # not validated yet: a list or a dict here is the field's error, not ours
            preset = MODEL_PRESETS.get(name, {}) if isinstance(name, str) else {}
            data = {**data, "kind": preset.get("arch", "gpt")}
        return data

    @model_validator(mode="after")
    def _sizes_known(self) -> ModelSpec:
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
            return {
                "n_layers": config.n_layers,
                "d_model": config.d_model,
                "n_heads": config.n_heads,
                "n_kv_heads": config.kv_heads,
                "vocab_size": config.vocab_size,
                "seq_len": config.seq_len,
                "d_ff": config.ffn_dim,
                "arch": config.arch,
            }
        sizes: dict[str, Any] = dict(MODEL_PRESETS.get(self.preset or "", {}))
        for name in (*_MODEL_SIZE_FIELDS, "d_ff", "n_kv_heads", *_MOE_FIELDS):
            value = getattr(self, name)
            if value is not None:
                sizes[name] = value
        if self.kind is not None:
            sizes["arch"] = self.kind
        return sizes

    def to_config(self) -> ModelConfig:
        """The workers' ModelConfig. With ``hf`` this reads ``<hf>/config.json`` (stdlib only) and raises
        :class:`~etrain.workers.protocol.errors.ConfigError` naming ``model.hf`` when the folder cannot be trained;
        a ``kind`` that is not a registered family is a ``ConfigError`` naming ``model.kind`` (``families.family``)."""
        if self.hf is None:
            config = ModelConfig(**self.resolved())
            families.family(config.arch)  # ConfigError naming the registered families
            return config
        folder = os.path.abspath(os.path.expanduser(self.hf))
        config = model_config_from_hf(read_hf_config(folder), seq_len=self.seq_len)
        if self.router_aux_loss_coef is not None:  # a training setting, not a size: it may replace the folder's
            config = dataclasses.replace(config, router_aux_loss_coef=self.router_aux_loss_coef)
        return dataclasses.replace(config, hf_path=folder)


#: The mixture-of-experts fields a spec may give (with a preset, or sizes of its own).
_MOE_FIELDS = ("n_experts", "experts_per_token", "moe_d_ff", "router_aux_loss_coef")
#: Fields ``model.hf`` replaces (only ``seq_len`` and ``router_aux_loss_coef`` may be given beside it).
_HF_EXCLUSIVE_FIELDS = (
    "preset",
    "n_layers",
    "d_model",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "d_ff",
    "n_experts",
    "experts_per_token",
    "moe_d_ff",
)


class DataSpec(_Section):
    kind: Literal["text", "tokens", "synthetic"] = "synthetic"
    path: PathText | None = Field(default=None, description="file or folder (text), .bin file (tokens)")
    seed: Seed = 0
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    tokenizer: PathText | None = Field(
        default=None,
        description="text only: a Hugging Face tokenizer.json (or its folder); the text is tokenized once "
        "into the service's token cache, never beside the data (`etrain prepare-data` ahead for big corpora). "
        "Default: byte tokens",
    )


class ParallelismSpec(_Section):
    dp: DataParallel = 1
    tp: _upto(MAX_HEADS) = Field(default=1, description="divides the heads (and kv heads, d_ff, vocab)")
    pp: _upto(MAX_LAYERS) = Field(default=1, description="divides model.n_layers (with virtual_stages)")
    zero: Literal[0, 1, 2, 3] = 0
    pp_schedule: PipelineSchedule = "1f1b"
    microbatches: _upto(MAX_GLOBAL_BATCH) | None = Field(
        default=None,
        description="pipeline micro-batches per step; derived as global_batch / (dp * micro_batch) "
        "and, when given, must equal that",
    )
    virtual_stages: _upto(MAX_LAYERS) = 1
    sequence_parallel: bool = False
    dp_replicate: _upto(MAX_WORKERS) = Field(
        default=1,
        description="HSDP: dp ranks form dp_replicate groups that each shard the model (FSDP2, zero 2/3), "
        "replicated across groups; must divide dp",
    )
    offload: Literal["none", "cpu"] = Field(
        default="none", description="cpu: FSDP2 keeps parameters, gradients and optimizer states in host memory"
    )
    ep: _upto(MAX_WORKERS) = Field(
        default=1,
        description="expert parallelism (mixture-of-experts models): ep ranks borrowed from dp split each "
        "layer's experts, n_experts / ep each, tokens exchanged by all-to-all; must divide dp and n_experts; "
        "under zero 2/3 (without cp; per replica group under dp_replicate) FSDP2 also shards them over the dp / ep ranks holding "
        "the same ones",
    )
    cp: _upto(MAX_WORKERS) = Field(
        default=1,
        description="context parallelism (Llama family, OLMo 2, GPT): every sequence split over cp ranks (two of 2·cp chunks "
        "each), attention as a ring over them; world = pp·dp·cp·tp, parameters replicated over cp and their "
        "gradients averaged over dp·cp; 2·cp must divide model.seq_len",
    )


class AutoParallelismSpec(_Section):
    """Let the planner choose (dp, tp, pp, zero, schedule), and cp or ep where they help, within a worker budget."""

    auto: Literal[True] = True
    max_workers: _upto(MAX_WORKERS) = Field(description="how many ranks (GPUs or CPU workers) the job may use")


class ResourcesSpec(_Section):
    device: Literal["cpu", "cuda"] = "cpu"
    cpus_per_worker: float = Field(
        default=1.0,
        ge=MIN_RESOURCE,
        le=MAX_CPUS_PER_WORKER,
        description="may be fractional so ranks share a machine (Ray counts 0.0001s)",
    )
    gpus_per_worker: float = Field(
        default=0.0,
        ge=0,
        le=MAX_GPUS_PER_WORKER,
        description="0, or at least 0.0001 (Ray counts 0.0001s)",
        json_schema_extra={"not": {"exclusiveMinimum": 0, "exclusiveMaximum": MIN_RESOURCE}},
    )
    device_memory_gb: float | None = Field(
        default=None,
        gt=0,
        le=MAX_DEVICE_MEMORY_GB,
        description="memory per rank (GiB) the planner checks against; default: what the cluster offers (the GPU "
        "memory its Ray nodes report, or the operator's ETRAIN_DEVICE_MEMORY_GB), else 80 (cuda) / 8 (cpu); "
        "a job may lower it, never raise it",
    )
    host_memory_gb: float | None = Field(
        default=None,
        gt=0,
        le=MAX_HOST_MEMORY_GB,
        description="host memory (GiB) Ray reserves for each rank on its node, beside its CPUs and GPUs; default: "
        "the planner's figure, set at submit (a CPU rank's whole plan; on a GPU the offloaded state, the async "
        "checkpoint's staging copy and the in-memory snapshots); a job may raise it, never lower it",
    )
    min_dp: DataParallel | None = Field(default=None, description="elastic floor; default: parallelism.dp")
    max_dp: DataParallel | None = Field(default=None, description="elastic ceiling; default: parallelism.dp")
    placement_strategy: Literal["PACK", "SPREAD"] = "PACK"

    @field_validator("gpus_per_worker")
    @classmethod
    def _whole_units(cls, value: float) -> float:
        if 0 < value < MIN_RESOURCE:
            raise ValueError(f"a rank asks for no GPU (0) or at least {MIN_RESOURCE} of one, got {value}")
        return value


class TrainingSpec(_Section):
    steps: _upto(MAX_STEPS)
    global_batch: _upto(MAX_GLOBAL_BATCH) = Field(description="sequences per optimizer step")
    micro_batch: _upto(MAX_GLOBAL_BATCH) = 1
    lr: float = Field(default=3e-4, gt=0, le=MAX_LR)
    warmup_steps: _upto(MAX_STEPS, 0) = 0
    grad_clip: float | None = Field(default=1.0, gt=0, le=1e6)
    weight_decay: float = Field(default=0.0, ge=0, le=100.0)
    seed: Seed = 0
    precision: Literal["fp32", "bf16"] = "fp32"
    activation_checkpointing: Annotated[ActivationCheckpointing, BeforeValidator(_checkpointing_mode)] = Field(
        default="none",
        description="none: keep every activation; full: recompute each block in backward (true is accepted "
        "for full, false for none); selective: keep the matmul and attention outputs, recompute the cheap ops",
    )
    compile: bool | None = Field(
        default=None,
        description="compile each transformer block with torch.compile (the compile cache stays on the node, "
        "so a restarted rank reuses it); default: true for resources.device cuda, false for cpu",
    )
    float8: bool = Field(
        default=False,
        description="float8 matmuls in the blocks (torchao, the etrain[float8] extra) with float8 all-gather "
        "under FSDP2; the output projection and small matmuls stay bf16; needs resources.device cuda with "
        "H100-class GPUs, training.precision bf16 and parallelism.tp 1",
    )
    loss_chunk_tokens: _upto(MAX_LOSS_CHUNK_TOKENS, 0) | Literal["auto"] = Field(
        default="auto",
        description="the output projection and the loss run over this many tokens at a time (forward and "
        "backward), so the full logits never exist; 0: whole; auto: whole where the plan with whole logits fits "
        "in 90% of each rank's memory (chunking cost 18% of a step on an H100), else chunks of about 512 MiB of "
        "fp32 logits",
    )
    timing_sync_every: _upto(MAX_STEPS) = Field(
        default=1,
        description="every this many steps the ranks meet in a scalar all-reduce so that the step's compute "
        "time excludes waiting on peers; straggler detection reads only those steps (1, the default: every "
        "step, so a straggler is found in tens of steps)",
    )


class CheckpointSpec(_Section):
    every_steps: _upto(MAX_STEPS, 0) | Literal["auto"] = Field(
        default=0,
        description="0: only at the end; N: every N steps; auto: the Young-Daly interval "
        "sqrt(2 x measured save blocking time x fault_tolerance.mtbf_hours), re-evaluated as saves are measured",
    )
    keep_last: _upto(1000) = 3
    path: PathText | None = Field(default=None, description="default: <data-dir>/checkpoints/<job-id>")
    async_save: bool | None = Field(
        default=None,
        alias="async",
        description="write checkpoints in the background (training blocks only for the copy to host memory); "
        "default: true for resources.device cuda, false for cpu",
    )
    export: Literal["hf", "none"] | None = Field(
        default=None,
        description="hf: when the job succeeds, write its final weights as a Hugging Face folder "
        "(default for jobs started from model.hf); none: checkpoints only (default otherwise)",
    )
    export_dtype: ExportDtype = Field(
        default="float32",
        description="the exported weights' dtype (the job's export and POST /v1/jobs/{id}/export's default): "
        "float32 keeps the fp32 master weights exactly; bfloat16 or float16 rounds them, half the bytes, "
        "as Hugging Face releases ship",
    )


class FaultToleranceSpec(_Section):
    max_restarts: _upto(MAX_RESTARTS, 0) = 3
    heartbeat_timeout_s: float = Field(default=60.0, gt=0, le=MAX_SECONDS)
    backoff_base_s: float = Field(
        default=1.0,
        ge=0,
        le=MAX_SECONDS,
        description="restart 1 waits for nothing; restart n >= 2 waits min(backoff_base_s * 2^(n-2), backoff_max_s)",
    )
    backoff_max_s: float = Field(default=60.0, ge=0, le=MAX_SECONDS, description="at least backoff_base_s")
    in_place: bool = Field(
        default=True,
        description="repair a single lost rank, and resize, in place: the kept ranks keep "
        "their processes and state; false relaunches every rank. With resources.device cuda only a resize "
        "runs in place: NCCL does not fail a survivor's collective with a dead peer, so a lost rank "
        "relaunches every rank",
    )
    mtbf_hours: float = Field(
        default=24.0,
        gt=0,
        le=MAX_SECONDS / 3600,
        description="mean time between failures the job expects; checkpoint.every_steps: "
        "auto balances the cost of a save against the work a failure loses",
    )


class StragglerSpec(_Section):
    # Defaults chosen from measured compute times (benchmarks/stragglers.py replayed through the detector,
    # DP, TP, ZeRO-3, PP, PP x DP): 0 false positives per 1,000 healthy steps, a 2x straggler in ~12 steps.
    enabled: bool = True
    window: _upto(10_000) = Field(default=4, description="timing-sync steps per window (each rank: the median)")
    threshold: float = Field(default=1.5, gt=1.0, le=1000.0)
    patience: _upto(10_000) = Field(default=3, description="consecutive windows over threshold before a report")
    sustained_windows: _upto(10_000, 0) = Field(
        default=8,
        description="the slow path: consecutive windows over 1 + 0.6 x (threshold - 1) (1.3 at 1.5) before a "
        "report, for a milder slowdown that lasts (0: off)",
    )
    action: Literal["report", "evict"] = "report"


class ElasticSpec(_Section):
    check_interval_s: float = Field(
        default=30.0, ge=0.1, le=MAX_SECONDS, description="how often the supervisor re-checks capacity (at least 0.1 s)"
    )


class JobSpec(_Section):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: ModelSpec
    data: DataSpec = DataSpec()
    parallelism: ParallelismSpec | AutoParallelismSpec | Literal["auto"] = ParallelismSpec()
    resources: ResourcesSpec = ResourcesSpec()
    training: TrainingSpec
    checkpoint: CheckpointSpec = CheckpointSpec()
    fault_tolerance: FaultToleranceSpec = FaultToleranceSpec()
    stragglers: StragglerSpec = StragglerSpec()
    elastic: ElasticSpec = ElasticSpec()
    priority: json_int(-1000, 1000) = Field(
        default=0,
        description="queue order: higher starts first, then oldest first (-1000..1000)",
    )

    @property
    def is_auto(self) -> bool:
        return not isinstance(self.parallelism, ParallelismSpec)

    @property
    def layout(self) -> ParallelismSpec:
        """The explicit layout; an auto spec must be resolved by the planner first."""
        if not isinstance(self.parallelism, ParallelismSpec):
            raise ValueError(
                "parallelism is 'auto': resolve it with etrain.service.planning.planner.resolve_auto first"
            )
        return self.parallelism

    @property
    def export_format(self) -> Literal["hf", "none"]:
        """What a successful job writes besides its checkpoints: ``checkpoint.export`` or its default."""
        if self.checkpoint.export is not None:
            return self.checkpoint.export
        return "hf" if self.model.hf is not None else "none"

    @property
    def async_checkpoints(self) -> bool:
        """``checkpoint.async`` or its default: on for CUDA, where a save's copy to pinned host memory takes
        about a second and the write to storage tens of seconds (measured on an H100: 25-30 s for 15 GB)."""
        if self.checkpoint.async_save is not None:
            return self.checkpoint.async_save
        return self.resources.device == "cuda"

    @property
    def compile_blocks(self) -> bool:
        """``training.compile`` or its default: on for CUDA (measured on an H100, Llama-1B shapes: 44.8%
        MFU compiled vs 34.0% eager), off on CPU, where compiling costs more than a short job gains. Under
        expert and context parallelism the blocks compile around the token exchange and the ring, which run
        eagerly between their graphs."""
        if self.training.compile is not None:
            return self.training.compile
        return self.resources.device == "cuda"

    def loss_chunk_tokens_for(self, tp: int) -> int:
        """``training.loss_chunk_tokens``, ``auto`` resolved for this model and tensor-parallel degree."""
        model = self.model.to_config()
        cp = 1 if self.is_auto else self.layout.cp  # a cp rank's loss covers its seq_len / cp tokens
        return layout_rules.loss_chunk_tokens(
            self.training.loss_chunk_tokens,
            tokens=self.training.micro_batch * model.seq_len // cp,
            vocab_size=model.vocab_size,
            tp=tp,
        )

    @property
    def min_dp(self) -> int:
        return self.resources.min_dp or self.layout.dp

    @property
    def max_dp(self) -> int:
        return self.resources.max_dp or self.layout.dp

    def with_layout(self, layout: ParallelismSpec) -> JobSpec:
        return self.model_copy(update={"parallelism": layout})

    def to_run_config(self, *, job_id: str, checkpoint_root: str, token_cache_dir: str | None = None) -> RunConfig:
        layout = self.layout
        return RunConfig(
            job_id=job_id,
            model=self.model.to_config(),
            data=DataConfig(
                kind=self.data.kind,
                path=self.data.path,
                seed=self.data.seed,
                token_dtype=self.data.token_dtype,
                tokenizer=self.data.tokenizer,
                token_cache_dir=token_cache_dir if self.data.tokenizer else None,
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
                ep=layout.ep,
                cp=layout.cp,
            ),
            training=TrainingConfig(
                **self.training.model_dump(exclude={"compile", "loss_chunk_tokens"}),
                compile=self.compile_blocks,
                loss_chunk_tokens=self.loss_chunk_tokens_for(layout.tp),
            ),
            checkpoint=CheckpointConfig(
                every_steps=0 if self.checkpoint.every_steps == "auto" else self.checkpoint.every_steps,
                keep_last=self.checkpoint.keep_last,
                path=self.checkpoint.path or checkpoint_root,
                async_save=self.async_checkpoints,
                auto_interval=self.checkpoint.every_steps == "auto",
                mtbf_hours=self.fault_tolerance.mtbf_hours,
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

    @classmethod
    def of(cls, problems: Iterable[layout_rules.Problem]) -> list[SpecProblem]:
        """The layout rules' problems (``etrain.workers.protocol.layout_rules``) as spec problems."""
        return [cls(field=p.field, message=p.message, fix=p.fix) for p in problems]
