"""Why a layout cannot run, in the spec's words: its layout rules and its memory, each with the fix.

The layout rules themselves are ``etrain.workers.protocol.layout_rules`` and, those that ask the model's
family, ``etrain.workers.families.layout`` (the engine checks the same ones);
this module hands them a planner :class:`~etrain.service.planning.estimate.Case` and turns what they
find into :class:`~etrain.service.planning.spec.SpecProblem`. Memory problems name the biggest
component and the single changes that would help, each with the memory it would need.
"""

from __future__ import annotations

from etrain.service.planning.estimate import DEFAULT_DEVICE_MEMORY_GB, Case, PlanEstimate, evaluate
from etrain.service.planning.plan_memory import gib
from etrain.service.planning.plan_search import MAX_AUTO_TP
from etrain.service.planning.spec import JobSpec, ParallelismSpec, SpecProblem
from etrain.workers.families import layout as family_layout
from etrain.workers.protocol import layout_rules

__all__ = ["degree_problems", "device_memory_problems", "layout_problems", "memory_problem"]


def degree_problems(lay: ParallelismSpec) -> list[SpecProblem]:
    """Degrees below 1 (possible only past pydantic, e.g. model_construct): nothing else is computable."""
    explicit = {} if lay.microbatches is None else {"microbatches": lay.microbatches}
    return SpecProblem.of(
        layout_rules.degree_problems(
            dp=lay.dp, tp=lay.tp, pp=lay.pp, virtual_stages=lay.virtual_stages, ep=lay.ep, cp=lay.cp, **explicit
        )
    )


def layout_problems(case: Case, *, max_dp: int) -> list[SpecProblem]:
    """The layout rules (no memory) for the case's model, layout and micro-batch count."""
    lay = case.layout
    problems = degree_problems(lay)
    if problems:
        return problems
    m = case.microbatches
    source = (
        f"parallelism.microbatches={m}"
        if lay.microbatches
        else f"global_batch/(dp·micro_batch) = {case.global_batch}/({lay.dp}·{case.micro_batch}) = {m}"
    )
    return SpecProblem.of(
        family_layout.layout_problems(
            case.model,
            dp=lay.dp,
            tp=lay.tp,
            pp=lay.pp,
            zero=lay.zero,
            pp_schedule=lay.pp_schedule,
            virtual_stages=lay.virtual_stages,
            sequence_parallel=lay.sequence_parallel,
            dp_replicate=lay.dp_replicate,
            offload=lay.offload,
            microbatches=m,
            microbatch_source=source,
            max_dp=max_dp,
            ep=lay.ep,
            cp=lay.cp,
        )
    )


def memory_problem(case: Case, est: PlanEstimate, *, field: str = "parallelism", context: str = "") -> SpecProblem:
    """The estimate exceeds the device memory: the components, the biggest, and the fixes."""
    mem = est.memory
    parts = ", ".join(f"{name.replace('_', ' ')} {gib(value):.1f}" for name, value in mem.components().items())
    where = f"stage {mem.stage} of pp={est.pp}, " if est.pp > 1 else ""
    phase = "" if mem.phase == "forward_backward" else f" at its peak, the {mem.phase.replace('_', ' ')},"
    biggest = f"{mem.biggest.replace('_', ' ')} ({gib(getattr(mem, mem.biggest)):.1f} GiB"
    if mem.biggest == "buffers" and mem.buffer_parts:
        biggest += ": " + ", ".join(f"{k.replace('_', ' ')} {gib(v):.1f}" for k, v in mem.buffer_parts.items())
    message = (
        f"{context}estimated memory per rank{phase} {gib(mem.total):.1f} GiB ({where}{parts} GiB) exceeds "
        f"the device memory {gib(est.device_memory_bytes):.1f} GiB (resources.device_memory_gb) for "
        f"{est.layout}; the biggest component is {biggest})."
    )
    return SpecProblem(field=field, message=message, fix=_memory_fixes(case, est))


