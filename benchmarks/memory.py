"""Memory benchmarks: meta-device initialisation, and the planner's per-rank peak against measured RSS.

Both run the production ``etrain.workers.engine.train.Trainer`` on real gloo ranks (``tests.dist_utils``) and read
each rank's peak resident memory (``ru_maxrss``) — on a CPU run the planner's "device memory".

* :func:`bench_meta_init`: a Llama large enough that its parameters dominate the runtime, built by the
  Trainer as ZeRO-3 over 2 ranks (meta device, then only each rank's shards materialised), against
  ``etrain.workers.engine.init.build_model`` building the whole model in one process (what every rank did before).
* :func:`bench_planner_accuracy`: six layouts of a ~67M-parameter Llama (fp32 state ~1 GiB a rank,
  several times the runtime), trained a few steps; the planner's peak per rank, with its runtime
  allowance replaced by an empty rank's measured RSS, against the measured peak.

The ranks run with ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB (:data:`ALLOCATOR_ENV`): glibc then maps every
tensor of 1 MiB or more on its own and returns it to the system when freed, so RSS follows the live
tensors. With glibc's default (a threshold that grows to 32 MiB) freed tensors stay in the heap, and
FSDP's gather/free pattern leaves a ZeRO-3 rank ~30% above its live bytes; the planner predicts live
bytes, not allocator slack.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass

from etrain.workers.families import num_params
from etrain.workers.protocol.run_config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainingConfig

__all__ = [
    "ALLOCATOR_ENV",
    "ACCURACY_LAYOUTS",
    "ACCURACY_MODEL",
    "INIT_MODEL",
    "AccuracyRow",
    "InitResult",
    "accuracy_table",
    "bench_meta_init",
    "bench_planner_accuracy",
    "init_table",
    "predicted_peak_bytes",
    "within",
]

MiB = 2**20
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
#: ~790M parameters (3 GiB fp32), so the parameters dominate the ~270 MiB runtime both builds carry,
#: and an 8k vocabulary, so no single parameter (the init transient) is large next to the model:
#: 32 blocks of d 1280, SwiGLU 5120, 20 query / 4 key-value heads.
INIT_MODEL = ModelConfig(
    arch="llama", n_layers=32, d_model=1280, n_heads=20, n_kv_heads=4, d_ff=5120, vocab_size=8192, seq_len=64
)
#: ~67M parameters: 6 blocks of d 640 (10 heads, 2 kv heads), SwiGLU 1728, a 32k vocabulary, seq 64.
ACCURACY_MODEL = ModelConfig(
    arch="llama", n_layers=6, d_model=640, n_heads=10, n_kv_heads=2, d_ff=1728, vocab_size=32000, seq_len=64
)
ACCURACY_LAYOUTS = [
    ("DDP ×2", ParallelConfig(dp=2)),
    ("ZeRO-1 ×2", ParallelConfig(dp=2, zero=1)),
    ("ZeRO-2 ×2", ParallelConfig(dp=2, zero=2)),
    ("ZeRO-3 ×2", ParallelConfig(dp=2, zero=3)),
    ("TP ×2", ParallelConfig(tp=2)),
    ("PP ×2 1F1B", ParallelConfig(pp=2, pp_schedule="1f1b")),
]
#: global batch 4 of micro-batch 1: 2 micro-batches per dp rank (accumulation), 4 for TP / PP.
ACCURACY_TRAINING = TrainingConfig(steps=2, global_batch=4, micro_batch=1, lr=1e-4, seed=0)


# -- pure helpers ------------------------------------------------------------------------------------------


def predicted_peak_bytes(total: int, overhead: int, runtime_bytes: int) -> int:
    """The planner's peak with its runtime allowance (``overhead``) replaced by a measured one."""
    return total - overhead + runtime_bytes


def within(ratio: float, tolerance: float) -> bool:
    """Whether measured / predicted is within ``tolerance`` (0.15 = ±15%)."""
    return abs(ratio - 1.0) <= tolerance + 1e-12  # 0.85 - 1 is -0.15000000000000002 in binary


