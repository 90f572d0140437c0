"""Typed run configuration handed to every rank.

The service validates a user's JobSpec (pydantic, ``service/spec.py``) once at the boundary and turns
it into a :class:`RunConfig`: frozen, keyword-only dataclasses with no pydantic, Ray or torch
dependency, so the workers (and ``torchrun`` runs of ``workers/train.py``) can be configured and
tested without the service. Derived quantities (gradient accumulation, tokens per step) live here as
properties so that every component computes them the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from workers.errors import ConfigError

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
Precision = Literal["fp32", "bf16"]
DataKind = Literal["text", "tokens", "synthetic"]
Device = Literal["cpu", "cuda"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of the built-in GPT-style decoder (pre-norm, causal attention, GELU MLP)."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    d_ff: int | None = None  # defaults to 4 * d_model

    @property
    def ffn_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def num_params(self) -> int:
        """Exact parameter count of ``workers.model.GPT`` for these sizes (tested against the module)."""
        d, f, v, n = self.d_model, self.ffn_dim, self.vocab_size, self.n_layers
        per_layer = (
            2 * d  # attn norm (weight + bias)
            + 4 * d * d + 4 * d  # q, k, v, out projections with bias
            + 2 * d  # mlp norm
            + d * f + f + f * d + d  # mlp up, down with bias
        )
        embeddings = v * d + self.seq_len * d
        head = 2 * d + v * d  # final norm + output projection (no bias)
        return n * per_layer + embeddings + head


# Named sizes for quick starts; a spec may override any field of a preset.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "gpt-tiny": dict(n_layers=4, d_model=64, n_heads=4, vocab_size=256, seq_len=64),
    "gpt-mini": dict(n_layers=6, d_model=192, n_heads=6, vocab_size=256, seq_len=128),
    "gpt-small": dict(n_layers=12, d_model=768, n_heads=12, vocab_size=50304, seq_len=1024),
    "gpt-medium": dict(n_layers=24, d_model=1024, n_heads=16, vocab_size=50304, seq_len=1024),
    "gpt-1b": dict(n_layers=24, d_model=2048, n_heads=16, vocab_size=50304, seq_len=2048),
    "gpt-7b": dict(n_layers=32, d_model=4096, n_heads=32, vocab_size=32000, seq_len=4096),
    "gpt-13b": dict(n_layers=40, d_model=5120, n_heads=40, vocab_size=32000, seq_len=4096),
    "gpt-70b": dict(n_layers=80, d_model=8192, n_heads=64, vocab_size=32000, seq_len=4096),
}


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from. ``path`` is absolute by the time a worker sees it."""

    kind: DataKind = "synthetic"
    path: str | None = None
    seed: int = 0
    token_dtype: Literal["uint16", "uint32"] = "uint16"


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Degrees of the 3D layout (world = pp * dp * tp) and how each axis is run."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: Literal[0, 1, 2, 3] = 0
    pp_schedule: PipelineSchedule = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def describe(self) -> str:
        """Compact layout string, e.g. ``dp2·tp2·pp2 zero=3 1f1b``; every degree printed."""
        text = f"pp{self.pp}·dp{self.dp}·tp{self.tp} zero={self.zero}"
        if self.pp > 1:
            text += f" {self.pp_schedule}"
            if self.virtual_stages > 1:
                text += f"×{self.virtual_stages}v"
        if self.sequence_parallel:
            text += " sp"
        return text


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    steps: int
    global_batch: int
    micro_batch: int
    lr: float = 3e-4
    warmup_steps: int = 0
    grad_clip: float | None = 1.0
    weight_decay: float = 0.0
    seed: int = 0
    precision: Precision = "fp32"
    activation_checkpointing: bool = False

    def grad_accum_steps(self, dp: int) -> int:
        """Micro-steps per optimizer step on each dp rank: global_batch / (dp * micro_batch).

        Elastic resizing changes ``dp`` and this absorbs the difference, so the global batch (and the
        loss the optimizer sees) stays the same whatever the data-parallel degree.
        """
        per_step = dp * self.micro_batch
        if self.global_batch % per_step:
            raise ConfigError(
                f"global_batch={self.global_batch} is not divisible by dp*micro_batch={dp}*{self.micro_batch}.",
                field="training.global_batch",
                fix=f"use a global_batch that is a multiple of {per_step}, or change dp/micro_batch",
            )
        return self.global_batch // per_step


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every_steps: int = 0  # 0: only at the end and on demand
    keep_last: int = 3
    path: str | None = None
    async_save: bool = False


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a rank needs to train; built by the service from a validated JobSpec."""

    job_id: str
    model: ModelConfig
    data: DataConfig
    parallel: ParallelConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    device: Device = "cpu"
    collective_timeout_s: float = 120.0  # process-group timeout: survivors never hang for 30 minutes

    @property
    def grad_accum_steps(self) -> int:
        return self.training.grad_accum_steps(self.parallel.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.training.global_batch * self.model.seq_len

    def with_dp(self, dp: int) -> "RunConfig":
        """The same run at another data-parallel degree (elastic resize: tp and pp never change)."""
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, dp=dp))

    def replace(self, **sections) -> "RunConfig":
        return dataclasses.replace(self, **sections)
