"""What a model family declares: the :class:`ModelFamily` base class, the tensor-parallel style names a
plan is written in, and the Hugging Face ``config.json`` helpers decoder families share.

Pure (stdlib and the error family only): the control plane imports every family's declaration to
validate and plan a job without torch. A family's *modules* (torch) live in the module its
:attr:`ModelFamily.model_module` names, which ``etrain.workers.families.model`` imports by name when a rank
builds the model. The sizes a family reads are those of
:class:`~etrain.workers.protocol.run_config.ModelConfig` (typed here by :class:`Sizes`, so that the
declarations need only the protocol's errors; the run config names a family but never asks one: the
parameter count and the presets are the registry's, ``etrain.workers.families``).
``docs/adding-a-model-family.md`` walks through a family from start to finish.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from etrain.workers.protocol.errors import ConfigError

__all__ = [
    "DEFAULT_MAX_SEQ_LEN",
    "MOE_FIELDS",
    "TP_STYLES",
    "ModelFamily",
    "Sizes",
    "TPPlan",
    "hf_decoder_config",
    "hf_problem",
    "hf_rope",
    "hf_sizes",
    "refuse_hidden_act",
    "ring_block_kernel",
    "ring_block_transient",
    "rope_parameters",
]

#: ``seq_len`` when a spec gives none for a ``model.hf`` folder: ``min(max_position_embeddings, 4096)``.
DEFAULT_MAX_SEQ_LEN = 4096


class Sizes(Protocol):
    """The fields of ``ModelConfig`` a family reads (its derived ``ffn_dim``, ``head_dim``, ``kv_heads`` too)."""

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    n_kv_heads: int | None
    rope_theta: float
    rope_scaling: Any
    norm_eps: float
    attention_bias: str
    qk_norm: bool
    tie_embeddings: bool
    max_position_embeddings: int | None
    n_experts: int
    experts_per_token: int
    moe_d_ff: int | None
    norm_topk_prob: bool
    router_aux_loss_coef: float
    hf_architecture: str | None

    @property
    def ffn_dim(self) -> int: ...

    @property
    def expert_dim(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...


#: The mixture-of-experts fields of ``ModelConfig`` and their dense defaults (what every other family needs).
MOE_FIELDS: dict[str, Any] = {
    "n_experts": 0,
    "experts_per_token": 0,
    "moe_d_ff": None,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.0,
}

#: The tensor-parallel styles a :class:`TPPlan` names, and what each does; ``workers/engine/parallelize.py``
#: turns each into a torch ``ParallelStyle`` (so a plan is data the control plane can read too).
TP_STYLES: dict[str, str] = {
    "vocab_embedding": "token embedding split by vocabulary; output in the residual layout",
    "position_embedding": "learned positions, replicated (sliced by sequence under sequence parallelism)",
    "norm": "a norm over d_model: weights replicated; runs on a sequence shard under sequence parallelism",
    "colwise": "column-parallel projection (each rank its heads or its slice of the MLP width)",
    "colwise_sharded_output": "column-parallel projection whose output stays a width-sharded DTensor, for a "
    "following width_norm",
    "rowwise": "row-parallel projection; partial sums reduced into the residual layout",
    "head_norm": "a per-head norm on head-sharded activations (weights replicated)",
    "width_norm": "a norm over the whole tp-sharded width (weights sharded with it; the mean is all-reduced)",
    "vocab_head": "output projection split by vocabulary; the logits stay sharded for loss_parallel",
    "gather_sequence": "with sequence parallelism, gathers the sequence-sharded input (nothing otherwise)",
    "moe": "a mixture of experts: router replicated, every expert split by width (expert tensor parallelism), "
    "the partial outputs summed over tp; with sequence parallelism the input gathered and the output re-sharded",
}


@dataclass(frozen=True)
class TPPlan:
    """Which style (a :data:`TP_STYLES` name) each submodule gets: ``root`` names the model's own parts
    (skipped where a pipeline stage does not hold them), ``block`` the parts of each transformer block,
    applied in this order."""

    root: dict[str, str] = field(default_factory=dict)
    block: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted({*self.root.values(), *self.block.values()} - TP_STYLES.keys())
        if unknown:
            raise ValueError(f"unknown tensor-parallel styles {unknown}; use names of TP_STYLES")


def ring_block_kernel(device: str, *, fp32: bool, head_dim: int) -> str:
    """What computes one block of context parallelism's ring (``workers/families/ring_attention.py``):
    ``"cpu_flash"`` (torch's CPU flash kernel), ``"cuda_flash"`` (torch's CUDA flash kernel, which runs bf16
    or fp16 with a head_dim that is a multiple of 8 up to 256, on an Ampere-class GPU or newer: the rank
    checks the GPU, the planner assumes one) or ``"math"`` (fp32 matmuls, the block's
    scores materialised). ``fp32``: whether the block computes in fp32 (an fp32 run, or q and k in fp32).
    Pure, so the planner counts what the ranks run."""
    if device == "cpu":
        return "cpu_flash"
    if device == "cuda" and not fp32 and head_dim % 8 == 0 and head_dim <= 256:
        return "cuda_flash"
    return "math"


def ring_block_transient(kernel: str, *, micro_batch: int, n_heads: int, tokens: int, q_width: int, tp: int) -> float:
    """The ring's largest transient while one block computes, per micro-batch of ``tokens`` (a cp rank's)
    tokens: on the math path the rank's own block's fp32 scores and probabilities, and in the backward their
    gradients (``4 × batch·n_heads·tokens²·4``); with a kernel (:func:`ring_block_kernel`) about four fp32
    copies of the rank's q-wide tokens (a block's output and its merge, dQ, the repeated K/V). A tp rank
    carries ``n_heads / tp`` heads."""
    if kernel == "math":
        return 4 * micro_batch * n_heads * tokens**2 * 4 / tp
    return 4 * micro_batch * tokens * q_width * 4 / tp


class ModelFamily:
    """Everything one model family declares. Subclass it in ``workers/families/<name>.py``, set the class
    attributes, implement the counts, and register the instance in ``workers/families/__init__.py``.

    The methods receive a ``ModelConfig`` (:class:`Sizes`). Every count here is tested against the
    family's real modules (tests/unit/test_families.py), so the planner's numbers are the engine's.
    """

    #: ``ModelConfig.arch`` and the job spec's ``model.kind``.
    name: ClassVar[str]
    #: One line for listings and the spec's documentation.
    summary: ClassVar[str]
    #: The torch module that builds it: ``build(config) -> nn.Module`` (loaded by name, only on the ranks).
    model_module: ClassVar[str]
    #: Named sizes (``model.preset``), each a dict of ``ModelConfig`` fields (``arch`` is added).
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    #: Hugging Face ``architectures`` entries this family loads and exports, each with its ``model_type``
    #: and any ``ModelConfig`` fields the architecture implies. Empty: no Hugging Face format.
    hf_architectures: ClassVar[dict[str, dict[str, Any]]] = {}
    #: Whether ``n_kv_heads`` (grouped-query attention) applies.
    grouped_query_attention: ClassVar[bool] = False
    #: Whether the MLP is a mixture of experts (the ``MOE_FIELDS`` of ``ModelConfig`` apply).
    mixture_of_experts: ClassVar[bool] = False
    #: Parallel axes the family cannot run on (``"tp"``, ``"pp"``), each with why: the layout rules
    #: (``workers/families/layout.py``) refuse a degree above 1 on them, naming the field.
    refused_axes: ClassVar[dict[str, str]] = {}
    #: Whether a block's last matmul (the MLP's down projection) feeds only the residual sum (pre-norm
    #: blocks). Under ``training.compile`` with selective checkpointing the partitioner then keeps the sum,
    #: not that output (``plan_activations.selective_activation_bytes``); a post-norm (OLMo 2) reads it.
    last_matmul_feeds_the_residual: ClassVar[bool] = True
    #: Whether the family's attention runs as a ring over context-parallel ranks (``parallelism.cp``,
    #: ``etrain.workers.families.ring_attention``); the layout rules refuse cp > 1 for the others.
    context_parallel: ClassVar[bool] = False
    #: etrain ↔ Hugging Face parameter names: the model's own (``tok_embeddings.weight``) and those inside
    #: a block (``attention.wq.weight`` ↔ ``self_attn.q_proj.weight``, under ``model.layers.<i>.``).
    hf_top_names: ClassVar[dict[str, str]] = {}
    hf_layer_names: ClassVar[dict[str, str]] = {}
    #: Stacked expert parameters (``[n_experts, ...]``, in a block) and the Hugging Face tensor that holds
    #: each expert's slice, ``{expert}`` standing for its index (``feed_forward.experts.w1`` ↔
    #: ``mlp.experts.{expert}.gate_proj.weight``): one etrain parameter, ``n_experts`` tensors.
    hf_expert_names: ClassVar[dict[str, str]] = {}

    # -- shape -------------------------------------------------------------------------------------

    def shape_errors(self, model: Sizes) -> list[ConfigError]:
        """The shape rules the model itself needs (the layout rules add the parallel ones)."""
        errors = [
            ConfigError(f"model.{name} must be >= 1, got {getattr(model, name)}.", field=f"model.{name}")
            for name in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len")
            if getattr(model, name) < 1
        ]
        return errors + self._expert_errors(model)

    def _expert_errors(self, model: Sizes) -> list[ConfigError]:
        """The mixture-of-experts fields: unset on a dense family; on an MoE family at least one expert,
        a top-k within the experts, a positive expert width and a finite, non-negative loss weight."""
        if not self.mixture_of_experts:
            return [
                ConfigError(
                    f"model.{name} applies to a mixture-of-experts model, not model.kind={self.name!r}.",
                    field=f"model.{name}",
                    fix=f"remove model.{name}, or use a mixture-of-experts model.kind (e.g. qwen3_moe or mixtral)",
                )
                for name, default in MOE_FIELDS.items()
                if getattr(model, name) != default
            ]
        errors = []
        if model.n_experts < 1:
            errors.append(
                ConfigError(
                    f"model.n_experts must be >= 1 for model.kind={self.name!r}, got {model.n_experts}.",
                    field="model.n_experts",
                    fix="give the number of experts per block (e.g. 128 for Qwen3-30B-A3B)",
                )
            )
        elif not 1 <= model.experts_per_token <= model.n_experts:
            errors.append(
                ConfigError(
                    f"model.experts_per_token={model.experts_per_token} must be between 1 and "
                    f"model.n_experts={model.n_experts} (the router's top-k).",
                    field="model.experts_per_token",
                    fix=f"use experts_per_token in 1..{model.n_experts} (e.g. 8 for Qwen3-30B-A3B)",
                )
            )
        if model.moe_d_ff is not None and model.moe_d_ff < 1:
            errors.append(ConfigError(f"model.moe_d_ff must be >= 1, got {model.moe_d_ff}.", field="model.moe_d_ff"))
        coef = model.router_aux_loss_coef
        if not (isinstance(coef, (int, float)) and math.isfinite(coef) and coef >= 0):
            errors.append(
                ConfigError(
                    f"model.router_aux_loss_coef must be a finite number >= 0, got {coef!r}.",
                    field="model.router_aux_loss_coef",
                    fix="use e.g. 0.001 (Qwen3-MoE's), or 0 to train without the load-balancing loss",
                )
            )
        return errors

    def tp_dims(self, model: Sizes) -> tuple[tuple[str, int], ...]:
        """The sizes tensor parallelism splits, each of which ``tp`` must divide. ``n_heads`` and
        ``n_kv_heads`` together are reported as one rule (each rank holds whole heads)."""
        raise NotImplementedError

    def tp_plan(self, model: Sizes) -> TPPlan:
        """The tensor-parallel style of each submodule (:class:`TPPlan`)."""
        raise NotImplementedError

    # -- counts for the planner and MFU ------------------------------------------------------------

    def num_params(self, model: Sizes) -> int:
        """Exact parameter count of the model these sizes build (a tied weight once)."""
        raise NotImplementedError

    def layer_params(self, model: Sizes, tp: int = 1) -> float:
        """Parameters of one transformer block held by one tensor-parallel rank."""
        raise NotImplementedError

    def expert_params_per_layer(self, model: Sizes) -> int:
        """The stacked expert weights of one block (every expert; 0 for a dense family): what expert
        parallelism (``parallelism.ep``) splits over its ranks, and the data-parallel wrappers leave out."""
        return 0

    def embedding_params(self, model: Sizes, tp: int) -> float:
        """What the first stage holds besides its blocks: the token embedding (vocab-parallel) and any
        position embedding."""
        return model.vocab_size * model.d_model / tp

    def head_params(self, model: Sizes, tp: int, *, with_embedding: bool = False) -> float:
        """What the last stage holds besides its blocks: the final norm and the output head (a tied head
        on the embedding's stage is the embedding's weight, not counted again)."""
        raise NotImplementedError

    def largest_param(self, model: Sizes, *, first: bool = True, last: bool = True) -> int:
        """Elements of the largest single parameter a stage owns, whole (the init transient)."""
        raise NotImplementedError

    def matmul_params_per_layer(self, model: Sizes, tp: int = 1) -> float:
        """Weights one block multiplies by (autocast keeps a bf16 cast of each): not biases, not norms."""
        raise NotImplementedError

    def lookup_params(self, model: Sizes) -> int:
        """Parameters used only by lookups (embeddings, not the output head), excluded from FLOPs."""
        raise NotImplementedError

    def position_params(self, model: Sizes) -> int:
        """Learned position-embedding parameters (MFU's 6N leaves them out); 0 for rotary models."""
        return 0

    def flops_per_token(self, model: Sizes) -> float:
        """Training FLOPs per token, the one formula behind MFU and the planner's step time:
        ``6 × matmul weights + 12 × n_layers × attention width × seq_len``.

        Matmul weights are every block's projections (:meth:`matmul_params_per_layer`) and the output
        head (``vocab × d_model``, tied or not: it is a matmul either way); embedding lookups, norms and
        biases are not matmuls. 6 = 2 for the forward + 4 for the backward (input and weight gradients).
        The attention term is QK^T and AV, forward and backward, at full causal length (PaLM,
        Chowdhery et al. 2022, appendix B; what the issue's and Megatron's MFU count). Recomputation by
        activation checkpointing is not model FLOPs and is not counted.
        """
        return 6.0 * self.matmul_weights(model) + 12.0 * model.n_layers * self.attention_width(model) * model.seq_len

    def matmul_weights(self, model: Sizes) -> float:
        """Every weight a token is multiplied by: the blocks' projections and the output head."""
        return model.n_layers * self.active_matmul_params_per_layer(model) + model.vocab_size * model.d_model

    def active_matmul_params_per_layer(self, model: Sizes) -> float:
        """Weights of one block a token is multiplied by (the FLOPs' count): every projection of a dense
        block; a mixture of experts counts only the router and the ``experts_per_token`` experts it picks."""
        return self.matmul_params_per_layer(model)

    def column_output_width(self, model: Sizes) -> int:
        """Per token, the summed output widths of a block's column-parallel matmuls (what selective
        checkpointing keeps of them: ``service/planning/plan_activations.selective_activation_bytes``)."""
        raise NotImplementedError

    def attention_width(self, model: Sizes) -> int:
        """The width attention's QK^T and AV matmuls run at (``n_heads·head_dim``)."""
        return model.n_heads * model.head_dim

    def layer_activation_bytes(
        self,
        model: Sizes,
        *,
        micro_batch: int,
        tp: int,
        sequence_parallel: bool,
        precision: str,
        regime: str,
        checkpointing: bool,
        compiled: bool = False,
    ) -> float:
        """What one block saves for its backward, per micro-batch, in bytes (``regime``: ``fp32``,
        ``autocast`` or ``bf16_params``; see ``service/planning/plan_activations.py``). ``compiled``: the
        block runs under ``torch.compile`` (``training.compile``), whose partitioner recomputes the cheap
        element-wise ops instead of saving them; a family without its own compiled count returns the eager
        one (an overestimate)."""
        raise NotImplementedError

    def final_norm_bytes(self, model: Sizes, *, tokens: int, regime: str, sp_div: int) -> float:
        """What the final norm saves per micro-batch (its tensors, and its output saved by the head)."""
        raise NotImplementedError

    def rope_table_bytes(self, model: Sizes) -> int:
        """Module state each block's attention caches (RoPE cos/sin tables); 0 without."""
        return 0

    def ring_attention_bytes(
        self,
        model: Sizes,
        *,
        micro_batch: int,
        regime: str,
        tp: int = 1,
        device: str = "cuda",
        selective: bool = False,
        compiled: bool = False,
    ) -> tuple[float, float]:
        """Context parallelism (a family with :attr:`context_parallel`): ``model`` at one cp rank's
        ``seq_len / cp`` tokens. Returns (what a block saves beyond :meth:`layer_activation_bytes` at those
        tokens, the ring's largest transient while one block computes), in bytes per micro-batch; under tensor
        parallelism (``tp``) a rank's ring carries its ``n_heads / tp`` heads. ``device``: where the ring
        runs, which decides whether its blocks run in a fused kernel (:func:`ring_block_kernel`).
        ``selective``: under selective checkpointing, what the policy keeps of the ring (its output and
        log-sum-exp) beyond what it keeps of a fused kernel (``plan_activations.selective_activation_bytes``).
        ``compiled``: under ``training.compile``, beyond the family's compiled count at those tokens (the ring
        op sits inside the block's graph, and the partitioner may keep other tensors than eager autograd)."""
        return 0.0, 0.0

    # -- Hugging Face ------------------------------------------------------------------------------

    def config_from_hf(self, raw: dict[str, Any], architecture: str, *, seq_len: int | None) -> dict[str, Any]:
        """``ModelConfig`` fields of a parsed ``config.json`` of ``architecture`` (one of
        :attr:`hf_architectures`), trained at ``seq_len`` (None: the model's context, at most 4096:
        :func:`hf_sizes`); refuses what etrain cannot train exactly."""
        raise ConfigError(f"the {self.name} family has no Hugging Face format.", field="model.hf")

    def hf_config(self, model: Sizes) -> dict[str, Any]:
        """A ``config.json`` that ``transformers.AutoConfig`` reads back to the same model."""
        raise ConfigError(
            f"model.kind={self.name!r} has no Hugging Face format to export to.",
            field="checkpoint.export",
            fix="set checkpoint.export: none",
        )

    def hf_parameter_names(self, model: Sizes) -> list[str]:
        """Every etrain FQN of the model, in Hugging Face's order (a tied output excluded)."""
        raise NotImplementedError

    @property
    def has_hf_format(self) -> bool:
        return bool(self.hf_architectures)

    def default_hf_architecture(self) -> str:
        return next(iter(self.hf_architectures))

    def hf_name(self, fqn: str) -> str:
        """The ``transformers`` name of an etrain parameter (``layers.3.attention.wq.weight`` →
        ``model.layers.3.self_attn.q_proj.weight``); ``KeyError`` for a name the family does not map
        one to one (a stacked expert parameter is several tensors: :meth:`hf_tensors`)."""
        if fqn in self.hf_top_names:
            return self.hf_top_names[fqn]
        index, _, rest = fqn.removeprefix("layers.").partition(".")
        if fqn.startswith("layers.") and index.isdigit() and rest in self.hf_layer_names:
            return f"model.layers.{index}.{self.hf_layer_names[rest]}"
        raise KeyError(f"no Hugging Face name for parameter {fqn!r}")

    def expert_template(self, fqn: str) -> str | None:
        """The per-expert Hugging Face name (``{expert}`` for the index) of a stacked expert parameter, or
        None for a parameter that is one tensor."""
        index, _, rest = fqn.removeprefix("layers.").partition(".")
        if fqn.startswith("layers.") and index.isdigit() and rest in self.hf_expert_names:
            return f"model.layers.{index}.{self.hf_expert_names[rest]}"
        return None

    def hf_tensors(
        self, fqn: str, shape: tuple[int, ...], model: Sizes
    ) -> list[tuple[str, tuple[int, ...], int | None]]:
        """The Hugging Face tensors parameter ``fqn`` (of ``shape``) is written as: ``(name, shape, expert)``,
        one whole tensor (``expert`` None), or one ``shape[1:]`` tensor per expert of a stacked parameter
        (its slice ``[expert]``), in the experts' order."""
        template = self.expert_template(fqn)
        if template is None:
            return [(self.hf_name(fqn), tuple(shape), None)]
        if shape[0] != model.n_experts:
            raise ValueError(f"{fqn} has shape {list(shape)}, not {model.n_experts} experts first")
        return [(template.format(expert=e), tuple(shape[1:]), e) for e in range(model.n_experts)]

    def etrain_name(self, name: str) -> str:
        """The etrain parameter that holds Hugging Face tensor ``name`` (the inverse of :meth:`hf_name`; a
        per-expert tensor is a slice of a stacked parameter: :meth:`etrain_slice` says which)."""
        return self.etrain_slice(name)[0]

    def etrain_slice(self, name: str) -> tuple[str, int | None]:
        """``(etrain FQN, expert)`` of Hugging Face tensor ``name``: the expert whose slice of a stacked
        parameter it is, or None for a whole parameter."""
        top = {v: k for k, v in self.hf_top_names.items()}
        if name in top:
            return top[name], None
        layer = {v: k for k, v in self.hf_layer_names.items()}
        index, _, rest = name.removeprefix("model.layers.").partition(".")
        if name.startswith("model.layers.") and index.isdigit():
            if rest in layer:
                return f"layers.{index}.{layer[rest]}", None
            for fqn, template in self.hf_expert_names.items():
                prefix, _, suffix = template.partition("{expert}")
                expert = rest.removeprefix(prefix).removesuffix(suffix)
                if rest.startswith(prefix) and rest.endswith(suffix) and expert.isdigit():
                    return f"layers.{index}.{fqn}", int(expert)
        raise KeyError(f"no etrain name for Hugging Face tensor {name!r}")

    def __repr__(self) -> str:
        return f"<model family {self.name}>"


# -- Hugging Face config.json helpers --------------------------------------------------------------


def hf_problem(message: str, fix: str) -> ConfigError:
    return ConfigError(message, field="model.hf", fix=fix)


def refuse_hidden_act(raw: dict[str, Any]) -> None:
    """etrain's SwiGLU MLPs (and experts) use silu: a ``config.json`` with another ``hidden_act`` is refused."""
    if raw.get("hidden_act", "silu") != "silu":
        raise hf_problem(
            f"model.hf uses hidden_act={raw.get('hidden_act')!r}; etrain's SwiGLU uses silu.",
            "use a model with hidden_act 'silu'",
        )


def hf_sizes(raw: dict[str, Any], *, seq_len: int | None) -> dict[str, Any]:
    """The sizes every decoder ``config.json`` states (``hidden_size``, ``num_attention_heads``, ...),
    as ``ModelConfig`` fields, with the training context: ``seq_len`` or ``min(max_position_embeddings,
    4096)``, never more than the model's context."""
    try:
        d_model = int(raw["hidden_size"])
        n_heads = int(raw["num_attention_heads"])
        sizes = dict(
            n_layers=int(raw["num_hidden_layers"]),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
            d_ff=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise hf_problem(
            f"model.hf config.json lacks or mangles a size ({exc}).", "restore the config.json written by transformers"
        ) from exc
    max_positions = int(raw.get("max_position_embeddings") or DEFAULT_MAX_SEQ_LEN)
    seq = seq_len if seq_len is not None else min(max_positions, DEFAULT_MAX_SEQ_LEN)
    if seq > max_positions:
        raise ConfigError(
            f"model.seq_len={seq} exceeds the model's max_position_embeddings={max_positions}.",
            field="model.seq_len",
            fix=f"use model.seq_len <= {max_positions}",
        )
    head_dim = raw.get("head_dim")
    return dict(
        sizes,
        seq_len=seq,
        max_position_embeddings=max_positions,
        head_dim_override=int(head_dim) if head_dim and int(head_dim) != d_model // n_heads else None,
    )


def hf_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` (a ``RopeScaling`` as a dict, or None) from either transformers
    v4 (``rope_theta`` + ``rope_scaling``) or v5 (``rope_parameters``) configs."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = {**legacy, **params}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return dict(rope_theta=theta, rope_scaling=None)
    if kind == "linear":
        return dict(rope_theta=theta, rope_scaling=dict(kind="linear", factor=float(scaling["factor"])))
    if kind == "llama3":
        return dict(
            rope_theta=theta,
            rope_scaling=dict(
                kind="llama3",
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
            ),
        )
    raise hf_problem(
        f"model.hf uses rope scaling {kind!r}, which etrain does not implement.",
        "use a model with default, linear or llama3 RoPE scaling",
    )


def hf_decoder_config(model: Sizes, architecture: str, model_type: str, **fields: Any) -> dict[str, Any]:
    """The ``config.json`` keys every decoder family writes (sizes, RMSNorm, silu, RoPE under transformers
    v4's and v5's keys, torch_dtype float32, which the export sets to ``checkpoint.export_dtype``), with the
    family's own ``fields`` after the MLP width (which they may replace)."""
    rope = rope_parameters(model)
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": model.d_model,
        "intermediate_size": model.ffn_dim,
        **fields,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,  # read by transformers' attention and rotary embedding when present
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings or model.seq_len,
        "rms_norm_eps": model.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": model.tie_embeddings,
        "rope_theta": model.rope_theta,  # transformers v4 readers
        "rope_parameters": rope,  # transformers v5 readers
        "torch_dtype": "float32",
    }
    if model.rope_scaling is not None:
        config["rope_scaling"] = dict(rope)
    return config


def rope_parameters(model: Sizes) -> dict[str, Any]:
    """The ``rope_parameters`` of a ``config.json`` (transformers v5; also ``rope_scaling`` for v4 readers)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling is not None:
        scaling = model.rope_scaling
        rope.update(rope_type=scaling.kind, factor=scaling.factor)
        if scaling.kind == "llama3":
            rope.update(
                low_freq_factor=scaling.low_freq_factor,
                high_freq_factor=scaling.high_freq_factor,
                original_max_position_embeddings=scaling.original_max_position_embeddings,
            )
    return rope
