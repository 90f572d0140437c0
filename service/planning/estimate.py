"""What one explicit layout costs: memory per rank, bubble, communication, FLOPs and step time.

Pure arithmetic over the spec (no torch, no Ray), so the API answers at submit time and
``POST /v1/plan`` shows its work. The formulas, with their conventions and sources, are in
``plan_memory.py``, ``plan_activations.py`` and ``plan_comm.py``; this module applies them to a
spec's layout (:func:`estimate`) through a :class:`Case`, the spec flattened to the numbers the
estimate reads, so that the planner's searches and its suggested fixes can try variants cheaply.
Every number is a documented estimate, meant to reject what cannot fit and to rank layouts, not to
predict the allocator to the byte.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from etrain.service.errors import SpecRejected
from etrain.service.planning.plan_activations import (
    compute_regime,
    in_flight_microbatches,
    layer_activation_bytes,
    layer_chunks_in_flight,
)
from etrain.service.planning.plan_comm import (
    CommVolume,
    StepTime,
    bubble_fraction,
    cp_traffic,
    dp_traffic,
    ep_traffic,
    hardware_for,
    pp_traffic,
    step_flops,
    step_time,
    tp_traffic,
)
from etrain.service.planning.plan_memory import (
    RUNTIME_OVERHEAD_GIB,
    GiB,
    MemoryBreakdown,
    expert_split,
    gib,
    precision_bytes,
    stage_memory,
    stage_params,
)
from etrain.service.planning.spec import JobSpec, ParallelismSpec
from etrain.service.planning.spec_checks import field_problems
from etrain.workers import families
from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.compiled_blocks import compiled_block_form
from etrain.workers.protocol.run_config import ModelConfig, ParallelConfig

__all__ = [
    "DEFAULT_DEVICE_MEMORY_GB",
    "RUNTIME_OVERHEAD_GIB",
    "Case",
    "PlanEstimate",
    "case_for",
    "describe_layout",
    "device_memory_gb",
    "estimate",
    "evaluate",
    "require_bounds",
]

#: Memory per rank when neither the cluster (detected GPU memory) nor the operator
#: (``ETRAIN_DEVICE_MEMORY_GB``) says: 80 GiB per GPU, 8 GiB per CPU worker.
DEFAULT_DEVICE_MEMORY_GB = {"cuda": 80.0, "cpu": 8.0}


@dataclass(frozen=True, kw_only=True)
class PlanEstimate:
    """Everything the planner knows about one explicit layout."""

    layout: str
    world_size: int
    dp: int
    tp: int
    pp: int
    zero: int
    pp_schedule: str
    virtual_stages: int
    sequence_parallel: bool
    dp_replicate: int
    offload: str
    ep: int
    microbatches: int
    cp: int = 1
    micro_batch: int
    precision: str
    regime: str  # how blocks compute: fp32, autocast (bf16 matmuls) or bf16_params (FSDP2 mixed precision)
    activation_checkpointing: str
    #: under training.compile, how each block compiles (``compiled_blocks.COMPILED_BLOCK_FORMS``); else None
    compiled_blocks: str | None = None
    num_params: int
    params_per_rank: int  # the worst stage's parameters on one TP rank, before ZeRO sharding (experts / ep)
    layers_per_stage: int
    in_flight_microbatches: float
    activation_bytes_per_layer: int
    memory: MemoryBreakdown
    device_memory_bytes: int
    bubble_fraction: float
    comm: CommVolume
    flops_per_step: float
    flops_per_step_with_recompute: float
    step_time: StepTime

    @property
    def headroom_bytes(self) -> int:
        return self.device_memory_bytes - self.memory.total

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    def to_dict(self) -> dict:
        return {
            "layout": self.layout,
            "world_size": self.world_size,
            "parallelism": {
                "dp": self.dp,
                "tp": self.tp,
                "pp": self.pp,
                "zero": self.zero,
                "pp_schedule": self.pp_schedule,
                "virtual_stages": self.virtual_stages,
                "sequence_parallel": self.sequence_parallel,
                "microbatches": self.microbatches,
                "dp_replicate": self.dp_replicate,
                "offload": self.offload,
                "ep": self.ep,
                "cp": self.cp,
            },
            "training": {
                "micro_batch": self.micro_batch,
                "precision": self.precision,
                "compute": self.regime,
                "activation_checkpointing": self.activation_checkpointing,
                "compiled_blocks": self.compiled_blocks,
            },
            "params": {
                "total": self.num_params,
                "per_rank": self.params_per_rank,
                "layers_per_stage": self.layers_per_stage,
            },
            "memory": {
                **self.memory.to_dict(),
                "device_gib": gib(self.device_memory_bytes),
                "headroom_gib": gib(self.headroom_bytes),
                "fits": self.fits,
            },
            "activations": {
                "in_flight_microbatches": self.in_flight_microbatches,
                "bytes_per_layer_per_microbatch": self.activation_bytes_per_layer,
            },
            "bubble_fraction": round(self.bubble_fraction, 6),
            "comm_per_step": {
                **self.comm.to_dict(),
                "group_sizes": {"dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep, "cp": self.cp},
            },
            "flops_per_step": self.flops_per_step,
            "flops_per_step_with_recompute": self.flops_per_step_with_recompute,
            "step_time": self.step_time.to_dict(),
        }


@dataclass(frozen=True, kw_only=True)
class Case:
    """A spec flattened to the numbers the estimate reads, so variants are cheap to make."""

    model: ModelConfig
    layout: ParallelismSpec
    global_batch: int
    micro_batch: int
    precision: str
    checkpointing: str  # training.activation_checkpointing: none, full or selective
    device: str
    device_memory_bytes: int
    cpus_per_worker: float
    loss_chunk_tokens: int | str = 0  # training.loss_chunk_tokens: tokens, 0 (whole logits) or "auto"
    compiled: bool = False  # training.compile as resolved for the device (blocks under torch.compile)

    @property
    def microbatches(self) -> int:
        derived = max(1, self.global_batch // (self.layout.dp * self.micro_batch))
        return self.layout.microbatches or derived

    def replace(self, *, layout: dict | None = None, **fields) -> Case:
        if layout:
            fields["layout"] = self.layout.model_copy(update=layout)
        return dataclasses.replace(self, **fields)


def device_memory_gb(spec: JobSpec, available_gb: float | None = None) -> float:
    """Memory per rank the plan is checked against, in GiB.

    ``available_gb`` is what the cluster offers per rank for ``resources.device`` (the GPU memory
    Ray's nodes report, or the operator's ``ETRAIN_DEVICE_MEMORY_GB``), passed in by the caller so
    that the planner stays pure; None means unknown (:data:`DEFAULT_DEVICE_MEMORY_GB`). A job's
    ``resources.device_memory_gb`` may only lower it (:func:`check_plan` rejects a higher one), the
    default included: a job cannot talk the planner into more memory than the operator vouches for.
    """
    offered = available_gb if available_gb is not None else DEFAULT_DEVICE_MEMORY_GB[spec.resources.device]
    asked = spec.resources.device_memory_gb
    return offered if asked is None else min(asked, offered)


def case_for(spec: JobSpec, layout: ParallelismSpec, available_gb: float | None = None) -> Case:
    return Case(
        model=spec.model.to_config(),
        layout=layout,
        global_batch=spec.training.global_batch,
        micro_batch=spec.training.micro_batch,
        precision=spec.training.precision,
        checkpointing=spec.training.activation_checkpointing,
        device=spec.resources.device,
        device_memory_bytes=int(device_memory_gb(spec, available_gb) * GiB),
        cpus_per_worker=spec.resources.cpus_per_worker,
        loss_chunk_tokens=spec.training.loss_chunk_tokens,
        compiled=spec.compile_blocks,
    )


def describe_layout(layout: ParallelismSpec) -> str:
    text = ParallelConfig(
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        zero=layout.zero,
        pp_schedule=layout.pp_schedule,
        virtual_stages=layout.virtual_stages,
        sequence_parallel=layout.sequence_parallel,
        ep=layout.ep,
        cp=layout.cp,
    ).describe()
    if layout.dp_replicate > 1:
        text += f" hsdp={layout.dp_replicate}x{layout.dp // layout.dp_replicate}"
    if layout.offload != "none":
        text += f" offload={layout.offload}"
    return text


def evaluate(case: Case) -> PlanEstimate:
    model, lay = case.model, case.layout
    dp, tp, pp, zero, ep, cp = lay.dp, lay.tp, lay.pp, lay.zero, lay.ep, lay.cp
    v = lay.virtual_stages if pp > 1 else 1
    m, b, s, d = case.microbatches, case.micro_batch, model.seq_len, model.d_model
    fsdp = layout_rules.uses_fsdp(zero, dp * cp)  # cp is one more data dimension for the parameters
    replicate = lay.dp_replicate if fsdp and not layout_rules.dp_replicate_problems(dp, lay.dp_replicate) else 1
    regime = compute_regime(case.precision, fsdp=fsdp)
    act_elem = 4 if regime == "fp32" else 2  # what crosses tp and pp links
    pb, gb, _ = precision_bytes(case.precision)
    param_comm_bytes = 2 if regime == "bf16_params" else pb  # FSDP2 all-gathers bf16 copies
    layers = math.ceil(model.n_layers / (pp * v)) * v
    per_layer_act = layer_activation_bytes(
        model,
        micro_batch=b,
        tp=tp,
        sequence_parallel=lay.sequence_parallel,
        precision=case.precision,
        checkpointing=case.checkpointing,
        regime=regime,
        cp=cp,
        device=case.device,
    )
    hidden = s // cp * b * d * act_elem  # one micro-batch's hidden states (a cp rank's slice of them)
    sp_div = tp if lay.sequence_parallel else 1
    overhead = RUNTIME_OVERHEAD_GIB[case.device] * GiB

    chunk_tokens = layout_rules.loss_chunk_tokens(
        case.loss_chunk_tokens, tokens=b * s // cp, vocab_size=model.vocab_size, tp=tp
    )
    stages = sorted({0, pp - 1})
    memories, params_of, tp_bytes, dp_bytes, tp_ops, dp_ops = {}, {}, [], [], [], []
    for stage in stages:
        first, last = stage == 0, stage == pp - 1
        params = stage_params(model, tp=tp, layers=layers, first=first, last=last)
        split, experts_local, _ = expert_split(model, layers=layers, ep=ep, tp=tp)
        held = layer_chunks_in_flight(lay.pp_schedule, pp=pp, microbatches=m, virtual_stages=v, stage=stage)
        memories[stage] = stage_memory(
            model,
            stage=stage,
            pp=pp,
            layers=layers,
            virtual_stages=v,
            held=held,
            dp=dp,
            tp=tp,
            zero=zero,
            micro_batch=b,
            microbatches=m,
            precision=case.precision,
            checkpointing=case.checkpointing,
            device=case.device,
            overhead=overhead,
            dp_replicate=replicate,
            offload=lay.offload,
            sequence_parallel=lay.sequence_parallel,
            loss_chunk_tokens=chunk_tokens,
            compiled=case.compiled,
            ep=ep,
            cp=cp,
        )
        params_of[stage] = params - split + experts_local
        volume, ops = dp_traffic(
            zero=zero,
            dp=dp * cp,  # gradients averaged over dp·cp
            pp=pp,
            microbatches=m,
            params=params - split,  # the experts split over ep are left out of DDP / FSDP2
            param_bytes=param_comm_bytes,
            grad_bytes=gb,
            units=layers + int(first or last),
            tensors=16 * layers + 2 * int(first) + 3 * int(last),
            dp_replicate=replicate,
        )
        expert_shards = layout_rules.expert_fsdp_shards(
            n_experts=model.n_experts, zero=zero, dp=dp, ep=ep, dp_replicate=replicate, cp=cp, offload=lay.offload
        )
        holders = dp // ep * cp  # the ranks holding the same experts: edp, and the cp ranks of each
        if expert_shards:  # FSDP2 over the ranks holding the same experts: gathered and reduce-scattered per block
            expert_volume, expert_ops = dp_traffic(
                zero=zero,
                dp=holders,  # under HSDP: shard groups of expert_shards ranks, all-reduced over the replicas
                pp=pp,
                microbatches=m,
                params=experts_local,
                param_bytes=param_comm_bytes,
                grad_bytes=gb,
                units=layers,
                tensors=3 * layers,
                dp_replicate=holders // expert_shards,
            )
            volume, ops = volume + expert_volume, ops + expert_ops
        elif ep > 1:  # the local experts' gradients, all-reduced over edp, then over cp (reduce_expert_grads)
            for group in (n for n in (dp // ep, cp) if n > 1):
                volume += 2 * (group - 1) / group * experts_local * gb
                ops += 3 * layers
        dp_bytes.append(volume)
        dp_ops.append(ops)
        volume, ops = tp_traffic(
            tp=tp,
            microbatches=m,
            layers=layers,
            first=first,
            last=last,
            checkpointing=case.checkpointing,
            hidden_bytes=hidden,
            tokens=b * s // cp,
            # a mixture of experts reduces its tokens' summed outputs in the residual stream's dtype (MoE)
            mlp_factor=(4 if regime == "autocast" else act_elem) / act_elem if model.n_experts else 1.0,
        )
        tp_ops.append(ops)
        tp_bytes.append(volume)
    worst = max(stages, key=lambda st: memories[st].total)
    ep_bytes, ep_ops = ep_traffic(
        ep=ep,
        microbatches=m,
        moe_layers=layers if model.n_experts else 0,
        tokens=b * s // cp,  # a cp rank routes its slice of each sequence
        top_k=model.experts_per_token,
        d_model=d,
        elem_bytes=act_elem,
        checkpointing=case.checkpointing,
    )
    cp_bytes, cp_ops = cp_traffic(
        cp=cp,
        microbatches=m,
        layers=layers,
        tokens=b * s,
        kv_width=model.kv_heads * model.head_dim // tp,  # a tp rank's ring carries its kv heads
        elem_bytes=act_elem,
        checkpointing=case.checkpointing,
    )
    pp_bytes, pp_ops = pp_traffic(pp=pp, virtual_stages=v, microbatches=m, hidden_bytes=hidden, sp_div=sp_div)
    flops, flops_recompute = step_flops(model, global_batch=case.global_batch, checkpointing=case.checkpointing)
    bubble = bubble_fraction(pp, m, lay.pp_schedule, v)
    comm = CommVolume(
        dp=math.ceil(max(dp_bytes)),
        tp=math.ceil(max(tp_bytes)),
        pp=math.ceil(pp_bytes),
        dp_ops=max(dp_ops),
        tp_ops=max(tp_ops),
        pp_ops=pp_ops,
        ep=math.ceil(ep_bytes),
        ep_ops=ep_ops,
        cp=math.ceil(cp_bytes),
        cp_ops=cp_ops,
    )
    step = step_time(
        hardware_for(case.device, case.precision, case.cpus_per_worker),
        dp=dp,
        tp=tp,
        pp=pp,
        comm=comm,
        flops=flops_recompute,
        bubble=bubble,
        ep=ep,
        cp=cp,
    )
    return PlanEstimate(
        layout=describe_layout(lay),
        world_size=layout_rules.world_size(pp=pp, dp=dp, tp=tp, cp=cp),
        dp=dp,
        tp=tp,
        pp=pp,
        zero=zero,
        pp_schedule=lay.pp_schedule,
        virtual_stages=lay.virtual_stages,
        sequence_parallel=lay.sequence_parallel,
        dp_replicate=lay.dp_replicate,
        offload=lay.offload,
        ep=ep,
        cp=cp,
        microbatches=m,
        micro_batch=b,
        precision=case.precision,
        regime=regime,
        activation_checkpointing=case.checkpointing,
        compiled_blocks=(
            compiled_block_form(ep=ep, tp=tp, moe=model.n_experts > 0, checkpointing=case.checkpointing)
            if case.compiled
            else None
        ),
        num_params=families.num_params(model),
        params_per_rank=math.ceil(params_of[worst]),
        layers_per_stage=layers,
        in_flight_microbatches=in_flight_microbatches(
            lay.pp_schedule, pp=pp, microbatches=m, virtual_stages=v, stage=worst
        ),
        activation_bytes_per_layer=math.ceil(per_layer_act),
        memory=memories[worst],
        device_memory_bytes=case.device_memory_bytes,
        bubble_fraction=bubble,
        comm=comm,
        flops_per_step=float(flops),
        flops_per_step_with_recompute=float(flops_recompute),
        step_time=step,
    )


def estimate(spec: JobSpec, *, available_gb: float | None = None) -> PlanEstimate:
    """Memory, bubble, communication, FLOPs and step time of the spec's explicit layout.

    ``available_gb``: memory per rank the cluster offers (see :func:`device_memory_gb`)."""
    require_bounds(spec)
    return evaluate(case_for(spec, spec.layout, available_gb))


def require_bounds(spec: JobSpec) -> None:
    """Every entry point of the planner first: a spec that skipped validation (``model_construct``)
    with sizes out of bounds is refused before any search over them (:func:`field_problems`)."""
    problems = field_problems(spec)
    if problems:
        raise SpecRejected(problems)
