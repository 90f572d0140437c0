"""The layout rules that depend on what a model family declares; the family-free rules are
``etrain.workers.protocol.layout_rules``.

Each rule here asks the family of ``model.arch`` (:func:`etrain.workers.families.family`) and applies its
answer to every family alike: what tensor parallelism splits (``tp_dims``) and the parallel axes a family
refuses (``refused_axes``), whether it has experts for expert parallelism to split
(``mixture_of_experts``) and a ring attention for context parallelism (``context_parallel``). A pipeline's
rules (:func:`pipeline_problems`) and a whole layout's (:func:`layout_problems`) gather these and the
family-free ones. Like those, each returns a list of :class:`~etrain.workers.protocol.layout_rules.Problem`,
raised by :func:`~etrain.workers.protocol.layout_rules.check` in the engine and turned into the spec's 422
problems by the service.

The spec checks and the planner (``service/planning/``) and the engine (``workers/engine/train.py``,
``workers/engine/parallelize.py``, ``workers/engine/pipeline.py``) ask this module. It lives with the families
because it asks them (the families may import the protocol, never the other way round).

Pure (the registry, the family declarations and the protocol's rules): the control plane imports it without
torch or Ray.
"""

from __future__ import annotations

import math

from etrain.workers.families import family, family_names
from etrain.workers.families.base import Sizes
from etrain.workers.protocol.layout_rules import (
    SINGLE_STAGE_SCHEDULES,
    Problem,
    data_parallel_problems,
    degree_problems,
    divisors,
    expert_fsdp_shards,
    is_count,
    layer_problems,
    schedule_problems,
    sequence_parallel_problems,
    tied_embedding_problems,
    world_size,
    zero_problems,
)

__all__ = [
    "cp_problems",
    "ep_problems",
    "family_axis_problems",
    "layout_problems",
    "pipeline_problems",
    "tp_dims",
    "tp_problems",
    "valid_tps",
]


# -- tensor parallelism -------------------------------------------------------------------------


def family_axis_problems(model: Sizes, *, tp: int = 1, pp: int = 1) -> list[Problem]:
    """The parallel axes the model's family cannot run on (its ``refused_axes``: a mixture-of-experts
    family refuses tensor and pipeline parallelism, say), each refused above degree 1 with why."""
    refused = family(model.arch).refused_axes
    problems = []
    for axis, degree, fix in (
        ("tp", tp, "use parallelism.tp=1 and shard with data parallelism instead (parallelism.dp with zero 3)"),
        ("pp", pp, "use parallelism.pp=1 and shard with data parallelism instead (parallelism.dp with zero 3)"),
    ):
        if degree > 1 and axis in refused:
            problems.append(
                Problem(
                    field=f"parallelism.{axis}",
                    message=f"parallelism.{axis}={degree}: model.kind={model.arch!r} does not run with "
                    f"{'tensor' if axis == 'tp' else 'pipeline'} parallelism ({refused[axis]}).",
                    fix=fix,
                )
            )
    return problems


def tp_dims(model: Sizes) -> tuple[tuple[str, int], ...]:
    """The sizes tensor parallelism splits, as the model's family declares them: whole query (and, with
    grouped-query attention, key/value) heads, the MLP width and the vocabulary (embedding and output
    are vocab-parallel); the GPT also splits d_model (its q/k/v/out are d x d)."""
    return family(model.arch).tp_dims(model)


def valid_tps(model: Sizes) -> list[int]:
    """Every tensor-parallel degree that splits all of :func:`tp_dims` evenly: the divisors of their gcd
    (only 1 for a family that refuses tensor parallelism)."""
    if "tp" in family(model.arch).refused_axes:
        return [1]
    return divisors(math.gcd(*(size for _, size in tp_dims(model))))


