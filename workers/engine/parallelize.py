"""Parallelise a model (or one pipeline stage): an ordered list of ``apply_*`` steps.

The order is torchtitan's and matters:

1. ``apply_tp``  — tensor parallelism first, because it turns parameters into DTensors on the
   ``tp`` axis and the later steps must see (and keep) that sharding;
2. ``apply_ac``  — activation checkpointing wraps whole blocks, after TP has rewritten their
   projections, so recomputation replays the TP collectives too;
3. ``apply_compile`` — ``training.compile`` compiles each (wrapped) block in place
   (``workers/engine/compile.py``), so the compiled graph holds the TP collectives and the
   recomputation, and FSDP2's hooks on the block stay outside it;
4. ``apply_dp``  — data parallelism last (DDP, ZeRO-1, FSDP2 ZeRO-2/3), because FSDP2 shards the
   DTensors TP produced along the ``dp`` axis, and DDP must see the final parameters.

Pipeline parallelism splits the model before any of this; ``workers/engine/pipeline.py`` calls
:func:`parallelize_stage` on each stage module, so a stage gets exactly the same steps.

Everything is driven by one :class:`ParallelDims` (degrees + the named DeviceMesh); no process group
is stored in a module global.

Three per-run choices shape the FSDP2 step (ZeRO-2/3): ``training.precision="bf16"`` gives FSDP2 a
``MixedPrecisionPolicy`` (bf16 compute copies of fp32 master weights, fp32 gradient reduction), in
place of autocast; ``parallelism.dp_replicate > 1`` runs it as HSDP on the 2-D (replicate, shard)
mesh; ``parallelism.offload="cpu"`` keeps the shards, gradients and optimizer state in host memory.
:func:`validate_data_parallel` rejects the combinations that have no meaning. Every such rule is
``etrain.workers.protocol.layout_rules``'s, and the shape rules of tensor parallelism (what the family says
it splits) are ``etrain.workers.families.layout``'s; the planner checks both too.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from etrain.workers.engine.mesh import ParallelMesh, validate_dp_replicate
from etrain.workers.families import family
from etrain.workers.families.layout import tp_problems
from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.compiled_blocks import compiled_block_form
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.run_config import ParallelConfig, RunConfig
from etrain.workers.protocol.topology import Topology

__all__ = [
    "ParallelDims",
    "ReplicateParallel",
    "WidthShardedNorm",
    "apply_ac",
    "apply_cp",
    "apply_dp",
    "apply_ep",
    "expert_parameters",
    "reduce_expert_grads",
    "shards_experts",
    "apply_tp",
    "fsdp_policies",
    "gradient_sync",
    "loss_context",
    "parallelize_stage",
    "tp_style",
    "unwrap",
    "uses_fsdp",
    "validate_data_parallel",
]


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The degrees of a ``pp × dp × tp`` layout and the DeviceMesh whose axes carry them.

    ``dp`` is split as ``dp_replicate × dp_shard`` for HSDP (``dp_replicate = 1``: plain FSDP / DDP).
    Built once per rank from the run's :class:`~etrain.workers.protocol.run_config.ParallelConfig`, the
    :class:`~etrain.workers.protocol.topology.Topology` and the mesh; every ``apply_*`` step reads it.
    """

    pp: int
    dp: int
    tp: int
    world_size: int
    dp_replicate: int = 1
    #: expert parallelism: ep ranks of dp split the experts (``dp = edp × ep``)
    ep: int = 1
    #: context parallelism: cp ranks split every sequence; for the parameters one more data dimension
    cp: int = 1
    mesh: ParallelMesh | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        layout_rules.check(
            layout_rules.world_size_problems(pp=self.pp, dp=self.dp, tp=self.tp, cp=self.cp, world=self.world_size)
        )
        validate_dp_replicate(self.dp, self.dp_replicate)
        if self.ep < 1 or self.dp % self.ep:
            raise ConfigError(
                f"parallelism.ep={self.ep} does not divide parallelism.dp={self.dp}.", field="parallelism.ep"
            )
        expected = (self.pp, self.dp_replicate, self.dp_shard, *((self.cp,) if self.cp > 1 else ()), self.tp)
        if self.mesh is not None and self.mesh.shape != expected:
            raise ConfigError(
                f"DeviceMesh shape {self.mesh.shape} does not match (pp, dp_replicate, dp_shard[, cp], tp) = "
                f"{expected}.",
                field="parallel",
            )

    @classmethod
    def build(
        cls, topology: Topology, mesh: ParallelMesh | None, world_size: int, *, dp_replicate: int = 1, ep: int = 1
    ) -> ParallelDims:
        return cls(
            pp=topology.pp,
            dp=topology.dp,
            tp=topology.tp,
            cp=topology.cp,
            world_size=world_size,
            dp_replicate=dp_replicate,
            ep=ep,
            mesh=mesh,
        )

    @property
    def edp(self) -> int:
        """Ranks that hold the same experts (``dp / ep``): their expert gradients are averaged together."""
        return self.dp // self.ep

    @property
    def dp_cp(self) -> int:
        """Ranks the parameters are replicated (or FSDP2-sharded) over and their gradients averaged over."""
        return self.dp * self.cp

    @property
    def dp_shard(self) -> int:
        """Ranks that shard the model inside one HSDP replica (all dp ranks without HSDP)."""
        return self.dp // self.dp_replicate

    def axis(self, name: str) -> DeviceMesh:
        """The 1-D sub-mesh of axis ``name`` (``"pp"``, ``"dp"``, ``"tp"``, ``"dp_replicate"``,
        ``"dp_shard"``, and with expert parallelism ``"ep"`` and ``"edp"``) holding this rank."""
        assert self.mesh is not None, "ParallelDims has no DeviceMesh (single process without a group)"
        return self.mesh[name]

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of axis ``name``, or None when that axis has degree 1."""
        if getattr(self, name) == 1 or self.mesh is None:
            return None
        return self.mesh.get_group(name)

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 runs on: 1-D ``dp`` (FSDP), or 2-D ``(dp_replicate, dp_shard)`` (HSDP)."""
        assert self.mesh is not None, "ParallelDims has no DeviceMesh (single process without a group)"
        return self.mesh.fsdp

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1


