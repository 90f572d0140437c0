"""The pipeline bubble, timed on a shared machine: one method for the test that asserts it
(tests/integration/test_pipeline_bubble.py) and the benchmark figure that reports it (benchmarks/engine.py,
figure 7).

Two gloo ranks, one pipeline stage each, and a model large enough that compute dominates the p2p
transfers (8 layers of d_model 256, 4 per stage, 256 tokens per micro-batch: tens of milliseconds of
forward+backward per micro-batch against ~0.2 ms per activation transfer). ``PipelineRunner`` times
every stage forward, loss and backward; ``idle_fraction = 1 - busy / step_wall``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from etrain.workers.engine.init import build_model
from etrain.workers.engine.mesh import build_device_mesh
from etrain.workers.engine.pipeline import StepTiming, build_pipeline
from etrain.workers.families.model import cross_entropy_loss
from etrain.workers.protocol.run_config import ModelConfig, ParallelConfig
from etrain.workers.protocol.topology import Topology

MODEL = ModelConfig(n_layers=8, d_model=256, n_heads=4, vocab_size=64, seq_len=64)
MICRO_BATCH = 4
PP = 2
MAX_DESCHEDULED = 0.25  # a step is clean if each rank computed for >= 75% of its busy wall time

Case = tuple[str, int, int]  # (schedule, virtual_stages, n_microbatches)


def bubble(num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a stage in a fill-drain schedule with equal stage times: (P-1)/(vM+P-1)."""
    return (PP - 1) / (virtual_stages * num_microbatches + PP - 1)


def time_pipeline_steps(rank: int, world_size: int, cases: list[Case], wanted: int, budget_s: float) -> dict:
    """Runs in each rank: every case's step timings, and which steps were clean.

    The machine is shared. A rank descheduled while computing stretches its busy time and its peer's
    wait, which is noise, not bubble; so each step also measures the process CPU time, and a step is
    clean only if on *both* ranks the compute got at least ``1 - MAX_DESCHEDULED`` of a core (``busy_s``
    against CPU seconds). Cases take turns step by step (round-robin), so a burst of load lands on all
    of them alike, and rounds continue until every case has ``wanted`` clean steps or ``budget_s`` runs
    out. Decisions are all-reduced so both ranks stop together.

    Returns ``{"clean": {case: [StepTiming]}, "all": {case: [(idle_fraction, descheduled)]}}``, where
    ``descheduled`` is the worse rank's share of its busy time without a core.
    """
    pp_mesh = build_device_mesh(Topology(pp=PP, dp=1, tp=1), "cpu")["pp"]
    group = pp_mesh.get_group()
    model = build_model(MODEL, seed=0)
    runners, batches = {}, {}
    for case in cases:
        schedule, virtual_stages, num_microbatches = case
        runners[case] = build_pipeline(
            model,
            pp_mesh=pp_mesh,
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
    for case, runner in runners.items():  # warm-up: the first step also infers shapes
        runner.step(batches[case], batches[case])

    clean: dict[Case, list[StepTiming]] = {case: [] for case in runners}
    every: dict[Case, list[tuple[float, float]]] = {case: [] for case in runners}
    deadline = time.monotonic() + budget_s
    while True:
        for case, runner in runners.items():
            cpu_started = time.process_time()
            runner.step(batches[case], batches[case])
            cpu_s = time.process_time() - cpu_started
            timing = runner.last_step_timing
            worst = torch.tensor([max(0.0, 1.0 - cpu_s / timing.busy_s)])
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
            every[case].append((timing.idle_fraction, worst.item()))
            if worst.item() <= MAX_DESCHEDULED:
                clean[case].append(timing)
        more = min(len(steps) for steps in clean.values()) < wanted and time.monotonic() < deadline
        flag = torch.tensor([int(more)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        if not flag.item():
            return {"clean": clean, "all": every}