def tp_problems(model: Sizes, tp: int, *, context: str = "") -> list[Problem]:
    """``tp`` divides every size tensor parallelism splits (one problem per size that it does not).

    ``context`` is appended to each message (the planner adds the world, ``(world = dp·tp·pp = ...)``).
    A family that refuses tensor parallelism gets that one problem instead (:func:`family_axis_problems`).
    """
    refused = family_axis_problems(model, tp=tp)
    if refused:
        return refused
    problems = []
    fix = f"use tp in {valid_tps(model)}"
    dims = dict(tp_dims(model))
    heads_problem = "n_kv_heads" in dims and bool(dims["n_heads"] % tp or dims["n_kv_heads"] % tp)
    if heads_problem:
        problems.append(
            Problem(
                field="parallelism.tp",
                message=f"parallelism.tp={tp} must divide both model.n_heads={model.n_heads} and "
                f"model.n_kv_heads={model.kv_heads}: each rank holds whole query and key/value heads{context}.",
                fix=fix,
            )
        )
    for dim, size in tp_dims(model):
        if heads_problem and dim in ("n_heads", "n_kv_heads"):
            continue
        if size % tp:
            why = " (the output head is column-parallel over the vocabulary)" if dim == "vocab_size" else ""
            problems.append(
                Problem(
                    field="parallelism.tp",
                    message=f"parallelism.tp={tp} does not divide model.{dim}={size}{why}{context}.",
                    fix=fix,
                )
            )
    return problems


# -- pipeline stages ----------------------------------------------------------------------------


def pipeline_problems(
    *,
    n_layers: int,
    tie_embeddings: bool,
    pp: int,
    virtual_stages: int,
    microbatches: int,
    schedule: str,
    model: Sizes | None = None,
) -> list[Problem]:
    """Everything a pipeline needs before it is cut: a family that runs pipelined (``model``, when given),
    equal stages, untied ends, a schedule torch runs."""
    return (
        (family_axis_problems(model, pp=pp) if model is not None else [])
        + layer_problems(n_layers, pp, virtual_stages)
        + tied_embedding_problems(tie_embeddings=tie_embeddings, pp=pp)
        + schedule_problems(pp, virtual_stages, microbatches, schedule)
    )


# -- expert parallelism -------------------------------------------------------------------------


