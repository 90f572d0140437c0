"""Context parallelism's ring attention on CPU: what splitting a sequence over cp ranks costs and saves.

Two figures, each on real gloo ranks (``tests.dist_utils``), one thread per rank:

* :func:`bench_ring`: one causal attention, forward and backward (grouped-query: 8 query heads on 2 kv heads
  of 64, one sequence), through the ring op (``etrain::ring_attention``) at cp = 2 and 4, against the same
  attention over the whole sequence in one process (``scaled_dot_product_attention``, torch's CPU flash
  kernel: the peer). The ring's time is its slowest rank's. With ``cp`` ranks each rank multiplies
  ``c² + (cp − 1)·c²/2`` query-key pairs per head (``c = S/cp``) against the peer's ``S²/2``, so the ideal
  ratio is ``(1 + (cp − 1)/2)/cp²·2`` of the peer's time (0.75 at cp=2, 0.31 at cp=4), before the exchanges
  and the merges.
* :func:`bench_checkpointing`: a cp=2 Llama's training step under selective and full activation
  checkpointing (and none), the engine's ``Trainer``: selective keeps the ring op's output, so its backward
  runs no ring, where full replays every block's forward, its ring included; each eagerly and with
  ``training.compile`` (inductor, the ring op inside each block's graph), against eager (the peer).

Medians of ``REPEATS`` timed runs after one warm-up. On 2 cores the ranks share the cores with nothing else
(the peer runs alone); the figures are for the relative costs, not absolute speed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from etrain.workers.protocol.run_config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainingConfig
from tests.dist_utils import run_distributed

__all__ = ["CheckpointingRow", "RingRow", "bench_checkpointing", "bench_ring", "checkpointing_table", "ring_table"]

REPEATS = 5
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
SEQ_LENS = (2048, 4096)
CP_SIZES = (2, 4)


@dataclass(frozen=True)
class RingRow:
    seq_len: int
    cp: int
    ring_s: float  # the slowest rank's median forward + backward
    peer_s: float  # whole-sequence SDPA, one process

    @property
    def ratio(self) -> float:
        return self.ring_s / self.peer_s

    @property
    def ideal(self) -> float:
        """The share of the peer's query-key pairs a ring rank multiplies (its own block causal, the rest half)."""
        return (1 + (self.cp - 1) / 2) / self.cp**2 * 2


