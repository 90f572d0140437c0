"""The pipeline bubble, measured: each stage's idle fraction tracks (P-1)/(M+P-1).

Two real processes over gloo (one pipeline stage each, one intra-op thread) and a model large
enough that compute dominates the p2p transfers (``tests/pipeline_timing.py``, the method the
benchmark's figure 7 uses too). ``PipelineRunner`` times every stage forward, loss and backward (the
trainer's ``compute_s``); ``idle_fraction = 1 - busy / step_wall``, where the step ends with an
all-reduce over the pp group so every stage's wall spans the whole pipeline step.

With P=2 stages and M micro-batches GPipe (and 1F1B) leave each stage idle (P-1)/(M+P-1) of the
step: 1/3, 1/5 and 1/9 at M = 2, 4, 8. Interleaving two virtual stages per rank halves the ramp,
(P-1)/(2M+P-1) (what an event simulation of torch's interleaved action order gives for equal
layer times). Measured values sit a few hundredths above the formulas (p2p and thread wake-up
latency on two shared cores). Each number is the median over several steps, and steps in which a
rank lost its core to other processes are left out (``tests.pipeline_timing.time_pipeline_steps``).

The two stages' mean idle must be within ±0.12 of the formula, each stage's within ±0.20. The mean is
the robust figure: a stage that loses part of its core for a moment (still a "clean" step) stretches
the step, so its peer's idle rises by about what its own falls, and the mean barely moves (CI once saw
stage 0 at 0.332 and stage 1 at 0.227 for M=4, formula 0.200, mean 0.280). The per-stage band still
fails a schedule that does not overlap at all (every stage idle 0.5 at P=2).
"""

from __future__ import annotations

import statistics
import time

import pytest

from tests.dist_utils import run_distributed
from tests.pipeline_timing import MAX_DESCHEDULED, PP, bubble, time_pipeline_steps

BAND = 0.12  # the mean over stages
STAGE_BAND = 0.20  # each stage
MEASURED_STEPS = 4  # clean steps per case, after one warm-up step
MIN_CLEAN_STEPS = 3  # fewer after BUDGET_S: skip, the machine is too loaded to time anything
BUDGET_S = 40.0
CASES = [  # (schedule, virtual_stages, n_microbatches)
    ("gpipe", 1, 2),
    ("gpipe", 1, 4),
    ("gpipe", 1, 8),
    ("1f1b", 1, 4),
    ("interleaved_1f1b", 2, 2),
    ("interleaved_1f1b", 2, 4),
]


@pytest.fixture(scope="module")
def idle() -> dict[tuple, list[float]]:
    """Median idle fraction over clean steps per case, one entry per stage (rank)."""
    started = time.monotonic()
    per_rank = run_distributed(time_pipeline_steps, PP, CASES, MEASURED_STEPS, BUDGET_S, timeout_s=BUDGET_S + 120.0)
    descheduled = [worst for steps in per_rank[0]["all"].values() for _, worst in steps]
    counts = {case: len(per_rank[0]["clean"][case]) for case in CASES}
    medians = {
        case: [
            statistics.median(t.idle_fraction for t in rank["clean"][case]) if counts[case] else float("nan")
            for rank in per_rank
        ]
        for case in CASES
    }
    report = "\n".join(
        f"  {s:>16} v{v} M={m}: idle {', '.join(f'{x:.3f}' for x in medians[(s, v, m)])} "
        f"(formula {bubble(m, v):.3f}; {counts[(s, v, m)]} clean steps)"
        for s, v, m in CASES
    )
    print(
        f"\npipeline bubble, measured in {time.monotonic() - started:.1f} s; {sum(counts.values())} of "
        f"{len(descheduled)} steps clean (median descheduled {statistics.median(descheduled):.0%}):\n{report}"
    )
    if min(counts.values()) < MIN_CLEAN_STEPS:
        pytest.skip(
            f"the machine is too loaded to time a pipeline: in {BUDGET_S:.0f} s only {counts} steps had both "
            f"ranks descheduled <= {MAX_DESCHEDULED:.0%} of their compute (median "
            f"{statistics.median(descheduled):.0%})"
        )
    return medians


@pytest.mark.parametrize("schedule, num_microbatches", [("gpipe", 2), ("gpipe", 4), ("gpipe", 8), ("1f1b", 4)])
def test_each_stage_idles_for_the_bubble_fraction(idle, schedule: str, num_microbatches: int) -> None:
    formula = bubble(num_microbatches)
    stages = idle[(schedule, 1, num_microbatches)]
    mean = statistics.mean(stages)
    assert abs(mean - formula) <= BAND, (
        f"{schedule} M={num_microbatches}: mean idle fraction {mean:.3f} (stages {stages}), "
        f"formula (P-1)/(M+P-1) = {formula:.3f}; want |mean - formula| <= {BAND}"
    )
    for stage, measured in enumerate(stages):
        assert abs(measured - formula) <= STAGE_BAND, (
            f"{schedule} M={num_microbatches} stage {stage}: idle fraction {measured:.3f}, "
            f"formula (P-1)/(M+P-1) = {formula:.3f}; want |measured - formula| <= {STAGE_BAND}"
        )


def test_the_bubble_shrinks_as_micro_batches_grow(idle) -> None:
    mean = {m: statistics.mean(idle[("gpipe", 1, m)]) for m in (2, 4, 8)}
    assert mean[2] > mean[4] > mean[8], f"mean idle fraction by M: {mean}"
    for stage in range(PP):
        assert idle[("gpipe", 1, 2)][stage] > idle[("gpipe", 1, 8)][stage], f"stage {stage}: {idle}"


@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_interleaving_idles_less_than_gpipe(idle, num_microbatches: int) -> None:
    """Where interleaving's gain is larger than its cost: not at M=8 on two shared cores.

    Interleaving sends twice the p2p messages of GPipe, each wake-up costing a few hundredths of the step
    here. At M=2 and 4 the formulas differ by 0.13 and 0.09; at M=8 by 0.05, which that cost eats (CI
    measured 0.169 for both), so M=8 is not compared (nor timed).
    """
    interleaved = statistics.mean(idle[("interleaved_1f1b", 2, num_microbatches)])
    gpipe = statistics.mean(idle[("gpipe", 1, num_microbatches)])
    assert interleaved < gpipe, (
        f"M={num_microbatches}: interleaved (v=2) idle {interleaved:.3f} (formula "
        f"{bubble(num_microbatches, 2):.3f}) is not below GPipe's {gpipe:.3f} (formula {bubble(num_microbatches):.3f})"
    )
