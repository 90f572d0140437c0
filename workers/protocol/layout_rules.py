"""Every rule a parallel layout must satisfy that needs no model family, written once (over 500 lines because
one home for them all is the point).

The spec validation (``service/planning/spec_checks.py``), the planner (``service/planning/``), the
elastic policy (``service/decisions/elastic.py``) and the engine (``workers/engine/pipeline.py``,
``workers/engine/parallelize.py``, ``workers/engine/mesh.py``, ``workers/engine/data.py``, the run config) all ask this
module, so a layout the service accepts is exactly a layout the engine runs, and a message never
says one thing at submit time and another inside a rank.

Why problems, not exceptions: the service answers one 422 listing every problem at once, the engine
stops at the first. So each rule returns a list of :class:`Problem` (the dotted spec field, the
message with the numbers, the fix); :func:`check` raises the first as a
:class:`~etrain.workers.protocol.errors.ConfigError` (or another ``EtrainError`` subclass), and the
service turns them into its ``SpecProblem``.

What is here: the degrees (each an integer >= 1) and the world they make (``pp·dp·tp``); the sequence
under sequence parallelism; how a pipeline splits the layers and which stages a pipeline rank holds; the
batch arithmetic (``global_batch = dp · micro_batch · micro-batches``); what each pipeline schedule
runs (exactly torch's own checks, see :func:`schedule_problems`); the FSDP2 features (HSDP, CPU
offload); and the data-parallel sizes an elastic job may run at. Where ranks sit on the mesh (the
rank order) is :class:`etrain.workers.protocol.topology.Topology`'s, which takes its degree rule and world
size from here.

The rules that depend on what a model family declares (what tensor parallelism splits, the axes a family
refuses, expert and context parallelism, a whole layout: ``layout_problems``) are
``etrain.workers.families.layout``, which builds on the rules here: the protocol never asks a family.

Pure standard library (plus the error family): the control plane imports it without torch or Ray.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from etrain.workers.protocol.errors import ConfigError, EtrainError

__all__ = [
    "LOSS_CHUNK_BYTES",
    "PIPELINE_SCHEDULES",
    "SINGLE_STAGE_SCHEDULES",
    "Problem",
    "auto_loss_chunk_tokens",
    "loss_chunk_tokens",
    "float8_problems",
    "batch_problems",
    "check",
    "data_parallel_problems",
    "degree_problems",
    "divisors",
    "dp_multiple",
    "dp_range_problems",
    "dp_replicate_problems",
    "grad_accum_steps",
    "interleaved_rounds",
    "is_count",
    "is_legal_dp",
    "layer_problems",
    "legal_dp_sizes",
    "micro_batch_count",
    "micro_batch_count_problems",
    "schedule_problems",
    "sequence_parallel_problems",
    "split_layers",
    "stage_ids_for_rank",
    "tied_embedding_problems",
    "uses_fsdp",
    "expert_fsdp_shards",
    "world_size",
    "world_size_problems",
    "zero_problems",
]

#: The schedules the engine runs. The single-stage ones hold one stage per pipeline rank; the
#: interleaved one holds ``virtual_stages`` (loop style: see :func:`stage_ids_for_rank`).
SINGLE_STAGE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
PIPELINE_SCHEDULES: tuple[str, ...] = (*SINGLE_STAGE_SCHEDULES, "interleaved_1f1b")

_DEGREE_NAMES = {
    "pp": "pipeline-parallel degree",
    "dp": "data-parallel degree",
    "ep": "expert-parallel degree",
    "cp": "context-parallel degree",
    "tp": "tensor-parallel degree",
    "virtual_stages": "pipeline stages per rank",
    "microbatches": "pipeline micro-batches per step",
}
_DEGREE_FIXES = {
    "microbatches": "omit parallelism.microbatches (it is derived as global_batch / (dp * micro_batch)), or "
    "raise training.global_batch to at least parallelism.dp * training.micro_batch",
}


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One reason a layout cannot run: the dotted spec field, what is wrong (with the numbers), the fix."""

    field: str
    message: str
    fix: str | None = None


def check(problems: Iterable[Problem], error: type[EtrainError] = ConfigError) -> None:
    """Raise the first problem as ``error(message, field=, fix=)``; nothing when there is none."""
    for problem in problems:
        raise error(problem.message, field=problem.field, fix=problem.fix)


