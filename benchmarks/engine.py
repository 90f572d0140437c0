"""Engine-level figures (no Ray, no service): real gloo ranks from ``tests.dist_utils.run_distributed``.

* **6, checkpoints** (:func:`checkpoint_figure`): DP2 ``Trainer`` ranks of a 5 M-parameter GPT (a 64 MB
  checkpoint with AdamW state). Rounds take turns, round-robin: no save / a synchronous
  ``save_checkpoint`` / an ``AsyncCheckpointer.save``, each followed by ``K`` training steps and, for the
  async save, the wait for its write if it is still running (what the next save would block on). A
  round's *overhead* is its wall time minus the median no-save round: everything a save costs the
  training loop, blocking copy, contention from the background write and the final wait included.
  Then save MB/s (bytes the ranks wrote / the slowest rank's synchronous save), load MB/s into the same
  layout (with the manifest's SHA-256 verification, as production loads), and the same checkpoint
  restored into ZeRO-3 x2 (DCP reshards by FQN), compared with the same-layout load and checked
  bit-equal to the saved parameters.
* **7, pipeline bubble** (:func:`bubble_figure`): the method of ``tests/integration/
  test_pipeline_bubble.py``, shared with it (``tests/pipeline_timing.py``: two gloo stages, GPipe, busy
  time from ``PipelineRunner``'s own timing, steps in which a rank lost its core left out) at M = 2, 4, 8, 16 micro-batches, against
  (P-1)/(M+P-1).
* **8, steady state** (:func:`steady_state_figure`): ``benchmarks/run.py``'s DDP x2 rows, etrain's
  ``Trainer`` against its bare torch DDP loop, alternating runs; speed ratio = peer step / etrain step.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import time
from typing import Any

from benchmarks.figures import Goal, Row
from etrain.workers.protocol.run_config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainingConfig

# -- 8: steady state ---------------------------------------------------------------------------------------


def steady_state_figure(*, reps: int, steps: int, log=print) -> tuple[list[Row], dict[str, Any]]:
    from benchmarks import run as throughput
    from tests.dist_utils import run_distributed

    config = throughput.bench_config(steps, ParallelConfig(dp=2))
    samples: dict[str, list[float]] = {"etrain": [], "peer": []}
    for rep in range(reps):
        order = ("etrain", "peer") if rep % 2 == 0 else ("peer", "etrain")
        for side in order:
            fn = throughput._etrain_rank if side == "etrain" else throughput._peer_ddp_rank
            ranks = run_distributed(fn, 2, config, timeout_s=300)
            samples[side].append(1e3 * max(r["step_s"] for r in ranks))  # the slower rank sets the pace
            log(f"  steady state rep {rep + 1}/{reps} {side:<6} {samples[side][-1]:7.1f} ms/step")
    row = Row(
        label="8. steady-state step time, DDP ×2 (speed vs a bare torch DDP loop)",
        unit="ms",
        etrain=samples["etrain"],
        reference_name="bare torch DDP loop (benchmarks/run.py)",
        reference=samples["peer"],
        ratio="reference/etrain",
        goal=Goal(on="ratio", op=">=", value=0.97, text="≥ 0.97× the DDP loop's speed"),
        note=f"model 4×128, seq 64, global batch 16, micro 4; median of {steps - throughput.WARMUP_STEPS} steps "
        "after warm-up per run",
    )
    return [row], {"config": {"steps": steps, "model": "4x128 d, vocab 256, seq 64"}, "samples_ms": samples}


# -- 6: checkpoints ---------------------------------------------------------------------------------------

CHECKPOINT_MODEL = ModelConfig(n_layers=4, d_model=256, n_heads=4, vocab_size=4096, seq_len=64)


def _config(parallel: ParallelConfig) -> RunConfig:
    return RunConfig(
        job_id="bench-ckpt",
        model=CHECKPOINT_MODEL,
        data=DataConfig(kind="synthetic", seed=0),
        parallel=parallel,
        training=TrainingConfig(steps=10_000, global_batch=8, micro_batch=4, seed=0),
    )


def _digest(state: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _checkpoint_rank(
    rank: int, world_size: int, root: str, rounds: int, steps_between: int, loads: int
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from etrain.workers.checkpoints.checkpoint import AsyncCheckpointer, load_checkpoint, save_checkpoint
    from etrain.workers.checkpoints.checkpoint_commit import commit
    from etrain.workers.engine.train import Trainer
    from tests.state_utils import full_state_dict

    def barrier_max(seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    trainer = Trainer(_config(ParallelConfig(dp=2)), rank=rank, world_size=world_size, device=torch.device("cpu"))
    step = 0
    for _ in range(2):  # warm-up
        trainer.train_step(step)
        step += 1
    checkpointer = AsyncCheckpointer()
    walls: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    save_s: dict[str, list[float]] = {"sync": [], "async": []}
    bytes_written: list[int] = []
    async_pending_at_end: list[bool] = []
    modes = ["none", "sync", "async"]
    for round_index in range(rounds):
        for mode in modes[round_index % 3 :] + modes[: round_index % 3]:  # rotate who goes first
            directory = os.path.join(root, f"r{round_index}-{mode}")
            dist.barrier()
            started = time.perf_counter()
            pending = None
            if mode != "none":
                model_parts, optimizers, extra = trainer.state_for_checkpoint()
                if mode == "sync":
                    report = save_checkpoint(directory, model_parts, optimizers, extra)
                    sizes = torch.tensor([sum(f.size for f in report.files)])
                    dist.all_reduce(sizes)
                    bytes_written.append(int(sizes.item()))
                else:
                    pending = checkpointer.save(directory, model_parts, optimizers, extra)
                save_s[mode].append(barrier_max(time.perf_counter() - started))
            for _ in range(steps_between):
                trainer.train_step(step)
                step += 1
            if pending is not None:
                async_pending_at_end.append(not pending.done())
                pending.wait(600.0)
            walls[mode].append(barrier_max(time.perf_counter() - started))
    checkpointer.close()

    # One committed checkpoint of the current state, then loads into this layout and into ZeRO-3 x2.
    directory = os.path.join(root, "committed")
    model_parts, optimizers, extra = trainer.state_for_checkpoint()
    report = save_checkpoint(directory, model_parts, optimizers, extra)
    reports: list[Any] = [None] * world_size
    dist.all_gather_object(reports, report)
    if rank == 0:
        commit(directory, step, "dp2", world_size, reports)
    dist.barrier()
    total = sum(f.size for r in reports for f in r.files)
    saved_digest = _digest(full_state_dict(trainer))

    def timed_loads(into: Trainer) -> list[float]:
        """``loads`` loads of the committed checkpoint into ``into``, the slowest rank's seconds each."""
        seconds = []
        for _ in range(loads):
            dist.barrier()
            started = time.perf_counter()
            load_checkpoint(directory, into.model_parts, into.optimizers)
            seconds.append(barrier_max(time.perf_counter() - started))
        return seconds

    same_layout = timed_loads(trainer)
    del trainer
    resharded = Trainer(
        _config(ParallelConfig(dp=2, zero=3)), rank=rank, world_size=world_size, device=torch.device("cpu")
    )
    other_layout = timed_loads(resharded)
    restored_equal = _digest(full_state_dict(resharded)) == saved_digest
    return {
        "walls": walls,
        "save_s": save_s,
        "bytes_written": bytes_written,
        "async_still_writing_after_k_steps": async_pending_at_end,
        "checkpoint_bytes": total,
        "load_same_s": same_layout,
        "load_zero3_s": other_layout,
        "restored_equal": restored_equal,
    }


