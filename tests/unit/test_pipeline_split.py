"""How the pipeline cuts the model: layer splits, stage placement, schedule rules, stage FQNs.

Pure tests (no process group): the stage modules are built with ``stage_module``, the same function
``build_pipeline`` uses, and the schedule rules (``etrain.workers.protocol.layout_rules``) are checked against
the torch schedule classes themselves, constructed over stand-in stages: what they accept, and how
many micro-batches the planner says a stage holds at its peak.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from etrain.service.planning.plan_activations import layer_chunks_in_flight
from etrain.workers.engine.init import build_model
from etrain.workers.engine.pipeline import StepTiming, stage_module
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.layout_rules import PIPELINE_SCHEDULES, schedule_problems, split_layers, stage_ids_for_rank
from etrain.workers.protocol.run_config import ModelConfig

CONFIG = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=16)


# -- split_layers ---------------------------------------------------------------------------------


def test_split_layers_gives_contiguous_equal_runs() -> None:
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(12, 4) == [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert split_layers(5, 1) == [range(0, 5)]


@pytest.mark.parametrize("n_layers, num_stages", [(n, s) for n in range(1, 25) for s in range(1, 9) if n % s == 0])
def test_split_layers_partitions_every_layer_once(n_layers: int, num_stages: int) -> None:
    runs = split_layers(n_layers, num_stages)
    assert len(runs) == num_stages
    assert [i for run in runs for i in run] == list(range(n_layers))
    assert {len(run) for run in runs} == {n_layers // num_stages}


def test_split_layers_rejects_an_uneven_split_naming_the_settings() -> None:
    with pytest.raises(ConfigError) as info:
        split_layers(6, 4)
    error = info.value
    assert error.field == "parallelism.pp"
    assert "model.n_layers=6" in error.message
    assert "pp·virtual_stages = 4·1 = 4" in error.message
    assert "multiple of 4" in error.fix and "use pp in [1, 2, 3, 6]" in error.fix


def test_split_layers_rejects_zero_stages() -> None:
    with pytest.raises(ConfigError, match="must be an integer >= 1, got 0"):
        split_layers(4, 0)


# -- stage_ids_for_rank -----------------------------------------------------------------------------


def test_one_stage_per_rank_for_gpipe_and_1f1b() -> None:
    for schedule in ("gpipe", "1f1b"):
        assert [stage_ids_for_rank(r, 4, 1, schedule) for r in range(4)] == [(0,), (1,), (2,), (3,)]


def test_interleaved_stages_are_loop_style() -> None:
    assert [stage_ids_for_rank(r, 2, 2, "interleaved_1f1b") for r in range(2)] == [(0, 2), (1, 3)]
    assert stage_ids_for_rank(1, 4, 3, "interleaved_1f1b") == (1, 5, 9)


@pytest.mark.parametrize("pp, virtual_stages", list(itertools.product(range(1, 9), range(2, 5))))
def test_interleaved_stage_placement_equals_torchs_loop_mapping(pp: int, virtual_stages: int) -> None:
    num_stages = pp * virtual_stages
    torch_mapping = generate_stage_to_rank_mapping(pp, num_stages, style="loop")
    ours = {
        stage: rank for rank in range(pp) for stage in stage_ids_for_rank(rank, pp, virtual_stages, "interleaved_1f1b")
    }
    assert ours == torch_mapping


def test_stage_ids_reject_a_rank_outside_the_pipeline() -> None:
    with pytest.raises(ValueError, match="pp_rank=2 is out of range for pp=2"):
        stage_ids_for_rank(2, 2, 1, "1f1b")


# -- schedule_problems -------------------------------------------------------------------------------


def _stage(index: int, rank: int, pp: int, virtual_stages: int) -> SimpleNamespace:
    """A stand-in for a PipelineStage: what the schedule classes read when they plan (no process group)."""
    num_stages = pp * virtual_stages
    return SimpleNamespace(
        stage_index=index,
        num_stages=num_stages,
        group_size=pp,
        group_rank=rank,
        is_first=index == 0,
        is_last=index == num_stages - 1,
    )


def _interleaved(pp: int, virtual_stages: int, n_microbatches: int, rank: int) -> ScheduleInterleaved1F1B:
    stages = [_stage(v * pp + rank, rank, pp, virtual_stages) for v in range(virtual_stages)]
    return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=lambda output, target: output)


def _torch_accepts(pp: int, virtual_stages: int, n_microbatches: int, schedule: str) -> bool:
    """Whether the torch schedule class constructs for every rank (stand-in stages, no process group)."""
    try:
        for rank in range(pp):
            if schedule == "interleaved_1f1b":
                _interleaved(pp, virtual_stages, n_microbatches, rank)
            else:
                cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
                cls(_stage(rank, rank, pp, virtual_stages), n_microbatches, loss_fn=lambda output, target: output)
    except ValueError:
        return False
    return True


def _we_accept(pp: int, virtual_stages: int, n_microbatches: int, schedule: str) -> bool:
    return not schedule_problems(pp, virtual_stages, n_microbatches, schedule)


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_schedule_problems_accept_exactly_what_torch_runs(schedule: str) -> None:
    virtual = (1,) if schedule != "interleaved_1f1b" else (2, 3)
    for pp, v, m in itertools.product(range(2, 6), virtual, range(1, 17)):
        assert _we_accept(pp, v, m, schedule) == _torch_accepts(pp, v, m, schedule), (schedule, pp, v, m)


@pytest.mark.parametrize(
    "pp, virtual_stages, n_microbatches, schedule, field, message, fix",
    [
        (2, 2, 4, "gpipe", "parallelism.virtual_stages", "virtual_stages=2 needs an interleaved", "virtual_stages=1"),
        (2, 2, 4, "1f1b", "parallelism.virtual_stages", "runs one stage per rank", "'interleaved_1f1b'"),
        (
            2,
            1,
            4,
            "interleaved_1f1b",
            "parallelism.virtual_stages",
            "needs parallelism.virtual_stages >= 2",
            "virtual_stages=2",
        ),
        (4, 1, 3, "1f1b", "parallelism.microbatches", "at least parallelism.pp=4 micro-batches", "'gpipe'"),
        (
            4,
            2,
            9,
            "interleaved_1f1b",
            "parallelism.microbatches",
            "not a multiple of 2",
            "multiple of parallelism.pp=4",
        ),
        (2, 1, 0, "gpipe", "parallelism.microbatches", "must be an integer >= 1, got 0", "training.global_batch"),
        (2, 1, 4, "zb", "parallelism.pp_schedule", "'zb' is not a known", "gpipe, 1f1b, interleaved_1f1b"),
    ],
)
def test_schedule_problems_name_the_setting_and_the_fix(
    pp, virtual_stages, n_microbatches, schedule, field, message, fix
) -> None:
    problems = schedule_problems(pp, virtual_stages, n_microbatches, schedule)
    assert [p.field for p in problems] == [field]
    assert message in problems[0].message
    assert fix in problems[0].fix


def test_schedule_problems_accept_the_usual_layouts() -> None:
    assert schedule_problems(2, 1, 1, "gpipe") == []
    assert schedule_problems(4, 1, 4, "1f1b") == []
    assert schedule_problems(4, 2, 8, "interleaved_1f1b") == []
    assert schedule_problems(4, 2, 10, "interleaved_1f1b") == []  # torch's flexible rounds: 2 rounds of 5
    assert schedule_problems(4, 2, 3, "interleaved_1f1b") == []  # fewer micro-batches than ranks: one round
    assert schedule_problems(2, 2, 3, "interleaved_1f1b") == []  # the equivalence tests train this one


def _torch_peak_chunks(pp: int, virtual_stages: int, n_microbatches: int, rank: int) -> int:
    """The most (chunk, micro-batch) forwards whose backward has not run yet, on ``rank``, in the order
    torch's ScheduleInterleaved1F1B computes (its ``pipeline_order``, built over stand-in stages)."""
    held = peak = 0
    for action in _interleaved(pp, virtual_stages, n_microbatches, rank).pipeline_order[rank]:
        if action is None:
            continue
        kind = action.computation_type.value  # "F" forward, "B" full backward (the only kinds it plans)
        held += {"F": 1, "B": -1}[kind]
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_the_planners_interleaved_activations_are_torchs_peak(pp: int) -> None:
    """``layer_chunks_in_flight`` (the planner's activation count) equals what torch's interleaved
    schedule keeps alive at its peak, for every stage, including micro-batch counts that are not a
    multiple of pp (torch's flexible rounds), which the planner now accepts."""
    for v, m in itertools.product((2, 3), range(1, 13)):
        if schedule_problems(pp, v, m, "interleaved_1f1b"):
            continue
        for rank in range(pp):
            ours = layer_chunks_in_flight("interleaved_1f1b", pp=pp, microbatches=m, virtual_stages=v, stage=rank)
            assert ours == _torch_peak_chunks(pp, v, m, rank), (pp, v, m, rank)


