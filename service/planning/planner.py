"""The planner's entry points: check a layout, choose one, and answer ``POST /v1/plan``.

:func:`check_plan` says every reason a spec's layout cannot run (the layout rules of
``etrain.workers.protocol.layout_rules`` and ``etrain.workers.families.layout``, and memory,
``plan_problems.py``); :func:`resolve_auto` chooses a
layout for ``parallelism: auto`` (the search is ``plan_search.py``, the estimates ``estimate.py``);
:func:`plan_report` is check_spec and the planner in one answer. Pure (no torch, no Ray).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading

from etrain.service.decisions.job_policy import collectives_fail_on_peer_loss
from etrain.service.errors import SpecRejected
from etrain.service.planning.estimate import (
    Case,
    PlanEstimate,
    case_for,
    estimate,
    evaluate,
    require_bounds,
)
from etrain.service.planning.plan_host import HostMemory, host_memory, host_memory_gb, snapshot_copies
from etrain.service.planning.plan_memory import gib
from etrain.service.planning.plan_problems import (
    degree_problems,
    device_memory_problems,
    layout_problems,
    memory_problem,
)
from etrain.service.planning.plan_search import (
    AUTO_MEMORY_TARGET,
    MAX_AUTO_LAYOUTS,
    AutoPlan,
    candidate_groups,
    choose_layout,
    context_parallel_sizes,
    explain_choice,
    fits_after_shrink,
    frugal_layout,
    worker_budget,
)
from etrain.service.planning.spec import JobSpec, ParallelismSpec, SpecProblem
from etrain.service.planning.spec_checks import check_spec, field_problems
from etrain.workers.protocol.memory_resume import snapshots_are_read

__all__ = [
    "check_plan",
    "host_plan",
    "plan_report",
    "resolve_auto",
    "resolve_host_memory",
    "resolve_loss_chunk",
    "worker_init",
]

#: How much lower a planner worker process's CPU priority is than the API's (``os.nice``).
PLANNER_NICENESS = 10


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
        return (None if spec.is_auto else degree_problems(spec.layout)) or bounds
    memory_problems = device_memory_problems(spec, available_gb)
    if spec.is_auto:
        try:
            resolve_auto(spec, available_gb=available_gb)
        except SpecRejected as rejected:
            return memory_problems + list(rejected.problems)
        return memory_problems
    case = case_for(spec, spec.layout, available_gb)
    problems = memory_problems + layout_problems(case, max_dp=spec.max_dp)
    if degree_problems(case.layout):
        return problems
    est = evaluate(case)
    if not est.fits:
        problems.append(memory_problem(case, est))
    host_problem = _host_memory_problem(spec, available_gb)
    if host_problem is not None:
        problems.append(host_problem)
    if est.fits and spec.min_dp < case.layout.dp:
        shrunk = case.replace(layout={"dp": spec.min_dp, "microbatches": None})
        low = evaluate(shrunk)
        if not low.fits:
            problems.append(
                memory_problem(
                    shrunk,
                    low,
                    field="resources.min_dp",
                    context=f"after an elastic shrink to resources.min_dp={spec.min_dp}: ",
                )
            )
    return problems


def host_plan(spec: JobSpec, *, available_gb: float | None = None) -> HostMemory:
    """The host memory one rank of the spec's explicit layout holds (``plan_host.py``): the most of it at the
    layout's dp and at ``resources.min_dp``, where ZeRO shards the state over fewer ranks."""
    case = case_for(spec, spec.layout, available_gb)
    cases = [case]
    if spec.min_dp < case.layout.dp:
        cases.append(case.replace(layout={"dp": spec.min_dp, "microbatches": None}))
    figures = []
    for each in cases:
        layout = each.layout
        copies = snapshot_copies(
            read=snapshots_are_read(
                in_place=spec.fault_tolerance.in_place,
                repairs_in_place=collectives_fail_on_peer_loss(spec.resources.device),
                resizable=spec.min_dp < spec.max_dp,
            ),
            dp=layout.dp,
            zero=layout.zero,
            dp_replicate=layout.dp_replicate,
            ep=layout.ep,
            cp=layout.cp,
            may_grow=spec.max_dp > layout.dp,
        )
        figures.append(
            host_memory(
                evaluate(each).memory,
                device=spec.resources.device,
                async_checkpoints=spec.async_checkpoints,
                snapshots=copies,
            )
        )
    return max(figures, key=lambda host: host.total)


