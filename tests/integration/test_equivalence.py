"""Parallel equivalence: every DP / ZeRO / TP layout trains exactly like one process.

Invariant 1 of the architecture. Each layout trains the same tiny GPT for 8 steps (global batch 8,
micro-batch 2: gradient accumulation 4 on one process, 2 at dp=2), AdamW fp32 with gradient
clipping that binds on every step, on real gloo ranks (no Ray). Against the single-process run:

* every step's loss within 1e-5 relative (and the gradient norm, which clipping uses),
* every final parameter within 1e-4 absolute,
* and all ranks end with bit-identical full parameters (dp replicas never drift).

A layout that misses these is a bug, not a tolerance to loosen. Pipeline layouts live in
``test_pipeline_equivalence.py`` and reuse ``tests/equivalence_utils.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.equivalence_utils import (
    RunResult,
    assert_equivalent,
    assert_replicas_identical,
    reference_key,
    run_layout,
    run_reference,
    small_config,
)
from workers.config import ParallelConfig, RunConfig

BASE = small_config(steps=8)

LAYOUTS: dict[str, tuple[ParallelConfig, bool]] = {
    # id: (layout, activation checkpointing)
    "ddp2": (ParallelConfig(dp=2, zero=0), False),
    "zero1-dp2": (ParallelConfig(dp=2, zero=1), False),
    "zero2-dp2": (ParallelConfig(dp=2, zero=2), False),
    "zero3-dp2": (ParallelConfig(dp=2, zero=3), False),
    "zero3-dp2-ac": (ParallelConfig(dp=2, zero=3), True),
    "tp2": (ParallelConfig(tp=2), False),
    "tp2-sp": (ParallelConfig(tp=2, sequence_parallel=True), False),
    "dp2-tp2": (ParallelConfig(dp=2, tp=2, zero=0), False),
    "zero1-dp2-tp2": (ParallelConfig(dp=2, tp=2, zero=1), False),
    "zero3-dp2-tp2-sp": (ParallelConfig(dp=2, tp=2, zero=3, sequence_parallel=True), False),
}


def _config(layout_id: str) -> RunConfig:
    parallel, activation_checkpointing = LAYOUTS[layout_id]
    training = dataclasses.replace(BASE.training, activation_checkpointing=activation_checkpointing)
    return dataclasses.replace(BASE, parallel=parallel, training=training)


@pytest.fixture(scope="module")
def references() -> dict[RunConfig, RunResult]:
    """Single-process runs, computed once per distinct config and shared by all layouts."""
    return {}


def _reference(references: dict[RunConfig, RunResult], config: RunConfig) -> RunResult:
    key = reference_key(config)
    if key not in references:
        references[key] = run_reference(key)
    return references[key]


@pytest.mark.parametrize("layout_id", list(LAYOUTS))
def test_layout_trains_like_one_process(layout_id: str, references) -> None:
    config = _config(layout_id)
    reference = _reference(references, config)
    assert reference.losses[-1] < reference.losses[0], "the reference run should learn"

    results = run_layout(config)

    layout = f"{layout_id} ({config.parallel.describe()})"
    assert_equivalent(reference, results, layout=layout)
    assert_replicas_identical(results, layout=layout)
