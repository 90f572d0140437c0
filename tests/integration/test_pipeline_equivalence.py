"""Pipeline-parallel training equals one process (correctness invariant 1, PP part).

Each layout trains the built-in GPT (4 layers, d_model 32, 4 heads, vocab 64, seq 16) for 4 steps
through the production path, ``etrain.workers.engine.train.Trainer`` (which calls ``build_pipeline`` when pp > 1),
on real gloo ranks: AdamW in fp32, clipping at a norm that binds, grad accumulation of 4 micro-batches
(2 per dp replica at dp=2). It must match the same Trainer in one process: every step's loss within
1e-5 relative and every final parameter within 1e-4 absolute (``tests/equivalence_utils``).

The untied Llama (``TINY_LLAMA``: GQA, q/k/v biases, q/k norms, SwiGLU, RoPE) runs one layout per
distinct pipeline code path: end stages only, middle stages (interleaved), DDP per stage, FSDP2 per
stage, and its TP plan per stage. A tied Llama cannot be pipelined: ``build_pipeline`` refuses it.

Why micro-batch counts that are not powers of two are covered too: the pipeline backpropagates
``loss / n_microbatches`` per micro-batch, the same float operations as the trainer's gradient
accumulation. Dividing the summed gradients afterwards (torch's ``scale_grads``) is the same
function but rounds differently when n is not a power of two, and AdamW's ``g / (|g| + eps)``
magnifies that ulp into ~3e-4 parameter differences where gradients are ~1e-9 (columns of
GELU-saturated hidden units): it fails the 1e-4 bound at 3 micro-batches with no pipelining at all.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.run_config import ParallelConfig, RunConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import (
    TINY_LLAMA,
    TINY_LLAMA_TIED,
    assert_equivalent,
    reference_key,
    run_layout,
    run_reference,
    small_config,
)

TIMEOUT_S = 240.0


@functools.cache
def _reference(config: RunConfig):
    return run_reference(config)


def _layout(global_batch: int = 8, **parallel) -> RunConfig:
    return small_config(steps=4, global_batch=global_batch, parallel=ParallelConfig(**parallel))


LAYOUTS = {
    "pp2-gpipe": _layout(pp=2, pp_schedule="gpipe"),
    "pp2-1f1b": _layout(pp=2, pp_schedule="1f1b"),
    "pp2-interleaved_1f1b-v2": _layout(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2),
    # 3 micro-batches: fewer than pp * virtual_stages and not a power of two (see the docstring).
    "pp2-interleaved_1f1b-v2-M3": _layout(6, pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2),
    "pp2-1f1b-M3": _layout(6, pp=2, pp_schedule="1f1b"),
}

COMPOSED_LAYOUTS = {  # PP with the engine's per-stage TP / DP (DDP, FSDP2) via stage_transform
    "dp2-pp2-1f1b": _layout(dp=2, pp=2, pp_schedule="1f1b"),
    "tp2-pp2-interleaved_1f1b-v2": _layout(tp=2, pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2),
    "dp2-tp2-pp2-gpipe": _layout(dp=2, tp=2, pp=2, pp_schedule="gpipe"),
}
MORE_COMPOSED_LAYOUTS = {
    "dp2-zero3-pp2-interleaved_1f1b-v2": _layout(dp=2, zero=3, pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2),
    "tp2-sp-pp2-1f1b": _layout(tp=2, sequence_parallel=True, pp=2, pp_schedule="1f1b"),
    "dp2-zero3-tp2-pp2-1f1b": _layout(dp=2, zero=3, tp=2, pp=2, pp_schedule="1f1b"),
}


#: Layouts the Llama runs too, one per pipeline code path it could break (see the module docstring).
LLAMA_LAYOUTS = (
    "pp2-1f1b",  # first and last stages: embeddings on one, norm + output on the other
    "pp2-interleaved_1f1b-v2",  # stages that own neither end (no embeddings, no output)
    "dp2-pp2-1f1b",  # DDP on each stage
    "tp2-pp2-interleaved_1f1b-v2",  # the Llama TP plan (w3, kv heads, head-sharded q/k norms) per stage
    "dp2-zero3-pp2-interleaved_1f1b-v2",  # FSDP2 on each stage
)
ALL_LAYOUTS = {**LAYOUTS, **COMPOSED_LAYOUTS, **MORE_COMPOSED_LAYOUTS}


def _check(config: RunConfig, layout: str) -> None:
    assert config.parallel.pp > 1
    reference = _reference(reference_key(config))
    clipped = sum(norm > config.training.grad_clip for norm in reference.grad_norms)
    assert clipped >= config.training.steps // 2, f"clipping barely binds: {reference.grad_norms}"
    results = run_layout(config, timeout_s=TIMEOUT_S)
    assert_equivalent(reference, results, layout=f"{layout} ({config.parallel.describe()})")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_trains_like_one_process(layout: str) -> None:
    _check(LAYOUTS[layout], layout)


@pytest.mark.parametrize("layout", COMPOSED_LAYOUTS)
def test_pipeline_composed_with_dp_and_tp_trains_like_one_process(layout: str) -> None:
    _check(COMPOSED_LAYOUTS[layout], layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", MORE_COMPOSED_LAYOUTS)
def test_pipeline_composed_with_fsdp_and_sequence_parallel_trains_like_one_process(layout: str) -> None:
    _check(MORE_COMPOSED_LAYOUTS[layout], layout)


@pytest.mark.parametrize("layout", LLAMA_LAYOUTS)
def test_llama_pipeline_trains_like_one_process(layout: str) -> None:
    _check(dataclasses.replace(ALL_LAYOUTS[layout], model=TINY_LLAMA), f"llama {layout}")


def _build_tied_pipeline(rank: int, world_size: int) -> tuple[str, str | None, str | None]:
    from torch.distributed.device_mesh import init_device_mesh

    from etrain.workers.engine.pipeline import build_pipeline
    from etrain.workers.families.model import build_model_skeleton, cross_entropy_loss

    with torch.device("meta"):
        model = build_model_skeleton(TINY_LLAMA_TIED)
    try:
        build_pipeline(
            model,
            pp_mesh=init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",)),
            pp_rank=rank,
            parallel=ParallelConfig(pp=world_size),
            n_microbatches=4,
            loss_fn=cross_entropy_loss,
            device="cpu",
        )
    except ConfigError as exc:
        return str(exc), exc.field, exc.fix
    return "built", None, None


def test_tied_embeddings_cannot_be_pipelined() -> None:
    """The embedding (first stage) and the output (last stage) would be one parameter on two ranks."""
    for message, field, fix in run_distributed(_build_tied_pipeline, 2, timeout_s=60.0):
        assert "tied input and output embeddings cannot be cut into pipeline stages" in message, message
        assert field == "parallelism.pp"
        assert "parallelism.pp=1" in fix


def test_layouts_use_gradient_accumulation() -> None:
    """The micro-batches are the pipeline's grad accumulation; every layout here has at least 2."""
    for config in (*LAYOUTS.values(), *COMPOSED_LAYOUTS.values(), *MORE_COMPOSED_LAYOUTS.values()):
        assert config.grad_accum_steps >= 2, config.parallel.describe()