def checkpoint_figure(*, rounds: int, steps_between: int, loads: int, log=print) -> tuple[list[Row], dict[str, Any]]:
    from tests.dist_utils import run_distributed

    with tempfile.TemporaryDirectory(prefix="etrain-bench-ckpt-") as root:
        results = run_distributed(_checkpoint_rank, 2, root, rounds, steps_between, loads, timeout_s=600)
    r = results[0]  # every timing was max-reduced over the ranks
    baseline = statistics.median(r["walls"]["none"])
    overhead = {mode: [1e3 * (w - baseline) for w in r["walls"][mode]] for mode in ("sync", "async")}
    mb = r["checkpoint_bytes"] / 1e6
    save_rates = [b / 1e6 / s for b, s in zip(r["bytes_written"], r["save_s"]["sync"])]
    load_same = [mb / s for s in r["load_same_s"]]
    load_zero3 = [mb / s for s in r["load_zero3_s"]]
    log(
        f"  checkpoint {mb:.0f} MB: overhead sync {statistics.median(overhead['sync']):.0f} ms, async "
        f"{statistics.median(overhead['async']):.0f} ms per save; save {statistics.median(save_rates):.0f} MB/s, "
        f"load {statistics.median(load_same):.0f} MB/s, into ZeRO-3 {statistics.median(load_zero3):.0f} MB/s, "
        f"bit-equal {r['restored_equal']}"
    )
    every = f"{steps_between} steps between saves"
    rows = [
        Row(
            label="6a. checkpoint overhead per save, async vs sync",
            unit="ms",
            etrain=overhead["async"],
            reference_name="etrain sync save",
            reference=overhead["sync"],
            note=f"{mb:.0f} MB checkpoint (GPT 4×256, vocab 4096, AdamW), DP2; {every}; per training step at "
            f"that cadence: divide by {steps_between}",
        ),
        Row(label="6b. checkpoint save (sync), all ranks", unit="MB/s", etrain=save_rates),
        Row(label="6c. checkpoint load into the same layout (SHA-256 verified)", unit="MB/s", etrain=load_same),
        Row(
            label="6d. restore DP2 → ZeRO-3 ×2 (resharded) vs same-layout load",
            unit="MB/s",
            etrain=load_zero3,
            reference_name="same-layout load",
            reference=load_same,
            note="parameters bit-equal after the reshard: " + ("yes" if r["restored_equal"] else "NO"),
        ),
    ]
    raw = {
        "rank0": r,
        "baseline_round_s": baseline,
        "steps_between": steps_between,
        "model": "GPT 4x256, vocab 4096, seq 64",
        "filesystem": _filesystem(tempfile.gettempdir()),
    }
    return rows, raw