# -- arithmetic ---------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n`` (>= 1), ascending, in O(sqrt(n)) steps.

    Every degree divides something (pp the layers, tp the heads, dp the micro-batches), so the
    searches over layouts enumerate divisors instead of ranges.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"divisors() needs an integer >= 1, got {n!r}")
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def is_count(value: object) -> bool:
    """An integer >= 1 (a degree, a count of ranks or micro-batches)."""
    # bool is an int subclass, but `dp=True` is a bug, not a degree of 1.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# -- degrees and the world ----------------------------------------------------------------------


def degree_problems(**degrees: object) -> list[Problem]:
    """Each given degree (``pp``, ``dp``, ``tp``, ``virtual_stages``, ``microbatches``) is an integer >= 1.

    Nothing else about a layout is computable until this holds, so callers stop at these problems.
    """
    return [
        Problem(
            field=f"parallelism.{name}",
            message=f"{name} (the {_DEGREE_NAMES[name]}) must be an integer >= 1, got {value!r}",
            fix=_DEGREE_FIXES.get(name, f"set parallelism.{name} to an integer >= 1"),
        )
        for name, value in degrees.items()
        if not is_count(value)
    ]


def world_size(*, pp: int, dp: int, tp: int, cp: int = 1) -> int:
    """Ranks of a ``pp × dp × cp × tp`` layout: one rank per (pipeline stage, replica, sequence slice,
    tensor shard)."""
    return pp * dp * cp * tp


def world_size_problems(*, pp: int, dp: int, tp: int, world: int, cp: int = 1) -> list[Problem]:
    """The degrees multiply to the number of ranks there are (the message prints every degree)."""
    product = world_size(pp=pp, dp=dp, tp=tp, cp=cp)
    if product == world:
        return []
    cp_text = f" × cp={cp}" if cp != 1 else ""
    return [
        Problem(
            field="parallelism",
            message=f"parallel layout pp={pp} × dp={dp}{cp_text} × tp={tp} = {product} ranks, but the world size "
            f"is {world}.",
            fix=f"choose degrees whose product is {world}",
        )
    ]


# -- sequence parallelism -----------------------------------------------------------------------


