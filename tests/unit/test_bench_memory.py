"""The memory benchmarks' pure helpers: the prediction they compare against, ratios and tables."""

from __future__ import annotations

from benchmarks.memory import (
    ACCURACY_LAYOUTS,
    ACCURACY_MODEL,
    INIT_MODEL,
    AccuracyRow,
    InitResult,
    accuracy_table,
    init_table,
    predicted_peak_bytes,
    within,
)
from etrain.workers import families

MiB = 2**20


def test_the_prediction_swaps_the_planner_runtime_allowance_for_the_measured_one():
    assert predicted_peak_bytes(total=1000 * MiB, overhead=300 * MiB, runtime_bytes=274 * MiB) == 974 * MiB


def test_within_is_symmetric_around_one():
    assert within(1.15, 0.15) and within(0.85, 0.15) and within(1.0, 0.0)
    assert not within(1.151, 0.15) and not within(0.849, 0.15)


def test_the_models_are_the_sizes_the_readme_quotes():
    assert 750e6 < families.num_params(INIT_MODEL) < 800e6  # parameters dominate the runtime
    assert INIT_MODEL.vocab_size * INIT_MODEL.d_model < families.num_params(INIT_MODEL) / 50  # a small init transient
    assert 60e6 < families.num_params(ACCURACY_MODEL) < 70e6
    assert [name for name, _ in ACCURACY_LAYOUTS] == [
        "DDP ×2",
        "ZeRO-1 ×2",
        "ZeRO-2 ×2",
        "ZeRO-3 ×2",
        "TP ×2",
        "PP ×2 1F1B",
    ]


def test_init_table():
    result = InitResult(
        params=776_029_440,
        meta_zero3_rss=(1851 * MiB, 1852 * MiB),
        full_build_rss=3291 * MiB,
        runtime_rss=274 * MiB,
        planned_init=1814 * MiB,
    )
    assert result.ratio == 1852 / 3291
    text = init_table(result)
    assert "| `build_model` (whole model, one process) | 1 | 3291 | 3017 |" in text
    assert "| Trainer, ZeRO-3 ×2, meta-device init | 2 | 1851 / 1852 | 1577 / 1578 |" in text
    assert "**0.56×**" in text and "1814 MiB, measured / planner 1.02" in text


def test_accuracy_table():
    rows = [
        AccuracyRow(
            layout="DDP ×2", ranks=2, phase="optimizer_step", predicted=1000 * MiB, measured=1040 * MiB, seconds=10.0
        ),
        AccuracyRow(
            layout="TP ×2", ranks=2, phase="forward_backward", predicted=800 * MiB, measured=720 * MiB, seconds=10.0
        ),
    ]
    assert rows[0].ratio == 1.04 and rows[1].ratio == 0.9
    text = accuracy_table(rows, runtime_bytes=274 * MiB, params=families.num_params(ACCURACY_MODEL))
    assert "| DDP ×2 | 2 | optimizer step | 1000 | 1040 | 1.04 |" in text
    assert "| TP ×2 | 2 | forward backward | 800 | 720 | 0.90 |" in text
    assert "Largest deviation: TP ×2, -10%; all within the ±15% target." in text
