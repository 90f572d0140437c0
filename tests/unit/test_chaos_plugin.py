"""Fault drills are an opt-in plugin: loaded only when the launch plan enables them, and then exact.

Rank side: ``etrain.workers.rank.chaos.RankDrills`` (arming by id, firing at a step or inside a save, the slow
and hang drills) and the worker's gate (``TrainWorker._arm_drills``: no plugin, no callback and a refused
``chaos`` call without ``LaunchPlan.chaos_enabled``). Service side: ``etrain.service.runtime.chaos_drills``
(orders from requests, arming, the checkpoint corruption on real files). The import checks run in a fresh
interpreter, so nothing the test process already loaded can hide an import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from etrain.service.runtime.chaos_drills import CorruptOrder, JobDrills
from etrain.workers.checkpoints.checkpoint_commit import step_dir
from etrain.workers.protocol.messages import ChaosOrder
from etrain.workers.rank.chaos import RankDrills
from etrain.workers.rank.host_memory import host_memory_use

REPO = Path(__file__).resolve().parents[2]

_GATE = r"""
import json, sys
from etrain.workers.protocol.messages import ChaosOrder, LaunchPlan
from etrain.workers.protocol.run_config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainingConfig
import etrain.service.runtime.supervisor_actor, etrain.service.runtime.worker_group  # the service's side
answer = {"service_loaded": sorted(m for m in sys.modules if m in (
    "etrain.workers.rank.worker", "etrain.workers.rank.chaos", "etrain.service.runtime.chaos_drills", "torch"))}
import etrain.workers.rank.spare  # what a warm spare loads before its job: the drill plugin is not part of it
from etrain.workers.rank.worker import TrainWorker
answer["rank_loaded"] = sorted(m for m in sys.modules if m in ("etrain.workers.rank.chaos", "torch"))

config = RunConfig(job_id="gate", model=ModelConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16),
                   data=DataConfig(), parallel=ParallelConfig(), training=TrainingConfig(steps=4, global_batch=2, micro_batch=2))
order = ChaosOrder(id=7, action="slow_rank", rank=0, factor=2.0, at_step=3)
worker = TrainWorker(job_id="gate", rank=0, world_size=1, supervisor=None)
answer["callbacks_off"] = len(worker._arm_drills(LaunchPlan(attempt=1, config=config, start_step=0, resume_dir=None,
                                                            chaos=(order,))))
answer["chaos_loaded_off"] = "etrain.workers.rank.chaos" in sys.modules
try:
    worker.chaos(order)
except RuntimeError as err:
    answer["refused"] = str(err)