def sequence_parallel_problems(*, seq_len: int, tp: int, enabled: bool, cp: int = 1) -> list[Problem]:
    """Sequence parallelism shards the norms' activations along the sequence over the tp ranks (under
    context parallelism, a cp rank's ``seq_len / cp`` tokens)."""
    if not enabled:
        return []
    if tp == 1:
        return [
            Problem(
                field="parallelism.sequence_parallel",
                message="parallelism.sequence_parallel=true needs tp > 1, got tp=1.",
                fix="set tp >= 2 or sequence_parallel=false",
            )
        ]
    if seq_len % tp:
        return [
            Problem(
                field="parallelism.sequence_parallel",
                message=f"sequence parallelism shards the sequence: model.seq_len={seq_len} is not "
                f"divisible by parallelism.tp={tp}.",
                fix=f"use a seq_len that is a multiple of {tp}, or sequence_parallel=false",
            )
        ]
    if cp > 1 and seq_len % cp == 0 and (seq_len // cp) % tp:
        return [
            Problem(
                field="parallelism.sequence_parallel",
                message=f"sequence parallelism shards each cp rank's tokens: model.seq_len / parallelism.cp = "
                f"{seq_len} / {cp} = {seq_len // cp} is not divisible by parallelism.tp={tp}.",
                fix=f"use a seq_len that is a multiple of {cp * tp} (and of 2·cp), or sequence_parallel=false",
            )
        ]
    return []


# -- pipeline stages ----------------------------------------------------------------------------


def layer_problems(n_layers: int, pp: int, virtual_stages: int = 1, *, context: str = "") -> list[Problem]:
    """The layers split into ``pp · virtual_stages`` equal runs (equal stages keep the pipeline
    balanced, which the bubble formula assumes, so an uneven split is an error, not a best effort)."""
    problems = degree_problems(pp=pp, virtual_stages=virtual_stages)
    if problems:
        return problems
    chunks = pp * virtual_stages
    if n_layers % chunks == 0:
        return []
    field = "parallelism.virtual_stages" if virtual_stages > 1 and n_layers % pp == 0 else "parallelism.pp"
    valid_pp = [p for p in divisors(n_layers) if n_layers % (p * virtual_stages) == 0]
    return [
        Problem(
            field=field,
            message=f"model.n_layers={n_layers} is not divisible by pp·virtual_stages = {pp}·{virtual_stages} = "
            f"{chunks}{context}.",
            fix=f"use pp in {valid_pp[:12]} (with virtual_stages={virtual_stages}), or a model.n_layers that is a "
            f"multiple of {chunks}",
        )
    ]


def split_layers(n_layers: int, num_stages: int) -> list[range]:
    """Contiguous, equal runs of global layer indices, one per stage (stage ``s`` gets ``result[s]``)."""
    check(layer_problems(n_layers, num_stages))
    per_stage = n_layers // num_stages
    return [range(s * per_stage, (s + 1) * per_stage) for s in range(num_stages)]


def tied_embedding_problems(*, tie_embeddings: bool, pp: int) -> list[Problem]:
    """A tied model's input embedding (first stage) and output head (last stage) are one weight."""
    if not (tie_embeddings and pp > 1):
        return []
    return [
        Problem(
            field="parallelism.pp",
            message=f"parallelism.pp={pp} would cut the model into stages, but a model with tied input and output "
            "embeddings cannot be cut into pipeline stages (tie_embeddings: the embedding and the output "
            "head are one weight, which cannot live on two stages).",
            fix="use parallelism.pp=1 (shard with parallelism.zero 3 or parallelism.tp instead), or a model with "
            "untied embeddings",
        )
    ]


def _schedule_name_problems(schedule: str) -> list[Problem]:
    if schedule in PIPELINE_SCHEDULES:
        return []
    return [
        Problem(
            field="parallelism.pp_schedule",
            message=f"parallelism.pp_schedule={schedule!r} is not a known pipeline schedule.",
            fix=f"use one of {', '.join(PIPELINE_SCHEDULES)}",
        )
    ]


def stage_ids_for_rank(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> tuple[int, ...]:
    """The global stage indices that pipeline rank ``pp_rank`` runs, in execution order.

    Loop style (what torch's interleaved schedules expect): rank ``r`` holds stages
    ``r, r + pp, r + 2*pp, ...``, so activations travel round the ring ``virtual_stages`` times.
    """
    check(_schedule_name_problems(schedule))
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} is out of range for pp={pp}")
    if schedule in SINGLE_STAGE_SCHEDULES:
        return (pp_rank,)
    return tuple(v * pp + pp_rank for v in range(virtual_stages))


def interleaved_rounds(pp: int, microbatches: int) -> tuple[int, int]:
    """(rounds, micro-batches per round) of torch's interleaved 1F1B: ``max(1, M // pp)`` rounds of
    ``M // rounds`` (the "flexible" schedule: M need not be a multiple of pp)."""
    rounds = max(1, microbatches // pp)
    return rounds, microbatches // rounds


def schedule_problems(
    pp: int, virtual_stages: int, microbatches: int, schedule: str, *, source: str | None = None
) -> list[Problem]:
    """What the torch schedule classes accept, checked before any rank builds one.

    Exactly torch 2.13's own constructor checks (``torch/distributed/pipelining/schedules.py``), so a
    layout fails at submit time with the setting named, never inside a rank, and nothing torch runs
    is refused:

    * GPipe: any ``M >= 1`` (with ``M < pp`` some stages idle longer; the planner's bubble says so).
    * 1F1B: ``M >= pp`` (``Schedule1F1B`` raises below that).
    * both run one stage per rank: ``virtual_stages == 1``.
    * Interleaved 1F1B needs ``pp >= 2`` and ``virtual_stages >= 2`` (one stage per rank is plain
      1F1B), and runs ``max(1, M // pp)`` rounds, so ``M`` must be a multiple of the round count
      (``ScheduleInterleaved1F1B`` raises otherwise). Any ``M < 2·pp`` is one round and runs: pp=2
      with 3 micro-batches trains exactly like one process (tests/integration/test_pipeline_equivalence.py,
      test_interleaved_boundary.py); pp=2 with 5 is two rounds and torch refuses it.

    ``source`` says where ``M`` came from, for the message (default: the derived count).
    """
    problems = _schedule_name_problems(schedule) + degree_problems(
        pp=pp, virtual_stages=virtual_stages, microbatches=microbatches
    )
    if problems:
        return problems
    m, v = microbatches, virtual_stages
    got = source or f"{m} micro-batches (= global_batch / (dp * micro_batch))"
    if schedule in SINGLE_STAGE_SCHEDULES:
        if v != 1:
            problems.append(
                Problem(
                    field="parallelism.virtual_stages",
                    message=f"parallelism.virtual_stages={v} needs an interleaved schedule, but "
                    f"parallelism.pp_schedule={schedule!r} runs one stage per rank.",
                    fix="set parallelism.virtual_stages=1, or parallelism.pp_schedule='interleaved_1f1b' (with pp >= 2)",
                )
            )
        if schedule == "1f1b" and m < pp:
            problems.append(
                Problem(
                    field="parallelism.microbatches",
                    message=f"parallelism.pp_schedule='1f1b' needs at least parallelism.pp={pp} micro-batches per "
                    f"step to fill the pipeline, got {got}.",
                    fix=f"raise training.global_batch or lower training.micro_batch (or dp) so that there are >= {pp} "
                    "micro-batches, or use parallelism.pp_schedule='gpipe'",
                )
            )
        return problems
    if pp < 2:
        problems.append(
            Problem(
                field="parallelism.pp_schedule",
                message=f"parallelism.pp_schedule={schedule!r} needs parallelism.pp >= 2, got pp={pp}.",
                fix="use pp >= 2 or pp_schedule='1f1b'",
            )
        )
    if v < 2:
        problems.append(
            Problem(
                field="parallelism.virtual_stages",
                message=f"parallelism.pp_schedule={schedule!r} needs parallelism.virtual_stages >= 2, got {v}.",
                fix="set parallelism.virtual_stages=2 (or more), or use parallelism.pp_schedule='1f1b'",
            )
        )
    rounds, _ = interleaved_rounds(pp, m)
    if m % rounds:
        problems.append(
            Problem(
                field="parallelism.microbatches",
                message=f"parallelism.pp_schedule={schedule!r} runs micro-batches in rounds of max(1, microbatches // pp) "
                f"= {rounds}, and {got} is not a multiple of {rounds}.",
                fix=f"use a number of micro-batches that is a multiple of parallelism.pp={pp} (e.g. {rounds * pp}), or "
                f"fewer than {2 * pp}",
            )
        )
    return problems


# -- the batch ----------------------------------------------------------------------------------


def _accumulates_whole(global_batch: int, micro_batch: int, dp: int) -> bool:
    """``global_batch = dp · micro_batch · M`` for a whole number of micro-batches M per replica."""
    return global_batch % micro_batch == 0 and (global_batch // micro_batch) % dp == 0


def batch_problems(*, global_batch: int, micro_batch: int, dp: int, microbatches: int | None = None) -> list[Problem]:
    """``global_batch`` splits into ``dp`` replicas of whole micro-batches; an explicit
    ``parallelism.microbatches`` equals the derived count ``global_batch / (dp · micro_batch)``."""
    for field, value in (
        ("training.global_batch", global_batch),
        ("training.micro_batch", micro_batch),
        ("parallelism.dp", dp),
    ):
        if not is_count(value):
            return [
                Problem(
                    field=field, message=f"{field}={value!r} must be an integer >= 1.", fix=f"set {field} to at least 1"
                )
            ]
    per_step = dp * micro_batch
    if not _accumulates_whole(global_batch, micro_batch, dp):
        return [
            Problem(
                field="training.global_batch",
                message=f"training.global_batch={global_batch} is not divisible by parallelism.dp * training.micro_batch "
                f"= {dp} * {micro_batch} = {per_step}.",
                fix=f"use a multiple of {per_step} (e.g. {per_step * max(1, global_batch // per_step)}), or change "
                "dp/micro_batch",
            )
        ]
    derived = global_batch // per_step
    if microbatches is not None and microbatches != derived:
        return [
            Problem(
                field="parallelism.microbatches",
                message=f"parallelism.microbatches={microbatches} but global_batch / (dp * micro_batch) = "
                f"{global_batch} / ({dp} * {micro_batch}) = {derived}.",
                fix=f"omit parallelism.microbatches or set it to {derived}",
            )
        ]
    return []


#: ``training.loss_chunk_tokens: auto`` sizes a chunk of the output projection + loss so that its fp32
#: logits on one rank take about this much memory (Llama-3 vocabulary, tp=1: 1,024 tokens).
LOSS_CHUNK_BYTES = 512 * 2**20
#: Chunks are whole multiples of this many tokens (matmul-friendly shapes).
_LOSS_CHUNK_ALIGN = 256


def loss_chunk_tokens(setting: int | str, *, tokens: int, vocab_size: int, tp: int = 1) -> int:
    """``training.loss_chunk_tokens`` as the engine runs it: a number as given, ``auto`` resolved by
    :func:`auto_loss_chunk_tokens` for a micro-batch of ``tokens`` on ``tp`` ranks."""
    if setting == "auto":
        return auto_loss_chunk_tokens(tokens=tokens, vocab_size=vocab_size, tp=tp)
    return int(setting)


def auto_loss_chunk_tokens(*, tokens: int, vocab_size: int, tp: int = 1) -> int:
    """Tokens per chunk of the output projection + loss under ``auto``; 0 (whole) when one micro-batch's
    fp32 logits (``tokens × vocab / tp × 4`` bytes) already fit in :data:`LOSS_CHUNK_BYTES`.

    Why a byte budget: the logits are the largest activation of a large-vocabulary model (8,192 tokens of
    Llama-3's 128,256-token vocabulary are 4.2 GB in fp32, and the loss's backward holds two more such
    buffers), while chunks of ~1k tokens still give the output matmul full-size tiles.
    """
    per_token = 4 * vocab_size / max(1, tp)
    if tokens * per_token <= LOSS_CHUNK_BYTES:
        return 0
    chunk = int(LOSS_CHUNK_BYTES // per_token) // _LOSS_CHUNK_ALIGN * _LOSS_CHUNK_ALIGN
    return max(_LOSS_CHUNK_ALIGN, chunk)


def float8_problems(
    *, device: str, precision: str, tp: int, sequence_parallel: bool = False, emulate: bool = False
) -> list[Problem]:
    """``training.float8``: float8 matmuls need a GPU with float8 tensor cores (compute capability 8.9+,
    checked again by the rank on its device) and bf16 for everything float8 does not cover. Tensor
    parallelism composes (torchao's float8 column-/row-wise styles, ``parallelize.apply_tp``); sequence
    parallelism beside it does not yet: its all-gathers would carry float8 tensors, which gloo refuses
    and which are not proven on NCCL here. ``emulate``: the engine's CPU emulation (tests), which runs
    anywhere."""
    problems = []
    if device != "cuda" and not emulate:
        problems.append(
            Problem(
                field="training.float8",
                message=f"training.float8 needs a GPU with float8 tensor cores (H100-class); resources.device is {device!r}.",
                fix="set training.float8: false, or run on resources.device: cuda with H100/H200/L40S-class GPUs",
            )
        )
    if precision != "bf16":
        problems.append(
            Problem(
                field="training.float8",
                message=f"training.float8 computes the rest in bf16; training.precision is {precision!r}.",
                fix="set training.precision: bf16",
            )
        )
    if tp > 1 and sequence_parallel:
        problems.append(
            Problem(
                field="training.float8",
                message=f"training.float8 does not compose with sequence parallelism yet (parallelism.tp={tp}, "
                "sequence_parallel: true).",
                fix="set parallelism.sequence_parallel: false (float8 runs with tp), or float8: false",
            )
        )
    return problems


def grad_accum_steps(global_batch: int, micro_batch: int, dp: int) -> int:
    """Micro-batches each replica runs per optimizer step: ``global_batch / (dp · micro_batch)``
    (raises :class:`ConfigError` when that is not whole). Under pipeline parallelism these are the
    pipeline's micro-batches. Elastic resizing changes dp and this absorbs it, so the global batch
    (and the loss the optimizer sees) is the same at every size."""
    check(batch_problems(global_batch=global_batch, micro_batch=micro_batch, dp=dp))
    return global_batch // (dp * micro_batch)


# -- data parallelism: FSDP2 features -----------------------------------------------------------


def uses_fsdp(zero: int, dp: int) -> bool:
    """Whether the engine shards with FSDP2: ZeRO-2/3 over more than one dp rank."""
    return zero in (2, 3) and dp > 1


def expert_fsdp_shards(
    *,
    n_experts: int,
    zero: int,
    dp: int,
    ep: int,
    dp_replicate: int = 1,
    cp: int = 1,
    offload: str = "none",
) -> int:
    """Over how many ranks FSDP2 shards the experts, beside ep's split of them; 0 where it leaves them out.

    torchtitan's composition: FSDP2 takes an expert weight that is already a DTensor split by expert over ep
    (and with tp by width) and adds its own shard over the ranks that hold the same experts: the
    ``edp = dp / ep`` ranks of an ep index, times the ``cp`` ranks of each (context parallelism splits the
    sequence, not the model, so they hold the same experts too). A rank then holds ``1 / (ep · shards)`` of
    the experts' weights, gradients and AdamW states instead of ``1 / ep``, their gradients are
    reduce-scattered block by block in the backward (overlapped with it) instead of all-reduced after it, and
    CPU offload moves them to host memory with the dense shards.

    * ZeRO-2/3 (FSDP2), and the sharding ranks must divide a rank's ``n_experts / ep`` experts, so that FSDP2
      shards them by expert, each rank a run of whole experts, as every other expert split is.
    * Plain FSDP2: over all ``edp · cp`` ranks, where there are more than one (with one there is nothing to
      shard, and a wrapper would only add a copy of each layer's experts while they compute) or with CPU
      offload.
    * HSDP (``dp_replicate > 1``): as the dense weights, sharded within a replica group (over its
      ``dp / dp_replicate / ep · cp`` ranks holding the same experts) and replicated over the groups; ep must
      divide a replica's dp ranks, and at least two ranks of a group must hold each expert.

    Elsewhere (DDP, ZeRO-1, and the cases above) the experts stay whole over edp and cp, outside DDP, ZeRO-1
    and FSDP2, and their gradients are all-reduced over them after the backward (``reduce_expert_grads``)."""
    if ep < 2 or cp < 1 or not uses_fsdp(zero, dp * cp) or dp % ep or n_experts % ep:
        return 0
    if dp_replicate > 1:
        if dp % dp_replicate or (dp // dp_replicate) % ep:
            return 0
        shards = dp // dp_replicate // ep * cp
        return shards if shards > 1 and (n_experts // ep) % shards == 0 else 0
    shards = dp // ep * cp
    return shards if (shards > 1 or offload != "none") and (n_experts // ep) % shards == 0 else 0


def dp_replicate_problems(dp: int, dp_replicate: int) -> list[Problem]:
    """HSDP splits the dp ranks into ``dp_replicate`` equal replica groups: it must divide ``dp``."""
    if is_count(dp_replicate) and dp % dp_replicate == 0:
        return []
    return [
        Problem(
            field="parallelism.dp_replicate",
            message=f"parallelism.dp_replicate={dp_replicate} does not divide parallelism.dp={dp} (HSDP splits the dp "
            "ranks into dp_replicate equal groups that each shard the model).",
            fix=f"use dp_replicate in {divisors(dp)[:24] if is_count(dp) else [1]} (1 = plain FSDP)",
        )
    ]


def data_parallel_problems(*, dp: int, zero: int, dp_replicate: int = 1, offload: str = "none") -> list[Problem]:
    """HSDP and CPU offload are FSDP2 features: both need ZeRO-2/3 with dp > 1; HSDP's groups divide dp."""
    problems = []
    fsdp_fix = "set parallelism.zero to 2 or 3 (FSDP2) with dp >= 2"
    if dp_replicate != 1:
        problems += dp_replicate_problems(dp, dp_replicate)
        if not uses_fsdp(zero, dp):
            problems.append(
                Problem(
                    field="parallelism.dp_replicate",
                    message=f"parallelism.dp_replicate={dp_replicate} (HSDP) needs FSDP2 inside each replica group, "
                    f"i.e. parallelism.zero 2 or 3 with dp > 1, but parallelism.zero={zero} with "
                    f"parallelism.dp={dp}.",
                    fix=f"{fsdp_fix}, or parallelism.dp_replicate=1 (DDP and ZeRO-1 already replicate over every dp rank)",
                )
            )
    if offload != "none" and not uses_fsdp(zero, dp):
        problems.append(
            Problem(
                field="parallelism.offload",
                message=f"parallelism.offload={offload!r} moves FSDP2's shards to host memory and needs FSDP2 "
                f"(parallelism.zero 2 or 3 with dp > 1), but parallelism.zero={zero} with parallelism.dp={dp}.",
                fix=f"{fsdp_fix}, or offload='none'",
            )
        )
    return problems


def zero_problems(*, zero: int, dp: int, max_dp: int) -> list[Problem]:
    """ZeRO shards across data-parallel ranks: with one rank now and no room to grow it does nothing."""
    if zero > 0 and dp == 1 and max_dp <= 1:
        return [
            Problem(
                field="parallelism.zero",
                message=f"parallelism.zero={zero} shards across data-parallel ranks but dp=1 (and "
                "resources.max_dp allows no more).",
                fix="set zero=0, or dp >= 2 (or resources.max_dp >= 2)",
            )
        ]
    return []


# -- elastic data-parallel sizes ----------------------------------------------------------------


def micro_batch_count_problems(global_batch: int, micro_batch: int) -> list[Problem]:
    """``global_batch / micro_batch`` micro-batches per step, a whole number whatever the dp."""
    if global_batch < 1 or micro_batch < 1:
        return [
            Problem(
                field="training.global_batch" if global_batch < 1 else "training.micro_batch",
                message=f"global_batch={global_batch} and micro_batch={micro_batch} must both be >= 1",
                fix="set training.global_batch and training.micro_batch to at least 1",
            )
        ]
    if global_batch % micro_batch:
        return [
            Problem(
                field="training.global_batch",
                message=f"global_batch={global_batch} is not a multiple of micro_batch={micro_batch}; choose a "
                f"global_batch that is (e.g. {global_batch - global_batch % micro_batch or micro_batch})",
                fix="make training.global_batch a multiple of training.micro_batch",
            )
        ]
    return []


def micro_batch_count(global_batch: int, micro_batch: int) -> int:
    """Micro-batches per optimizer step over all replicas (raises when not whole)."""
    check(micro_batch_count_problems(global_batch, micro_batch))
    return global_batch // micro_batch


def dp_multiple(*, dp_replicate: int = 1, ep: int = 1) -> int:
    """What every dp an elastic job runs at must be a multiple of: HSDP's ``dp_replicate`` (its replica
    groups each shard over ``dp / dp_replicate`` ranks) and expert parallelism's ``ep`` (each run of ``ep``
    dp ranks splits the experts); their least common multiple."""
    return math.lcm(max(1, dp_replicate), max(1, ep))


def dp_range_problems(min_dp: int, max_dp: int, dp_multiple: int = 1) -> list[Problem]:
    """An elastic range ``1 <= min_dp <= max_dp``; ``dp_multiple`` (HSDP's dp_replicate) >= 1."""
    if min_dp < 1:
        return [Problem(field="resources.min_dp", message=f"min_dp={min_dp} must be >= 1", fix="set min_dp >= 1")]
    if max_dp < min_dp:
        return [
            Problem(
                field="resources.max_dp",
                message=f"max_dp={max_dp} must be >= min_dp={min_dp}",
                fix="set max_dp at least min_dp",
            )
        ]
    if dp_multiple < 1:
        return [
            Problem(
                field="parallelism.dp_replicate",
                message=f"dp_multiple={dp_multiple} (dp_replicate) must be >= 1",
                fix="set dp_replicate >= 1",
            )
        ]
    return []


def is_legal_dp(
    dp: int, *, global_batch: int, micro_batch: int, min_dp: int, max_dp: int, dp_multiple: int = 1
) -> bool:
    """A dp an elastic job may run at: in range, a multiple of ``dp_multiple``, and it keeps the
    global batch (it divides the micro-batch count: any other size would change the batch or skip
    and repeat samples)."""
    return (
        is_count(dp)
        and min_dp <= dp <= max_dp
        and dp % dp_multiple == 0
        and _accumulates_whole(global_batch, micro_batch, dp)
    )


def legal_dp_sizes(global_batch: int, micro_batch: int, min_dp: int, max_dp: int, dp_multiple: int = 1) -> list[int]:
    """Every legal dp (:func:`is_legal_dp`), ascending; found among the divisors of the micro-batch
    count (O(sqrt(n))), never by scanning the range, so a huge range or batch costs microseconds.

    Raises :class:`ConfigError` on a batch or range that has no meaning (see the ``*_problems``)."""
    count = micro_batch_count(global_batch, micro_batch)
    check(dp_range_problems(min_dp, max_dp, dp_multiple))
    return [dp for dp in divisors(count) if min_dp <= dp <= max_dp and dp % dp_multiple == 0]
