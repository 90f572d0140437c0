"""`make bench`: throughput of each layout, meta-device initialisation memory, and the planner's
memory prediction against measured peaks.

Four benchmarks, each a few minutes at most on 2 CPU cores (``--only`` runs a subset):

* ``throughput``: every row runs the production ``etrain.workers.engine.train.Trainer`` on real gloo process
  groups (no Ray, so the numbers are the engine's, not the scheduler's). The peer row is a bare
  torch DDP loop over the same model and batch, the smallest thing a user could write by hand, so
  the overhead of etrain's engine (global sampler, measured timing, sync point, clipping across
  shards) is visible.
* ``init`` and ``planner``: ``benchmarks/memory.py`` (meta-device init peak RSS against building the
  whole model; the planner's per-rank peak against measured peak RSS for six layouts).
* ``ring``: ``benchmarks/ring.py`` (context parallelism: the ring attention at cp = 2 and 4 against the
  whole sequence's attention in one process, and a cp=2 step under none / selective / full checkpointing).

Writes ``<out>/results.json`` and one markdown table per benchmark (``throughput.md``, ``init.md``,
``planner.md``, ``ring.md``; the tables pasted into benchmarks/README.md) and prints them. On a 2-core CPU machine,
absolute speeds are small; what the throughput table shows is the relative cost of each layout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import memory, ring
from etrain.workers.families import num_params
from etrain.workers.protocol.run_config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainingConfig
from tests.dist_utils import run_distributed

BENCHMARKS = ("throughput", "init", "planner", "ring")

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

    from etrain.workers.engine.train import Trainer

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

    from etrain.workers.engine.init import build_model
    from etrain.workers.families.model import cross_entropy_loss

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
            tokens = torch.randint(
                0, config.model.vocab_size, (config.training.micro_batch, config.model.seq_len + 1), generator=generator
            )
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


def planned_mb(config: RunConfig, runtime_bytes: int) -> float | None:
    """The planner's per-rank peak for the same layout, its runtime allowance replaced by the measured one."""
    try:
        from etrain.service.planning.estimate import estimate
        from etrain.service.planning.spec import JobSpec
    except ImportError:
        return None
    p, m = config.parallel, config.model
    spec = JobSpec.model_validate(
        {
            "name": "bench",
            "model": {
                "kind": m.arch,
                "n_layers": m.n_layers,
                "d_model": m.d_model,
                "n_heads": m.n_heads,
                "vocab_size": m.vocab_size,
                "seq_len": m.seq_len,
                "d_ff": m.ffn_dim,
            },
            "parallelism": {
                "dp": p.dp,
                "tp": p.tp,
                "pp": p.pp,
                "zero": p.zero,
                "pp_schedule": p.pp_schedule,
                "virtual_stages": p.virtual_stages,
                "sequence_parallel": p.sequence_parallel,
            },
            "training": {
                "steps": config.training.steps,
                "global_batch": config.training.global_batch,
                "micro_batch": config.training.micro_batch,
            },
        }
    )
    mem = estimate(spec).memory
    return memory.predicted_peak_bytes(mem.total, mem.overhead, runtime_bytes) / 2**20


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


def run(steps: int, runtime_bytes: int) -> list[Row]:
    """The throughput table's rows (the layouts, then the peer)."""
    rows: list[Row] = []

    def record(name: str, results: list[dict], config: RunConfig) -> None:
        worst = max(results, key=lambda r: r["step_s"])
        rows.append(
            Row(
                layout=name,
                ranks=config.parallel.world_size,
                step_ms=1e3 * worst["step_s"],
                tokens_per_s=config.training.global_batch * config.model.seq_len / worst["step_s"],
                compute_ms=1e3 * worst["compute_s"],
                comm_wait_ms=1e3 * worst["comm_wait_s"],
                peak_rss_mb=max(r["peak_rss"] for r in results) / 2**20,
                planned_mb=planned_mb(config, runtime_bytes),
            )
        )
        print(f"  {name:<22} {rows[-1].step_ms:8.1f} ms/step  {rows[-1].tokens_per_s:9.0f} tok/s", flush=True)

    for name, parallel in LAYOUTS:
        config = bench_config(steps, parallel)
        record(name, run_distributed(_etrain_rank, parallel.world_size, config, timeout_s=600), config)
    peer = bench_config(steps, ParallelConfig(dp=2))
    record("peer: bare torch DDP ×2", run_distributed(_peer_ddp_rank, 2, peer, timeout_s=600), peer)
    return rows


def table(rows: list[Row], runtime_bytes: int) -> str:
    def ms(value: float) -> str:
        return "–" if value != value else f"{value:.1f}"

    lines = [
        f"Model 4×128 (0.9 M params), seq 64, global batch 16, micro-batch 4, fp32, gloo on "
        f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}); medians after {WARMUP_STEPS} "
        "warm-up steps.",
        "",
        f"At this size the Python + torch runtime (an empty rank: {runtime_bytes / 2**20:.0f} MiB) is nearly all of a "
        "rank's memory; the planner column is its peak per rank with that runtime as its allowance.",
        "",
        "| layout | ranks | step (ms) | tokens/s | compute (ms) | comm wait (ms) | peak RSS/rank (MiB) "
        "| planner peak/rank (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        planned = "–" if r.planned_mb is None else f"{r.planned_mb:.0f}"
        lines.append(
            f"| {r.layout} | {r.ranks} | {ms(r.step_ms)} | {r.tokens_per_s:.0f} | {ms(r.compute_ms)} | "
            f"{ms(r.comm_wait_ms)} | {r.peak_rss_mb:.0f} | {planned} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument(
        "--only", action="append", choices=BENCHMARKS, help="run only this benchmark (repeatable); default: all"
    )
    args = parser.parse_args()
    selected = args.only or list(BENCHMARKS)
    args.out.mkdir(parents=True, exist_ok=True)
    runtime_bytes = memory.measure_runtime_rss()
    print(f"runtime (an empty rank's peak RSS): {runtime_bytes / 2**20:.0f} MiB", flush=True)
    results: dict = {"runtime_rss_bytes": runtime_bytes}
    tables: list[str] = []

    def emit(name: str, text: str) -> None:
        (args.out / f"{name}.md").write_text(text)
        tables.append(text)
        print(f"\n{text}", flush=True)

    if "throughput" in selected:
        rows = run(args.steps, runtime_bytes)
        results["throughput"] = [asdict(r) for r in rows]
        emit("throughput", table(rows, runtime_bytes))
    if "init" in selected:
        start = time.perf_counter()
        init = memory.bench_meta_init(runtime_bytes)
        results["init"] = {**asdict(init), "ratio": init.ratio, "seconds": time.perf_counter() - start}
        emit("init", memory.init_table(init))
    if "planner" in selected:
        accuracy = memory.bench_planner_accuracy(runtime_bytes)
        results["planner"] = [{**asdict(r), "ratio": r.ratio} for r in accuracy]
        emit("planner", memory.accuracy_table(accuracy, runtime_bytes, num_params(memory.ACCURACY_MODEL)))
    if "ring" in selected:
        rows = ring.bench_ring()
        checkpointing = ring.bench_checkpointing()
        results["ring"] = [{**asdict(r), "ratio": r.ratio, "ideal": r.ideal} for r in rows]
        results["ring_checkpointing"] = [asdict(r) for r in checkpointing]
        emit("ring", ring.ring_table(rows) + "\n" + ring.checkpointing_table(checkpointing))
    (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
