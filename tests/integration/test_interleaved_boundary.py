"""Interleaved 1F1B at the edge of its rule, on the real engine: the planner accepts what trains, and
what it refuses, torch itself refuses.

The rule (``etrain.workers.protocol.layout_rules.schedule_problems``) is torch 2.13's own: the interleaved
schedule runs ``max(1, M // pp)`` rounds, so M must be a multiple of the round count. Any M below
``2·pp`` is a single round: pp=2 with 3 micro-batches (``pp2-interleaved_1f1b-v2-M3`` in
test_pipeline_equivalence.py) and with 1 (here) train exactly like one process. pp=2 with 5 is two
rounds of 2 plus one left over: ``ScheduleInterleaved1F1B`` raises, and the rule names the setting
before any rank gets that far. The planner used to demand M divisible by pp and refused M=3, which
the engine trains; now the spec, the planner and the engine ask the same module.
"""

from __future__ import annotations

import dataclasses

import torch

import tests.integration.test_pipeline_equivalence as equivalence
from etrain.service.planning.planner import check_plan
from etrain.service.planning.spec import JobSpec
from etrain.service.planning.spec_checks import check_spec
from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.run_config import ParallelConfig, RunConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import TINY_GPT, assert_equivalent, reference_key, run_layout, run_reference, small_config

INTERLEAVED = ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2)


def _spec(config: RunConfig) -> JobSpec:
    """The job spec that runs ``config``: its model sizes, batch and layout."""
    model, parallel, training = config.model, config.parallel, config.training
    sizes = {name: getattr(model, name) for name in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len")}
    if model.arch == "llama":
        sizes.update(kind="llama", n_kv_heads=model.kv_heads, d_ff=model.ffn_dim)
    layout = {
        name: getattr(parallel, name)
        for name in ("dp", "tp", "pp", "zero", "pp_schedule", "virtual_stages", "sequence_parallel")
    }
    return JobSpec.model_validate(
        {
            "name": "boundary",
            "model": sizes,
            "parallelism": layout,
            "training": {
                "steps": training.steps,
                "global_batch": training.global_batch,
                "micro_batch": training.micro_batch,
            },
        }
    )


def test_the_planner_accepts_every_pipeline_layout_the_engine_trains() -> None:
    """Each layout test_pipeline_equivalence.py trains (and matches to one process) is a valid spec."""
    configs = {
        **equivalence.ALL_LAYOUTS,
        **{
            f"llama {name}": dataclasses.replace(equivalence.ALL_LAYOUTS[name], model=equivalence.TINY_LLAMA)
            for name in equivalence.LLAMA_LAYOUTS
        },
    }
    assert "pp2-interleaved_1f1b-v2-M3" in configs
    for name, config in configs.items():
        spec = _spec(config)
        assert check_spec(spec) == [], name
        assert check_plan(spec) == [], name


def test_one_micro_batch_on_two_interleaved_ranks_trains_like_one_process() -> None:
    """M=1 < pp=2: one round of one; stage 0 runs both of its chunks before any backward."""
    config = small_config(steps=4, global_batch=2, micro_batch=2, parallel=INTERLEAVED)
    assert config.grad_accum_steps == 1
    assert layout_rules.schedule_problems(2, 2, 1, "interleaved_1f1b") == []
    assert check_plan(_spec(config)) == []
    reference = run_reference(reference_key(config))
    assert_equivalent(reference, run_layout(config, timeout_s=120.0), layout="pp2 interleaved v2 M=1")


def _build_with(rank: int, world_size: int, counts: tuple[int, ...]) -> dict[int, tuple[str | None, tuple | None]]:
    """On each rank, for each micro-batch count: torch's own schedule over real stages (its error, if
    any), then the engine's build_pipeline (the field and message it refuses with, if any)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    from etrain.workers.engine.init import build_model
    from etrain.workers.engine.pipeline import build_pipeline, stage_module
    from etrain.workers.families.model import cross_entropy_loss

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    model = build_model(TINY_GPT, seed=0)
    num_stages = world_size * 2
    stages = [
        PipelineStage(
            stage_module(model, index, num_stages), index, num_stages, torch.device("cpu"), group=mesh.get_group()
        )
        for index in layout_rules.stage_ids_for_rank(rank, world_size, 2, "interleaved_1f1b")
    ]
    answers = {}
    for n_microbatches in counts:
        torch_error = ours = None
        try:
            ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=cross_entropy_loss, scale_grads=False)
        except ValueError as exc:
            torch_error = str(exc)
        try:
            build_pipeline(
                model,
                pp_mesh=mesh,
                pp_rank=rank,
                parallel=INTERLEAVED,
                n_microbatches=n_microbatches,
                loss_fn=cross_entropy_loss,
                device="cpu",
            )
        except ConfigError as exc:
            ours = (exc.field, exc.message)
        answers[n_microbatches] = (torch_error, ours)
    return answers


def test_what_the_rule_refuses_torch_refuses_and_what_it_accepts_torch_builds() -> None:
    for answers in run_distributed(_build_with, 2, (3, 5), timeout_s=120.0):
        assert answers[3] == (None, None)  # one round of 3: torch builds it, and so does the engine
        torch_error, ours = answers[5]
        assert torch_error is not None and "multiple of the number of rounds (2), but got 5" in torch_error
        assert ours is not None and ours[0] == "parallelism.microbatches"
        assert "rounds of max(1, microbatches // pp) = 2" in ours[1] and "5 micro-batches" in ours[1]
