"""The layout rules (etrain.workers.protocol.layout_rules and, those that ask the model's family,
etrain.workers.families.layout), each against an independent brute-force formulation,
exhaustively over small degree ranges: what the spec, the planner, the elastic policy and the engine
all accept is exactly what these say.

The brute forces state each rule the plain way (search for the whole number, scan the range, test
every divisibility separately) rather than the way the module computes it. The schedule rules are
also checked against torch's own schedule classes (tests/unit/test_pipeline_split.py) and the engine
(tests/integration/test_pipeline_equivalence.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest

from etrain.service.planning.bounds import MAX_GLOBAL_BATCH
from etrain.workers.families import layout as family_rules
from etrain.workers.protocol import layout_rules as rules
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.layout_rules import divisors
from etrain.workers.protocol.run_config import ModelConfig, ParallelConfig, PipelineSchedule, TrainingConfig
from etrain.workers.protocol.topology import Topology, TopologyError

GPT = ModelConfig(n_layers=12, d_model=48, n_heads=6, vocab_size=96, seq_len=18, d_ff=72)
LLAMA = ModelConfig(arch="llama", n_layers=8, d_model=32, n_heads=8, n_kv_heads=2, d_ff=40, vocab_size=64, seq_len=16)
LLAMA_TIED = dataclasses.replace(LLAMA, tie_embeddings=True)


def fields(problems) -> set[str]:
    return {p.field for p in problems}


# -- arithmetic ---------------------------------------------------------------------------------------


def test_divisors_are_every_divisor_ascending():
    for n in range(1, 1500):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    assert divisors(126) == [1, 2, 3, 6, 7, 9, 14, 18, 21, 42, 63, 126]
    assert divisors(2**24) == [2**k for k in range(25)]
    assert len(divisors(14414400)) == 504  # a highly composite batch below MAX_GLOBAL_BATCH


def test_divisors_cost_grows_with_the_square_root():
    started = time.perf_counter()
    assert divisors(MAX_GLOBAL_BATCH)[-1] == MAX_GLOBAL_BATCH  # 4096 trial divisions
    assert divisors(10**12 + 39)[:2] == [1, 10**12 + 39] or len(divisors(10**12 + 39)) >= 2
    assert time.perf_counter() - started < 0.5  # 10**12: one million trial divisions, not 10**12


@pytest.mark.parametrize("bad", [0, -4, 2.0, True])
def test_divisors_refuse_what_has_none(bad):
    with pytest.raises(ValueError, match="integer >= 1"):
        divisors(bad)


# -- degrees and the world ----------------------------------------------------------------------------


def test_degrees_are_integers_of_at_least_one():
    for value in (-2, -1, 0, 1, 2, 7, 1.0, 2.5, "2", None, True, False):
        problems = rules.degree_problems(tp=value)
        good = type(value) is int and value >= 1
        assert (problems == []) == good, value
        if not good:
            assert problems[0].field == "parallelism.tp"
            assert problems[0].message == f"tp (the tensor-parallel degree) must be an integer >= 1, got {value!r}"


def test_world_size_is_the_product_and_the_message_prints_every_degree():
    for pp, dp, tp in itertools.product(range(1, 6), repeat=3):
        ranks = len([(i, j, k) for i in range(pp) for j in range(dp) for k in range(tp)])
        assert rules.world_size(pp=pp, dp=dp, tp=tp) == ranks == Topology(pp=pp, dp=dp, tp=tp).world_size
        assert ParallelConfig(pp=pp, dp=dp, tp=tp).world_size == ranks
        for world in range(1, 40):
            problems = rules.world_size_problems(pp=pp, dp=dp, tp=tp, world=world)
            assert (problems == []) == (ranks == world)
    (problem,) = rules.world_size_problems(pp=2, dp=3, tp=2, world=8)
    assert problem.message == "parallel layout pp=2 × dp=3 × tp=2 = 12 ranks, but the world size is 8."
    assert problem.fix == "choose degrees whose product is 8"


def test_topology_refuses_the_same_degrees_with_the_same_words():
    with pytest.raises(TopologyError) as info:
        Topology(pp=1, dp=0, tp=1)
    (problem,) = rules.degree_problems(dp=0)
    assert (info.value.message, info.value.field, info.value.fix) == (problem.message, problem.field, problem.fix)


# -- tensor and sequence parallelism ------------------------------------------------------------------


def _tp_splits(model: ModelConfig, tp: int) -> bool:
    """Brute force: every sharded weight's rows split into tp equal whole-head / whole-column pieces."""
    widths = [model.n_heads, model.ffn_dim, model.vocab_size]
    widths += [model.kv_heads] if model.arch == "llama" else [model.d_model]
    return all(any(tp * k == width for k in range(1, width + 1)) for width in widths)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_tensor_parallel_degrees_split_every_sharded_size(arch):
    checked = 0
    for heads, kv, d_ff, vocab in itertools.product((1, 2, 3, 4, 6, 8), (1, 2, 3, 4), (8, 12, 18, 24), (16, 24, 30)):
        if arch == "llama" and heads % kv:
            continue
        model = ModelConfig(
            arch=arch,
            n_layers=2,
            d_model=heads * 4,
            n_heads=heads,
            d_ff=d_ff,
            vocab_size=vocab,
            seq_len=8,
            n_kv_heads=kv if arch == "llama" else None,
        )
        valid = [tp for tp in range(1, 13) if _tp_splits(model, tp)]
        assert family_rules.valid_tps(model) == valid, model
        for tp in range(1, 13):
            assert (family_rules.tp_problems(model, tp) == []) == (tp in valid), (model, tp)
            checked += 1
    assert checked > 1000