def _memory_fixes(case: Case, est: PlanEstimate) -> str:
    """Concrete single changes, each with the memory it would need ("fits" when it does)."""
    lay, model = case.layout, case.model
    variants: list[tuple[str, Case]] = []
    if lay.dp > 1:  # lower stages too: with accumulation, ZeRO-2/3 hold unsharded gradients
        for z in (z for z in range(4) if z != lay.zero and not (z == 1 and lay.ep > 1)):  # ZeRO-1 refuses ep
            fsdp_only = {} if z >= 2 else {"dp_replicate": 1, "offload": "none"}  # HSDP/offload need FSDP2
            variants.append((f"parallelism.zero={z}", case.replace(layout={"zero": z, **fsdp_only})))
    if (
        layout_rules.uses_fsdp(lay.zero, lay.dp)
        and lay.offload == "none"
        and case.device == "cuda"
        and not family_layout.ep_problems(  # under ep only where FSDP2 shards the experts too
            model, ep=lay.ep, dp=lay.dp, zero=lay.zero, dp_replicate=lay.dp_replicate, offload="cpu", cp=lay.cp
        )
    ):
        variants.append(("parallelism.offload=cpu (states in host memory)", case.replace(layout={"offload": "cpu"})))
    wider = lay.ep * 2  # split the experts over more of the dp ranks (same world)
    if model.n_experts and not family_layout.ep_problems(
        model, ep=wider, dp=lay.dp, zero=lay.zero, dp_replicate=lay.dp_replicate, offload=lay.offload, cp=lay.cp
    ):
        variants.append(
            (f"parallelism.ep={wider} (experts split over {wider} ranks)", case.replace(layout={"ep": wider}))
        )
    if case.checkpointing == "none":
        variants.append(("training.activation_checkpointing=selective", case.replace(checkpointing="selective")))
    if case.checkpointing != "full":
        variants.append(("training.activation_checkpointing=full", case.replace(checkpointing="full")))
    if case.micro_batch > 1:
        variants.append(("training.micro_batch=1", case.replace(micro_batch=1, layout={"microbatches": None})))
    if (
        lay.zero >= 2
        and case.microbatches > 1
        and not layout_rules.batch_problems(global_batch=case.global_batch, micro_batch=1, dp=lay.dp)
    ):
        whole = case.global_batch // lay.dp  # one micro-batch per step: FSDP reduce-scatters at once
        variants.append(
            (
                f"training.micro_batch={whole} (no accumulation, so gradients stay sharded)",
                case.replace(micro_batch=whole, layout={"microbatches": None}),
            )
        )
    if lay.tp * 2 <= MAX_AUTO_TP and not family_layout.tp_problems(model, lay.tp * 2):
        variants.append(
            (f"parallelism.tp={lay.tp * 2} (world {est.world_size * 2})", case.replace(layout={"tp": lay.tp * 2}))
        )
    deeper = lay.pp * 2
    if not (
        layout_rules.layer_problems(model.n_layers, deeper, lay.virtual_stages)
        or layout_rules.tied_embedding_problems(tie_embeddings=model.tie_embeddings, pp=deeper)
        or family_layout.family_axis_problems(model, pp=deeper)
    ):
        variants.append(
            (
                f"parallelism.pp={lay.pp * 2} (world {est.world_size * 2})",
                case.replace(layout={"pp": lay.pp * 2, "microbatches": None}),
            )
        )
    texts, seen_fit = [], False
    for label, variant in variants:
        if label.startswith("parallelism.zero") and seen_fit:
            continue  # name only the lowest ZeRO stage that fits
        total = evaluate(variant).memory.total
        if total >= est.memory.total:
            continue  # only changes that help
        fits = total <= case.device_memory_bytes
        seen_fit = seen_fit or (fits and label.startswith("parallelism.zero"))
        texts.append(f"{label} → {gib(total):.1f} GiB/rank{' (fits)' if fits else ''}")
    advice = "; ".join(texts) if texts else "no single change helps"
    return (
        f"try {advice}; or combine them, use a device with more memory, or let the planner choose with "
        "parallelism: {auto: true, max_workers: N}"
    )


def device_memory_problems(spec: JobSpec, available_gb: float | None) -> list[SpecProblem]:
    """A job may lower the memory per rank the cluster offers, never raise it; when nothing says what
    the cluster offers, the limit is the default (:data:`DEFAULT_DEVICE_MEMORY_GB`), which only the
    operator can raise (``ETRAIN_DEVICE_MEMORY_GB``)."""
    asked = spec.resources.device_memory_gb
    limit = available_gb if available_gb is not None else DEFAULT_DEVICE_MEMORY_GB[spec.resources.device]
    if asked is None or asked <= limit:
        return []
    device = "GPU" if spec.resources.device == "cuda" else "CPU worker"
    source = (
        "this cluster offers (detected from the Ray nodes' accelerators, or set by the operator with "
        "ETRAIN_DEVICE_MEMORY_GB)"
        if available_gb is not None
        else "the planner assumes: neither the operator (ETRAIN_DEVICE_MEMORY_GB) nor the cluster's GPUs say more"
    )
    return [
        SpecProblem(
            field="resources.device_memory_gb",
            message=f"resources.device_memory_gb={asked:g} GiB exceeds the {limit:g} GiB per {device} {source}.",
            fix=f"omit resources.device_memory_gb (the planner uses {limit:g} GiB) or set it at most {limit:g}; "
            "only the operator can allow more",
        )
    ]
