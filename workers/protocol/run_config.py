"""Typed run configuration handed to every rank.

The service validates a user's JobSpec (pydantic, ``service/planning/spec.py``) once at the boundary and turns
it into a :class:`RunConfig`: frozen, keyword-only dataclasses with no pydantic, Ray or torch
dependency, so the workers (and ``torchrun -m etrain.workers.engine.torchrun``) can be configured and
tested without the service. Derived quantities (gradient accumulation, tokens per step) live here as
properties so that every component computes them the same way.

Family-agnostic: ``ModelConfig.arch`` names a model family, but the protocol never asks one (the families
import the protocol, not the other way round). Whether ``arch`` is registered, the parameter count
(``etrain.workers.families.num_params``) and the presets (``etrain.workers.families.MODEL_PRESETS``) are the
families' to say, asked where a config enters: the spec checks, ``torchrun``'s config file and the model
builder.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from etrain.workers.protocol import layout_rules

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
Precision = Literal["fp32", "bf16"]
DataKind = Literal["text", "tokens", "synthetic"]
Device = Literal["cpu", "cuda"]
#: ``none``: keep every activation; ``full``: recompute each block in backward (keep its input);
#: ``selective``: keep the matmul and attention outputs, recompute the cheap ops between them.
ActivationCheckpointing = Literal["none", "full", "selective"]
#: ``checkpoint.export_dtype``: the dtype of an exported Hugging Face folder's weights (``float32``: the fp32 master
#: weights exactly; ``bfloat16``/``float16``: rounded to nearest, half the bytes, as Hugging Face releases ship).
ExportDtype = Literal["float32", "bfloat16", "float16"]


#: A registered model family's name (``etrain.workers.families``), e.g. ``gpt`` or ``llama``.
ModelArch = str
AttentionBias = Literal["none", "qkv", "all"]


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face configs describe it (``rope_scaling`` / ``rope_parameters``).

    ``kind="linear"`` divides every frequency by ``factor``; ``kind="llama3"`` is Llama 3.1's
    wavelength-dependent scaling (``low_freq_factor``, ``high_freq_factor`` and the original
    context ``original_max_position_embeddings``).
    """

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes and architecture of a decoder-only language model.

    ``arch`` names the model family (``etrain.workers.families``, whose declaration says what each field
    means to it), e.g. ``"gpt"``, the built-in GPT-2-style decoder (learned positions, LayerNorm, GELU,
    biases), or ``"llama"``, the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3): RoPE, RMSNorm, SwiGLU,
    grouped-query attention (``n_kv_heads``), optional q/k/v bias (Qwen2) or bias everywhere
    (Llama ``attention_bias``), optional per-head q/k RMSNorm (Qwen3), tied or untied embeddings.
    ``seq_len`` is the training context. A config of an unregistered ``arch`` is built but never trained:
    ``etrain.workers.families.family`` refuses the name where a config enters (the spec checks, ``torchrun``,
    the model builder).

    Mixture of experts (a family that declares ``mixture_of_experts``, e.g. ``qwen3_moe``): each block's MLP
    is ``n_experts`` SwiGLU experts of width ``moe_d_ff`` (default ``d_ff``), of which a router picks
    ``experts_per_token`` per token (top-k of a softmax, renormalised over the k when
    ``norm_topk_prob``); ``router_aux_loss_coef`` weighs the load-balancing loss added to the training
    loss. The defaults (0 experts) are a dense model, which every other family requires; each family's
    ``shape_errors`` checks these fields, naming the one that is wrong. ``hf_architecture`` remembers the Hugging Face class the
    model came from, so an export writes the same one back.
    """

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    d_ff: int | None = None  # defaults to 4 * d_model
    arch: ModelArch = "gpt"
    n_kv_heads: int | None = None  # grouped-query attention; default n_heads
    head_dim_override: int | None = None  # Qwen3: head_dim != d_model / n_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    attention_bias: AttentionBias = "none"
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int | None = None
    n_experts: int = 0  # mixture of experts: experts per block (0: a dense MLP)
    experts_per_token: int = 0  # mixture of experts: the router's top-k
    moe_d_ff: int | None = None  # mixture of experts: each expert's SwiGLU width; default d_ff
    norm_topk_prob: bool = False  # mixture of experts: renormalise the top-k routing weights to sum to 1
    router_aux_loss_coef: float = 0.0  # mixture of experts: weight of the load-balancing loss
    hf_architecture: str | None = None
    #: The Hugging Face folder the model was read from (``model.hf``): its safetensors, when present,
    #: are the step-0 weights, and its tokenizer files are copied into exports.
    hf_path: str | None = None

    def __post_init__(self) -> None:
        # A config read back from JSON (``torchrun`` entry point, Ray) carries rope_scaling as a dict.
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @property
    def ffn_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def expert_dim(self) -> int:
        """Each expert's SwiGLU width (mixture of experts): ``moe_d_ff``, default the MLP width."""
        return self.moe_d_ff if self.moe_d_ff is not None else self.ffn_dim


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from. ``path`` (and ``tokenizer``) are absolute by the time a worker sees them."""

    kind: DataKind = "synthetic"
    path: str | None = None
    seed: int = 0
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    #: ``kind="text"`` only: a Hugging Face tokenizer.json (or its folder). The text is tokenized once
    #: into a content-addressed ``.bin`` in ``token_cache_dir`` (``workers/engine/tokenized.py``); without it, bytes.
    tokenizer: str | None = None
    #: The service's token cache folder (``Settings.token_cache_dir``: every node sees it, only the service writes
    #: it), where a tokenized corpus is found or, when missing, written; needed with ``tokenizer``.
    token_cache_dir: str | None = None


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Degrees of the layout (world = pp * dp * cp * tp) and how each axis is run (``ep`` lives inside ``dp``)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: Literal[0, 1, 2, 3] = 0
    pp_schedule: PipelineSchedule = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    #: HSDP: FSDP2 on a 2-D (replicate, shard) mesh; the dp ranks form dp_replicate groups of
    #: dp / dp_replicate that each shard the model, replicated across groups. 1 = plain FSDP.
    dp_replicate: int = 1
    #: FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer states live in host memory.
    offload: Literal["none", "cpu"] = "none"
    #: Expert parallelism (torchtitan's composition): ep ranks borrowed from dp split each mixture-of-experts
    #: layer's experts (n_experts / ep each); ep divides dp and n_experts
    #: (``etrain.workers.families.layout.ep_problems``).
    ep: int = 1
    #: Context parallelism: every sequence split over cp ranks (two of 2·cp chunks each, balanced for the
    #: causal mask), attention as a ring over them; parameters replicated over cp, gradients averaged over
    #: dp·cp (``etrain.workers.families.layout.cp_problems``). Fixed for a job's life, like tp and pp.
    cp: int = 1

    @property
    def world_size(self) -> int:
        return layout_rules.world_size(pp=self.pp, dp=self.dp, tp=self.tp, cp=self.cp)

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def dp_multiple(self) -> int:
        """Every dp this layout may be resized to is a multiple of this (``layout_rules.dp_multiple``)."""
        return layout_rules.dp_multiple(dp_replicate=self.dp_replicate, ep=self.ep)

    def describe(self) -> str:
        """Compact layout string, e.g. ``dp2·tp2·pp2 zero=3 1f1b``; every degree printed (``ep`` when > 1:
        ``pp1·dp4·tp1 ep2 zero=0``; ``cp`` when > 1: ``pp1·dp2·tp1 cp2 zero=0``)."""
        text = f"pp{self.pp}·dp{self.dp}·tp{self.tp}"
        if self.cp > 1:
            text += f" cp{self.cp}"
        if self.ep > 1:
            text += f" ep{self.ep}"
        text += f" zero={self.zero}"
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
    activation_checkpointing: ActivationCheckpointing = "none"
    #: Compile each block with ``torch.compile`` (``workers/engine/compile.py``).
    compile: bool = False
    #: Tokens per chunk of the output projection + loss (``workers/families/head_loss.py``): the full
    #: ``[tokens, vocab]`` logits never exist; 0 computes them whole. The service resolves ``auto``.
    loss_chunk_tokens: int = 0
    #: float8 linears (torchao; ``workers/engine/float8.py``); bf16 for the rest.
    float8: bool = False
    #: Every this many steps the ranks meet in a world-wide scalar all-reduce before the last
    #: backward, so that step's compute_s excludes waiting on peers (straggler detection reads only
    #: those steps); the steps between have none. 1 (the default) = every step: stragglers are
    #: found in tens of steps (``benchmarks/stragglers.py``).
    timing_sync_every: int = 1

    def grad_accum_steps(self, dp: int) -> int:
        """Micro-steps per optimizer step on each dp rank
        (:func:`etrain.workers.protocol.layout_rules.grad_accum_steps`)."""
        return layout_rules.grad_accum_steps(self.global_batch, self.micro_batch, dp)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every_steps: int = 0  # 0: only at the end and on demand
    keep_last: int = 3
    path: str | None = None
    async_save: bool = False
    #: ``every_steps: auto``: rank 0 requests saves at the Young-Daly interval
    #: (workers/checkpoints/checkpoint_cadence.py)
    auto_interval: bool = False
    mtbf_hours: float = 24.0  # fault_tolerance.mtbf_hours: what ``auto`` balances the save cost against


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

    def with_dp(self, dp: int) -> RunConfig:
        """The same run at another data-parallel degree (elastic resize: tp and pp never change)."""
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, dp=dp))

    def replace(self, **sections) -> RunConfig:
        return dataclasses.replace(self, **sections)