# -- stage modules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_stage_parameters_are_a_partition_of_the_full_models_under_the_same_names(num_stages: int) -> None:
    full = build_model(CONFIG, seed=3)
    full_params = dict(full.named_parameters())
    seen: dict[str, torch.Tensor] = {}
    for index in range(num_stages):
        stage = dict(stage_module(full, index, num_stages).named_parameters())
        assert stage.keys() <= full_params.keys()
        assert not stage.keys() & seen.keys(), f"stage {index} repeats {sorted(stage.keys() & seen.keys())}"
        seen.update(stage)
    assert seen.keys() == full_params.keys()
    for name, param in seen.items():
        assert torch.equal(param, full_params[name]), name
        assert param.data_ptr() != full_params[name].data_ptr(), f"{name} shares storage with the full model"


def test_stage_modules_own_their_layers_embeddings_and_head() -> None:
    full = build_model(CONFIG, seed=3)
    first, middle, last = (stage_module(full, index, 4) for index in (0, 1, 3))
    assert list(first.layers.keys()) == ["0"]
    assert list(middle.layers.keys()) == ["1"]
    assert list(last.layers.keys()) == ["3"]
    assert first.tok_embeddings is not None and first.pos_embeddings is not None
    assert first.norm is None and first.output is None
    assert middle.tok_embeddings is None and middle.norm is None and middle.output is None
    assert last.tok_embeddings is None and last.norm is not None and last.output is not None
    assert sorted(name for name, _ in last.named_parameters())[:2] == [
        "layers.3.attention.wk.bias",
        "layers.3.attention.wk.weight",
    ]
    assert list(full.layers.keys()) == ["0", "1", "2", "3"] and full.norm is not None  # untouched


def test_stages_chained_compute_the_full_models_logits() -> None:
    full = build_model(CONFIG, seed=3)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len), generator=torch.Generator().manual_seed(0))
    hidden = tokens
    for index in range(4):
        hidden = stage_module(full, index, 4)(hidden)
    torch.testing.assert_close(hidden, full(tokens), rtol=0, atol=0)


def test_stage_module_rejects_a_stage_outside_the_pipeline() -> None:
    with pytest.raises(ValueError, match="stage_index=2 is out of range for 2 stages"):
        stage_module(build_model(CONFIG, seed=3), 2, 2)


# -- step timing ------------------------------------------------------------------------------------


def test_step_timing_splits_a_step_into_busy_and_waiting() -> None:
    timing = StepTiming(step_s=2.0, forward_s=0.5, backward_s=1.0)
    assert timing.busy_s == 1.5
    assert timing.wait_s == 0.5
    assert timing.idle_fraction == pytest.approx(0.25)
    assert StepTiming(step_s=0.0, forward_s=0.0, backward_s=0.0).idle_fraction == 0.0