# -- tensor parallelism ----------------------------------------------------------------------------


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters as DTensors on the TP mesh; no compute is sharded.

    Why: modules outside the Megatron plan (position embedding, and layer norms when sequence
    parallelism is off) would otherwise keep plain-tensor parameters next to DTensor ones. Making
    every parameter a DTensor gives the gradient-norm, FSDP2 and DCP paths one kind of tensor to
    handle. The input is taken as replicated; the output is redistributed to ``output_layout``
    (e.g. ``Shard(0)`` slices the position embedding along the sequence for sequence parallelism,
    a local chunk with no communication) and returned as a local tensor.
    """

    def __init__(self, *, output_layout=None):
        super().__init__()
        self.output_layout = output_layout or Replicate()

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            # Every rank holds identical weights (one seed), so from_local needs no broadcast.
            dtensor = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
            module.register_parameter(param_name, nn.Parameter(dtensor, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        output_layout = self.output_layout

        def input_fn(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def output_fn(mod, output, mesh):
            return output.redistribute(placements=[output_layout]).to_local()

        return distribute_module(module, device_mesh, self._replicate_params, input_fn, output_fn)


class WidthShardedNorm(ParallelStyle):
    """A norm over a whole width that tensor parallelism shards (q/k norms over all the heads' features):
    its weights are sharded like the features (``Shard(0)``), the input arrives as the width-sharded
    DTensor a ``colwise_sharded_output`` projection hands over, DTensor reduces the mean over the width
    across the tp ranks (one value per token), and the output is returned as the rank's local features
    (its heads)."""

    @staticmethod
    def _shard_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def output_fn(mod, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, self._shard_params, None, output_fn)


class VocabEmbeddingParallel(RowwiseParallel):
    """``RowwiseParallel`` for the token embedding, whose output is a settled tensor of its own.

    Why: torch's style hands out the local tensor of an *asynchronous* all-reduce (or reduce-scatter),
    an ``AsyncCollectiveTensor`` that waits on first use. Fed straight into a compiled block
    (``training.compile``; measured with torch 2.13), AOTAutograd gives DTensor's backward a plain
    tensor where it expects a DTensor (``'Tensor' object has no attribute '_local_tensor'``). One copy of
    the embedding output per micro-batch (batch × seq × d) settles it; the GPT's position-embedding add
    did the same by accident. Used only when the blocks are compiled (``tp_style(compiled=True)``).
    """

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if use_local_output else out


class MoEParallel(ParallelStyle):
    """A mixture-of-experts MLP under tensor parallelism (Megatron's expert tensor parallelism, ETP = tp).

    Every tp rank routes the whole (replicated) set of tokens with the replicated router and runs every picked
    row through its slice of each expert's width: the stacked ``w1``/``w3`` split by rows of the expert width
    (column-parallel per expert) and ``w2`` by its columns (row-parallel), the partial outputs summed over tp
    once per layer, after the router's weights and the sum over each token's picks (``MoE``:
    ``copy_to_tensor_parallel`` on the rows' source and the weights, ``reduce_from_tensor_parallel`` on the
    ``[tokens, d]`` output). So every tensor after the layer, and the router's gradient, is the same on every
    tp rank. Under expert parallelism too the experts are
    split by expert over ep and by width over tp (:func:`apply_ep` composes the two).

    With sequence parallelism the block hands over a sequence shard: the layer gathers the whole sequence
    first (``MoE.sequence_group``: the router's copy, whose gradient is whole on every rank and is sliced,
    and the experts', whose partial gradient is reduce-scattered along the sequence instead of all-reduced)
    and hands back this rank's shard of the output: the partial outputs are reduce-scattered along the
    sequence (``MoE`` leaves them unreduced, ``GroupedExperts.reduce_output``), half the volume of an
    all-reduce, and the backward gathers the gradient. The router's weight is a replicated DTensor, like every parameter outside the Megatron
    split (``ReplicateParallel``)."""

    def __init__(self, *, sequence_parallel: bool):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        ReplicateParallel._replicate_params("router", module.router, device_mesh)
        experts = module.experts
        for name, dim in experts.tp_shard_dims.items():
            param = getattr(experts, name)
            sharded = distribute_tensor(param.data, device_mesh, [Shard(dim)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.tp_group = device_mesh.get_group()
        if self.sequence_parallel:
            module.sequence_group = device_mesh.get_group()  # MoE gathers the sequence itself

            def shard(mod, args, out):
                first = out[0] if isinstance(out, tuple) else out
                first = DTensor.from_local(first, device_mesh, [Partial()], run_check=False)
                first = first.redistribute(device_mesh, [Shard(1)]).to_local()  # a reduce-scatter
                return (first, *out[1:]) if isinstance(out, tuple) else first

            experts.reduce_output = False  # the hook below reduce-scatters the partial outputs instead
            module.register_forward_hook(shard)
        return module


def tp_style(name: str, *, sequence_parallel: bool, compiled: bool = False) -> ParallelStyle | None:
    """The torch ``ParallelStyle`` of a style a family's plan names (``etrain.workers.families.base.TP_STYLES``);
    None for ``gather_sequence`` without sequence parallelism (nothing to do)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    if name == "vocab_embedding":
        # Compiled blocks need the embedding output settled (VocabEmbeddingParallel); eager ones do not.
        style = VocabEmbeddingParallel if compiled else RowwiseParallel
        return style(input_layouts=Replicate(), output_layouts=residual)
    if name == "position_embedding":  # positions [seq] -> [seq, d]: the sequence is dim 0 here.
        return ReplicateParallel(output_layout=Shard(0) if sequence_parallel else Replicate())
    if name == "norm":
        return SequenceParallel() if sequence_parallel else ReplicateParallel()
    if name == "colwise":
        return ColwiseParallel()
    if name == "colwise_sharded_output":
        return ColwiseParallel(use_local_output=False)
    if name == "rowwise":
        return RowwiseParallel(output_layouts=residual)
    if name == "head_norm":
        # [batch, seq, local heads, head_dim]: heads (dim 2) are sharded, the weight is replicated and its
        # gradient reduced over tp by DTensor.
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if name == "width_norm":
        return WidthShardedNorm()
    if name == "vocab_head":
        return ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    if name == "moe":
        return MoEParallel(sequence_parallel=sequence_parallel)
    if name == "gather_sequence":
        # The norm hands over a sequence shard; attention and MLP need the whole sequence.
        return (
            PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            if sequence_parallel
            else None
        )
    raise ValueError(f"unknown tensor-parallel style {name!r}")


def _float8_style(style: ParallelStyle | None, submodule: nn.Module) -> ParallelStyle | None:
    """``style`` for a projection that ``training.float8`` made a torchao float8 linear: torchao's own
    column-/row-wise styles (its weights and inputs are cast to float8 as DTensors; torchtitan's
    composition), the same layouts. Any other module keeps ``style``."""
    if style is None or type(style) not in (ColwiseParallel, RowwiseParallel):
        return style
    # A float8 linear exists only where its module was imported: asked without importing torchao, which
    # cost every TP rank 0.7 s of CPU (and its native libraries' load warnings) in a job without float8.
    float8_linear = sys.modules.get("torchao.float8.float8_linear")
    if float8_linear is None or not isinstance(submodule, float8_linear.Float8Linear):
        return style
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    float8 = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
    return float8(
        input_layouts=style.input_layouts[0],
        output_layouts=style.output_layouts[0],
        use_local_output=style.use_local_output,
    )


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, compiled: bool = False) -> None:
    """Megatron tensor parallelism with DTensor: one all-reduce (or reduce-scatter with SP) per block half,
    as the model family's plan says (``ModelFamily.tp_plan``: a style name per submodule).

    ``wq/wk/wv`` and ``w1`` (``w3``) are column-parallel (each rank computes its heads / its slice of the
    hidden layer), ``wo`` and ``w2`` row-parallel (partial sums reduced once). The embedding is
    split by vocabulary, and so is the output projection, whose logits *stay* split: a DTensor
    ``Shard(-1)`` on the tp mesh (``use_local_output=False``), so no rank ever holds the full
    ``[batch, seq, vocab]`` logits. The loss then runs vocab-parallel inside :func:`loss_context`
    (``loss_parallel``: the softmax max / sum-exp and the target logit are reduced over tp ranks,
    not the logits). With sequence parallelism the residual
    stream between blocks is sharded on the sequence dim: norms run on a sequence shard and the
    row-parallel outputs are reduce-scattered instead of all-reduced. Works on a pipeline stage too:
    parts the stage does not own are ``None`` and skipped.
    """
    plan = family(module.config.arch).tp_plan(module.config)
    root_plan: dict[str, ParallelStyle] = {
        name: tp_style(style, sequence_parallel=sequence_parallel, compiled=compiled)
        for name, style in plan.root.items()
        if getattr(module, name, None) is not None
    }
    if root_plan:
        parallelize_module(module, tp_mesh, root_plan)

    for block in module.layers.values():
        block_plan = {name: tp_style(style, sequence_parallel=sequence_parallel) for name, style in plan.block.items()}
        block_plan = {name: _float8_style(style, block.get_submodule(name)) for name, style in block_plan.items()}
        parallelize_module(block, tp_mesh, {name: style for name, style in block_plan.items() if style is not None})
    tie_weights = getattr(module, "tie_weights", None)
    if tie_weights is not None:
        # Each TP style swapped in its own DTensor; a tied output re-shares the embedding's (both
        # are sharded by vocabulary, Shard(0), so one parameter serves both).
        tie_weights()


# -- activation checkpointing --------------------------------------------------------------------


def apply_ac(module: nn.Module, mode: str = "full") -> None:
    """Activation checkpointing of each block (non-reentrant ``checkpoint_wrapper``), by ``mode``:

    * ``full``: keep only each block's input and recompute the whole block in backward: the memory of
      one block's activations instead of all of them, for ~1/3 more compute;
    * ``selective``: torch's per-op selective checkpointing (torchtitan's ``op`` policy): the outputs of
      the matmuls, of attention and of the tensor-parallel reduce-scatters are kept, the cheap ops
      between them (norms, activations, RoPE, residual adds, casts) recomputed. Most of the memory of
      ``none`` is in those cheap ops' fp32 and element-wise tensors; the recompute costs no matmul.
    * ``none``: nothing.

    The wrapper adds ``_checkpoint_wrapped_module`` to parameter paths; ``state_dict()`` and DCP's
    ``get_model_state_dict`` strip it, so checkpoint FQNs stay layout-independent.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ConfigError(
            f"training.activation_checkpointing must be none, full or selective, got {mode!r}",
            field="training.activation_checkpointing",
        )
    extra = {"context_fn": _selective_contexts} if mode == "selective" else {}
    for key in list(module.layers.keys()):
        module.layers[key] = checkpoint_wrapper(module.layers[key], preserve_rng_state=False, **extra)


def _saved_by_selective() -> frozenset:
    """The ops whose outputs selective checkpointing keeps (those that exist in this torch build)."""
    names = [
        ("aten", "mm"),
        ("aten", "addmm"),
        ("aten", "bmm"),
        ("aten", "_scaled_dot_product_efficient_attention"),
        ("aten", "_scaled_dot_product_flash_attention"),
        ("aten", "_scaled_dot_product_cudnn_attention"),
        ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
        ("_c10d_functional", "reduce_scatter_tensor"),
        # training.float8: the absolute maxima torchao's casts scale by (a number per tensor), as torchtitan
        # keeps them: the recomputed casts then skip the reductions (a pass over each input and weight)
        ("aten", "max"),
        # a mixture of experts' grouped matmuls: torch's kernel, and etrain's loop where torch has none
        # (registered by etrain.workers.families.qwen3_moe_model, imported before a model is built)
        ("aten", "_grouped_mm"),
        ("etrain", "grouped_mm"),
        # context parallelism's ring attention, one op (etrain.workers.families.ring_attention): its output and
        # log-sum-exp, as the fused kernels' above, so the recompute does not run the ring's exchanges again
        ("etrain", "ring_attention"),
    ]
    ops = set()
    for namespace, name in names:
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            ops.add(packet.default)
    return frozenset(ops)


def _selective_contexts():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_by_selective()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


# -- context parallelism -------------------------------------------------------------------------


def apply_cp(module: nn.Module, dims: ParallelDims) -> None:
    """Context parallelism: every attention with a ``cp_group`` slot (the Llama family's) gets the ``cp``
    process group and runs as a ring over it (``etrain.workers.families.ring_attention``); a model with a
    ``statistics_group`` slot (a mixture of experts) sums its routing statistics over it. The parameters
    are untouched (replicated over cp; :func:`apply_dp` averages their gradients over ``dp · cp``), so a
    checkpoint holds them as at cp = 1 and restores into any layout. The trainer feeds each rank its two
    chunks of every sequence (``shard_sequence``)."""
    group = dims.mesh.get_group("cp")
    attentions = [m for m in module.modules() if hasattr(m, "cp_group")]
    if not attentions:
        raise ConfigError(
            f"parallelism.cp={dims.cp}: model.kind={module.config.arch!r} has no ring attention.",
            field="parallelism.cp",
            fix="use parallelism.cp=1",
        )
    for attention in attentions:
        attention.cp_group = group
    for part in module.modules():  # a mixture of experts' load-balancing loss: its statistics summed over cp
        if hasattr(part, "statistics_group"):
            part.statistics_group = group


# -- expert parallelism --------------------------------------------------------------------------


def _moe_layers(module: nn.Module) -> list[nn.Module]:
    """The mixture-of-experts layers of ``module``: those with an ``ep_group`` slot and stacked ``experts``."""
    return [
        m for m in module.modules() if hasattr(m, "ep_group") and isinstance(getattr(m, "experts", None), nn.Module)
    ]


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The stacked expert weights of every mixture-of-experts layer of ``module`` (under expert parallelism
    the ``(edp, ep)`` DTensors that the data-parallel wrappers leave alone)."""
    return [p for layer in _moe_layers(module) for p in layer.experts.parameters()]


def apply_ep(module: nn.Module, dims: ParallelDims, *, fsdp_shards_experts: bool = False) -> None:
    """Expert parallelism, torchtitan's composition: the ``ep`` ranks are borrowed from ``dp`` (``dp = edp ×
    ep``). Every MoE layer's stacked expert weights (``[n_experts, ...]``) become DTensors on the ``(edp, ep)``
    mesh, ``Replicate`` over ``edp`` and ``Shard(0)`` (by expert) over ``ep``: a rank holds ``n_experts / ep``
    whole experts and DCP saves them by global expert index, so a checkpoint reshards into any other layout
    (ep = 1 included). The layer gets the ``ep`` process group, over which it exchanges its tokens
    (``etrain.workers.families.expert_parallel``). Works on a meta-device module (the shards are
    materialised later, each drawn whole and sliced like every sharded parameter).

    Gradients: the data-parallel wrappers (:func:`apply_dp`) leave these weights out; after the backward,
    :func:`reduce_expert_grads` sums them over ``edp`` and divides by ``dp``, which is the gradient of the
    mean loss over the global batch (a rank's expert gradient already sums the tokens every ep peer sent it).

    ``fsdp_shards_experts`` (``layout_rules.expert_fsdp_shards``): FSDP2 will shard the experts over
    ``edp`` (and ``cp``) too (:func:`apply_dp`). The weights are then DTensors on the ``ep`` mesh alone (``(ep, tp)`` under
    tensor parallelism), which FSDP2 composes with its own ``edp`` dimension, as it composes with tp.
    """
    if dims.mesh is None or dims.mesh.expert_root is None:
        raise ConfigError("expert parallelism needs the (edp, ep) expert mesh", field="parallelism.ep")
    group = dims.mesh.get_group("ep")
    for layer in _moe_layers(module):
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.shape[0] % dims.ep:
                raise ConfigError(
                    f"parallelism.ep={dims.ep} does not divide the {param.shape[0]} experts of {name}.",
                    field="parallelism.ep",
                )
            # Under tensor parallelism (MoEParallel) the weight is already split by width over tp: keep that
            # split as the mesh's last dimension.
            # Replicated over edp, or with no edp dimension where FSDP2 adds its own (it shards over edp).
            over_edp = () if fsdp_shards_experts else (Replicate(),)
            axes = ("ep",) if fsdp_shards_experts else ("edp", "ep")
            if isinstance(param, DTensor):
                mesh, placements = dims.mesh.expert_root[(*axes, "tp")], (*over_edp, Shard(0), *param.placements)
                local, whole = param.to_local(), param.shape
            else:
                mesh, placements = dims.mesh.expert_root[axes], (*over_edp, Shard(0))
                local, whole = param.data, param.shape
            local_shape = (local.shape[0] // dims.ep, *local.shape[1:])
            if param.is_meta:
                local = torch.empty(local_shape, dtype=param.dtype, device="meta")
                sharded = DTensor.from_local(
                    local, mesh, placements, run_check=False, shape=whole, stride=param.stride()
                )
            else:
                full = param.full_tensor() if isinstance(param, DTensor) else param.data
                sharded = distribute_tensor(full, mesh, placements, src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        layer.ep_group = group


#: The most bytes of expert gradients reduced in one collective (:func:`reduce_expert_grads`): few enough
#: launches that a 48-layer MoE pays a handful, not one per weight per group, and a bounded extra copy.
EXPERT_GRAD_BUCKET_BYTES = 64 << 20


@torch.no_grad()
def reduce_expert_grads(modules: Iterable[nn.Module], dims: ParallelDims) -> None:
    """After the step's backward (every micro-batch): each expert gradient summed over the ``edp`` ranks
    that hold the same experts (and over ``cp``, whose ranks hold them too), divided by ``dp · cp``. A rank's
    local expert gradient is the sum over the tokens its ep peers routed to it of their micro-batch losses'
    gradients (``loss / micro-batches`` on each), so the sum over ``edp`` and ``cp`` covers every (dp, cp)
    rank once and ``/ dp · cp`` makes it the mean, exactly what DDP's and FSDP2's averages over dp·cp give
    every other parameter (and one process gives all of them).

    Written here because DDP's and FSDP2's reducers leave these weights out (they are DTensors over the expert
    mesh): the gradients are reduced in flat buckets of at most :data:`EXPERT_GRAD_BUCKET_BYTES` (one dtype
    and device each), as DDP's reducer does for its own, so a step pays a few collectives per group instead
    of one per weight."""
    if not dims.ep_enabled:
        return
    groups = [dims.mesh.get_group(axis) for axis in ("edp", "cp") if getattr(dims, axis) > 1]
    grads = [
        param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        for module in modules
        for layer in _moe_layers(module)
        if not isinstance(layer.experts, FSDPModule)  # FSDP2 reduce-scattered these in the backward (apply_dp)
        for param in layer.experts.parameters()
        if param.grad is not None
    ]
    for bucket in _buckets(grads, EXPERT_GRAD_BUCKET_BYTES):
        flat = bucket[0] if len(bucket) == 1 else torch.cat([grad.reshape(-1) for grad in bucket])
        for group in groups:
            dist.all_reduce(flat, group=group)
        flat.div_(dims.dp_cp)
        if len(bucket) > 1:
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()


def _buckets(tensors: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    """``tensors`` in order, as runs of one dtype and device of at most ``cap_bytes`` together (a tensor
    larger than the cap is a run of its own)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        fits = bucket and bucket[0].dtype == tensor.dtype and bucket[0].device == tensor.device
        if bucket and (not fits or size + nbytes > cap_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket


# -- data parallelism ----------------------------------------------------------------------------


def validate_data_parallel(parallel: ParallelConfig) -> None:
    """The engine-side rules for HSDP and CPU offload (``layout_rules.data_parallel_problems``): both are
    FSDP2 features, so both need ZeRO-2/3 with dp > 1; HSDP's replica groups divide dp."""
    layout_rules.check(
        layout_rules.data_parallel_problems(
            dp=parallel.dp * parallel.cp,  # context parallelism: FSDP2 shards over dp·cp
            zero=parallel.zero,
            dp_replicate=parallel.dp_replicate,
            offload=parallel.offload,
        )
    )


def shards_experts(config: RunConfig) -> bool:
    """Whether FSDP2 shards the run's experts over the ranks holding the same ones
    (``layout_rules.expert_fsdp_shards``): :func:`apply_ep` and :func:`apply_dp` then compose so, and
    the mesh FSDP2 shards them on is built with the others (``build_device_mesh(experts_sharded=)``)."""
    parallel = config.parallel
    shards = layout_rules.expert_fsdp_shards(
        n_experts=config.model.n_experts,
        zero=parallel.zero,
        dp=parallel.dp,
        ep=parallel.ep,
        dp_replicate=parallel.dp_replicate,
        cp=parallel.cp,
        offload=parallel.offload,
    )
    return shards > 0


def uses_fsdp(dims: ParallelDims, parallel: ParallelConfig) -> bool:
    """Whether :func:`apply_dp` wraps with FSDP2 (ZeRO-2/3 over more than one dp·cp rank)."""
    return layout_rules.uses_fsdp(parallel.zero, dims.dp_cp)


def fsdp_policies(config: RunConfig, device: torch.device) -> dict[str, object]:
    """``fully_shard`` keyword arguments for the run's precision and offload settings.

    * bf16: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. FSDP2 keeps the sharded
      fp32 parameters as the master weights (the optimizer and its state stay fp32), all-gathers
      bf16 copies for compute (half the all-gather bytes), and reduce-scatters gradients in fp32
      before casting them onto the fp32 shards, so gradient accumulation over dp ranks loses
      nothing. The trainer then does not autocast (``Trainer._autocast``): FSDP already casts.
    * offload cpu: ``CPUOffloadPolicy``; the optimizer then steps the host-resident shards. Pinned
      memory speeds the host-device copies on CUDA; a CPU-only run cannot pin (no accelerator),
      and there the policy only exercises the same code path.
    """
    kwargs: dict[str, object] = {}
    if config.training.precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if config.parallel.offload == "cpu":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return kwargs


def loss_context(dims: ParallelDims) -> AbstractContextManager:
    """The context the forward, the loss *and* its backward run in.

    Under TP the logits are vocab-sharded DTensors (see :func:`apply_tp`); ``loss_parallel()``
    makes ``F.cross_entropy`` on them reduce across tp ranks instead of gathering the logits, and
    its backward must run inside the same context (torch's rule for ``loss_parallel``). Without TP
    it is a no-op.
    """
    return loss_parallel() if dims.tp_enabled else contextlib.nullcontext()


def apply_dp(
    module: nn.Module,
    dims: ParallelDims,
    *,
    zero: int,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    fsdp_shards_experts: bool = False,
) -> nn.Module:
    """Data parallelism over the ``dp`` axis by ZeRO stage; returns the module to call.

    * 0 — DDP. Plain ``DistributedDataParallel`` over the dp group when parameters are plain
      tensors. With TP the parameters are DTensors, which DDP cannot bucket; the composable
      ``replicate`` built on FSDP2 (``torch.distributed._composable.replicate_with_fsdp``) all-reduces
      DTensor gradients over the dp axis and keeps parameters DTensors, so the clip-norm and
      DCP paths need no special case (the older DDP-based ``replicate`` flattens DTensors into local
      tensors, losing the sharding DCP needs).
    * 1 — ZeRO-1: DDP for gradients as in stage 0; the optimizer state is sharded by
      ``etrain.workers.engine.optim.build_optimizer`` (``ZeroRedundancyOptimizer`` over the dp group).
    * 2 — FSDP2 ``fully_shard(reshard_after_forward=False)``: gradients and optimizer state sharded;
      parameters are gathered once per step and kept through backward (ZeRO-2's communication
      volume: one all-gather + one reduce-scatter). Unlike DeepSpeed's ZeRO-2 they are also sharded
      between steps, which only saves memory; FSDP2 has no mode that keeps them replicated.
    * 3 — FSDP2 ``fully_shard(reshard_after_forward=True)``: parameters sharded too (ZeRO-3).

    FSDP2 wraps each block, then the root, so each block's all-gather overlaps the previous
    block's compute. With dp=1 there is nothing to replicate or shard and nothing is wrapped.
    With ``dims.dp_replicate > 1`` FSDP2 runs on the 2-D ``(dp_replicate, dp_shard)`` mesh (HSDP):
    parameters are sharded within a replica group, and gradients are reduce-scattered there and
    then all-reduced across replicas. ``mp_policy`` / ``offload_policy`` (:func:`fsdp_policies`)
    go to every ``fully_shard`` call, so blocks and root agree.

    Context parallelism (torchtitan's composition): the cp ranks are one more data dimension for the
    parameters, so everything above runs over the flattened ``dp_cp`` mesh (``dp · cp`` ranks). Each cp rank's
    loss is the mean over its ``S / cp`` tokens of every sequence it holds (no token is ever ignored, so the
    counts are equal), and the average of those means over cp is the mean over the whole sequence: averaging
    the gradients over ``dp · cp`` is exactly one process's gradient of the global batch's mean loss.

    Expert parallelism: the experts (DTensors split over ep, :func:`apply_ep`) are left to
    :func:`reduce_expert_grads`, or with ``fsdp_shards_experts`` get an FSDP2 unit of their own in each block
    on the mesh of the ranks holding the same experts (``ParallelMesh.expert_fsdp``: edp, with cp edp·cp,
    under HSDP 2-D), wrapped before the block so that the block's unit leaves them out (torchtitan's order).
    Its reduce-scatter sums a rank's expert gradient over those ranks, and its divide factor is ``dp · cp``,
    not their count: that gradient already sums the tokens of the ep peers that routed to it, so over edp
    and cp it covers every (dp, cp) rank once, and the mean over the global batch divides by dp · cp (as
    :func:`reduce_expert_grads` does).
    """
    if dims.dp_cp == 1:
        return module
    experts = set(expert_parameters(module)) if dims.ep_enabled else set()
    if layout_rules.uses_fsdp(zero, dims.dp_cp):
        fsdp_mesh = dims.fsdp_mesh
        policies: dict[str, object] = {"reshard_after_forward": zero == 3}
        if mp_policy is not None:
            policies["mp_policy"] = mp_policy
        if offload_policy is not None:
            policies["offload_policy"] = offload_policy
        if experts and not fsdp_shards_experts:  # sharded by expert over ep and reduced by reduce_expert_grads
            policies["ignored_params"] = experts
        for block in module.layers.values():
            if fsdp_shards_experts:
                experts_mesh = dims.mesh.expert_fsdp  # edp (edp·cp), or under HSDP 2-D
                for layer in _moe_layers(block):
                    fully_shard(layer.experts, mesh=experts_mesh, **policies)
                    layer.experts.set_gradient_divide_factor(float(dims.dp_cp))
                    # gloo has no pre-multiplied sum: a sum, then a division. Not with one rank to shard over
                    # (offload at dp = ep), where FSDP2 reduces nothing and (torch 2.13) would divide twice.
                    if experts_mesh.device_type == "cpu" and experts_mesh.size(-1) > 1:
                        layer.experts.set_force_sum_reduction_for_comms(True)
            fully_shard(block, mesh=fsdp_mesh, **policies)
        fully_shard(module, mesh=fsdp_mesh, **policies)
        return module
    if _has_dtensor_params(module, experts):
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(module, mesh=dims.axis("dp_cp"), ignored_params=experts or None)  # experts: as below
        return module
    if experts:  # DDP leaves the expert weights to reduce_expert_grads
        names = [name for name, p in module.named_parameters() if p in experts]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
    group = dims.mesh.get_group("dp_cp") if dims.cp_enabled else dims.group("dp")
    return DistributedDataParallel(module, process_group=group)


def _has_dtensor_params(module: nn.Module, ignored: set[nn.Parameter] = frozenset()) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters() if p not in ignored)


def parallelize_stage(
    module: nn.Module,
    dims: ParallelDims,
    config: RunConfig,
    materialize: Callable[[nn.Module], nn.Module] | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """(float8 →) TP → EP → AC → compile → DP on a whole model or one pipeline stage; returns the module to run.

    ``module`` may live on the ``meta`` device; ``materialize`` then allocates and initialises its
    local shards at the latest point that is legal: after FSDP2 has sharded it (ZeRO-2/3, so a rank
    only ever allocates its shards), or before DDP / ``replicate`` / ZeRO-1 wrap it (they need real
    parameters, and hold them whole anyway).

    The returned module may be a DDP wrapper; its ``.module`` (or the module itself) keeps the
    original FQNs. Passed as ``stage_transform`` to ``etrain.workers.engine.pipeline.build_pipeline``. With CPU
    offload the caller's ``materialize`` must allocate on the CPU (the shards live there).
    """
    parallel = config.parallel
    validate_data_parallel(parallel)
    materialize = materialize or (lambda m: m)
    layout_rules.check(
        layout_rules.sequence_parallel_problems(
            seq_len=config.model.seq_len, tp=dims.tp, enabled=parallel.sequence_parallel, cp=dims.cp
        )
    )
    # The head and loss in chunks of tokens (a stage that owns the output projection; run_trunk).
    module.loss_chunk_tokens = config.training.loss_chunk_tokens
    if config.training.float8:  # before TP and FSDP2 wrap the projections (torchtitan's order)
        from etrain.workers.engine.float8 import apply_float8

        apply_float8(
            module,
            device=torch.device(device or "cpu"),
            fsdp=uses_fsdp(dims, parallel),
            precision=config.training.precision,
            tp=dims.tp,
            sequence_parallel=parallel.sequence_parallel,
        )
    if dims.tp_enabled:
        layout_rules.check(tp_problems(config.model, dims.tp))
        apply_tp(
            module, dims.axis("tp"), sequence_parallel=parallel.sequence_parallel, compiled=config.training.compile
        )
    fsdp_shards_experts = shards_experts(config)
    if dims.ep_enabled:  # its rules were checked by the Trainer before any process group
        apply_ep(module, dims, fsdp_shards_experts=fsdp_shards_experts)
    if dims.cp_enabled:  # likewise
        apply_cp(module, dims)
    apply_ac(module, config.training.activation_checkpointing)
    if config.training.compile:
        from etrain.workers.engine.compile import apply_compile

        # the ep token exchange and tensor-parallel experts' collectives run eagerly, between a block's
        # graphs; the cp ring is a custom op inside the graph (ring_attention.py)
        form = compiled_block_form(
            ep=dims.ep,
            tp=dims.tp,
            moe=bool(_moe_layers(module)),
            checkpointing=config.training.activation_checkpointing,
        )
        apply_compile(module, form=form)
    if uses_fsdp(dims, parallel):
        device = torch.device(dims.fsdp_mesh.device_type)
        return materialize(
            apply_dp(
                module,
                dims,
                zero=parallel.zero,
                fsdp_shards_experts=fsdp_shards_experts,
                **fsdp_policies(config, device),
            )
        )
    return apply_dp(materialize(module), dims, zero=parallel.zero)


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FQNs as in the original model)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


@contextlib.contextmanager
def gradient_sync(modules: Iterable[nn.Module], enabled: bool) -> Iterator[None]:
    """Run a micro-step with gradient synchronisation on (last micro-step) or off (the others).

    Accumulating micro-steps locally and reducing once per optimizer step is what makes gradient
    accumulation cheap: DDP's ``no_sync()``; FSDP2's ``set_requires_gradient_sync(False)``
    (unsharded gradients accumulate locally, one reduce-scatter on the last micro-step).
    """
    with contextlib.ExitStack() as stack:
        for module in modules:
            if isinstance(module, DistributedDataParallel):
                if not enabled:
                    stack.enter_context(module.no_sync())
            elif isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(enabled)
        yield
