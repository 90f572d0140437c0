"""`make bench`: throughput, time split and memory of each layout, and overhead against a peer.

Every row runs the production ``workers.train.Trainer`` on real gloo process groups (no Ray, so
the numbers are the engine's, not the scheduler's). The peer row is a bare torch DDP loop over the
same model and batch, the smallest thing a user could write by hand, so the overhead of etrain's
engine (global sampler, measured timing, sync point, clipping across shards) is visible.

Writes ``<out>/results.json`` and ``<out>/results.md`` (the table pasted into the README) and
prints the table. On a 2-core CPU machine, absolute numbers are small; what the table shows is the
relative cost of each layout and the planner's memory estimate next to the measured peak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tests.dist_utils import run_distributed
from workers.config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainingConfig

WARMUP_STEPS = 3


@dataclass(frozen=True)
class Row:
    layout: str
    ranks: int
    step_ms: float
    tokens_per_s: float
    compute_ms: float
    comm_wait_ms: float
    peak_rss_mb: float
    planned_mb: float | None


def bench_config(steps: int, parallel: ParallelConfig) -> RunConfig:
    return RunConfig(
        job_id="bench",
        model=ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=64),
        data=DataConfig(kind="synthetic", seed=0),
        parallel=parallel,
        training=TrainingConfig(steps=steps, global_batch=16, micro_batch=4, lr=1e-3, seed=0),
    )


def _etrain_rank(rank: int, world_size: int, config: RunConfig) -> dict:
    import torch

    from workers.train import Trainer

    trainer = Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))
    metrics = [trainer.train_step(step) for step in range(config.training.steps)]
    timed = metrics[WARMUP_STEPS:]
    return {
        "step_s": statistics.median(m.step_s for m in timed),
        "compute_s": statistics.median(m.compute_s for m in timed),
        "comm_wait_s": statistics.median(m.comm_wait_s for m in timed),
        "tokens_per_s": statistics.median(m.tokens_per_s for m in timed),
        "peak_rss": max(m.peak_mem_bytes for m in timed),
    }


def _peer_ddp_rank(rank: int, world_size: int, config: RunConfig) -> dict:
    """The peer: a hand-written DDP loop (no accumulation sync control, no metrics, no clipping)."""
    import resource

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from workers.model import build_model, cross_entropy_loss

    model = build_model(config.model, seed=0)
    if world_size > 1:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accum = config.training.global_batch // (world_size * config.training.micro_batch)
    generator = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(config.training.steps):
        start = time.perf_counter()
        for _ in range(accum):
            tokens = torch.randint(0, config.model.vocab_size, (config.training.micro_batch, config.model.seq_len + 1),
                                   generator=generator)
            loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]) / accum
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if world_size > 1:
            dist.barrier()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[WARMUP_STEPS:])
    return {
        "step_s": step_s,
        "compute_s": float("nan"),
        "comm_wait_s": float("nan"),
        "tokens_per_s": config.training.global_batch * config.model.seq_len / step_s,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def planned_mb(config: RunConfig) -> float | None:
    """The planner's per-rank estimate for the same layout (fp32 states), for comparison."""
    try:
        from service.planner import estimate
        from service.spec import JobSpec
    except ImportError:
        return None
    p = config.parallel
    spec = JobSpec.model_validate({
        "name": "bench",
        "model": {k: v for k, v in asdict(config.model).items() if v is not None},
        "parallelism": {"dp": p.dp, "tp": p.tp, "pp": p.pp, "zero": p.zero, "pp_schedule": p.pp_schedule,
                        "virtual_stages": p.virtual_stages},
        "training": {"steps": config.training.steps, "global_batch": config.training.global_batch,
                     "micro_batch": config.training.micro_batch},
    })
    memory = estimate(spec).memory
    return (memory.total - memory.overhead) / 2**20  # the runtime allowance would swamp a tiny model


LAYOUTS = [
    ("single process", ParallelConfig()),
    ("DDP ×2", ParallelConfig(dp=2)),
    ("ZeRO-1 ×2", ParallelConfig(dp=2, zero=1)),
    ("ZeRO-2 ×2", ParallelConfig(dp=2, zero=2)),
    ("ZeRO-3 ×2", ParallelConfig(dp=2, zero=3)),
    ("TP ×2", ParallelConfig(tp=2)),
    ("TP ×2 + SP", ParallelConfig(tp=2, sequence_parallel=True)),
    ("PP ×2 1F1B", ParallelConfig(pp=2, pp_schedule="1f1b")),
    ("PP ×2 interleaved", ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2)),
]


def run(out: Path, steps: int) -> list[Row]:
    rows: list[Row] = []

    def record(name: str, results: list[dict], config: RunConfig) -> None:
        worst = max(results, key=lambda r: r["step_s"])
        rows.append(Row(
            layout=name,
            ranks=config.parallel.world_size,
            step_ms=1e3 * worst["step_s"],
            tokens_per_s=config.training.global_batch * config.model.seq_len / worst["step_s"],
            compute_ms=1e3 * worst["compute_s"],
            comm_wait_ms=1e3 * worst["comm_wait_s"],
            peak_rss_mb=max(r["peak_rss"] for r in results) / 2**20,
            planned_mb=planned_mb(config),
        ))
        print(f"  {name:<22} {rows[-1].step_ms:8.1f} ms/step  {rows[-1].tokens_per_s:9.0f} tok/s", flush=True)

    for name, parallel in LAYOUTS:
        config = bench_config(steps, parallel)
        record(name, run_distributed(_etrain_rank, parallel.world_size, config, timeout_s=600), config)
    peer = bench_config(steps, ParallelConfig(dp=2))
    record("peer: bare torch DDP ×2", run_distributed(_peer_ddp_rank, 2, peer, timeout_s=600), peer)

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    (out / "results.md").write_text(table(rows))
    return rows


def table(rows: list[Row]) -> str:
    def ms(value: float) -> str:
        return "–" if value != value else f"{value:.1f}"

    lines = [
        f"Model 4×128 (0.9 M params), seq 64, global batch 16, micro-batch 4, fp32, gloo on "
        f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}); medians after {WARMUP_STEPS} warm-up steps.",
        "",
        "Peak RSS includes the Python + torch runtime (about 340 MiB per process); the planner column is its estimate "
        "of model state + activations per rank, without its runtime allowance.",
        "",
        "| layout | ranks | step (ms) | tokens/s | compute (ms) | comm wait (ms) | peak RSS/rank (MiB) | planner: states + activations (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        planned = "–" if r.planned_mb is None else f"{r.planned_mb:.2f}"
        lines.append(f"| {r.layout} | {r.ranks} | {ms(r.step_ms)} | {r.tokens_per_s:.0f} | {ms(r.compute_ms)} | "
                     f"{ms(r.comm_wait_ms)} | {r.peak_rss_mb:.0f} | {planned} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    rows = run(args.out, args.steps)
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