on = LaunchPlan(attempt=2, config=config, start_step=0, resume_dir=None, chaos=(order,), chaos_enabled=True)
callbacks = worker._arm_drills(on)
answer["callbacks_on"] = [type(cb).__name__ for cb in callbacks]
answer["chaos_loaded_on"] = "etrain.workers.rank.chaos" in sys.modules
answer["same_drills_next_attempt"] = worker._arm_drills(on)[0] is callbacks[0]
print(json.dumps(answer))
"""


def test_the_default_path_never_loads_the_drill_plugin(tmp_path):
    result = subprocess.run([sys.executable, "-c", _GATE], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    # The service's runtime modules load without the worker actor module, either drill module or torch.
    assert answer["service_loaded"] == []
    assert answer["rank_loaded"] == []
    assert (answer["callbacks_off"], answer["chaos_loaded_off"]) == (0, False)
    assert answer["refused"] == (
        "rank 0 of job gate refuses chaos order 7 (slow_rank): fault drills are disabled for this job (its launch "
        "plan has chaos_enabled=False); they run only on servers started with ETRAIN_ENABLE_CHAOS=1 "
        "(`etrain serve --enable-chaos`)"
    )
    assert (answer["callbacks_on"], answer["chaos_loaded_on"]) == (["ChaosCallback"], True)
    assert answer["same_drills_next_attempt"] is True  # a kept process keeps its drills (in-place repair)


def _drills(rank: int = 0, *, fail_reports: bool = False) -> tuple[RankDrills, list]:
    reports: list = []

    def report(order: ChaosOrder, step: int | None) -> None:
        reports.append((order.id, step))
        if fail_reports:
            raise TimeoutError("supervisor gone")

    return RankDrills(rank=rank, report=report), reports


def test_an_armed_order_fires_once_at_its_step_even_when_delivered_twice():
    drills, reports = _drills(rank=1)
    order = ChaosOrder(id=3, action="slow_rank", rank=1, factor=2.5, at_step=4)
    drills.arm(order)  # in the launch plan ...
    drills.receive(order)  # ... and by a call once the group is up
    drills.arm(ChaosOrder(id=4, action="hang_rank", rank=0, at_step=0))  # another rank's: not ours
    for step in range(4):
        drills.fire_due(step)
    assert (drills.slow_factor, reports) == (1.0, [])
    drills.fire_due(4)
    drills.fire_due(5)
    assert (drills.slow_factor, reports, drills.hung.is_set()) == (2.5, [(3, 4)], False)


def test_an_immediate_order_fires_on_delivery_and_a_save_kill_waits_for_its_save():
    drills, reports = _drills()
    drills.receive(ChaosOrder(id=1, action="hang_rank", rank=0))
    assert drills.hung.is_set() and reports == [(1, None)]
    drills.receive(ChaosOrder(id=2, action="slow_rank", rank=0, factor=3.0, at_step=0, during="checkpoint_write"))
    drills.fire_due(8)  # the start of step 8: not a save
    drills.fire_due(8, "checkpoint_commit")  # another moment of the save
    assert drills.slow_factor == 1.0
    drills.fire_due(8, "checkpoint_write")
    assert (drills.slow_factor, reports) == (3.0, [(1, None), (2, 8)])


def test_a_drill_fires_even_when_its_report_fails():
    drills, reports = _drills(fail_reports=True)
    drills.receive(ChaosOrder(id=9, action="slow_rank", rank=0, factor=4.0))
    assert (drills.slow_factor, reports) == (4.0, [(9, None)])


def test_the_memory_drill_holds_its_own_pages_and_a_new_size_replaces_the_old():
    """The held bytes are written (the rank's anonymous pages, what its sampler reads), a second order replaces
    the first rather than adding to it, and ``gib: 0`` lets go."""
    drills, reports = _drills()
    before = host_memory_use().anonymous
    drills.receive(ChaosOrder(id=1, action="hold_host_memory", rank=0, gib=0.125))
    assert sum(map(len, drills.held_memory)) == 128 << 20 and reports == [(1, None)]
    if before is not None:
        assert host_memory_use().anonymous - before >= 120 << 20
    drills.receive(ChaosOrder(id=2, action="hold_host_memory", rank=0, gib=0.0625))
    assert sum(map(len, drills.held_memory)) == 64 << 20
    drills.receive(ChaosOrder(id=3, action="hold_host_memory", rank=0, gib=0))
    assert drills.held_memory is None and [order for order, _ in reports] == [1, 2, 3]
    from etrain.workers.rank import chaos

    def too_much(nbytes):
        raise MemoryError(nbytes)

    drills.receive(ChaosOrder(id=4, action="hold_host_memory", rank=0, gib=0.5))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chaos, "_written_bytes", too_much)
        with pytest.raises(MemoryError):  # more than the node has: the error rises where it fired
            drills.receive(ChaosOrder(id=5, action="hold_host_memory", rank=0, gib=4096))
    assert drills.held_memory is None and reports[-1] == (5, None)  # reported all the same: never re-armed
    order, answer = JobDrills(root="unused", record=lambda *_: None).order(
        {"action": "hold_host_memory", "rank": 3, "gib": 1.5}
    )
    assert order == ChaosOrder(id=1, action="hold_host_memory", rank=3, gib=1.5) and answer["gib"] == 1.5


def test_the_slow_drill_multiplies_the_measured_compute():
    """Each micro-step sleeps (factor - 1) x the last step's own compute per micro-step, sleep excluded."""
    drills, _ = _drills()
    callback = drills.callback
    callback.on_step_start(None, 0)
    for micro in range(2):
        callback.on_compute(None, 0, micro)
    callback.on_step_end(None, SimpleNamespace(compute_s=0.04))  # 0.02 s per micro-step, unslowed
    drills.receive(ChaosOrder(id=1, action="slow_rank", rank=0, factor=3.0))
    callback.on_step_start(None, 1)
    started = time.perf_counter()
    for micro in range(2):
        callback.on_compute(None, 1, micro)
    slept = time.perf_counter() - started
    assert 0.08 <= slept < 0.5  # 2 x (3 - 1) x 0.02 s
    assert callback._slept_s == pytest.approx(0.08)
    callback.on_step_end(None, SimpleNamespace(compute_s=0.04 + 0.08))
    assert callback._per_micro_s == pytest.approx(0.02)  # the next step's sleep is sized on the unslowed compute
    # factor 1 ends the slowdown: the next step sleeps nothing.
    drills.receive(ChaosOrder(id=2, action="slow_rank", rank=0, factor=1.0))
    callback.on_step_start(None, 2)
    for micro in range(2):
        callback.on_compute(None, 2, micro)
    assert drills.slow_factor == 1.0 and callback._slept_s == 0.0


def test_job_drills_turn_requests_into_orders_and_arm_them():
    events: list[tuple[str, str]] = []
    drills = JobDrills(root="/nowhere", record=lambda kind, detail: events.append((kind, detail)))
    now, answer_now = drills.order({"action": "kill_rank", "rank": 1})
    save, _ = drills.order({"action": "kill_actor", "rank": 0, "during": "checkpoint_commit"})
    later, _ = drills.order({"action": "slow_rank", "rank": 2, "factor": 3, "at_step": 6})
    corrupt, answer_corrupt = drills.order({"action": "corrupt_checkpoint", "step": 4})
    assert now == ChaosOrder(id=1, action="kill_rank", rank=1)
    assert answer_now == {
        "id": 1,
        "action": "kill_rank",
        "rank": 1,
        "factor": 1.0,
        "gib": 0.0,
        "at_step": None,
        "during": "step",
        "armed": True,
    }
    assert save == ChaosOrder(id=2, action="kill_actor", rank=0, at_step=0, during="checkpoint_commit")
    assert later == ChaosOrder(id=3, action="slow_rank", rank=2, factor=3.0, at_step=6)
    assert (corrupt, answer_corrupt) == (
        CorruptOrder(id=4, step=4),
        {"id": 4, "action": "corrupt_checkpoint", "step": 4, "armed": True},
    )

    for order in (now, save, later):  # the group is not up: every order waits, armed
        drills.arm(order, world_size=4, group=None, committed_step=None)
    drills.arm(ChaosOrder(id=5, action="hang_rank", rank=4), world_size=4, group=None, committed_step=None)
    assert drills.plan_orders() == (save, later)  # a launch plan carries those waiting for a step
    drills.fired(2, 3, 6)
    drills.fired(2, 3, 6)  # a second report of the same firing records nothing
    assert drills.plan_orders() == (save,)
    assert events == [
        ("chaos_armed", "kill_rank on rank 1 when the group is up"),
        ("chaos_armed", "kill_actor on rank 0 at step 0 during checkpoint_commit"),
        ("chaos_armed", "slow_rank on rank 2 at step 6"),
        ("chaos_rejected", "rank 4 is outside the world of 4 ranks"),
        ("chaos_fired", "slow_rank on rank 2 at step 6 (order 3)"),
    ]


def test_an_order_sent_to_a_running_group_is_armed_and_its_firing_recorded():
    events: list[tuple[str, str]] = []
    sent: list[ChaosOrder] = []
    group = SimpleNamespace(chaos=sent.append, kill_actor=lambda rank: sent.append(("kill_actor", rank)))
    drills = JobDrills(root="/nowhere", record=lambda kind, detail: events.append((kind, detail)))
    slow, _ = drills.order({"action": "slow_rank", "rank": 1, "factor": 10})
    drills.arm(slow, world_size=2, group=group, committed_step=None)
    assert sent == [slow]
    drills.fired(1, slow.id, 7)  # the rank's report
    kill, _ = drills.order({"action": "kill_actor", "rank": 0})
    drills.arm(kill, world_size=2, group=group, committed_step=None)
    assert sent == [slow, ("kill_actor", 0)]
    hold, _ = drills.order({"action": "hold_host_memory", "rank": 1, "gib": 2})
    drills.arm(hold, world_size=2, group=group, committed_step=None)
    drills.fired(1, hold.id, None)  # fired on delivery, between steps: the rank reports no step
    assert events[-2:] == [
        ("chaos_armed", "hold_host_memory on rank 1 now, to the running group"),
        ("chaos_fired", "hold_host_memory on rank 1 on delivery (order 3)"),
    ]
    del events[-2:]
    assert events == [
        ("chaos_armed", "slow_rank on rank 1 now, to the running group"),
        ("chaos_fired", "slow_rank on rank 1 at step 7 (order 1)"),
        ("chaos_armed", "kill_actor on rank 0 now, to the running group"),
        ("chaos_fired", "kill_actor on rank 0 (order 2)"),
    ]
    assert drills.plan_orders() == ()


def test_job_drills_corrupt_a_checkpoint_only_once_it_is_committed(tmp_path):
    events: list[tuple[str, str]] = []
    drills = JobDrills(root=str(tmp_path), record=lambda kind, detail: events.append((kind, detail)))
    directory = Path(step_dir(str(tmp_path), 4))
    directory.mkdir(parents=True)
    small, large = bytes(range(100)), bytes(i % 251 for i in range(300))
    (directory / "__0_0.distcp").write_bytes(small)
    (directory / "__1_0.distcp").write_bytes(large)
    order, _ = drills.order({"action": "corrupt_checkpoint", "step": 4})
    drills.arm(order, world_size=2, group=None, committed_step=None)  # not committed yet
    drills.corrupt_due(4)  # committed by the state machine, but no manifest on disk yet
    assert (directory / "__1_0.distcp").read_bytes() == large
    (directory / "manifest.json").write_text("{}")
    drills.corrupt_due(2)  # an older step committed: not this one
    assert (directory / "__1_0.distcp").read_bytes() == large
    drills.corrupt_due(4)
    drills.corrupt_due(8)  # fired once
    after = (directory / "__1_0.distcp").read_bytes()
    offset = 300 // 2 - 32
    assert len(after) == 300 and (directory / "__0_0.distcp").read_bytes() == small  # the largest shard only
    assert after[:offset] == large[:offset] and after[offset + 64 :] == large[offset + 64 :]
    assert after[offset : offset + 64] == bytes(b ^ 0xFF for b in large[offset : offset + 64])
    assert events == [
        ("chaos_armed", "corrupt_checkpoint step 4 (order 1)"),
        ("chaos_fired", "corrupt_checkpoint flipped bytes in __1_0.distcp of step 4"),
    ]