def resolve_host_memory(spec: JobSpec, *, available_gb: float | None = None) -> JobSpec:
    """``resources.host_memory_gb`` left out: the planner's figure (:func:`host_plan`), so the stored spec says
    what Ray reserves for each rank and a supervisor recreated later reserves the same. A value the job gives
    is kept (:func:`check_plan` refused one below the figure)."""
    if spec.resources.host_memory_gb is not None or spec.is_auto:
        return spec
    figure = host_memory_gb(host_plan(spec, available_gb=available_gb).total)
    return spec.model_copy(update={"resources": spec.resources.model_copy(update={"host_memory_gb": figure})})


def _host_memory_problem(spec: JobSpec, available_gb: float | None) -> SpecProblem | None:
    """A ``resources.host_memory_gb`` the job gives below what each rank holds: Ray would place ranks on nodes
    whose RAM cannot hold them."""
    asked = spec.resources.host_memory_gb
    if asked is None:
        return None
    host = host_plan(spec, available_gb=available_gb)
    needed = host_memory_gb(host.total)
    if asked >= needed:
        return None
    parts = host.to_dict()["gib"]
    shown = ", ".join(
        f"{name.replace('_', ' ')} {value:.2f}" for name, value in parts.items() if name != "total" and value
    )
    return SpecProblem(
        field="resources.host_memory_gb",
        message=f"each rank holds {needed:g} GiB of host memory ({shown}), more than resources.host_memory_gb={asked:g}.",
        fix=f"raise resources.host_memory_gb to at least {needed:g}, or leave it out (the planner's figure)",
    )


def offloaded_fit(evaluated: list[tuple[Case, PlanEstimate]], min_dp: int | None) -> PlanEstimate | None:
    """Where nothing fits: the layout among those searched that, with ``parallelism.offload: cpu`` (FSDP2's
    offload of the parameters, gradients and AdamW states to host memory, ZeRO-2/3 on a GPU), fits in the least
    device memory; None where none would. The search itself leaves offload out (a step then waits on host
    memory and PCIe): this is what the refusal's fix offers instead, with its numbers."""
    best = None
    for case, _ in evaluated:
        if case.device != "cuda" or case.layout.zero < 2 or case.layout.offload != "none":
            continue
        variant = case.replace(layout={"offload": "cpu"})
        if layout_problems(variant, max_dp=variant.layout.dp):
            continue  # e.g. experts FSDP2 leaves whole (layout_rules.expert_fsdp_shards)
        est = evaluate(variant)
        if est.fits and fits_after_shrink(variant, min_dp) and (best is None or est.memory.total < best.memory.total):
            best = est
    return best