def _inputs(seq_len: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    shapes = [(1, HEADS, seq_len, HEAD_DIM), (1, KV_HEADS, seq_len, HEAD_DIM), (1, KV_HEADS, seq_len, HEAD_DIM)]
    q, k, v = (torch.randn(shape, generator=generator) for shape in shapes)
    return q, k, v, torch.randn(q.shape, generator=generator)


def _timed(run) -> float:
    run()  # warm-up
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ring_rank(rank: int, world_size: int, seq_len: int) -> float:
    import torch
    import torch.distributed as dist

    from etrain.workers.families.ring_attention import ring_attention, shard_sequence

    torch.set_num_threads(1)
    q, k, v, grad = (shard_sequence(t, world_size, rank, dim=2) for t in _inputs(seq_len))

    def run() -> None:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ring_attention(*leaves, group=dist.group.WORLD, seq_len=seq_len).backward(grad)
        dist.barrier()

    return _timed(run)


def _peer_rank(rank: int, world_size: int, seq_len: int) -> float:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    q, k, v, grad = _inputs(seq_len)
    repeat = HEADS // KV_HEADS

    def run() -> None:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        key, value = (t.repeat_interleave(repeat, dim=1) for t in leaves[1:])
        F.scaled_dot_product_attention(leaves[0], key, value, is_causal=True).backward(grad)

    return _timed(run)


def bench_ring(seq_lens=SEQ_LENS, cp_sizes=CP_SIZES, log=print) -> list[RingRow]:
    rows = []
    for seq_len in seq_lens:
        (peer,) = run_distributed(_peer_rank, 1, seq_len, timeout_s=600)
        for cp in cp_sizes:
            ring = max(run_distributed(_ring_rank, cp, seq_len, timeout_s=600))
            rows.append(RingRow(seq_len=seq_len, cp=cp, ring_s=ring, peer_s=peer))
            log(f"  ring cp={cp} seq {seq_len}: {ring:.3f} s against {peer:.3f} s whole ({ring / peer:.2f}x)")
    return rows


def ring_table(rows: list[RingRow]) -> str:
    lines = [
        f"One causal attention, forward and backward ({HEADS} query heads on {KV_HEADS} kv heads of {HEAD_DIM}, "
        f"one sequence), gloo, one thread per rank; medians of {REPEATS} after a warm-up.",
        "",
        "| seq_len | cp | ring, slowest rank (s) | whole sequence in one process (s) | ratio | query-key pairs per rank / whole |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.seq_len} | {r.cp} | {r.ring_s:.3f} | {r.peer_s:.3f} | {r.ratio:.2f}× | {r.ideal:.2f} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class CheckpointingRow:
    mode: str
    step_s: float  # the slowest rank's median step
    peak_rss_mb: float
    compiled: bool = False
    first_step_s: float = 0.0  # the slowest rank's first step (compiling, where compiled)


CHECKPOINTING_MODEL = ModelConfig(
    arch="llama", n_layers=4, d_model=256, n_heads=8, n_kv_heads=2, d_ff=512, vocab_size=512, seq_len=2048
)


def _checkpointing_config(mode: str, steps: int, compiled: bool = False) -> RunConfig:
    return RunConfig(
        job_id="bench-ring",
        model=CHECKPOINTING_MODEL,
        data=DataConfig(kind="synthetic", seed=0),
        parallel=ParallelConfig(cp=2),
        training=TrainingConfig(
            steps=steps,
            global_batch=2,
            micro_batch=1,
            lr=1e-3,
            seed=0,
            activation_checkpointing=mode,
            compile=compiled,
        ),
    )


def _checkpointing_rank(rank: int, world_size: int, config: RunConfig) -> dict:
    import torch

    from etrain.workers.engine.train import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))
    metrics = [trainer.train_step(step) for step in range(config.training.steps)]
    return {
        "step_s": statistics.median(m.step_s for m in metrics[1:]),
        "first_s": metrics[0].step_s,
        "peak": max(m.peak_mem_bytes for m in metrics),
    }


def bench_checkpointing(steps: int = 6, log=print) -> list[CheckpointingRow]:
    rows = []
    for compiled in (False, True):
        for mode in ("none", "selective", "full"):
            config = _checkpointing_config(mode, steps, compiled)
            results = run_distributed(_checkpointing_rank, 2, config, timeout_s=600)
            rows.append(
                CheckpointingRow(
                    mode=mode,
                    step_s=max(r["step_s"] for r in results),
                    peak_rss_mb=max(r["peak"] for r in results) / 2**20,
                    compiled=compiled,
                    first_step_s=max(r["first_s"] for r in results),
                )
            )
            row = rows[-1]
            log(
                f"  cp=2 {mode:<9} {'compiled' if compiled else 'eager':<8} {row.step_s:.3f} s/step "
                f"(first {row.first_step_s:.1f} s), peak RSS {row.peak_rss_mb:.0f} MiB"
            )
    return rows


def checkpointing_table(rows: list[CheckpointingRow]) -> str:
    m = CHECKPOINTING_MODEL
    base = next(r for r in rows if r.mode == "none" and not r.compiled).step_s
    lines = [
        f"A cp=2 Llama ({m.n_layers} layers of {m.d_model}, {m.n_heads} heads on {m.n_kv_heads} kv heads, "
        f"seq_len {m.seq_len}, two sequences per step in micro-batches of one, fp32), the engine's Trainer on two gloo "
        "ranks, one thread each; the median step after the first.",
        "",
        "| activation_checkpointing | blocks | step (s) | × none, eager | × eager (same mode) | first step (s) "
        "| peak RSS/rank (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    eager = {r.mode: r.step_s for r in rows if not r.compiled}
    for r in rows:
        blocks = "compiled (inductor)" if r.compiled else "eager"
        lines.append(
            f"| {r.mode} | {blocks} | {r.step_s:.3f} | {r.step_s / base:.2f}× | {r.step_s / eager[r.mode]:.2f}× "
            f"| {r.first_step_s:.1f} | {r.peak_rss_mb:.0f} |"
        )
    return "\n".join(lines) + "\n"