@dataclass(frozen=True)
class InitResult:
    params: int
    meta_zero3_rss: tuple[int, ...]  # bytes, per rank
    full_build_rss: int
    runtime_rss: int
    planned_init: int  # the planner's init phase for the ZeRO-3 ranks, with the measured runtime

    @property
    def ratio(self) -> float:
        return max(self.meta_zero3_rss) / self.full_build_rss


@dataclass(frozen=True)
class AccuracyRow:
    layout: str
    ranks: int
    phase: str  # the planner's peak phase
    predicted: int  # bytes per rank, the worst rank
    measured: int  # peak RSS, the worst rank
    seconds: float

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted


def init_table(result: InitResult) -> str:
    mib = lambda n: f"{n / MiB:.0f}"  # noqa: E731
    lines = [
        f"Llama {INIT_MODEL.n_layers}×{INIT_MODEL.d_model}, {result.params / 1e6:.0f} M parameters "
        f"({4 * result.params / MiB:.0f} MiB fp32); empty rank (runtime) {mib(result.runtime_rss)} MiB.",
        "",
        "| build | ranks | peak RSS per rank (MiB) | above the runtime (MiB) |",
        "|---|---|---|---|",
        f"| `build_model` (whole model, one process) | 1 | {mib(result.full_build_rss)} | "
        f"{mib(result.full_build_rss - result.runtime_rss)} |",
        f"| Trainer, ZeRO-3 ×2, meta-device init | 2 | {' / '.join(mib(r) for r in result.meta_zero3_rss)} | "
        f"{' / '.join(mib(r - result.runtime_rss) for r in result.meta_zero3_rss)} |",
        "",
        f"Meta-device init peak / full build: **{result.ratio:.2f}×** (target ≤ 0.6×). The planner's init phase "
        f"for the ZeRO-3 ranks (shards + the largest parameter drawn whole + its slice, + the measured runtime): "
        f"{mib(result.planned_init)} MiB, measured / planner {max(result.meta_zero3_rss) / result.planned_init:.2f}.",
    ]
    return "\n".join(lines) + "\n"


def accuracy_table(rows: list[AccuracyRow], runtime_bytes: int, params: int) -> str:
    lines = [
        f"Llama {ACCURACY_MODEL.n_layers}×{ACCURACY_MODEL.d_model} ({params / 1e6:.0f} M parameters, vocab "
        f"{ACCURACY_MODEL.vocab_size}), seq {ACCURACY_MODEL.seq_len}, global batch {ACCURACY_TRAINING.global_batch}, "
        f"micro-batch {ACCURACY_TRAINING.micro_batch}, fp32, {ACCURACY_TRAINING.steps} steps; runtime allowance "
        f"= an empty rank's measured RSS, {runtime_bytes / MiB:.0f} MiB.",
        "",
        "| layout | ranks | planner peak phase | planner peak/rank (MiB) | measured peak RSS/rank (MiB) "
        "| measured / planner |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.layout} | {r.ranks} | {r.phase.replace('_', ' ')} | {r.predicted / MiB:.0f} | "
            f"{r.measured / MiB:.0f} | {r.ratio:.2f} |"
        )
    worst = max(rows, key=lambda r: abs(r.ratio - 1))
    verdict = "all within" if all(within(r.ratio, 0.15) for r in rows) else "NOT all within"
    lines += ["", f"Largest deviation: {worst.layout}, {worst.ratio - 1:+.0%}; {verdict} the ±15% target."]
    return "\n".join(lines) + "\n"


# -- rank functions (module level: pickled into spawned processes) -----------------------------------------


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _empty_rank(rank: int, world_size: int) -> int:
    """A rank with the engine imported and the process group up, holding no model: the runtime."""
    import torch
    import torch.distributed as dist

    import etrain.workers.engine.train  # noqa: F401 - the imports a real rank has

    dist.all_reduce(torch.zeros(1))
    return _max_rss()


def _trainer_init_rank(rank: int, world_size: int, config: RunConfig) -> int:
    import torch

    from etrain.workers.engine.train import Trainer

    Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))
    return _max_rss()


