"""``workers/protocol/compiled_blocks.py``: how ``training.compile`` compiles a block, for every layout kind and
checkpointing mode, and the planner's activation count following it. Pure (no torch)."""

from __future__ import annotations

import itertools

import pytest

from etrain.workers.protocol.compiled_blocks import COMPILED_BLOCK_FORMS, compiled_block_form, has_eager_regions

MODES = ("none", "selective", "full")


@pytest.mark.parametrize(
    "ep, tp, moe, checkpointing", list(itertools.product((1, 2, 8), (1, 2, 4), (False, True), MODES))
)
def test_every_layout_gets_the_form_its_eager_regions_and_checkpointing_allow(ep, tp, moe, checkpointing):
    form = compiled_block_form(ep=ep, tp=tp, moe=moe, checkpointing=checkpointing)
    assert form in COMPILED_BLOCK_FORMS
    eager_regions = moe and (ep > 1 or tp > 1)  # the exchange, or tensor-parallel experts' collectives
    assert has_eager_regions(ep=ep, tp=tp, moe=moe) is eager_regions
    if not eager_regions:  # a dense model (any tp: DTensor collectives trace), cp included: one graph
        assert form == "whole"
    else:
        assert form == {"none": "split", "full": "split_inside_checkpoint", "selective": "eager"}[checkpointing]


def test_the_planner_counts_a_block_as_it_runs():
    """A mixture of experts at tp=2 (ep=1): compiled in graphs between the experts' collectives, the planner's
    compiled count; under selective checkpointing the block runs eagerly, so its eager count."""
    from etrain.service.planning.plan_memory import stage_memory
    from etrain.workers.families import MODEL_PRESETS
    from etrain.workers.protocol.run_config import ModelConfig

    model = ModelConfig(**MODEL_PRESETS["qwen3-30b-a3b"])
    common = dict(
        stage=0, pp=1, layers=model.n_layers, virtual_stages=1, held=1, dp=4, tp=2, ep=1, zero=3, micro_batch=1,
        microbatches=1, precision="bf16", device="cuda", overhead=0,
    )  # fmt: skip
    for checkpointing in MODES:
        eager = stage_memory(model, **common, checkpointing=checkpointing).activations
        compiled = stage_memory(model, **common, checkpointing=checkpointing, compiled=True).activations
        if checkpointing == "selective":
            assert compiled == eager
        else:
            assert compiled < eager, (checkpointing, compiled, eager)


@pytest.mark.parametrize(
    "parallelism, training, form",
    [
        ({"tp": 2}, {"activation_checkpointing": "selective"}, "eager"),
        ({"tp": 2}, {"activation_checkpointing": "full"}, "split_inside_checkpoint"),
        ({"dp": 2, "ep": 2}, {}, "split"),
        ({"dp": 2}, {"activation_checkpointing": "selective"}, "whole"),
        ({"dp": 2, "ep": 2}, {"compile": False}, None),
    ],
)
def test_the_plan_says_how_the_blocks_compile(parallelism, training, form):
    from etrain.service.planning.estimate import estimate
    from etrain.service.planning.spec import JobSpec

    spec = JobSpec.model_validate(
        {
            "name": "moe",
            "model": {"preset": "qwen3-moe-tiny"},
            "parallelism": parallelism,
            "training": {"steps": 1, "global_batch": 4, "micro_batch": 1, "compile": True, **training},
        }
    )
    report = estimate(spec).to_dict()
    assert report["training"]["compiled_blocks"] == form
