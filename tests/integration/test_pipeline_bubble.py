"""The pipeline bubble, measured: each stage's idle fraction tracks (P-1)/(M+P-1).

Two real processes over gloo (one pipeline stage each, one intra-op thread), a model large enough
that compute dominates the p2p transfers (8 layers of d_model 256, 4 per stage; 256 tokens per
micro-batch, so one micro-batch's forward+backward on a stage is tens of milliseconds against
sub-millisecond 256 KiB activation transfers). ``PipelineRunner`` times every stage forward, loss
and backward; ``idle_fraction = 1 - busy / step_wall`` is what the trainer reports as comm_wait_s.

With P=2 stages and M micro-batches GPipe leaves each stage idle (P-1)/(M+P-1) of the step:
1/3, 1/5 and 1/9 at M = 2, 4, 8. Interleaving two virtual stages per rank halves the ramp:
≈ (P-1)/(2M+P-1). The machine is shared, so each number is the median over several steps and
the band is ±0.12 around the formula.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from tests.dist_utils import run_distributed
from workers.config import ModelConfig, ParallelConfig
from workers.mesh import build_device_mesh
from workers.model import build_model, cross_entropy_loss
from workers.pipeline import StepTiming, build_pipeline
from workers.topology import Topology

MODEL = ModelConfig(n_layers=8, d_model=256, n_heads=4, vocab_size=64, seq_len=64)
MICRO_BATCH = 4
PP = 2
BAND = 0.12
MEASURED_STEPS = 5  # per case, after one warm-up step
CASES = [  # (schedule, virtual_stages, n_microbatches)
    ("gpipe", 1, 2),
    ("gpipe", 1, 4),
    ("gpipe", 1, 8),
    ("1f1b", 1, 4),
    ("interleaved_1f1b", 2, 4),
    ("interleaved_1f1b", 2, 8),
]


def _bubble(num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a stage in a fill-drain schedule with equal stage times."""
    return (PP - 1) / (virtual_stages * num_microbatches + PP - 1)


def _measure(rank: int, world_size: int, cases: list[tuple[str, int, int]]) -> dict[tuple, list[StepTiming]]:
    """Runs in each rank: every case's step timings after a warm-up round.

    Cases take turns step by step (round-robin) rather than one after another, so a burst of load
    from other processes on the shared machine lands on every case alike instead of on one.
    """
    mesh = build_device_mesh(Topology(pp=PP, dp=1, tp=1), "cpu")
    model = build_model(MODEL, seed=0)
    runners, batches = {}, {}
    for schedule, virtual_stages, num_microbatches in cases:
        case = (schedule, virtual_stages, num_microbatches)
        runners[case] = build_pipeline(
            model,
            pp_mesh=mesh["pp"],
            pp_rank=rank,
            parallel=ParallelConfig(pp=PP, pp_schedule=schedule, virtual_stages=virtual_stages),
            n_microbatches=num_microbatches,
            loss_fn=cross_entropy_loss,
            device="cpu",
        )
        generator = torch.Generator().manual_seed(num_microbatches)
        batches[case] = torch.randint(
            0, MODEL.vocab_size, (num_microbatches * MICRO_BATCH, MODEL.seq_len), generator=generator
        )
    timings: dict[tuple, list[StepTiming]] = {case: [] for case in runners}
    for round_index in range(1 + MEASURED_STEPS):
        for case, runner in runners.items():
            runner.step(batches[case], batches[case])
            if round_index > 0:  # the first step also infers shapes and warms up
                timings[case].append(runner.last_step_timing)
    return timings


@pytest.fixture(scope="module")
def idle() -> dict[tuple, list[float]]:
    """Median idle fraction per case, one entry per stage (rank)."""
    started = time.monotonic()
    per_rank = run_distributed(_measure, PP, CASES, timeout_s=180.0)
    medians = {
        case: [statistics.median(t.idle_fraction for t in rank_timings[case]) for rank_timings in per_rank]
        for case in CASES
    }
    report = "\n".join(
        f"  {s:>16} v{v} M={m}: idle {', '.join(f'{x:.3f}' for x in medians[(s, v, m)])} "
        f"(formula {_bubble(m, v):.3f}; step {statistics.median(t.step_s for t in per_rank[0][(s, v, m)]):.3f} s)"
        for s, v, m in CASES
    )
    print(f"\npipeline bubble, measured in {time.monotonic() - started:.1f} s:\n{report}")
    return medians


@pytest.mark.parametrize("schedule, num_microbatches", [("gpipe", 2), ("gpipe", 4), ("gpipe", 8), ("1f1b", 4)])
def test_each_stage_idles_for_the_bubble_fraction(idle, schedule: str, num_microbatches: int) -> None:
    formula = _bubble(num_microbatches)
    for stage, measured in enumerate(idle[(schedule, 1, num_microbatches)]):
        assert abs(measured - formula) <= BAND, (
            f"{schedule} M={num_microbatches} stage {stage}: idle fraction {measured:.3f}, "
            f"formula (P-1)/(M+P-1) = {formula:.3f}; want |measured - formula| <= {BAND}"
        )


def test_the_bubble_shrinks_as_micro_batches_grow(idle) -> None:
    mean = {m: statistics.mean(idle[("gpipe", 1, m)]) for m in (2, 4, 8)}
    assert mean[2] > mean[4] > mean[8], f"mean idle fraction by M: {mean}"
    for stage in range(PP):
        assert idle[("gpipe", 1, 2)][stage] > idle[("gpipe", 1, 8)][stage], f"stage {stage}: {idle}"


@pytest.mark.parametrize("num_microbatches", [4, 8])
def test_interleaving_idles_less_than_gpipe(idle, num_microbatches: int) -> None:
    interleaved = statistics.mean(idle[("interleaved_1f1b", 2, num_microbatches)])
    gpipe = statistics.mean(idle[("gpipe", 1, num_microbatches)])
    assert interleaved < gpipe, (
        f"M={num_microbatches}: interleaved (v=2) idle {interleaved:.3f} (formula "
        f"{_bubble(num_microbatches, 2):.3f}) is not below GPipe's {gpipe:.3f} (formula {_bubble(num_microbatches):.3f})"
    )
    assert abs(interleaved - _bubble(num_microbatches, 2)) <= BAND
