"""The automatic choice of a layout: which layouts to try, which one wins, and why.

``parallelism: auto`` (or ``{auto: true, max_workers: N}``) asks the planner to choose ``(dp, tp, pp,
zero, schedule, sp)`` within a worker budget, and context parallelism (``cp``) for a sequence whose
activations fit no layout without it, expert parallelism (``ep``) for a mixture of experts.
:func:`candidate_layouts` enumerates what the layout rules (``etrain.workers.protocol.layout_rules``,
``etrain.workers.families.layout``) allow, built from divisors and capped (``etrain.service.planning.bounds.spread``);
:func:`choose_layout` picks by the step-time cost model; :func:`explain_choice` says why, one reason per
decision. ``planner.resolve_auto`` runs the search.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

from etrain.service.planning.bounds import spread
from etrain.service.planning.estimate import Case, PlanEstimate, evaluate
from etrain.service.planning.plan_memory import gib
from etrain.service.planning.spec import JobSpec, ParallelismSpec
from etrain.workers.families import family
from etrain.workers.families import layout as family_layout
from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.run_config import ModelConfig

__all__ = [
    "AUTO_MEMORY_TARGET",
    "AUTO_SCHEDULES",
    "MAX_AUTO_CP_SIZES",
    "MAX_AUTO_DP_SIZES",
    "MAX_AUTO_EP_SIZES",
    "MAX_AUTO_LAYOUTS",
    "MAX_AUTO_PP_SIZES",
    "MAX_AUTO_TP",
    "STEP_TIME_TOLERANCE",
    "AutoPlan",
    "candidate_groups",
    "candidate_layouts",
    "choose_layout",
    "context_parallel_sizes",
    "explain_choice",
    "fits_after_shrink",
    "frugal_layout",
    "worker_budget",
]

#: Layouts whose estimated step time is within this fraction of the fastest count as equally fast.
STEP_TIME_TOLERANCE = 0.05


#: Auto-planning first looks for layouts within this share of device memory (estimates are estimates).
AUTO_MEMORY_TARGET = 0.9


MAX_AUTO_TP = 8  # tensor parallelism stays inside one node (8 GPUs, NVLink)


#: Auto-planning tries at most this many pipeline depths (divisors of n_layers) and, per (cp, tp, pp), this
#: many dp sizes (divisors of global_batch / micro_batch within the budget): all of them when there are
#: no more, else an even spread that keeps the smallest and the largest (``etrain.service.planning.bounds.spread``).
MAX_AUTO_PP_SIZES = 16


MAX_AUTO_DP_SIZES = 16


#: And at most this many layouts in all (each costs ~0.2 ms to estimate), in order of preference
#: (fewest pipeline stages first), so no spec makes POST /v1/plan or /v1/jobs search for long.
MAX_AUTO_LAYOUTS = 4096
#: Context parallelism is tried only when no layout without it fits (:func:`choose_layout`), at most this many
#: cp degrees: the least divisors of seq_len the rules allow.
MAX_AUTO_CP_SIZES = 8
#: Expert parallelism (a mixture of experts) tries at most this many ep degrees per (dp, zero): divisors of
#: gcd(dp, n_experts) the rules allow.
MAX_AUTO_EP_SIZES = 8
#: The (schedule, virtual_stages) auto-planning tries for pp > 1 (pp = 1: the first, plain accumulation).
AUTO_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4))


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
            "layout": self.layout.model_dump(),
            "layout_text": self.estimate.layout,
            "reasons": list(self.reasons),
            "candidates_considered": self.candidates_considered,
            "candidates_fitting": self.candidates_fitting,
            "max_workers": self.max_workers,
        }


def worker_budget(spec: JobSpec) -> int:
    """max_workers; for the literal ``"auto"`` the elastic ceiling ``resources.max_dp``, else 1."""
    if isinstance(spec.parallelism, ParallelismSpec):
        raise ValueError("resolve_auto needs parallelism: auto or {auto: true, max_workers: N}")
    if spec.parallelism == "auto":
        return spec.resources.max_dp or 1
    return spec.parallelism.max_workers


def context_parallel_sizes(spec: JobSpec, base: Case, budget: int) -> list[int]:
    """The cp degrees auto-planning tries, least first: 1, then those
    ``etrain.workers.families.layout.cp_problems`` allows for the spec's model
    (a family with the ring; 2·cp divides seq_len)
    within the budget at ``resources.min_dp``: the MAX_AUTO_CP_SIZES least of them, since the least cp that
    fits is the one chosen (:func:`choose_layout`)."""
    model, lo_dp = base.model, spec.resources.min_dp or 1
    allowed = [
        c
        for c in layout_rules.divisors(model.seq_len)
        if 1 < c <= budget // lo_dp and not family_layout.cp_problems(model, cp=c)
    ]
    return [1, *allowed[:MAX_AUTO_CP_SIZES]]


def _expert_parallel_sizes(spec: JobSpec, model: ModelConfig, *, dp: int, zero: int) -> list[int]:
    """1, and for a mixture of experts the ep degrees ``etrain.workers.families.layout.ep_problems`` allows at
    this (dp, zero): divisors of gcd(dp, n_experts), at most MAX_AUTO_EP_SIZES of them (``spread``)."""
    if dp == 1 or not family(model.arch).mixture_of_experts:
        return [1]
    allowed = [
        e
        for e in layout_rules.divisors(math.gcd(dp, model.n_experts))
        if e > 1 and not family_layout.ep_problems(model, ep=e, dp=dp, zero=zero)
    ]
    return [1, *spread(allowed, MAX_AUTO_EP_SIZES)] if allowed else [1]


def candidate_layouts(spec: JobSpec, base: Case, budget: int, *, cp: int | None = None) -> Iterator[Case]:
    """The (dp, tp, pp, zero, schedule, sp, ep, cp) layouts within the budget that the structural rules
    allow, by cp (1 first: :func:`context_parallel_sizes`, or only ``cp`` when given), then fewest pipeline
    stages first: :func:`candidate_groups`, one after the other."""
    for group in candidate_groups(spec, base, budget, cp=cp):
        yield from group


def candidate_groups(spec: JobSpec, base: Case, budget: int, *, cp: int | None = None) -> Iterator[list[Case]]:
    """:func:`candidate_layouts` in groups of one (cp, pp, tp) each, in the same order (dp, then ZeRO, ep
    and the schedule within a group), so a search can pass over a group whose :func:`frugal_layout` does not fit.

    Built from divisors, not ranges, and filtered by the layout rules (``etrain.workers.protocol.layout_rules``,
    ``etrain.workers.families.layout``):
    tp splits every TP dimension and stays in one node (MAX_AUTO_TP), pp divides n_layers (only pp=1
    for a tied model or a family that refuses pipelines), dp is a legal size (it divides the micro-batches per step, global_batch /
    micro_batch) within ``resources.min_dp..max_dp``, a schedule is one torch runs with those
    micro-batches (AUTO_SCHEDULES: GPipe has 1F1B's bubble and more memory, so it is never the better
    choice); sequence parallelism is on whenever it applies (not with ``training.float8``). World = pp·dp·cp·tp within the budget; ZeRO
    shards over dp·cp. For a mixture of experts, ep among the divisors of gcd(dp, n_experts) that
    ``ep_problems`` allows (it comes out of dp: no extra ranks); cp among :func:`context_parallel_sizes`. At most MAX_AUTO_PP_SIZES pp, MAX_AUTO_DP_SIZES dp values per
    (cp, tp, pp) and MAX_AUTO_EP_SIZES ep values per (dp, zero) are tried
    (:func:`etrain.service.planning.bounds.spread`). A layout with cp > 1 is estimated as compiled where
    the spec compiles (``plan_activations``: the ring op sits inside each compiled block's graph).
    """
    model, res, training = base.model, spec.resources, spec.training
    lo_dp, hi_dp = res.min_dp or 1, res.max_dp or budget
    if layout_rules.micro_batch_count_problems(training.global_batch, training.micro_batch) or lo_dp > hi_dp:
        return  # check_spec reports it; no dp keeps the batch whole
    per_replica = layout_rules.micro_batch_count(training.global_batch, training.micro_batch)
    dps = layout_rules.legal_dp_sizes(training.global_batch, training.micro_batch, lo_dp, hi_dp)
    tps = [t for t in family_layout.valid_tps(model) if t <= min(budget, MAX_AUTO_TP)]
    pps = [
        p
        for p in spread([p for p in layout_rules.divisors(model.n_layers) if p <= budget], MAX_AUTO_PP_SIZES)
        if not layout_rules.tied_embedding_problems(tie_embeddings=model.tie_embeddings, pp=p)
        and not family_layout.family_axis_problems(model, pp=p)
    ]
    for c in context_parallel_sizes(spec, base, budget) if cp is None else [cp]:
        for pp in pps:
            for tp in tps:
                if c * tp * pp > budget:
                    continue
                # Sequence parallelism, where it applies, shards activations at no extra traffic: never
                # slower nor bigger than without it, so the layout without it is not tried. Not with float8
                # (layout_rules.float8_problems: its float8 all-gathers are not proven).
                sp = (
                    tp > 1
                    and not training.float8
                    and not layout_rules.sequence_parallel_problems(seq_len=model.seq_len, tp=tp, enabled=True, cp=c)
                )
                group = []
                for dp in spread([d for d in dps if d <= budget // (c * tp * pp)], MAX_AUTO_DP_SIZES):
                    m = per_replica // dp
                    schedules = [
                        (name, v)
                        for name, v in (AUTO_SCHEDULES if pp > 1 else AUTO_SCHEDULES[:1])
                        if not layout_rules.schedule_problems(pp, v, m, name)
                        and not layout_rules.layer_problems(model.n_layers, pp, v)
                    ]
                    for zero in range(4) if dp * c > 1 else (0,):  # ZeRO shards over dp·cp ranks
                        for ep in _expert_parallel_sizes(spec, model, dp=dp, zero=zero):
                            group += [
                                dataclasses.replace(
                                    base,
                                    layout=ParallelismSpec(
                                        dp=dp,
                                        tp=tp,
                                        pp=pp,
                                        zero=zero,
                                        pp_schedule=schedule,
                                        virtual_stages=v,
                                        sequence_parallel=sp,
                                        ep=ep,
                                        cp=c,
                                    ),
                                    compiled=base.compiled,
                                )
                                for schedule, v in schedules
                            ]
                if group:
                    yield group


def frugal_layout(group: list[Case]) -> Case:
    """The layout of a :func:`candidate_groups` group that needs the least memory, by construction: the most
    ranks sharding the states (the largest dp, then the highest ZeRO stage, then the widest ep) and the fewest
    micro-batches in flight (the first schedule of AUTO_SCHEDULES at that size, 1F1B where it runs). When it
    does not fit, no layout of its group is expected to: the search for cp > 1 passes over the group."""
    return max(group, key=lambda case: (case.layout.dp, case.layout.zero, case.layout.ep))


def choose_layout(fitting: list[PlanEstimate]) -> PlanEstimate:
    """The cost model's pick among layouts that fit.

    1. Context parallelism only when needed, and only as much as needed: only layouts with the least
       cp that fits compete (cp=1 whenever something fits without it, even above AUTO_MEMORY_TARGET).
       cp is the axis for a long sequence whose activations fit no other layout: it adds the ring's
       traffic and its quadratic scores transient, and takes ranks from dp.
    2. Layouts within AUTO_MEMORY_TARGET of device memory, when there are any (headroom for error).
    3. Pipeline parallelism only when needed, and only as much as needed: only layouts with the
       smallest pp that fits compete (pp=1 whenever something fits without a pipeline).
    4. Among layouts whose estimated step time is within STEP_TIME_TOLERANCE of the fastest, the
       least tensor parallelism (the comm-heavy axis).
    5. Within that (cp, pp, tp): the fastest step; exact ties (same traffic, e.g. sequence parallelism
       on or off) go to lower memory. So ZeRO is used when memory needs it or it is faster, and expert
       parallelism (which comes out of dp, at the same world size) when it is faster or needed to fit:
       it shards the experts' weights, gradients and states, and their gradients leave DDP / FSDP2, for
       the tokens' all-to-alls.
    """
    least_cp = min(e.cp for e in fitting)
    pool = [e for e in fitting if e.cp == least_cp]
    roomy = [e for e in pool if e.memory.total <= AUTO_MEMORY_TARGET * e.device_memory_bytes]
    pool = roomy or pool
    fewest_stages = min(e.pp for e in pool)
    pool = [e for e in pool if e.pp == fewest_stages]
    fastest = min(e.step_time.total_s for e in pool)
    band = [e for e in pool if e.step_time.total_s <= fastest * (1 + STEP_TIME_TOLERANCE)]
    tp = min(e.tp for e in band)
    same_axes = [e for e in pool if e.tp == tp]
    best = min(e.step_time.total_s for e in same_axes)
    ties = [e for e in same_axes if e.step_time.total_s <= best * (1 + 1e-9)]
    return min(ties, key=lambda e: (e.memory.total, e.step_time.total_s, e.layout))


def fits_after_shrink(case: Case, min_dp: int | None) -> bool:
    """An elastic job must also fit after shrinking to ``resources.min_dp`` (ZeRO shards over fewer)."""
    if not min_dp or min_dp >= case.layout.dp:
        return True
    return evaluate(case.replace(layout={"dp": min_dp, "microbatches": None})).fits


def _biggest(est: PlanEstimate) -> str:
    """The largest memory component of an estimate, named with its size: ``activations 51.5 GiB``."""
    return f"{est.memory.biggest.replace('_', ' ')} {gib(getattr(est.memory, est.memory.biggest)):.1f} GiB"


def _axis_reason(
    axis: str,
    label: str,
    chosen: PlanEstimate,
    evaluated: list[PlanEstimate],
    fitting: list[PlanEstimate],
    dev: float,
    *,
    same: tuple[str, ...] = (),
) -> str:
    """Why ``axis`` is not 1: the best layout without it is slower, too tight, or does not fit. ``same``: the
    axes the comparison keeps at the chosen layout's degrees (the alternatives choose_layout weighed)."""
    value = getattr(chosen, axis)
    if value == 1:
        return f"{axis}=1: the model fits without {label}"
    scope = "".join(f" and {a}={getattr(chosen, a)}" for a in same if getattr(chosen, a) > 1)

    def without(pool: list[PlanEstimate]) -> list[PlanEstimate]:
        return [e for e in pool if getattr(e, axis) == 1 and all(getattr(e, a) == getattr(chosen, a) for a in same)]

    alts = without(fitting)
    roomy = [e for e in alts if e.memory.total <= AUTO_MEMORY_TARGET * e.device_memory_bytes]
    if roomy:
        alt = min(roomy, key=lambda e: e.step_time.total_s)
        return (
            f"{axis}={value}: est. step {chosen.step_time.total_s:.3g} s vs {alt.step_time.total_s:.3g} s "
            f"for the best layout with {axis}=1{scope} ({alt.layout})"
        )
    if alts:
        alt = min(alts, key=lambda e: e.memory.total)
        return (
            f"{axis}={value}: with {axis}=1{scope} the best fit ({alt.layout}) needs "
            f"{gib(alt.memory.total):.1f} of {dev:.1f} GiB/rank, above the "
            f"{AUTO_MEMORY_TARGET:.0%} planning target"
        )
    pool = without(evaluated)
    if not pool:
        return f"{axis}={value}: no valid layout with {axis}=1{scope} within the budget"
    low = min(pool, key=lambda e: e.memory.total)
    if low.fits:  # it fits as sized but not after shrinking to resources.min_dp
        return (
            f"{axis}={value}: layouts with {axis}=1{scope} fit at their size (the smallest, {low.layout}, "
            f"{gib(low.memory.total):.1f} GiB/rank) but not after an elastic shrink to resources.min_dp"
        )
    return (
        f"{axis}={value}: no layout with {axis}=1{scope} fits; the smallest ({low.layout}) needs "
        f"{gib(low.memory.total):.1f} GiB/rank > {dev:.1f} GiB ({_biggest(low)})"
    )


def _cp_reason(chosen: PlanEstimate, case: Case, evaluated: list[PlanEstimate], dev: float) -> str:
    """Why cp > 1 (choose_layout takes the least cp that fits): what the smallest layout without it, and with
    the next smaller cp tried, needs; what a rank holds with it, and what the ring costs."""
    seq_len, cp = case.model.seq_len, chosen.cp
    head = f"cp={cp}: splits each sequence of {seq_len} tokens over {cp} ranks ({seq_len // cp} each)"
    below = [e for e in evaluated if e.cp < cp]
    plain = [e for e in below if e.cp == 1]
    if not plain:
        return f"{head}; no valid layout without context parallelism within the budget"
    low = min(plain, key=lambda e: e.memory.total)
    if low.fits:  # it fits as sized but not after shrinking to resources.min_dp
        why = (
            f"layouts without it fit at their size (the smallest, {low.layout}, {gib(low.memory.total):.1f} GiB/rank) "
            "but not after an elastic shrink to resources.min_dp"
        )
    else:
        why = (
            f"without it the activations of seq_len {seq_len} need {gib(low.memory.activations):.1f} GiB/rank in the "
            f"smallest layout ({low.layout}), {gib(low.memory.total):.1f} GiB in all, above the device's {dev:.1f} GiB"
        )
    tried = sorted({e.cp for e in below if e.cp > 1})
    if tried:
        lesser = min((e for e in below if e.cp == tried[-1]), key=lambda e: e.memory.total)
        why += f"; with cp={tried[-1]} the smallest ({lesser.layout}) needs {gib(lesser.memory.total):.1f} GiB ({_biggest(lesser)})"
    return (
        f"{head}: {why}; now activations {gib(chosen.memory.activations):.1f} GiB and transient "
        f"{gib(chosen.memory.transient):.1f} GiB per rank, and {chosen.step_time.cp_comm_s:.3g} s of ring exchanges "
        "per step"
    )


def _ep_reason(chosen: PlanEstimate, evaluated: list[PlanEstimate], fitting: list[PlanEstimate], dev: float) -> str:
    """Why ep (a mixture of experts): the cost model's pick among the same (cp, pp, tp), or what fits."""
    if chosen.ep > 1:
        reason = _axis_reason("ep", "expert parallelism", chosen, evaluated, fitting, dev, same=("pp", "cp", "tp"))
        return (
            f"{reason}; each of the ep={chosen.ep} ranks of a dp group holds 1/{chosen.ep} of the experts "
            f"(all-to-all {gib(chosen.comm.ep):.2f} GiB/step, {chosen.step_time.ep_comm_s:.3g} s)"
        )
    axes = (chosen.pp, chosen.cp, chosen.tp)
    others = [e for e in fitting if e.ep > 1 and (e.pp, e.cp, e.tp) == axes]
    if others:
        alt = min(others, key=lambda e: e.step_time.total_s)
        return (
            f"ep=1: est. step {chosen.step_time.total_s:.3g} s vs {alt.step_time.total_s:.3g} s for the best "
            f"layout with expert parallelism ({alt.layout})"
        )
    if any(e.ep > 1 and (e.pp, e.cp, e.tp) == axes for e in evaluated):
        return "ep=1: no layout with expert parallelism fits"
    return (
        "ep=1: no valid layout with expert parallelism within the budget (ep divides dp and n_experts; "
        "not with zero=1 nor compiled blocks)"
    )


def explain_choice(
    chosen: PlanEstimate,
    case: Case,
    evaluated: list[PlanEstimate],
    fitting: list[PlanEstimate],
    budget: int,
    dev: float,
) -> list[str]:
    """One reason per decision: the budget, tp, pp, cp (when > 1), ep (a mixture of experts), the schedule,
    ZeRO, sequence parallelism, dp, the total."""
    reasons = [
        f"budget: at most {budget} workers; {len(evaluated)} valid layouts considered, "
        f"{len(fitting)} fit in {dev:.1f} GiB/rank",
        _axis_reason("tp", "tensor parallelism", chosen, evaluated, fitting, dev, same=("pp", "cp")),
        _axis_reason("pp", "pipeline parallelism", chosen, evaluated, fitting, dev, same=("cp",)),
    ]
    if chosen.cp > 1:
        reasons.append(_cp_reason(chosen, case, evaluated, dev))
    if family(case.model.arch).mixture_of_experts:
        reasons.append(_ep_reason(chosen, evaluated, fitting, dev))
    if chosen.pp > 1:
        reasons.append(
            f"pp_schedule={chosen.pp_schedule}"
            f"{f' x{chosen.virtual_stages} virtual stages' if chosen.virtual_stages > 1 else ''}: "
            f"bubble {chosen.bubble_fraction:.1%} with {chosen.microbatches} micro-batches, "
            f"stage {chosen.memory.stage} holds {chosen.in_flight_microbatches:g} in flight"
        )
    over = f"dp={chosen.dp}" if chosen.cp == 1 else f"dp·cp = {chosen.dp}·{chosen.cp}"
    if chosen.zero == 0:
        reasons.append(
            "zero=0: dp=1, nothing to shard"
            if chosen.dp * chosen.cp == 1
            else f"zero=0: replicated optimizer states fit ({gib(chosen.memory.optimizer_states):.1f} GiB/rank)"
        )
    else:
        plain = evaluate(case.replace(layout={"zero": 0}))
        shards = {
            1: "optimizer states",
            2: "optimizer states and gradients",
            3: "optimizer states, gradients and parameters",
        }[chosen.zero]
        if not plain.fits:
            verdict = f"exceeds {dev:.1f} GiB"
        elif plain.memory.total > AUTO_MEMORY_TARGET * plain.device_memory_bytes:
            verdict = f"leaves under {1 - AUTO_MEMORY_TARGET:.0%} of {dev:.1f} GiB free"
        else:
            verdict = (
                f"fits, but zero={chosen.zero} is estimated faster ({chosen.step_time.total_s:.4g} s vs "
                f"{plain.step_time.total_s:.4g} s per step)"
            )
        reasons.append(
            f"zero={chosen.zero}: shards {shards} over {over}; at zero=0 optimizer states "
            f"take {gib(plain.memory.optimizer_states):.1f} GiB/rank and the total "
            f"{gib(plain.memory.total):.1f} GiB/rank {verdict}; now {gib(chosen.memory.total):.1f} GiB"
        )
    if chosen.sequence_parallel:
        reasons.append(
            f"sequence_parallel: shards the norms' activations over tp={chosen.tp} at no extra communication volume"
        )
    used = f"{chosen.world_size} of {budget} workers"
    limit = (
        ""
        if chosen.world_size == budget
        else (f" (dp must divide global_batch/micro_batch = {case.global_batch}/{case.micro_batch} and fit the budget)")
    )
    world = (
        f"dp·tp·pp = {chosen.dp}·{chosen.tp}·{chosen.pp}"
        if chosen.cp == 1
        else f"pp·dp·cp·tp = {chosen.pp}·{chosen.dp}·{chosen.cp}·{chosen.tp}"
    )
    reasons.append(f"dp={chosen.dp}: world = {world} uses {used}{limit}")
    st = chosen.step_time
    comm_s = st.tp_comm_s + st.pp_comm_s + st.dp_comm_s + st.ep_comm_s + st.cp_comm_s
    reasons.append(
        f"chosen {chosen.layout}: {gib(chosen.memory.total):.1f} of {dev:.1f} GiB/rank, est. step "
        f"{st.total_s:.3g} s (compute {st.compute_s:.3g}, comm {comm_s:.3g}, "
        f"bubble {chosen.bubble_fraction:.1%})"
    )
    return reasons