def ep_problems(
    model: Sizes,
    *,
    ep: int,
    dp: int,
    zero: int = 0,
    dp_replicate: int = 1,
    offload: str = "none",
    cp: int = 1,
) -> list[Problem]:
    """Expert parallelism (``parallelism.ep``) the way torchtitan composes it: the ``ep`` ranks are borrowed
    from the data-parallel dimension (world = pp·dp·tp still; each run of ``ep`` consecutive dp ranks
    splits every mixture-of-experts layer's experts, ``n_experts / ep`` each), so ``ep`` divides ``dp`` and
    the number of experts, and only a family with experts has any to split. Under ZeRO-2/3 FSDP2 shards the
    experts too, over the ranks that hold the same ones (``layout_rules.expert_fsdp_shards``: under HSDP
    those of one replica group; with context parallelism their cp ranks too), so CPU offload moves them with
    the dense shards; where it does not (too few such ranks, or too many to split a rank's experts whole), CPU
    offload (an FSDP2 feature that would leave the experts in device memory) is refused. HSDP
    (``dp_replicate``) composes: FSDP2 shards the dense weights over each replica and the experts, outside
    FSDP2, are averaged over the ranks that hold them; so does ZeRO-1, over the dense weights only (its
    step broadcasts each parameter from its owner to every dp rank, and the ep ranks hold different
    experts: they get an AdamW of their own, ``Trainer``). Compiled blocks run it: the exchange runs
    eagerly between the block's graphs (``workers/families/expert_parallel.py``)."""
    if ep == 1:
        return []
    if not is_count(ep):
        return degree_problems(ep=ep)
    problems = []
    if not family(model.arch).mixture_of_experts:
        problems.append(
            Problem(
                field="parallelism.ep",
                message=f"parallelism.ep={ep} splits a mixture of experts' experts over ranks, but "
                f"model.kind={model.arch!r} is a dense model (it has no experts).",
                fix="use parallelism.ep=1 (the default), or a mixture-of-experts model (model.kind "
                + " or ".join(name for name in family_names() if family(name).mixture_of_experts)
                + ")",
            )
        )
        return problems
    if model.n_experts % ep:
        problems.append(
            Problem(
                field="parallelism.ep",
                message=f"parallelism.ep={ep} does not divide model.n_experts={model.n_experts} (each of the ep "
                "ranks holds n_experts / ep whole experts).",
                fix=f"use ep in {[e for e in divisors(model.n_experts) if is_count(dp) and dp % e == 0][:24]}",
            )
        )
    if is_count(dp) and dp % ep:
        problems.append(
            Problem(
                field="parallelism.ep",
                message=f"parallelism.ep={ep} does not divide parallelism.dp={dp}: expert parallelism borrows its "
                "ranks from the data-parallel dimension (each group of ep consecutive dp ranks splits the experts).",
                fix=f"use a dp that is a multiple of {ep} (e.g. {ep * max(1, dp // ep)}), or ep in "
                f"{[e for e in divisors(dp) if model.n_experts % e == 0][:24]}",
            )
        )
    if (
        offload != "none"
        and not problems
        and not expert_fsdp_shards(
            n_experts=model.n_experts, zero=zero, dp=dp, ep=ep, dp_replicate=dp_replicate, cp=cp, offload=offload
        )
    ):
        holders = dp // ep * cp
        problems.append(
            Problem(
                field="parallelism.ep",
                message=f"parallelism.ep={ep} with parallelism.offload={offload!r} needs FSDP2 to shard the experts "
                "(it offloads only what it shards), which it does under ZeRO-2/3 where the ranks holding the same "
                f"experts (dp / ep · cp = {holders}, or under HSDP those of one replica group, at least two) "
                f"divide a rank's n_experts / ep = {model.n_experts // ep} experts; here (zero={zero}, "
                f"dp_replicate={dp_replicate}, cp={cp}) the experts would stay in device memory.",
                fix="use parallelism.zero 2 or 3 and a dp whose dp / ep · cp (per replica group under HSDP) "
                "divides n_experts / ep, or offload='none'",
            )
        )
    return problems


# -- a whole layout -----------------------------------------------------------------------------


def layout_problems(
    model: Sizes,
    *,
    dp: int,
    tp: int,
    pp: int,
    zero: int = 0,
    pp_schedule: str = "1f1b",
    virtual_stages: int = 1,
    sequence_parallel: bool = False,
    dp_replicate: int = 1,
    offload: str = "none",
    microbatches: int = 1,
    microbatch_source: str | None = None,
    max_dp: int | None = None,
    ep: int = 1,
    cp: int = 1,
) -> list[Problem]:
    """Every structural rule of a layout (not the batch: :func:`~etrain.workers.protocol.layout_rules.batch_problems`; not memory: the planner).

    In order: degrees (alone, when any is broken), tensor parallelism, sequence parallelism, the axes
    the family refuses (pipeline stages), tied embeddings, the layer split, the schedule (only with pp > 1, or when a virtual stage or the
    interleaved schedule asks for a pipeline), HSDP / offload, ZeRO at dp=1 (``max_dp``: the
    elastic ceiling; default ``dp``), expert parallelism (``ep``: :func:`ep_problems`) and context
    parallelism (``cp``: :func:`cp_problems`).
    """
    problems = degree_problems(dp=dp, tp=tp, pp=pp, virtual_stages=virtual_stages, ep=ep, cp=cp)
    if problems:
        return problems
    context = f" (world = dp·tp·pp = {dp}·{tp}·{pp} = {world_size(pp=pp, dp=dp, tp=tp)})"
    problems += tp_problems(model, tp, context=context)
    problems += sequence_parallel_problems(seq_len=model.seq_len, tp=tp, enabled=sequence_parallel, cp=cp)
    problems += family_axis_problems(model, pp=pp)
    problems += tied_embedding_problems(tie_embeddings=model.tie_embeddings, pp=pp)
    problems += layer_problems(model.n_layers, pp, virtual_stages, context=context)
    if pp > 1 or virtual_stages != 1 or pp_schedule not in SINGLE_STAGE_SCHEDULES:
        problems += schedule_problems(pp, virtual_stages, microbatches, pp_schedule, source=microbatch_source)
    # context parallelism is one more data dimension for the parameters: FSDP2 / ZeRO over dp·cp ranks
    problems += data_parallel_problems(dp=dp * cp, zero=zero, dp_replicate=dp_replicate, offload=offload)
    problems += zero_problems(zero=zero, dp=dp * cp, max_dp=(dp if max_dp is None else max_dp) * cp)
    problems += ep_problems(model, ep=ep, dp=dp, zero=zero, dp_replicate=dp_replicate, offload=offload, cp=cp)
    problems += cp_problems(model, cp=cp, tp=tp, pp=pp, ep=ep, zero=zero, dp_replicate=dp_replicate)
    return problems


