"""The Trainer's contracts beyond equivalence, on two real gloo ranks (no Ray).

* timing: a slow rank shows high ``compute_s`` and its peer high ``comm_wait_s`` (on timing-sync
  steps, here every step);
* gradient accumulation does not synchronise on intermediate micro-steps (DDP and FSDP2);
* ZeRO-1 shards the optimizer state over the dp ranks;
* a non-finite loss on one rank raises ``NonFiniteLossError`` naming the step on every rank;
* callbacks fire in order, and the metrics are complete and identical where they must be;
* ``save`` / ``restore`` continue a run exactly, even into another layout (ZeRO-3 → TP).

All scenarios run in one spawned 2-rank job (process start-up dominates on 2 cores); each test
asserts on its part of the report.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from etrain.workers.protocol.errors import NonFiniteLossError
from etrain.workers.protocol.run_config import ParallelConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import small_config
from tests.state_utils import full_state_dict

SLOW_S = 0.25


class _Recorder:
    """Records every hook call; optionally sleeps on one rank (a chaos-style slow rank)."""

    def __init__(self, slow_rank: int | None = None):
        self.calls: list[tuple] = []
        self.slow_rank = slow_rank

    def on_step_start(self, trainer, step):
        self.calls.append(("start", step))

    def on_compute(self, trainer, step, micro_step):
        self.calls.append(("compute", step, micro_step))
        if trainer.rank == self.slow_rank:
            time.sleep(SLOW_S)

    def on_step_end(self, trainer, metrics):
        self.calls.append(("end", metrics.step))


class _GradProbe:
    """Before the last micro-step: what gradient synchronisation has happened so far."""

    def __init__(self):
        self.before_last: dict | None = None

    def on_compute(self, trainer, step, micro_step):
        if micro_step == trainer.grad_accum_steps - 1:
            params = [p for m in trainer.model_parts for p in m.parameters()]
            grads = [p.grad for p in params]
            self.before_last = {
                "all_none": all(g is None for g in grads),
                "first": None if grads[0] is None else grads[0].detach().clone(),
            }


class _PoisonOnRank0:
    def on_compute(self, trainer, step, micro_step):
        if step == 1 and trainer.rank == 0:
            with torch.no_grad():
                next(trainer.model_parts[0].parameters()).fill_(float("nan"))


def _trainer(rank, world_size, parallel, callbacks=(), **training):
    from etrain.workers.engine.train import Trainer

    config = small_config(parallel=parallel, **{"steps": 3, **training})
    return Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"), callbacks=callbacks)


def _resume(rank: int, world_size: int, directory: str) -> dict:
    """Save after 2 steps of ZeRO-3, go on to step 4; restore the save under TP and redo steps 2-3."""
    import torch.distributed as dist

    from etrain.workers.checkpoints.checkpoint_commit import commit

    first = _trainer(rank, world_size, ParallelConfig(dp=2, zero=3), steps=4)
    first.run(0, 2)
    report = first.save(directory)
    reports = [None] * world_size
    dist.all_gather_object(reports, report)
    if rank == 0:
        commit(directory, 2, first.config.parallel.describe(), world_size, reports)
    dist.barrier()
    straight = [m.loss for m in first.run(2, 4)]
    straight_params = full_state_dict(first)

    second = _trainer(rank, world_size, ParallelConfig(tp=2), steps=4)
    next_step = second.restore(directory)
    resumed = [m.loss for m in second.run(next_step, 4)]
    resumed_params = full_state_dict(second)
    return {
        "next_step": next_step,
        "straight": straight,
        "resumed": resumed,
        "max_param_diff": max((resumed_params[k] - v).abs().max().item() for k, v in straight_params.items()),
    }


def _scenarios(rank: int, world_size: int, directory: str) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    report: dict = {"resume": _resume(rank, world_size, directory)}

    recorder = _Recorder(slow_rank=1)
    # Every step a timing-sync step: the test reads step 2's compute / wait split.
    trainer = _trainer(rank, world_size, ParallelConfig(dp=2), callbacks=[recorder], timing_sync_every=1)
    report["timed"] = [dataclasses.asdict(trainer.train_step(s)) for s in range(3)]
    report["calls"] = recorder.calls
    report["grad_accum_steps"] = trainer.grad_accum_steps

    for zero in (0, 2):
        probe = _GradProbe()
        trainer = _trainer(rank, world_size, ParallelConfig(dp=2, zero=zero), callbacks=[probe])
        trainer.train_step(0)
        report[f"probe_zero{zero}"] = probe.before_last

    trainer = _trainer(rank, world_size, ParallelConfig(dp=2, zero=1))
    optimizer = trainer.optimizers[0]
    trainer.train_step(0)
    report["zero1"] = {
        "is_zero": isinstance(optimizer, ZeroRedundancyOptimizer),
        "local_numel": sum(p.numel() for g in optimizer.optim.param_groups for p in g["params"]),
        "local_state": sum(1 for s in optimizer.optim.state.values() if s),
        "total_numel": sum(p.numel() for p in trainer.model_parts[0].parameters()),
    }

    trainer = _trainer(rank, world_size, ParallelConfig(dp=2), callbacks=[_PoisonOnRank0()])
    trainer.train_step(0)
    try:
        trainer.train_step(1)
        report["nan"] = None
    except NonFiniteLossError as error:
        report["nan"] = (error.field, str(error))
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("checkpoints") / "step_00000002")
    return run_distributed(_scenarios, 2, directory, timeout_s=180.0)


def test_a_slow_rank_shows_compute_and_its_peer_shows_waiting(reports) -> None:
    # Step 2: DDP syncs its rebuilt gradient buckets in the first forward of step 1, a one-off
    # collective inside the compute region.
    fast, slow = (r["timed"][2] for r in reports)
    sleeps = SLOW_S * reports[1]["grad_accum_steps"]
    assert slow["compute_s"] >= sleeps
    assert fast["compute_s"] < slow["compute_s"] - 0.5 * sleeps
    assert fast["comm_wait_s"] >= 0.6 * sleeps
    assert slow["comm_wait_s"] < fast["comm_wait_s"]
    for metrics in (fast, slow):
        assert metrics["step_s"] >= metrics["compute_s"] + metrics["comm_wait_s"] - 1e-3


def test_metrics_are_complete_and_the_loss_is_global(reports) -> None:
    config = small_config()
    for step in range(3):
        rank0, rank1 = (r["timed"][step] for r in reports)
        assert rank0["loss"] == rank1["loss"] and rank0["grad_norm"] == rank1["grad_norm"]
        assert rank0["tokens"] == config.training.global_batch * config.model.seq_len
        assert rank0["tokens_per_s"] == pytest.approx(rank0["tokens"] / rank0["step_s"])
        assert rank0["flops_per_s"] > 0 and rank0["mfu"] is None  # no known peak on CPU
        assert rank0["peak_mem_bytes"] > 0 and rank0["lr"] > 0


def test_callbacks_fire_in_order_inside_each_step(reports) -> None:
    micro = reports[0]["grad_accum_steps"]
    expected = []
    for step in range(3):
        expected += [("start", step)] + [("compute", step, m) for m in range(micro)] + [("end", step)]
    assert [tuple(c) for c in reports[0]["calls"]] == expected


def test_ddp_does_not_synchronise_before_the_last_micro_step(reports) -> None:
    g0, g1 = (r["probe_zero0"]["first"] for r in reports)
    assert g0 is not None and not torch.allclose(g0, g1), "dp ranks' local gradients must differ"


def test_fsdp_does_not_reduce_scatter_before_the_last_micro_step(reports) -> None:
    # FSDP2 assigns the sharded .grad only when it reduce-scatters.
    assert all(r["probe_zero2"]["all_none"] for r in reports)


def test_zero1_shards_the_optimizer_state(reports) -> None:
    zero = [r["zero1"] for r in reports]
    assert all(z["is_zero"] for z in zero)
    total = zero[0]["total_numel"]
    assert sum(z["local_numel"] for z in zero) == total
    assert all(0 < z["local_numel"] < total and z["local_state"] > 0 for z in zero)


def test_a_non_finite_loss_on_one_rank_stops_every_rank(reports) -> None:
    for report in reports:
        assert report["nan"] is not None
        field, message = report["nan"]
        assert "step 1" in message and field == "training.lr"


def test_restore_continues_exactly_in_another_layout(reports) -> None:
    for report in (r["resume"] for r in reports):
        assert report["next_step"] == 2
        for got, want in zip(report["resumed"], report["straight"], strict=True):
            assert abs(got - want) <= 1e-5 * want
        assert report["max_param_diff"] <= 1e-4