def resolve_auto(spec: JobSpec, *, available_gb: float | None = None) -> AutoPlan:
    """Choose a layout for ``parallelism: auto`` within the worker budget.

    Enumerates pp·dp·cp·tp <= budget over divisors (:func:`candidate_groups`; tp <= 8: one node), every ZeRO
    stage (dp·cp > 1), the schedules of ``AUTO_SCHEDULES`` that torch runs for pp > 1, sequence
    parallelism for tp > 1, and expert parallelism for a mixture of experts, fewest stages first; stops at
    the first pp that has a layout within AUTO_MEMORY_TARGET (no deeper pipeline can win) or after
    MAX_AUTO_LAYOUTS layouts; drops layouts that break a layout rule or do not fit the device memory (also at
    ``resources.min_dp``). Only when the whole search without context parallelism found nothing that fits
    (not stopped by the cap) does it go on to cp > 1 (:func:`context_parallel_sizes`, least first, stopping
    after the first cp with a fit, within the same MAX_AUTO_LAYOUTS), where each (cp, pp, tp) group is
    searched only when its :func:`frugal_layout` fits. Picks by :func:`choose_layout` over the ``StepTime``
    cost model. Raises :class:`SpecRejected` when nothing fits.
    """
    require_bounds(spec)
    budget = worker_budget(spec)
    base = case_for(spec, ParallelismSpec(), available_gb)
    min_dp = spec.resources.min_dp
    evaluated: list[tuple[Case, PlanEstimate]] = []
    fitting: list[PlanEstimate] = []
    capped = False
    cps = context_parallel_sizes(spec, base, budget)

    def consider(case: Case) -> tuple[PlanEstimate | None, bool]:
        """(its estimate, whether it fits) for a layout the rules allow, recorded; (None, False) for another."""
        if layout_problems(case, max_dp=case.layout.dp):
            return None, False
        est = evaluate(case)
        evaluated.append((case, est))
        fits = est.fits and fits_after_shrink(case, min_dp)
        if fits:
            fitting.append(est)
        return est, fits

    for cp in cps:
        if fitting or capped:
            break  # a layout with less cp fits (more cp is never chosen: choose_layout), or the search ran out
        level, roomy_at_level = None, False
        for group in candidate_groups(spec, base, budget, cp=cp):
            if group[0].layout.pp != level:
                if roomy_at_level:
                    break  # a roomy layout with fewer stages exists: deeper pipelines can never be chosen (choose_layout)
                level = group[0].layout.pp
            if cp > 1 and len(group) > 1:  # first the group's most frugal layout: when it does not fit, nothing does
                if len(evaluated) >= MAX_AUTO_LAYOUTS:
                    capped = True
                    break
                probe = frugal_layout(group)
                est, fits = consider(probe)
                if est is not None and not fits:
                    continue
                group = [case for case in group if case is not probe]
                roomy_at_level = (
                    roomy_at_level or fits and est.memory.total <= AUTO_MEMORY_TARGET * est.device_memory_bytes
                )
            for case in group:
                if len(evaluated) >= MAX_AUTO_LAYOUTS:
                    capped = True
                    break
                est, fits = consider(case)
                roomy_at_level = (
                    roomy_at_level or fits and est.memory.total <= AUTO_MEMORY_TARGET * est.device_memory_bytes
                )
            else:
                continue
            break  # the cap
    dev = gib(base.device_memory_bytes)
    if not fitting:
        if evaluated:
            smallest = min((est for _, est in evaluated), key=lambda e: e.memory.total)
            detail = (
                f"the smallest, {smallest.layout}, needs {gib(smallest.memory.total):.1f} GiB/rank "
                f"({smallest.memory.biggest.replace('_', ' ')} "
                f"{gib(getattr(smallest.memory, smallest.memory.biggest)):.1f} GiB)"
            )
            if capped:
                detail += f"; the search stopped after {MAX_AUTO_LAYOUTS} layouts"
        else:
            detail = "no layout satisfies the divisibility and batch rules"
        offloaded = None if capped else offloaded_fit(evaluated, min_dp)
        raise SpecRejected(
            [
                SpecProblem(
                    field="parallelism.max_workers",
                    message=f"no layout of at most {budget} workers fits in {dev:.1f} GiB/rank: {detail}.",
                    fix=(
                        "give an explicit layout (parallelism: {dp, tp, pp, zero}), which POST /v1/plan checks, or "
                        "fewer choices (lower max_workers, a global_batch with fewer divisors)"
                        if capped
                        else "raise max_workers, enable training.activation_checkpointing, lower training.micro_batch, "
                        "or use a device with more memory (resources.device_memory_gb)"
                        + (
                            ""
                            if offloaded is None
                            else f"; or set parallelism.offload: cpu (auto searches without it: host memory is "
                            f"slower), where {offloaded.layout} needs {gib(offloaded.memory.total):.1f} "
                            f"GiB/rank on the device and {gib(offloaded.memory.host_bytes):.1f} GiB/rank of host memory"
                        )
                    ),
                )
            ]
        )
    chosen = choose_layout(fitting)
    case = next(c for c, e in evaluated if e is chosen)
    reasons = explain_choice(chosen, case, [e for _, e in evaluated], fitting, budget, dev)
    return AutoPlan(
        layout=case.layout,
        estimate=chosen,
        reasons=reasons,
        candidates_considered=len(evaluated),
        candidates_fitting=len(fitting),
        max_workers=budget,
    )