def test_tensor_parallel_problems_name_each_size_and_the_valid_degrees():
    problems = family_rules.tp_problems(GPT, 4)  # 6 heads, d_model 48, ffn 72, vocab 96
    assert [p.message for p in problems] == ["parallelism.tp=4 does not divide model.n_heads=6."]
    assert problems[0].fix == "use tp in [1, 2, 3, 6]"
    (heads,) = family_rules.tp_problems(LLAMA, 4)  # 8 heads, 2 kv heads: one problem for both
    assert heads.message.startswith("parallelism.tp=4 must divide both model.n_heads=8 and model.n_kv_heads=2")
    assert heads.fix == "use tp in [1, 2]"


def test_sequence_parallelism_splits_the_sequence_over_tp():
    for seq_len, tp, enabled in itertools.product(range(1, 25), range(1, 9), (False, True)):
        ok = not enabled or (tp > 1 and any(tp * k == seq_len for k in range(1, seq_len + 1)))
        problems = rules.sequence_parallel_problems(seq_len=seq_len, tp=tp, enabled=enabled)
        assert (problems == []) == ok, (seq_len, tp, enabled)
        assert fields(problems) <= {"parallelism.sequence_parallel"}


# -- pipeline stages ----------------------------------------------------------------------------------


def test_layers_split_into_equal_stages_exactly_when_the_product_divides_them():
    for n_layers, pp, v in itertools.product(range(1, 25), range(1, 9), range(1, 5)):
        equal = any(pp * v * k == n_layers for k in range(1, n_layers + 1))
        problems = rules.layer_problems(n_layers, pp, v)
        assert (problems == []) == equal, (n_layers, pp, v)
        if not equal:
            expected = "parallelism.virtual_stages" if v > 1 and n_layers % pp == 0 else "parallelism.pp"
            assert fields(problems) == {expected}
            assert f"pp·virtual_stages = {pp}·{v} = {pp * v}" in problems[0].message
        else:
            runs = rules.split_layers(n_layers, pp * v)
            assert [i for run in runs for i in run] == list(range(n_layers))
            assert {len(run) for run in runs} == {n_layers // (pp * v)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_every_stage_is_on_exactly_one_pipeline_rank(schedule):
    for pp, v in itertools.product(range(1, 7), (1,) if schedule != "interleaved_1f1b" else range(2, 5)):
        held = [s for rank in range(pp) for s in rules.stage_ids_for_rank(rank, pp, v, schedule)]
        assert sorted(held) == list(range(pp * v))
        assert all(s % pp == rank for rank in range(pp) for s in rules.stage_ids_for_rank(rank, pp, v, schedule))


def test_a_tied_model_is_never_cut():
    for pp in range(1, 9):
        assert (rules.tied_embedding_problems(tie_embeddings=True, pp=pp) == []) == (pp == 1)
        assert rules.tied_embedding_problems(tie_embeddings=False, pp=pp) == []


def _torch_runs(pp: int, v: int, m: int, schedule: str) -> bool:
    """The torch 2.13 constructors' conditions, written out: GPipe any M; 1F1B M >= stages; interleaved
    at least two local stages, and M whole rounds of M // rounds where rounds = max(1, floor(M / pp))."""
    if m < 1 or schedule not in ("gpipe", "1f1b", "interleaved_1f1b"):
        return False
    if schedule == "gpipe":
        return v == 1
    if schedule == "1f1b":
        return v == 1 and m >= pp
    rounds = max(1, m // pp)
    return pp >= 2 and v >= 2 and any(rounds * k == m for k in range(1, m + 1))


def test_schedules_accept_exactly_what_torch_runs():
    for pp, v, m, schedule in itertools.product(
        range(1, 7), range(1, 5), range(0, 30), ("gpipe", "1f1b", "interleaved_1f1b", "zb")
    ):
        problems = rules.schedule_problems(pp, v, m, schedule)
        assert (problems == []) == _torch_runs(pp, v, m, schedule), (pp, v, m, schedule)


def test_interleaved_rounds_are_torchs():
    assert rules.interleaved_rounds(2, 3) == (1, 3)  # one round of 3: runs (and trains like one process)
    assert rules.interleaved_rounds(2, 5) == (2, 2)  # 5 is not 2 rounds of 2: torch refuses it
    assert rules.interleaved_rounds(4, 10) == (2, 5)
    (problem,) = rules.schedule_problems(2, 2, 5, "interleaved_1f1b")
    assert problem.field == "parallelism.microbatches"
    assert "rounds of max(1, microbatches // pp) = 2" in problem.message and "5 micro-batches" in problem.message
    assert (
        problem.fix == "use a number of micro-batches that is a multiple of parallelism.pp=2 (e.g. 4), or fewer than 4"
    )


def test_pipeline_schedule_names_are_the_run_configs():
    assert rules.PIPELINE_SCHEDULES == PipelineSchedule.__args__


# -- the batch ----------------------------------------------------------------------------------------


def test_the_batch_splits_into_whole_micro_batches_per_replica():
    for gb, mb, dp in itertools.product(range(1, 49), range(1, 7), range(1, 9)):
        whole = [k for k in range(1, gb + 1) if dp * mb * k == gb]
        problems = rules.batch_problems(global_batch=gb, micro_batch=mb, dp=dp)
        assert (problems == []) == bool(whole), (gb, mb, dp)
        if whole:
            assert (
                rules.grad_accum_steps(gb, mb, dp)
                == whole[0]
                == TrainingConfig(steps=1, global_batch=gb, micro_batch=mb).grad_accum_steps(dp)
            )
            assert rules.batch_problems(global_batch=gb, micro_batch=mb, dp=dp, microbatches=whole[0]) == []
            assert fields(rules.batch_problems(global_batch=gb, micro_batch=mb, dp=dp, microbatches=whole[0] + 1)) == {
                "parallelism.microbatches"
            }
        else:
            assert fields(problems) == {"training.global_batch"}
            with pytest.raises(ConfigError, match=f"= {dp} \\* {mb} = {dp * mb}"):
                rules.grad_accum_steps(gb, mb, dp)


def test_the_batch_message_names_the_numbers_and_a_multiple():
    (problem,) = rules.batch_problems(global_batch=10, micro_batch=4, dp=2)
    assert problem.message == (
        "training.global_batch=10 is not divisible by parallelism.dp * training.micro_batch = 2 * 4 = 8."
    )
    assert problem.fix == "use a multiple of 8 (e.g. 8), or change dp/micro_batch"
    assert fields(rules.batch_problems(global_batch=8, micro_batch=0, dp=2)) == {"training.micro_batch"}


# -- data parallelism ---------------------------------------------------------------------------------


def test_fsdp_features_need_fsdp_and_hsdp_groups_divide_dp():
    for dp, zero, replicate, offload in itertools.product(range(1, 9), range(4), range(1, 9), ("none", "cpu")):
        fsdp = zero in (2, 3) and dp >= 2
        expected = set()
        if replicate != 1 and (not any(replicate * k == dp for k in range(1, dp + 1)) or not fsdp):
            expected.add("parallelism.dp_replicate")
        if offload == "cpu" and not fsdp:
            expected.add("parallelism.offload")
        problems = rules.data_parallel_problems(dp=dp, zero=zero, dp_replicate=replicate, offload=offload)
        assert fields(problems) == expected, (dp, zero, replicate, offload)
        assert rules.uses_fsdp(zero, dp) == fsdp


def test_hsdp_message_lists_the_divisors():
    (problem,) = rules.dp_replicate_problems(8, 3)
    assert problem.message.startswith("parallelism.dp_replicate=3 does not divide parallelism.dp=8")
    assert problem.fix == "use dp_replicate in [1, 2, 4, 8] (1 = plain FSDP)"


# -- elastic data-parallel sizes ----------------------------------------------------------------------


def test_legal_dp_sizes_are_the_range_scanned_for_whole_accumulation():
    for gb, mb in itertools.product(range(1, 41), range(1, 5)):
        if gb % mb:
            with pytest.raises(ConfigError, match=f"global_batch={gb} is not a multiple of micro_batch={mb}"):
                rules.legal_dp_sizes(gb, mb, 1, 64)
            continue
        for lo, hi, multiple in itertools.product((1, 2, 3), (3, 8, 64), (1, 2, 3)):
            if hi < lo:
                continue
            scanned = [
                dp
                for dp in range(lo, hi + 1)
                if any(dp * mb * k == gb for k in range(1, gb + 1)) and dp % multiple == 0
            ]
            assert rules.legal_dp_sizes(gb, mb, lo, hi, multiple) == scanned, (gb, mb, lo, hi, multiple)
            for dp in range(0, hi + 2):
                assert rules.is_legal_dp(
                    dp, global_batch=gb, micro_batch=mb, min_dp=lo, max_dp=hi, dp_multiple=multiple
                ) == (dp in scanned)


def test_a_range_must_be_a_range():
    assert fields(rules.dp_range_problems(0, 4)) == {"resources.min_dp"}
    assert fields(rules.dp_range_problems(4, 2)) == {"resources.max_dp"}
    assert fields(rules.dp_range_problems(1, 4, 0)) == {"parallelism.dp_replicate"}
    assert rules.dp_range_problems(2, 2) == []


# -- a whole layout: the sum of its rules, nothing more -------------------------------------------------


def _expected_fields(model: ModelConfig, *, dp, tp, pp, zero, schedule, v, sp, replicate, offload, m, max_dp) -> set:
    """Every rule stated on its own, by the field it names."""
    out = set()
    if not _tp_splits(model, tp):
        out.add("parallelism.tp")
    if sp and (tp == 1 or model.seq_len % tp):
        out.add("parallelism.sequence_parallel")
    if model.tie_embeddings and pp > 1:
        out.add("parallelism.pp")
    if model.n_layers % (pp * v):
        out.add("parallelism.virtual_stages" if v > 1 and model.n_layers % pp == 0 else "parallelism.pp")
    if pp > 1 or v != 1 or schedule == "interleaved_1f1b":
        if schedule == "interleaved_1f1b":
            if pp < 2:
                out.add("parallelism.pp_schedule")
            if v < 2:
                out.add("parallelism.virtual_stages")
            if m % max(1, m // pp):
                out.add("parallelism.microbatches")
        else:
            if v != 1:
                out.add("parallelism.virtual_stages")
            if schedule == "1f1b" and m < pp:
                out.add("parallelism.microbatches")
    fsdp = zero in (2, 3) and dp > 1
    if replicate != 1 and (dp % replicate or not fsdp):
        out.add("parallelism.dp_replicate")
    if offload != "none" and not fsdp:
        out.add("parallelism.offload")
    if zero and dp == 1 and max_dp <= 1:
        out.add("parallelism.zero")
    return out


@pytest.mark.parametrize("model", [GPT, LLAMA, LLAMA_TIED], ids=["gpt", "llama", "llama-tied"])
def test_layout_problems_are_exactly_the_failing_rules(model):
    checked = 0
    for dp, tp, pp, v, schedule, zero in itertools.product(
        (1, 2, 4), (1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3), ("gpipe", "1f1b", "interleaved_1f1b"), range(4)
    ):
        for sp, replicate, offload, m, max_dp in (
            (False, 1, "none", 4, dp),
            (True, 2, "cpu", 3, 8),
            (tp > 1, 1, "none", 1, 1),
            (False, 4, "none", 5, dp),
        ):
            layout = dict(
                dp=dp, tp=tp, pp=pp, zero=zero, v=v, sp=sp, replicate=replicate, offload=offload, m=m, max_dp=max_dp
            )
            problems = family_rules.layout_problems(
                model,
                dp=dp,
                tp=tp,
                pp=pp,
                zero=zero,
                pp_schedule=schedule,
                virtual_stages=v,
                sequence_parallel=sp,
                dp_replicate=replicate,
                offload=offload,
                microbatches=m,
                max_dp=max_dp,
            )
            assert fields(problems) == _expected_fields(model, schedule=schedule, **layout), (schedule, layout)
            checked += 1
    assert checked == 3 * 4 * 4 * 3 * 3 * 4 * 4


def test_broken_degrees_stop_the_layout_rules():
    problems = family_rules.layout_problems(GPT, dp=0, tp=7, pp=5, virtual_stages=0)
    assert [p.field for p in problems] == ["parallelism.dp", "parallelism.virtual_stages"]


# -- FSDP2's shards of the experts ----------------------------------------------------------------


@pytest.mark.parametrize(
    "layout, shards",
    [
        (dict(n_experts=8, zero=3, dp=4, ep=2), 2),  # edp = 2 ranks hold each expert
        (dict(n_experts=8, zero=2, dp=8, ep=2), 4),
        (dict(n_experts=8, zero=3, dp=2, ep=2), 0),  # one rank holds each: nothing to shard
        (dict(n_experts=8, zero=3, dp=2, ep=2, offload="cpu"), 1),  # ... but FSDP2 must hold them to offload
        (dict(n_experts=8, zero=1, dp=4, ep=2), 0),  # ZeRO-1 and DDP leave the experts whole
        (dict(n_experts=8, zero=0, dp=4, ep=2), 0),
        (dict(n_experts=8, zero=3, dp=4, ep=1), 0),  # no expert parallelism: the experts are FSDP2's anyway
        (dict(n_experts=8, zero=3, dp=4, ep=2, cp=2), 4),  # cp ranks hold the same experts: edp·cp = 4
        (dict(n_experts=8, zero=3, dp=2, ep=2, cp=2), 2),  # one edp rank, but two cp ranks hold each expert
        (dict(n_experts=8, zero=3, dp=8, ep=2, cp=4), 0),  # 16 ranks cannot split a rank's 4 experts whole
        (dict(n_experts=8, zero=1, dp=4, ep=2, cp=2), 0),
        (dict(n_experts=8, zero=3, dp=4, ep=2, dp_replicate=2, cp=2), 2),  # HSDP: one edp_shard rank x 2 cp
        (dict(n_experts=6, zero=3, dp=8, ep=2), 0),  # 4 ranks cannot split a rank's 3 experts whole
        (dict(n_experts=8, zero=3, dp=8, ep=2, dp_replicate=2), 2),  # HSDP: within a replica group of 4
        (dict(n_experts=8, zero=3, dp=4, ep=2, dp_replicate=2), 0),  # one rank of a group holds each expert
        (dict(n_experts=8, zero=3, dp=8, ep=4, dp_replicate=4), 0),  # ep does not divide a group's 2 ranks
        (dict(n_experts=8, zero=3, dp=8, ep=2, dp_replicate=3), 0),  # not an HSDP layout
    ],
)
def test_fsdp2_shards_the_experts_over_the_ranks_holding_the_same_ones(layout, shards):
    assert rules.expert_fsdp_shards(**layout) == shards


def test_wherever_fsdp2_shards_the_experts_each_rank_holds_a_run_of_whole_experts():
    for n_experts, zero, dp, ep, dp_replicate, cp, offload in itertools.product(
        (4, 6, 8, 16), (0, 1, 2, 3), (1, 2, 4, 6, 8, 16), (1, 2, 3, 4, 8), (1, 2, 4), (1, 2), ("none", "cpu")
    ):
        shards = rules.expert_fsdp_shards(
            n_experts=n_experts, zero=zero, dp=dp, ep=ep, dp_replicate=dp_replicate, cp=cp, offload=offload
        )
        if not shards:
            continue
        assert zero in (2, 3) and ep > 1 and dp % (ep * dp_replicate) == 0
        # the ranks of one replica group holding the same experts: its edp ranks and their cp ranks
        assert (n_experts // ep) % shards == 0 and shards * ep * dp_replicate == dp * cp
        assert shards > 1 or (offload == "cpu" and dp_replicate == 1)
