"""Parallel equivalence: every DP / ZeRO / TP layout trains exactly like one process.

Invariant 1 of the architecture. Each layout trains a tiny model for 4 steps (global batch 8,
micro-batch 2: gradient accumulation 4 on one process, 2 at dp=2, 1 at dp=4), AdamW fp32 with gradient
clipping that binds on every step, on real gloo ranks (no Ray). Against the single-process run:

* every step's loss within 1e-5 relative (and the gradient norm, which clipping uses),
* every final parameter within 1e-4 absolute,
* and all ranks end with bit-identical full parameters (dp replicas never drift).

Every layout runs for both architectures (``tests/equivalence_utils.MODELS``): the built-in GPT and a
Llama with grouped-query attention, q/k/v biases and q/k norms (its own TP plan: w3, kv heads, head-
sharded norms); the tied-embedding Llama runs on one layout per way of holding the shared weight
(DDP, FSDP2, TP, both).

TP layouts compute the loss vocab-parallel (``loss_parallel`` on logits sharded by vocabulary), so
that is held to the same bounds; HSDP and CPU offload are FSDP2 variants and are too.

A layout that misses these is a bug, not a tolerance to loosen. Pipeline layouts live in
``test_pipeline_equivalence.py`` and reuse ``tests/equivalence_utils.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from etrain.workers.protocol.run_config import ParallelConfig, RunConfig
from tests.equivalence_utils import (
    MODELS,
    RunResult,
    assert_equivalent,
    assert_replicas_identical,
    cached_reference,
    run_layout,
    small_config,
)

BASE = small_config(steps=4)

LAYOUTS: dict[str, tuple[ParallelConfig, bool]] = {
    # id: (layout, activation checkpointing)
    "ddp2": (ParallelConfig(dp=2, zero=0), "none"),
    "zero1-dp2": (ParallelConfig(dp=2, zero=1), "none"),
    "zero2-dp2": (ParallelConfig(dp=2, zero=2), "none"),
    "zero3-dp2": (ParallelConfig(dp=2, zero=3), "none"),
    "zero3-dp2-ac": (ParallelConfig(dp=2, zero=3), "full"),
    "tp2": (ParallelConfig(tp=2), "none"),
    "tp2-sp": (ParallelConfig(tp=2, sequence_parallel=True), "none"),
    "dp2-tp2": (ParallelConfig(dp=2, tp=2, zero=0), "none"),
    "zero1-dp2-tp2": (ParallelConfig(dp=2, tp=2, zero=1), "none"),
    "zero3-dp2-tp2-sp": (ParallelConfig(dp=2, tp=2, zero=3, sequence_parallel=True), "none"),
    # HSDP: FSDP2 on the 2-D (dp_replicate, dp_shard) mesh, 2 replicas of 2 shards (4 ranks).
    "hsdp-dp4-zero3": (ParallelConfig(dp=4, zero=3, dp_replicate=2), "none"),
    "hsdp-dp4-zero2": (ParallelConfig(dp=4, zero=2, dp_replicate=2), "none"),
    # FSDP2 CPUOffloadPolicy: shards, gradients and the optimizer step in host memory.
    "zero3-dp2-offload": (ParallelConfig(dp=2, zero=3, offload="cpu"), "none"),
}


#: (model, layout) pairs: every layout for the GPT and the untied Llama; the tied Llama where its
#: shared embedding/output weight is held differently (DDP buckets, FSDP2 shards, TP's vocab shards).
TIED_LAYOUTS = ("ddp2", "zero3-dp2", "tp2", "dp2-tp2")
CASES = [(model, layout_id) for model in ("gpt", "llama") for layout_id in LAYOUTS]
CASES += [("llama-tied", layout_id) for layout_id in TIED_LAYOUTS]


def _config(layout_id: str, model: str = "gpt") -> RunConfig:
    parallel, activation_checkpointing = LAYOUTS[layout_id]
    training = dataclasses.replace(BASE.training, activation_checkpointing=activation_checkpointing)
    return dataclasses.replace(BASE, model=MODELS[model], parallel=parallel, training=training)


@pytest.fixture(scope="module")
def references() -> dict[RunConfig, RunResult]:
    """Single-process runs, computed once per distinct config and shared by all layouts."""
    return {}


@pytest.mark.parametrize("model, layout_id", CASES, ids=[f"{model}-{layout_id}" for model, layout_id in CASES])
def test_layout_trains_like_one_process(model: str, layout_id: str, references) -> None:
    config = _config(layout_id, model)
    reference = cached_reference(references, config)
    assert reference.losses[-1] < reference.losses[0], "the reference run should learn"

    results = run_layout(config)

    layout = f"{model} {layout_id} ({config.parallel.describe()})"
    assert_equivalent(reference, results, layout=layout)
    assert_replicas_identical(results, layout=layout)
