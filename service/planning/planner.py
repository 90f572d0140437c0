"""The planner: memory per rank, pipeline bubble, communication and step time of a layout, the rules
a layout must satisfy, and the automatic choice of ``(dp, tp, pp, zero, schedule)``.

Pure arithmetic over the spec (no torch, no Ray), so the API can answer at submit time and
``POST /v1/plan`` can show its work. Every formula is a documented estimate; the numbers are
meant to reject what cannot fit and to rank layouts, not to predict the allocator to the byte.

The formulas themselves, with their conventions and sources, live in service/planning/plan_math.py (and are
re-exported here); this module applies them to a spec (``estimate``), holds the rules a layout must
satisfy (``check_plan``), searches the layouts (``resolve_auto``) and answers ``POST /v1/plan``
(``plan_report``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

from etrain.service.planning.bounds import divisors, spread
from etrain.service.errors import SpecRejected
from etrain.service.planning.plan_math import (
    DDP_BUCKET_BYTES,  # noqa: F401 - re-exported: importable from here as before the split
    MEMORY_COMPONENTS,  # noqa: F401 - re-exported as well
    CommVolume,
    GiB,
    Hardware,
    MemoryBreakdown,
    StepTime,
    _dp_traffic,
    _gib,
    _layer_chunks_in_flight,
    _pp_traffic,
    _step_flops,
    _step_time,
    _tp_traffic,
    bubble_fraction,
    bytes_per_param,
    compute_regime,
    hardware_for,
    in_flight_microbatches,
    korthikanti_activation_bytes,
    layer_activation_bytes,
    layer_params,
    llama_layer_activation_bytes,
    logits_bytes,
    precision_bytes,
    stage_memory,
    stage_params,
)
from etrain.service.planning.spec import JobSpec, ParallelismSpec, SpecProblem, check_spec, field_problems
from etrain.workers.protocol.run_config import ModelConfig, ParallelConfig

__all__ = [
    "GiB",
    "AutoPlan",
    "CommVolume",
    "Hardware",
    "MemoryBreakdown",
    "PlanEstimate",
    "StepTime",
    "bubble_fraction",
    "bytes_per_param",
    "check_plan",
    "device_memory_gb",
    "estimate",
    "hardware_for",
    "in_flight_microbatches",
    "korthikanti_activation_bytes",
    "layer_activation_bytes",
    "layer_params",
    "llama_layer_activation_bytes",
    "logits_bytes",
    "plan_report",
    "precision_bytes",
    "resolve_auto",
    "stage_params",
]

#: Memory per rank when neither the cluster (detected GPU memory) nor the operator
#: (``ETRAIN_DEVICE_MEMORY_GB``) says: 80 GiB per GPU, 8 GiB per CPU worker.
DEFAULT_DEVICE_MEMORY_GB = {"cuda": 80.0, "cpu": 8.0}
#: Memory a rank uses before holding any tensor. CUDA: context, NCCL buffers, allocator slack.
#: CPU: the Python + torch + gloo process of a rank, measured by ``make bench`` as an empty rank's
#: peak RSS (274 MiB on x86_64 Linux, torch 2.13), rounded up.
RUNTIME_OVERHEAD_GIB = {"cuda": 1.0, "cpu": 0.27}
#: Layouts whose estimated step time is within this fraction of the fastest count as equally fast.
STEP_TIME_TOLERANCE = 0.05
#: Auto-planning first looks for layouts within this share of device memory (estimates are estimates).
AUTO_MEMORY_TARGET = 0.9
MAX_AUTO_TP = 8  # tensor parallelism stays inside one node (8 GPUs, NVLink)
#: Auto-planning tries at most this many pipeline depths (divisors of n_layers) and, per (tp, pp), this
#: many dp sizes (divisors of global_batch / micro_batch within the budget): all of them when there are
#: no more, else an even spread that keeps the smallest and the largest (``etrain.service.planning.bounds.spread``).
MAX_AUTO_PP_SIZES = 16
MAX_AUTO_DP_SIZES = 16
#: And at most this many layouts in all (each costs ~0.2 ms to estimate), in order of preference
#: (fewest pipeline stages first), so no spec makes POST /v1/plan or /v1/jobs search for long.
MAX_AUTO_LAYOUTS = 4096


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
    microbatches: int
    micro_batch: int
    precision: str
    regime: str  # how blocks compute: fp32, autocast (bf16 matmuls) or bf16_params (FSDP2 mixed precision)
    activation_checkpointing: bool
    num_params: int
    params_per_rank: int  # the worst stage's parameters on one TP rank, before ZeRO sharding
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
                "dp": self.dp, "tp": self.tp, "pp": self.pp, "zero": self.zero,
                "pp_schedule": self.pp_schedule, "virtual_stages": self.virtual_stages,
                "sequence_parallel": self.sequence_parallel, "microbatches": self.microbatches,
                "dp_replicate": self.dp_replicate, "offload": self.offload,
            },
            "training": {"micro_batch": self.micro_batch, "precision": self.precision, "compute": self.regime,
                         "activation_checkpointing": self.activation_checkpointing},
            "params": {"total": self.num_params, "per_rank": self.params_per_rank,
                       "layers_per_stage": self.layers_per_stage},
            "memory": {
                **self.memory.to_dict(),
                "device_gib": _gib(self.device_memory_bytes),
                "headroom_gib": _gib(self.headroom_bytes),
                "fits": self.fits,
            },
            "activations": {"in_flight_microbatches": self.in_flight_microbatches,
                            "bytes_per_layer_per_microbatch": self.activation_bytes_per_layer},
            "bubble_fraction": round(self.bubble_fraction, 6),
            "comm_per_step": {**self.comm.to_dict(), "group_sizes": {"dp": self.dp, "tp": self.tp, "pp": self.pp}},
            "flops_per_step": self.flops_per_step,
            "flops_per_step_with_recompute": self.flops_per_step_with_recompute,
            "step_time": self.step_time.to_dict(),
        }


# ---------------------------------------------------------------------------------------------
# Estimating one layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Case:
    """A spec flattened to the numbers the estimate reads, so variants are cheap to make."""

    model: ModelConfig
    layout: ParallelismSpec
    global_batch: int
    micro_batch: int
    precision: str
    checkpointing: bool
    device: str
    device_memory_bytes: int
    cpus_per_worker: float

    @property
    def microbatches(self) -> int:
        derived = max(1, self.global_batch // (self.layout.dp * self.micro_batch))
        return self.layout.microbatches or derived

    def replace(self, *, layout: dict | None = None, **fields) -> "_Case":
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


def _case(spec: JobSpec, layout: ParallelismSpec, available_gb: float | None = None) -> _Case:
    return _Case(
        model=spec.model.to_config(), layout=layout, global_batch=spec.training.global_batch,
        micro_batch=spec.training.micro_batch, precision=spec.training.precision,
        checkpointing=spec.training.activation_checkpointing, device=spec.resources.device,
        device_memory_bytes=int(device_memory_gb(spec, available_gb) * GiB),
        cpus_per_worker=spec.resources.cpus_per_worker,
    )


def _describe(layout: ParallelismSpec) -> str:
    text = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, zero=layout.zero,
                          pp_schedule=layout.pp_schedule, virtual_stages=layout.virtual_stages,
                          sequence_parallel=layout.sequence_parallel).describe()
    if layout.dp_replicate > 1:
        text += f" hsdp={layout.dp_replicate}x{layout.dp // layout.dp_replicate}"
    if layout.offload != "none":
        text += f" offload={layout.offload}"
    return text


def _evaluate(case: _Case) -> PlanEstimate:
    model, lay = case.model, case.layout
    dp, tp, pp, zero = lay.dp, lay.tp, lay.pp, lay.zero
    v = lay.virtual_stages if pp > 1 else 1
    m, b, s, d = case.microbatches, case.micro_batch, model.seq_len, model.d_model
    fsdp = zero in (2, 3) and dp > 1
    replicate = lay.dp_replicate if fsdp and dp % lay.dp_replicate == 0 else 1
    regime = compute_regime(case.precision, fsdp=fsdp)
    act_elem = 4 if regime == "fp32" else 2  # what crosses tp and pp links
    pb, gb, _ = precision_bytes(case.precision)
    param_comm_bytes = 2 if regime == "bf16_params" else pb  # FSDP2 all-gathers bf16 copies
    layers = math.ceil(model.n_layers / (pp * v)) * v
    per_layer_act = layer_activation_bytes(model, micro_batch=b, tp=tp, sequence_parallel=lay.sequence_parallel,
                                           precision=case.precision, checkpointing=case.checkpointing, regime=regime)
    hidden = s * b * d * act_elem  # one micro-batch's hidden states
    sp_div = tp if lay.sequence_parallel else 1
    overhead = RUNTIME_OVERHEAD_GIB[case.device] * GiB

    stages = sorted({0, pp - 1})
    memories, params_of, tp_bytes, dp_bytes, tp_ops, dp_ops = {}, {}, [], [], [], []
    for stage in stages:
        first, last = stage == 0, stage == pp - 1
        params = stage_params(model, tp=tp, layers=layers, first=first, last=last)
        held = _layer_chunks_in_flight(lay.pp_schedule, pp=pp, microbatches=m, virtual_stages=v, stage=stage)
        memories[stage] = stage_memory(
            model, stage=stage, pp=pp, layers=layers, virtual_stages=v, held=held, dp=dp, tp=tp, zero=zero,
            micro_batch=b, microbatches=m, precision=case.precision, checkpointing=case.checkpointing,
            device=case.device, overhead=overhead, dp_replicate=replicate, offload=lay.offload,
            sequence_parallel=lay.sequence_parallel,
        )
        params_of[stage] = params
        volume, ops = _dp_traffic(zero=zero, dp=dp, pp=pp, microbatches=m, params=params,
                                  param_bytes=param_comm_bytes, grad_bytes=gb, units=layers + int(first or last),
                                  tensors=16 * layers + 2 * int(first) + 3 * int(last), dp_replicate=replicate)
        dp_bytes.append(volume)
        dp_ops.append(ops)
        volume, ops = _tp_traffic(tp=tp, microbatches=m, layers=layers, first=first, last=last,
                                  checkpointing=case.checkpointing, hidden_bytes=hidden, tokens=b * s)
        tp_ops.append(ops)
        tp_bytes.append(volume)
    worst = max(stages, key=lambda st: memories[st].total)
    pp_bytes, pp_ops = _pp_traffic(pp=pp, virtual_stages=v, microbatches=m, hidden_bytes=hidden, sp_div=sp_div)
    flops, flops_recompute = _step_flops(model, global_batch=case.global_batch, checkpointing=case.checkpointing)
    bubble = bubble_fraction(pp, m, lay.pp_schedule, v)
    comm = CommVolume(dp=math.ceil(max(dp_bytes)), tp=math.ceil(max(tp_bytes)), pp=math.ceil(pp_bytes),
                      dp_ops=max(dp_ops), tp_ops=max(tp_ops), pp_ops=pp_ops)
    step = _step_time(hardware_for(case.device, case.precision, case.cpus_per_worker), dp=dp, tp=tp, pp=pp,
                      comm=comm, flops=flops_recompute, bubble=bubble)
    return PlanEstimate(
        layout=_describe(lay), world_size=dp * tp * pp, dp=dp, tp=tp, pp=pp, zero=zero,
        pp_schedule=lay.pp_schedule, virtual_stages=lay.virtual_stages, sequence_parallel=lay.sequence_parallel,
        dp_replicate=lay.dp_replicate, offload=lay.offload,
        microbatches=m, micro_batch=b, precision=case.precision, regime=regime,
        activation_checkpointing=case.checkpointing,
        num_params=model.num_params, params_per_rank=math.ceil(params_of[worst]), layers_per_stage=layers,
        in_flight_microbatches=in_flight_microbatches(lay.pp_schedule, pp=pp, microbatches=m, virtual_stages=v,
                                                      stage=worst),
        activation_bytes_per_layer=math.ceil(per_layer_act), memory=memories[worst],
        device_memory_bytes=case.device_memory_bytes, bubble_fraction=bubble, comm=comm,
        flops_per_step=float(flops), flops_per_step_with_recompute=float(flops_recompute), step_time=step,
    )


def estimate(spec: JobSpec, *, available_gb: float | None = None) -> PlanEstimate:
    """Memory, bubble, communication, FLOPs and step time of the spec's explicit layout.

    ``available_gb``: memory per rank the cluster offers (see :func:`device_memory_gb`)."""
    _require_bounds(spec)
    return _evaluate(_case(spec, spec.layout, available_gb))


def _require_bounds(spec: JobSpec) -> None:
    """Every entry point of the planner first: a spec that skipped validation (``model_construct``)
    with sizes out of bounds is refused before any search over them (:func:`field_problems`)."""
    problems = field_problems(spec)
    if problems:
        raise SpecRejected(problems)


# ---------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------


def _tp_dims(model: ModelConfig) -> tuple[tuple[str, int], ...]:
    """The sizes tensor parallelism splits: whole query (and, for Llama, key/value) heads, the MLP
    width and the vocabulary; the GPT also splits d_model (its q/k/v/out are d x d)."""
    if model.arch == "llama":
        return (("n_heads", model.n_heads), ("n_kv_heads", model.kv_heads), ("ffn_dim", model.ffn_dim),
                ("vocab_size", model.vocab_size))
    return (("n_heads", model.n_heads), ("d_model", model.d_model), ("ffn_dim", model.ffn_dim),
            ("vocab_size", model.vocab_size))


def _divisors_ok(model: ModelConfig, tp: int) -> bool:
    return all(size % tp == 0 for _, size in _tp_dims(model))


def _valid_tps(model: ModelConfig) -> list[int]:
    """The tensor-parallel degrees up to one node (MAX_AUTO_TP) that split every TP dimension evenly."""
    return [t for t in range(1, min(model.n_heads, MAX_AUTO_TP) + 1) if _divisors_ok(model, t)]


def _degree_problems(lay: ParallelismSpec) -> list[SpecProblem]:
    """Degrees below 1 (possible only past pydantic, e.g. model_construct): nothing else is computable."""
    problems = []
    for name in ("dp", "tp", "pp", "virtual_stages"):
        value = getattr(lay, name)
        if not isinstance(value, int) or value < 1:
            problems.append(SpecProblem(field=f"parallelism.{name}", message=f"parallelism.{name}={value!r} "
                                        "must be an integer >= 1.", fix=f"set {name} >= 1"))
    if lay.microbatches is not None and (not isinstance(lay.microbatches, int) or lay.microbatches < 1):
        problems.append(SpecProblem(field="parallelism.microbatches", message="parallelism.microbatches="
                                    f"{lay.microbatches!r} must be >= 1.",
                                    fix="omit it (derived from the batch sizes) or set it >= 1"))
    return problems


def _layout_problems(case: _Case, *, max_dp: int) -> list[SpecProblem]:
    """Structural rules of a layout (no memory): degrees, divisibility, schedule, flags."""
    lay, model = case.layout, case.model
    problems = _degree_problems(lay)
    if problems:
        return problems

    def add(field: str, message: str, fix: str) -> None:
        problems.append(SpecProblem(field=field, message=message, fix=fix))

    dp, tp, pp, v = lay.dp, lay.tp, lay.pp, lay.virtual_stages
    degrees = f"(world = dp·tp·pp = {dp}·{tp}·{pp} = {dp * tp * pp})"
    valid_tp = _valid_tps(model)
    heads_problem = model.arch == "llama" and (model.n_heads % tp or model.kv_heads % tp)
    if heads_problem:
        add("parallelism.tp", f"parallelism.tp={tp} must divide both model.n_heads={model.n_heads} and "
            f"model.n_kv_heads={model.kv_heads}: each rank holds whole query and key/value heads {degrees}.",
            f"use tp in {valid_tp}")
    for dim, size in _tp_dims(model):
        if heads_problem and dim in ("n_heads", "n_kv_heads"):
            continue
        if size % tp:
            why = " (the output head is column-parallel over the vocabulary)" if dim == "vocab_size" else ""
            add("parallelism.tp", f"parallelism.tp={tp} does not divide model.{dim}={size}{why} {degrees}.",
                f"use tp in {valid_tp}")
    if lay.sequence_parallel and tp == 1:
        add("parallelism.sequence_parallel", "parallelism.sequence_parallel=true needs tp > 1, got tp=1.",
            "set tp >= 2 or sequence_parallel=false")
    elif lay.sequence_parallel and model.seq_len % tp:
        add("parallelism.sequence_parallel",
            f"sequence parallelism shards the sequence: model.seq_len={model.seq_len} is not divisible by tp={tp}.",
            f"use a seq_len that is a multiple of {tp}, or sequence_parallel=false")
    if pp > 1 and model.arch == "llama" and model.tie_embeddings:
        add("parallelism.pp", f"parallelism.pp={pp} splits the model into stages, but its input embedding and "
            "output head share one weight (tie_embeddings), which cannot live on two stages.",
            "use pp=1 (shard with parallelism.zero 3 or parallelism.tp instead)")
    chunks = pp * v
    if model.n_layers % chunks:
        field = "parallelism.virtual_stages" if v > 1 and model.n_layers % pp == 0 else "parallelism.pp"
        valid_pp = [p for p in divisors(model.n_layers) if model.n_layers % (p * v) == 0]
        add(field, f"model.n_layers={model.n_layers} is not divisible by pp·virtual_stages = {pp}·{v} = {chunks} "
            f"{degrees}.", f"use pp in {valid_pp[:12]} (with virtual_stages={v})")
    m = case.microbatches
    source = (f"parallelism.microbatches={m}" if lay.microbatches else
              f"global_batch/(dp·micro_batch) = {case.global_batch}/({dp}·{case.micro_batch}) = {m}")
    if pp > 1 and lay.pp_schedule in ("gpipe", "1f1b"):
        if v != 1:
            add("parallelism.virtual_stages",
                f"pp_schedule={lay.pp_schedule!r} runs one stage per rank but virtual_stages={v}.",
                "set virtual_stages=1 or pp_schedule='interleaved_1f1b'")
        if m < pp:
            add("parallelism.microbatches",
                f"pp_schedule={lay.pp_schedule!r} with pp={pp} needs at least {pp} micro-batches to fill the "
                f"pipeline, got {source}.",
                f"raise training.global_batch to >= {pp * dp * case.micro_batch} or lower training.micro_batch/dp")
    elif lay.pp_schedule == "interleaved_1f1b":
        if pp < 2:
            add("parallelism.pp_schedule", f"pp_schedule='interleaved_1f1b' needs pp >= 2, got pp={pp}.",
                "use pp >= 2 or pp_schedule='1f1b'")
        if v < 2:
            add("parallelism.virtual_stages",
                f"pp_schedule='interleaved_1f1b' needs virtual_stages >= 2, got {v}.",
                "set virtual_stages=2 (or more), or pp_schedule='1f1b'")
        if pp >= 2 and m % pp:
            add("parallelism.microbatches",
                f"pp_schedule='interleaved_1f1b' needs micro-batches divisible by pp={pp}, got {source}.",
                f"make global_batch/(dp·micro_batch) a multiple of {pp}")
    elif pp == 1 and v != 1:
        add("parallelism.virtual_stages", f"virtual_stages={v} needs pipeline parallelism, got pp=1.",
            "set virtual_stages=1")
    fsdp_fix = "set parallelism.zero to 2 or 3 (FSDP2) with dp >= 2"
    if lay.dp_replicate > 1:
        if dp % lay.dp_replicate:
            add("parallelism.dp_replicate", f"parallelism.dp_replicate={lay.dp_replicate} must divide "
                f"parallelism.dp={dp}: HSDP splits the dp ranks into equal replica groups.",
                f"use dp_replicate in {divisors(dp)[:24]}")
        if lay.zero not in (2, 3):
            add("parallelism.dp_replicate", f"parallelism.dp_replicate={lay.dp_replicate} (HSDP) shards with "
                f"FSDP2 inside each replica group, but parallelism.zero={lay.zero}.",
                f"{fsdp_fix}, or dp_replicate=1")
    if lay.offload != "none" and (lay.zero not in (2, 3) or dp < 2):
        add("parallelism.offload", f"parallelism.offload={lay.offload!r} moves FSDP2's shards to host memory, "
            f"but parallelism.zero={lay.zero} with dp={dp}.", f"{fsdp_fix}, or offload='none'")
    if lay.zero > 0 and dp == 1 and max_dp <= 1:
        add("parallelism.zero", f"parallelism.zero={lay.zero} shards across data-parallel ranks but dp=1 "
            "(and resources.max_dp allows no more).", "set zero=0, or dp >= 2 (or resources.max_dp >= 2)")
    return problems


def _memory_problem(case: _Case, est: PlanEstimate, *, field: str = "parallelism",
                    context: str = "") -> SpecProblem:
    mem = est.memory
    parts = ", ".join(f"{name.replace('_', ' ')} {_gib(value):.1f}" for name, value in mem.components().items())
    where = f"stage {mem.stage} of pp={est.pp}, " if est.pp > 1 else ""
    phase = "" if mem.phase == "forward_backward" else f" at its peak, the {mem.phase.replace('_', ' ')},"
    biggest = f"{mem.biggest.replace('_', ' ')} ({_gib(getattr(mem, mem.biggest)):.1f} GiB"
    if mem.biggest == "buffers" and mem.buffer_parts:
        biggest += ": " + ", ".join(f"{k.replace('_', ' ')} {_gib(v):.1f}" for k, v in mem.buffer_parts.items())
    message = (f"{context}estimated memory per rank{phase} {_gib(mem.total):.1f} GiB ({where}{parts} GiB) exceeds "
               f"the device memory {_gib(est.device_memory_bytes):.1f} GiB (resources.device_memory_gb) for "
               f"{est.layout}; the biggest component is {biggest}).")
    return SpecProblem(field=field, message=message, fix=_memory_fixes(case, est))


def _memory_fixes(case: _Case, est: PlanEstimate) -> str:
    """Concrete single changes, each with the memory it would need ("fits" when it does)."""
    lay, model = case.layout, case.model
    variants: list[tuple[str, _Case]] = []
    if lay.dp > 1:  # lower stages too: with accumulation, ZeRO-2/3 hold unsharded gradients
        for z in (z for z in range(4) if z != lay.zero):
            fsdp_only = {} if z >= 2 else {"dp_replicate": 1, "offload": "none"}  # HSDP/offload need FSDP2
            variants.append((f"parallelism.zero={z}", case.replace(layout={"zero": z, **fsdp_only})))
    if lay.dp > 1 and lay.zero >= 2 and lay.offload == "none" and case.device == "cuda":
        variants.append(("parallelism.offload=cpu (states in host memory)", case.replace(layout={"offload": "cpu"})))
    if not case.checkpointing:
        variants.append(("training.activation_checkpointing=true", case.replace(checkpointing=True)))
    if case.micro_batch > 1:
        variants.append(("training.micro_batch=1", case.replace(micro_batch=1, layout={"microbatches": None})))
    if lay.zero >= 2 and case.microbatches > 1 and case.global_batch % lay.dp == 0:
        whole = case.global_batch // lay.dp  # one micro-batch per step: FSDP reduce-scatters at once
        variants.append((f"training.micro_batch={whole} (no accumulation, so gradients stay sharded)",
                         case.replace(micro_batch=whole, layout={"microbatches": None})))
    if lay.tp * 2 <= MAX_AUTO_TP and _divisors_ok(model, lay.tp * 2):
        variants.append((f"parallelism.tp={lay.tp * 2} (world {est.world_size * 2})",
                         case.replace(layout={"tp": lay.tp * 2})))
    tied = model.arch == "llama" and model.tie_embeddings
    if model.n_layers % (lay.pp * 2 * lay.virtual_stages) == 0 and not tied:
        variants.append((f"parallelism.pp={lay.pp * 2} (world {est.world_size * 2})",
                         case.replace(layout={"pp": lay.pp * 2, "microbatches": None})))
    texts, seen_fit = [], False
    for label, variant in variants:
        if label.startswith("parallelism.zero") and seen_fit:
            continue  # name only the lowest ZeRO stage that fits
        total = _evaluate(variant).memory.total
        if total >= est.memory.total:
            continue  # only changes that help
        fits = total <= case.device_memory_bytes
        seen_fit = seen_fit or (fits and label.startswith("parallelism.zero"))
        texts.append(f"{label} → {_gib(total):.1f} GiB/rank{' (fits)' if fits else ''}")
    advice = "; ".join(texts) if texts else "no single change helps"
    return (f"try {advice}; or combine them, use a device with more memory, or let the planner choose with "
            "parallelism: {auto: true, max_workers: N}")


def _device_memory_problems(spec: JobSpec, available_gb: float | None) -> list[SpecProblem]:
    """A job may lower the memory per rank the cluster offers, never raise it; when nothing says what
    the cluster offers, the limit is the default (:data:`DEFAULT_DEVICE_MEMORY_GB`), which only the
    operator can raise (``ETRAIN_DEVICE_MEMORY_GB``)."""
    asked = spec.resources.device_memory_gb
    limit = available_gb if available_gb is not None else DEFAULT_DEVICE_MEMORY_GB[spec.resources.device]
    if asked is None or asked <= limit:
        return []
    device = "GPU" if spec.resources.device == "cuda" else "CPU worker"
    source = ("this cluster offers (detected from the Ray nodes' accelerators, or set by the operator with "
              "ETRAIN_DEVICE_MEMORY_GB)" if available_gb is not None else
              "the planner assumes: neither the operator (ETRAIN_DEVICE_MEMORY_GB) nor the cluster's GPUs say more")
    return [SpecProblem(
        field="resources.device_memory_gb",
        message=f"resources.device_memory_gb={asked:g} GiB exceeds the {limit:g} GiB per {device} {source}.",
        fix=f"omit resources.device_memory_gb (the planner uses {limit:g} GiB) or set it at most {limit:g}; "
            "only the operator can allow more",
    )]


def check_plan(spec: JobSpec, *, available_gb: float | None = None) -> list[SpecProblem]:
    """Every reason the spec's layout cannot run (layout rules and memory), each with numbers and a fix.

    An auto spec is checked by resolving it: the answer is empty when some layout fits the budget.
    ``zero > 0`` at ``dp == 1`` is rejected unless ``resources.max_dp`` lets the job grow. An elastic
    job is also checked at ``resources.min_dp``, where ZeRO shards over fewer ranks.
    ``available_gb``: memory per rank the cluster offers (:func:`device_memory_gb`); a spec asking
    for more is rejected.
    """
    bounds = field_problems(spec)
    if bounds:  # degrees below 1 keep the planner's own words
        return (None if spec.is_auto else _degree_problems(spec.layout)) or bounds
    memory_problems = _device_memory_problems(spec, available_gb)
    if spec.is_auto:
        try:
            resolve_auto(spec, available_gb=available_gb)
        except SpecRejected as rejected:
            return memory_problems + list(rejected.problems)
        return memory_problems
    case = _case(spec, spec.layout, available_gb)
    problems = memory_problems + _layout_problems(case, max_dp=spec.max_dp)
    if _degree_problems(case.layout):
        return problems
    est = _evaluate(case)
    if not est.fits:
        problems.append(_memory_problem(case, est))
    elif spec.min_dp < case.layout.dp:
        shrunk = case.replace(layout={"dp": spec.min_dp, "microbatches": None})
        low = _evaluate(shrunk)
        if not low.fits:
            problems.append(_memory_problem(shrunk, low, field="resources.min_dp",
                                            context=f"after an elastic shrink to resources.min_dp={spec.min_dp}: "))
    return problems


# ---------------------------------------------------------------------------------------------
# Auto-planning
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AutoPlan:
    """The layout the planner chose, its estimate, and why (one reason per decision)."""

    layout: ParallelismSpec
    estimate: PlanEstimate
    reasons: list[str]
    candidates_considered: int
    candidates_fitting: int
    max_workers: int

    def to_dict(self) -> dict:
        return {
            "layout": self.layout.model_dump(), "layout_text": self.estimate.layout, "reasons": list(self.reasons),
            "candidates_considered": self.candidates_considered, "candidates_fitting": self.candidates_fitting,
            "max_workers": self.max_workers,
        }


def _budget(spec: JobSpec) -> int:
    """max_workers; for the literal ``"auto"`` the elastic ceiling ``resources.max_dp``, else 1."""
    if isinstance(spec.parallelism, ParallelismSpec):
        raise ValueError("resolve_auto needs parallelism: auto or {auto: true, max_workers: N}")
    if spec.parallelism == "auto":
        return spec.resources.max_dp or 1
    return spec.parallelism.max_workers


def _candidates(spec: JobSpec, base: _Case, budget: int) -> Iterator[_Case]:
    """The (dp, tp, pp, zero, schedule, sp) layouts within the budget that the structural rules allow,
    fewest pipeline stages first.

    Built from divisors, not ranges: tp splits every TP dimension (:func:`_valid_tps`), pp divides
    n_layers (only pp=1 for a tied model), dp divides the micro-batches per step (global_batch /
    micro_batch) within ``resources.min_dp..max_dp``, interleaving needs n_layers divisible by pp·v and
    micro-batches by pp; sequence parallelism is on whenever tp > 1 divides seq_len. At most MAX_AUTO_PP_SIZES pp
    and MAX_AUTO_DP_SIZES dp values per (tp, pp) are tried (:func:`etrain.service.planning.bounds.spread`).
    """
    model, res = base.model, spec.resources
    if spec.training.global_batch % spec.training.micro_batch:
        return  # check_spec reports it; no dp keeps the batch whole
    per_replica = spec.training.global_batch // spec.training.micro_batch
    lo_dp, hi_dp = res.min_dp or 1, res.max_dp or budget
    tps = [t for t in _valid_tps(model) if t <= budget]
    tied = model.arch == "llama" and model.tie_embeddings
    pps = [1] if tied else spread([p for p in divisors(model.n_layers) if p <= budget], MAX_AUTO_PP_SIZES)
    dps = divisors(per_replica)
    for pp in pps:
        for tp in tps:
            if tp * pp > budget:
                continue
            ceiling = min(hi_dp, budget // (tp * pp))
            for dp in spread([d for d in dps if lo_dp <= d <= ceiling], MAX_AUTO_DP_SIZES):
                m = per_replica // dp
                schedules = [("1f1b", 1)] if pp == 1 or m >= pp else []
                if pp > 1 and m % pp == 0:
                    schedules += [("interleaved_1f1b", v) for v in (2, 4) if model.n_layers % (pp * v) == 0]
                # Sequence parallelism, where it applies, shards activations at no extra traffic: never
                # slower nor bigger than without it, so the layout without it is not tried.
                sp = tp > 1 and model.seq_len % tp == 0
                for zero in range(4) if dp > 1 else (0,):
                    for schedule, v in schedules:
                        layout = ParallelismSpec(dp=dp, tp=tp, pp=pp, zero=zero, pp_schedule=schedule,
                                                 virtual_stages=v, sequence_parallel=sp)
                        yield dataclasses.replace(base, layout=layout)


def _choose(fitting: list[PlanEstimate]) -> PlanEstimate:
    """The cost model's pick among layouts that fit.

    1. Layouts within AUTO_MEMORY_TARGET of device memory, when there are any (headroom for error).
    2. Pipeline parallelism only when needed, and only as much as needed: only layouts with the
       smallest pp that fits compete (pp=1 whenever something fits without a pipeline).
    3. Among layouts whose estimated step time is within STEP_TIME_TOLERANCE of the fastest, the
       least tensor parallelism (the comm-heavy axis).
    4. Within that (pp, tp): the fastest step; exact ties (same traffic, e.g. sequence parallelism
       on or off) go to lower memory. So ZeRO is used when memory needs it or it is faster.
    """
    roomy = [e for e in fitting if e.memory.total <= AUTO_MEMORY_TARGET * e.device_memory_bytes]
    pool = roomy or fitting
    fewest_stages = min(e.pp for e in pool)
    pool = [e for e in pool if e.pp == fewest_stages]
    fastest = min(e.step_time.total_s for e in pool)
    band = [e for e in pool if e.step_time.total_s <= fastest * (1 + STEP_TIME_TOLERANCE)]
    tp = min(e.tp for e in band)
    same_axes = [e for e in pool if e.tp == tp]
    best = min(e.step_time.total_s for e in same_axes)
    ties = [e for e in same_axes if e.step_time.total_s <= best * (1 + 1e-9)]
    return min(ties, key=lambda e: (e.memory.total, e.step_time.total_s, e.layout))


def _shrink_fits(case: _Case, min_dp: int | None) -> bool:
    """An elastic job must also fit after shrinking to ``resources.min_dp`` (ZeRO shards over fewer)."""
    if not min_dp or min_dp >= case.layout.dp:
        return True
    return _evaluate(case.replace(layout={"dp": min_dp, "microbatches": None})).fits


def resolve_auto(spec: JobSpec, *, available_gb: float | None = None) -> AutoPlan:
    """Choose a layout for ``parallelism: auto`` within the worker budget.

    Enumerates dp·tp·pp <= budget over divisors (:func:`_candidates`; tp <= 8: one node), every ZeRO
    stage (dp > 1), 1F1B and interleaved (v = 2, 4) schedules for pp > 1 (GPipe has 1F1B's bubble and
    more memory, so it is never the better choice) and sequence parallelism for tp > 1, fewest stages
    first; stops at the first pp that has a layout within AUTO_MEMORY_TARGET (no deeper pipeline can
    win) or after MAX_AUTO_LAYOUTS layouts; drops layouts
    that break a rule or do not fit the device memory (also at ``resources.min_dp``); picks by :func:`_choose` over the
    :class:`StepTime` cost model. Raises :class:`SpecRejected` when nothing fits.
    """
    _require_bounds(spec)
    budget = _budget(spec)
    base = _case(spec, ParallelismSpec(), available_gb)
    min_dp = spec.resources.min_dp
    evaluated: list[tuple[_Case, PlanEstimate]] = []
    fitting: list[PlanEstimate] = []
    level, roomy_at_level, capped = None, False, False
    for case in _candidates(spec, base, budget):
        if case.layout.pp != level:
            if roomy_at_level:
                break  # a roomy layout with fewer stages exists: deeper pipelines can never be chosen (_choose)
            level = case.layout.pp
        if len(evaluated) >= MAX_AUTO_LAYOUTS:
            capped = True
            break
        if _layout_problems(case, max_dp=case.layout.dp):
            continue
        est = _evaluate(case)
        evaluated.append((case, est))
        if est.fits and _shrink_fits(case, min_dp):
            fitting.append(est)
            roomy_at_level = roomy_at_level or est.memory.total <= AUTO_MEMORY_TARGET * est.device_memory_bytes
    dev = _gib(base.device_memory_bytes)
    if not fitting:
        if evaluated:
            smallest = min((est for _, est in evaluated), key=lambda e: e.memory.total)
            detail = (f"the smallest, {smallest.layout}, needs {_gib(smallest.memory.total):.1f} GiB/rank "
                      f"({smallest.memory.biggest.replace('_', ' ')} "
                      f"{_gib(getattr(smallest.memory, smallest.memory.biggest)):.1f} GiB)")
            if capped:
                detail += f"; the search stopped after {MAX_AUTO_LAYOUTS} layouts"
        else:
            detail = "no layout satisfies the divisibility and batch rules"
        raise SpecRejected([SpecProblem(
            field="parallelism.max_workers",
            message=f"no layout of at most {budget} workers fits in {dev:.1f} GiB/rank: {detail}.",
            fix=("give an explicit layout (parallelism: {dp, tp, pp, zero}), which POST /v1/plan checks, or "
                 "fewer choices (lower max_workers, a global_batch with fewer divisors)" if capped else
                 "raise max_workers, enable training.activation_checkpointing, lower training.micro_batch, "
                 "or use a device with more memory (resources.device_memory_gb)"),
        )])
    chosen = _choose(fitting)
    case = next(c for c, e in evaluated if e is chosen)
    reasons = _reasons(chosen, case, [e for _, e in evaluated], fitting, budget, dev)
    return AutoPlan(layout=case.layout, estimate=chosen, reasons=reasons, candidates_considered=len(evaluated),
                    candidates_fitting=len(fitting), max_workers=budget)


def _axis_reason(axis: str, label: str, chosen: PlanEstimate, evaluated: list[PlanEstimate],
                 fitting: list[PlanEstimate], dev: float, *, same_pp: bool = False) -> str:
    """Why ``axis`` is not 1: the best layout without it is slower, too tight, or does not fit."""
    value = getattr(chosen, axis)
    if value == 1:
        return f"{axis}=1: the model fits without {label}"
    scope = f" and pp={chosen.pp}" if same_pp and chosen.pp > 1 else ""

    def without(pool: list[PlanEstimate]) -> list[PlanEstimate]:
        return [e for e in pool if getattr(e, axis) == 1 and (not same_pp or e.pp == chosen.pp)]

    alts = without(fitting)
    roomy = [e for e in alts if e.memory.total <= AUTO_MEMORY_TARGET * e.device_memory_bytes]
    if roomy:
        alt = min(roomy, key=lambda e: e.step_time.total_s)
        return (f"{axis}={value}: est. step {chosen.step_time.total_s:.3g} s vs {alt.step_time.total_s:.3g} s "
                f"for the best layout with {axis}=1{scope} ({alt.layout})")
    if alts:
        alt = min(alts, key=lambda e: e.memory.total)
        return (f"{axis}={value}: with {axis}=1{scope} the best fit ({alt.layout}) needs "
                f"{_gib(alt.memory.total):.1f} of {dev:.1f} GiB/rank, above the "
                f"{AUTO_MEMORY_TARGET:.0%} planning target")
    pool = without(evaluated)
    if not pool:
        return f"{axis}={value}: no valid layout with {axis}=1{scope} within the budget"
    low = min(pool, key=lambda e: e.memory.total)
    if low.fits:  # it fits as sized but not after shrinking to resources.min_dp
        return (f"{axis}={value}: layouts with {axis}=1{scope} fit at their size (the smallest, {low.layout}, "
                f"{_gib(low.memory.total):.1f} GiB/rank) but not after an elastic shrink to resources.min_dp")
    return (f"{axis}={value}: no layout with {axis}=1{scope} fits; the smallest ({low.layout}) needs "
            f"{_gib(low.memory.total):.1f} GiB/rank > {dev:.1f} GiB "
            f"({low.memory.biggest.replace('_', ' ')} {_gib(getattr(low.memory, low.memory.biggest)):.1f} GiB)")


def _reasons(chosen: PlanEstimate, case: _Case, evaluated: list[PlanEstimate], fitting: list[PlanEstimate],
             budget: int, dev: float) -> list[str]:
    lay = case.layout
    reasons = [f"budget: at most {budget} workers; {len(evaluated)} valid layouts considered, "
               f"{len(fitting)} fit in {dev:.1f} GiB/rank",
               _axis_reason("tp", "tensor parallelism", chosen, evaluated, fitting, dev, same_pp=True),
               _axis_reason("pp", "pipeline parallelism", chosen, evaluated, fitting, dev)]
    if chosen.pp > 1:
        reasons.append(f"pp_schedule={chosen.pp_schedule}"
                       f"{f' x{chosen.virtual_stages} virtual stages' if chosen.virtual_stages > 1 else ''}: "
                       f"bubble {chosen.bubble_fraction:.1%} with {chosen.microbatches} micro-batches, "
                       f"stage {chosen.memory.stage} holds {chosen.in_flight_microbatches:g} in flight")
    if chosen.zero == 0:
        reasons.append("zero=0: dp=1, nothing to shard" if chosen.dp == 1 else
                       f"zero=0: replicated optimizer states fit "
                       f"({_gib(chosen.memory.optimizer_states):.1f} GiB/rank)")
    else:
        plain = _evaluate(case.replace(layout={"zero": 0}))
        shards = {1: "optimizer states", 2: "optimizer states and gradients",
                  3: "optimizer states, gradients and parameters"}[chosen.zero]
        if not plain.fits:
            verdict = f"exceeds {dev:.1f} GiB"
        elif plain.memory.total > AUTO_MEMORY_TARGET * plain.device_memory_bytes:
            verdict = f"leaves under {1 - AUTO_MEMORY_TARGET:.0%} of {dev:.1f} GiB free"
        else:
            verdict = (f"fits, but zero={chosen.zero} is estimated faster ({chosen.step_time.total_s:.4g} s vs "
                       f"{plain.step_time.total_s:.4g} s per step)")
        reasons.append(f"zero={chosen.zero}: shards {shards} over dp={chosen.dp}; at zero=0 optimizer states "
                       f"take {_gib(plain.memory.optimizer_states):.1f} GiB/rank and the total "
                       f"{_gib(plain.memory.total):.1f} GiB/rank {verdict}; now {_gib(chosen.memory.total):.1f} GiB")
    if chosen.sequence_parallel:
        reasons.append(f"sequence_parallel: shards the norms' activations over tp={chosen.tp} at no extra "
                       "communication volume")
    used = f"{chosen.world_size} of {budget} workers"
    limit = "" if chosen.world_size == budget else (
        f" (dp must divide global_batch/micro_batch = {case.global_batch}/{case.micro_batch} and fit the budget)")
    reasons.append(f"dp={chosen.dp}: world = dp·tp·pp = {chosen.dp}·{chosen.tp}·{chosen.pp} uses {used}{limit}")
    st = chosen.step_time
    comm_s = st.tp_comm_s + st.pp_comm_s + st.dp_comm_s
    reasons.append(f"chosen {chosen.layout}: {_gib(chosen.memory.total):.1f} of {dev:.1f} GiB/rank, est. step "
                   f"{st.total_s:.3g} s (compute {st.compute_s:.3g}, comm {comm_s:.3g}, "
                   f"bubble {chosen.bubble_fraction:.1%})")
    return reasons


# ---------------------------------------------------------------------------------------------
# The POST /v1/plan body
# ---------------------------------------------------------------------------------------------


def plan_report(spec: JobSpec, *, available_gb: float | None = None) -> dict:
    """``{"feasible", "problems", "layout", "estimate", "auto"}``: check_spec + planner in one answer.

    An auto spec is resolved first and its chosen layout checked like an explicit one.
    ``available_gb``: memory per rank the cluster offers (:func:`device_memory_gb`).
    """
    auto: AutoPlan | None = None
    problems = list(check_spec(spec))
    if field_problems(spec) or any(p.field == "model" or p.field.startswith("model.") for p in problems):
        # Without a model there is nothing to size (a bad model.hf cannot even be read): report
        # the spec's problems as an infeasible plan rather than failing the request.
        return {"feasible": False, "problems": [p.to_dict() for p in problems], "layout": None,
                "estimate": None, "auto": None}
    resolved = spec
    if spec.is_auto:
        problems += _device_memory_problems(spec, available_gb)
        try:
            auto = resolve_auto(spec, available_gb=available_gb)
        except SpecRejected as rejected:
            problems += rejected.problems
        else:
            resolved = spec.with_layout(auto.layout)
            problems += [p for p in check_spec(resolved) if p not in problems]
    if not resolved.is_auto:
        problems += [p for p in check_plan(resolved, available_gb=available_gb) if p not in problems]
    est = auto.estimate if auto else (None if resolved.is_auto else _safe_estimate(resolved, available_gb))
    return {
        "feasible": not problems,
        "problems": [p.to_dict() for p in problems],
        "layout": est.layout if est else None,
        "estimate": est.to_dict() if est else None,
        "auto": auto.to_dict() if auto else None,
    }


def _safe_estimate(spec: JobSpec, available_gb: float | None = None) -> PlanEstimate | None:
    return None if _degree_problems(spec.layout) else estimate(spec, available_gb=available_gb)