def _full_build_rank(rank: int, world_size: int, model: ModelConfig) -> int:
    import etrain.workers.engine.train  # noqa: F401 - the same imports as a Trainer rank
    from etrain.workers.engine.init import build_model

    build_model(model, seed=0)
    return _max_rss()


def _train_rank(rank: int, world_size: int, config: RunConfig) -> int:
    import torch

    from etrain.workers.engine.train import Trainer

    trainer = Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))
    for step in range(config.training.steps):
        trainer.train_step(step)
    return _max_rss()


# -- benchmarks ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def allocator_env() -> Iterator[None]:
    """Spawned ranks inherit :data:`ALLOCATOR_ENV` (glibc reads it when a process starts)."""
    saved = {key: os.environ.get(key) for key in ALLOCATOR_ENV}
    os.environ.update(ALLOCATOR_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def measure_runtime_rss() -> int:
    from tests.dist_utils import run_distributed

    with allocator_env():
        return max(run_distributed(_empty_rank, 2, timeout_s=300))


def _config(model: ModelConfig, parallel: ParallelConfig, training: TrainingConfig) -> RunConfig:
    return RunConfig(
        job_id="bench-memory",
        model=model,
        data=DataConfig(kind="synthetic", seed=0),
        parallel=parallel,
        training=training,
    )


def bench_meta_init(runtime_rss: int) -> InitResult:
    from tests.dist_utils import run_distributed

    config = _config(INIT_MODEL, ParallelConfig(dp=2, zero=3), TrainingConfig(steps=1, global_batch=2, micro_batch=1))
    with allocator_env():
        meta = run_distributed(_trainer_init_rank, 2, config, timeout_s=600)
        (full,) = run_distributed(_full_build_rank, 1, INIT_MODEL, timeout_s=600)
    memory = planner_estimate(config).memory
    planned = predicted_peak_bytes(memory.phases["init"], memory.overhead, runtime_rss)
    return InitResult(
        params=num_params(INIT_MODEL),
        meta_zero3_rss=tuple(meta),
        full_build_rss=full,
        runtime_rss=runtime_rss,
        planned_init=planned,
    )


def planner_estimate(config: RunConfig):
    """The planner's estimate for a RunConfig's layout, through the JobSpec a user would POST."""
    from etrain.service.planning.estimate import estimate
    from etrain.service.planning.spec import JobSpec

    m, p, t = config.model, config.parallel, config.training
    spec = JobSpec.model_validate(
        {
            "name": "bench",
            "model": {
                "kind": "llama",
                "n_layers": m.n_layers,
                "d_model": m.d_model,
                "n_heads": m.n_heads,
                "n_kv_heads": m.kv_heads,
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
            },
            "training": {
                "steps": t.steps,
                "global_batch": t.global_batch,
                "micro_batch": t.micro_batch,
                "precision": t.precision,
            },
        }
    )
    return estimate(spec)


def bench_planner_accuracy(runtime_rss: int, *, log=print) -> list[AccuracyRow]:
    from tests.dist_utils import run_distributed

    rows = []
    for name, parallel in ACCURACY_LAYOUTS:
        config = _config(ACCURACY_MODEL, parallel, ACCURACY_TRAINING)
        memory = planner_estimate(config).memory
        start = time.perf_counter()
        with allocator_env():
            measured = run_distributed(_train_rank, parallel.world_size, config, timeout_s=600)
        rows.append(
            AccuracyRow(
                layout=name,
                ranks=parallel.world_size,
                phase=memory.phase,
                predicted=predicted_peak_bytes(memory.total, memory.overhead, runtime_rss),
                measured=max(measured),
                seconds=time.perf_counter() - start,
            )
        )
        log(
            f"  {name:<14} planner {rows[-1].predicted / MiB:7.0f} MiB  measured {rows[-1].measured / MiB:7.0f} MiB"
            f"  ratio {rows[-1].ratio:.2f}  ({rows[-1].seconds:.0f} s)"
        )
    return rows