# -- context parallelism ------------------------------------------------------------------------


def cp_problems(
    model: Sizes,
    *,
    cp: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    zero: int = 0,
    dp_replicate: int = 1,
) -> list[Problem]:
    """Context parallelism (``parallelism.cp``): every sequence is cut into ``2·cp`` equal chunks and rank
    ``i`` of a cp group holds chunks ``i`` and ``2·cp − 1 − i`` (the causal load balance of torch's
    ``context_parallel`` and Megatron), attention runs as a ring over the cp ranks
    (``etrain.workers.families.ring_attention``). So ``2·cp`` divides ``model.seq_len``, and only a family
    whose attention has the ring (``ModelFamily.context_parallel``: every family here) runs it.
    Tensor parallelism composes (each tp rank runs the ring over its own heads; with sequence parallelism
    tp divides ``seq_len / cp``: :func:`~etrain.workers.protocol.layout_rules.sequence_parallel_problems`), and so does pipeline parallelism (the
    stages pass a cp rank's chunks on); ZeRO-1 shards the optimizer state over ``dp · cp``, FSDP2 the model,
    HSDP over each replica's ``dp_shard · cp`` ranks; a compiled block holds the ring as one op inside its
    graph. Expert parallelism composes too: an ep group is dp ranks of one cp index (the expert mesh is
    ``(pp, edp, ep, cp, tp)``), the expert gradients are averaged over ``edp · cp``, and a mixture of experts
    sums its routing statistics over cp. Selective activation checkpointing keeps the ring's output and
    log-sum-exp (the ring is one operator to it). ``tp``, ``pp``, ``ep``, ``zero`` and ``dp_replicate`` are
    accepted for the callers' symmetry."""
    if cp == 1:
        return []
    if not is_count(cp):
        return degree_problems(cp=cp)
    problems = []
    arch = family(model.arch)
    if not arch.context_parallel:
        supported = sorted(name for name in family_names() if family(name).context_parallel)
        problems.append(
            Problem(
                field="parallelism.cp",
                message=f"parallelism.cp={cp}: model.kind={model.arch!r} has no ring attention (context parallelism "
                f"runs on the families {supported}).",
                fix=f"use parallelism.cp=1 (the default) with model.kind={model.arch!r}, or a model of kind {supported}",
            )
        )
        return problems
    if model.seq_len % (2 * cp):
        good = divisors(model.seq_len // 2)[:24] if model.seq_len % 2 == 0 else [1]
        problems.append(
            Problem(
                field="parallelism.cp",
                message=f"parallelism.cp={cp} needs model.seq_len divisible by 2·cp = {2 * cp}, but seq_len is "
                f"{model.seq_len} (each cp rank holds two of 2·cp equal chunks of every sequence, balancing the "
                "causal mask's work).",
                fix=f"use cp in {good}, or a seq_len that is a multiple of {2 * cp}",
            )
        )
    return problems