def resolve_loss_chunk(spec: JobSpec, *, available_gb: float | None = None) -> JobSpec:
    """``training.loss_chunk_tokens: auto`` decided for the spec's explicit layout: ``0`` (whole logits)
    where the plan with whole logits fits within :data:`AUTO_MEMORY_TARGET` of each rank's memory, at
    the layout's dp and at ``resources.min_dp``; else ``auto`` stays (chunks of ~512 MiB of logits,
    ``layout_rules.auto_loss_chunk_tokens``). Any other value is the user's and is returned as given.

    Why not always chunk: on an H100 (Llama-3.2-1B shapes, micro-batch 4 × 2048 tokens, compiled
    blocks) the chunked loss saved 9.7 GiB of a 43.2 GiB peak but made the step 18% slower (0.363 s
    vs 0.307 s, ``benchmarks/results/gpu_throughput.json``): memory that is not short is not worth
    a fifth of the throughput.
    """
    if spec.training.loss_chunk_tokens != "auto" or spec.is_auto:
        return spec
    whole = spec.model_copy(update={"training": spec.training.model_copy(update={"loss_chunk_tokens": 0})})
    case = case_for(whole, whole.layout, available_gb)
    if degree_problems(case.layout) or layout_problems(case, max_dp=whole.max_dp):
        return spec
    cases = [case]
    if whole.min_dp < case.layout.dp:
        cases.append(case.replace(layout={"dp": whole.min_dp, "microbatches": None}))
    for each in cases:
        est = evaluate(each)
        if est.memory.total > AUTO_MEMORY_TARGET * est.device_memory_bytes:
            return spec
    return whole


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
        return {
            "feasible": False,
            "problems": [p.to_dict() for p in problems],
            "layout": None,
            "estimate": None,
            "auto": None,
            "loss_chunk_tokens": spec.training.loss_chunk_tokens,
            "host_memory": None,
        }
    resolved = spec
    if spec.is_auto:
        problems += device_memory_problems(spec, available_gb)
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
    if not problems:  # loss_chunk_tokens: auto decided as the job would run it (the manager's validate)
        decided = resolve_loss_chunk(resolved, available_gb=available_gb)
        if decided is not resolved:
            resolved, est = decided, _safe_estimate(decided, available_gb)
    # what Ray reserves for each rank (resources.host_memory_gb, as the manager's validate sets it)
    host = host_plan(resolved, available_gb=available_gb) if est is not None and not resolved.is_auto else None
    return {
        "feasible": not problems,
        "problems": [p.to_dict() for p in problems],
        "layout": est.layout if est else None,
        "estimate": est.to_dict() if est else None,
        "auto": auto.to_dict() if auto else None,
        "loss_chunk_tokens": resolved.training.loss_chunk_tokens,
        "host_memory": None
        if host is None
        else {**host.to_dict(), "reserved_gib": resolved.resources.host_memory_gb or host_memory_gb(host.total)},
    }


def _safe_estimate(spec: JobSpec, available_gb: float | None = None) -> PlanEstimate | None:
    return None if degree_problems(spec.layout) else estimate(spec, available_gb=available_gb)


def worker_init() -> None:
    """Initializer of a planner worker process (``etrain.service.manager.PlannerProcesses``). The worker runs
    at a lower CPU priority (nice +10) than the API it serves, so a flood of plans takes the cores the API
    leaves idle, not the API's own; and it ends when the process that started it does, however that one
    ended (a SIGKILL runs no clean-up). Here, not in the manager's module, so a worker imports the planner
    and nothing else (no Ray). Ctrl-C at a terminal signals the whole foreground process group: the worker
    ignores it (its parent stops it, or the watch below ends it), so ``make run`` interrupted prints one
    line, not a worker's KeyboardInterrupt traceback, and a pool is not broken under the API by a SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(PLANNER_NICENESS)
    except OSError:  # not allowed here: plans then share the cores evenly with the API
        pass
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="etrain-planner-parent", daemon=True).start()