def _filesystem(path: str) -> str:
    """The mount a path is on and its type (save/load MB/s depend on it): the longest matching mount."""
    try:
        best = ("", "")
        with open("/proc/mounts") as mounts:
            for line in mounts:
                _, point, kind = line.split()[:3]
                if os.path.realpath(path).startswith(point) and len(point) > len(best[0]):
                    best = (point, kind)
        return f"{best[0]} ({best[1]})"
    except OSError:
        return "unknown"


# -- 7: pipeline bubble -----------------------------------------------------------------------------------

BUBBLE_MS = (2, 4, 8, 16)
MIN_CLEAN_STEPS = 3


def _bubble_rank(rank: int, world_size: int, ms: tuple[int, ...], wanted: int, budget_s: float) -> dict[str, Any]:
    """The test's measurement (``tests.pipeline_timing``) of GPipe at each M, as idle fractions by M."""
    from tests.pipeline_timing import time_pipeline_steps

    timed = time_pipeline_steps(rank, world_size, [("gpipe", 1, m) for m in ms], wanted, budget_s)
    return {
        "clean": {m: [t.idle_fraction for t in timed["clean"][("gpipe", 1, m)]] for m in ms},
        "all": {m: timed["all"][("gpipe", 1, m)] for m in ms},
        "steps_seen": sum(len(steps) for steps in timed["all"].values()),
    }


def bubble_figure(*, wanted: int, budget_s: float, log=print) -> tuple[list[Row], dict[str, Any]]:
    from tests.dist_utils import run_distributed
    from tests.pipeline_timing import MAX_DESCHEDULED, PP, bubble

    per_rank = run_distributed(_bubble_rank, PP, BUBBLE_MS, wanted, budget_s, timeout_s=budget_s + 180)
    rows = []
    for m in BUBBLE_MS:
        # a step's idle fraction = the mean over the two stages (each stage idles (P-1)/(M+P-1) in theory)
        steps = [statistics.mean(pair) for pair in zip(*(r["clean"][m] for r in per_rank))]
        note = f"{len(steps)} clean steps (both ranks had ≥ {1 - MAX_DESCHEDULED:.0%} of a core while computing)"
        if len(steps) < MIN_CLEAN_STEPS:
            # Too loaded to find clean steps: every step, said in the note rather than dropping the figure
            # (a descheduled rank stretches its own busy time and its peer's wait alike).
            pairs = list(zip(*(r["all"][m] for r in per_rank)))
            steps = [statistics.mean(idle for idle, _ in pair) for pair in pairs]
            worst = statistics.median(max(d for _, d in pair) for pair in pairs) if pairs else float("nan")
            note = (
                f"machine too loaded for clean steps (median step: a rank descheduled {worst:.0%} of its compute); "
                f"all {len(steps)} steps, unreliable: descheduled time lands in both busy and wait time"
            )
        formula = bubble(m)
        rows.append(
            Row(
                label=f"7. pipeline bubble, GPipe P=2, M={m}",
                unit="fraction",
                etrain=steps,
                reference_name="(P-1)/(M+P-1)",
                reference=[formula],
                goal=Goal(on="difference", op="<=", value=0.12, text="within ±0.12 of the formula (the test's band)"),
                note=note,
            )
        )
        log(
            f"  bubble M={m:<2} measured {statistics.median(steps) if steps else float('nan'):.3f} "
            f"formula {formula:.3f} ({note})"
        )
    raw = {
        "clean_idle_fractions": {str(m): [r["clean"][m] for r in per_rank] for m in BUBBLE_MS},
        "all_steps_idle_descheduled": {str(m): [r["all"][m] for r in per_rank] for m in BUBBLE_MS},
        "steps_seen": per_rank[0]["steps_seen"],
        "model": "GPT 8x256, seq 64, micro-batch 4",
        "max_descheduled": MAX_DESCHEDULED,
    }
    return rows, raw


__all__ = ["CHECKPOINT_MODEL", "bubble_figure", "checkpoint_figure", "steady_state_figure"]
