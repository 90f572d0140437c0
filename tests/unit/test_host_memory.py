"""Host memory per rank (service/planning/plan_host.py): what each rank holds in its node's RAM, which Ray
reserves beside its CPUs and GPUs (``resources.host_memory_gb``). The copy size is checked against real
snapshots in tests/integration/test_snapshot.py; the reservation through the API in tests/api/test_host_memory.py."""

from __future__ import annotations

import math

import pytest

from etrain.service.planning.estimate import estimate
from etrain.service.planning.plan_host import SNAPSHOTS_KEPT, host_memory, host_memory_gb, snapshot_copies
from etrain.service.planning.plan_memory import GiB
from etrain.service.planning.planner import check_plan, host_plan, plan_report, resolve_host_memory
from etrain.service.planning.spec import JobSpec
from etrain.workers.protocol.memory_resume import snapshots_are_read


def _spec(*, device="cuda", parallelism=None, resources=None, **sections) -> JobSpec:
    gpu = {"gpus_per_worker": 1} if device == "cuda" else {}
    return JobSpec.model_validate(
        {
            "name": "host",
            "model": {"preset": "llama3-1b"},
            "parallelism": parallelism or {"dp": 8},
            "resources": {"device": device, **gpu, **(resources or {})},
            "training": {"steps": 10, "global_batch": 16, "precision": "bf16" if device == "cuda" else "fp32"},
            **sections,
        }
    )


@pytest.mark.parametrize(
    ("in_place", "repairs_in_place", "resizable", "read"),
    [
        (True, True, False, True),  # gloo: an in-place repair reads them
        (True, False, True, True),  # NCCL, elastic: an in-place resize reads them
        (True, False, False, False),  # NCCL, one size: a lost rank relaunches every rank, nothing reads them
        (True, True, True, True),
        (False, True, True, False),  # fault_tolerance.in_place: false relaunches for everything
        (False, False, False, False),
    ],
)
def test_snapshots_are_kept_only_where_something_reads_them(in_place, repairs_in_place, resizable, read):
    assert snapshots_are_read(in_place=in_place, repairs_in_place=repairs_in_place, resizable=resizable) is read


@pytest.mark.parametrize(
    ("layout", "copies"),
    [
        ({"dp": 2}, SNAPSHOTS_KEPT),  # DDP: the replica can serve a lost rank
        ({"dp": 2, "zero": 3}, 0),  # FSDP2: no replica, every rank restores from storage
        ({"dp": 2, "zero": 1}, 0),
        ({"dp": 4, "zero": 3, "dp_replicate": 2}, SNAPSHOTS_KEPT),  # HSDP: the other replica group's shard
        ({"dp": 2, "ep": 2}, 0),  # each dp rank holds other experts
        ({"dp": 4, "ep": 2}, SNAPSHOTS_KEPT),
        ({"dp": 1}, 0),
        ({"dp": 1, "may_grow": True}, SNAPSHOTS_KEPT),  # a grow's added ranks receive the dp=1 copy
        ({"dp": 1, "zero": 3, "may_grow": True}, 0),
    ],
)
def test_snapshot_copies_follow_the_replicas(layout, copies):
    layout = {"zero": 0, **layout}
    assert snapshot_copies(read=True, **layout) == copies
    assert snapshot_copies(read=False, **layout) == 0


def test_a_gpu_rank_holds_the_staging_copy_and_where_read_two_snapshots_of_its_state():
    """Llama-3.2-1B on 8 GPUs. The state is 12 bytes per parameter (fp32 weights, AdamW's two moments), and the
    tied embedding (128256 x 2048) is in it under two names, so DCP's staging copy holds 4 bytes per element more,
    while a snapshot copies the one tensor once: whole under DDP, an eighth under ZeRO-3 (a hand count against the
    plan). On an H100 the staging buffers of this model held 15.9 GB (docs/gpu.md)."""
    ddp = _spec()
    params, tied = estimate(ddp).num_params, 128256 * 2048
    host = host_plan(ddp)
    assert host.checkpoint_staging == 12 * params + 4 * tied and host.snapshots == 0  # one size on NCCL: none kept
    assert round(host.checkpoint_staging / 1e9, 1) == 15.9  # the H100's staging, measured
    assert host.init_draw == estimate(ddp).memory.host_bytes > 0 and host.state == 0
    elastic = host_plan(_spec(resources={"min_dp": 4}))
    assert elastic.snapshots == 2 * 12 * params  # the tied embedding once in each (0.98 GiB less a copy)
    assert host_memory_gb(elastic.total) == pytest.approx(43.4)  # the figure docs/job-spec.md quotes
    zero3 = host_plan(_spec(parallelism={"dp": 8, "zero": 3}))
    assert zero3.checkpoint_staging == pytest.approx((12 * params + 4 * tied) / 8, rel=1e-6)
    no_async = host_plan(_spec(checkpoint={"async": False}))
    assert no_async.checkpoint_staging == 0 and no_async.total == host.init_draw


def test_offload_keeps_the_state_on_the_host():
    offloaded = _spec(parallelism={"dp": 8, "zero": 3, "offload": "cpu"})
    memory = estimate(offloaded).memory
    host = host_plan(offloaded)
    assert memory.offloaded and memory.parameters == memory.optimizer_states == 0
    assert host.state == memory.host_bytes >= memory.checkpoint_bytes and host.init_draw == 0
    assert host.checkpoint_staging == memory.checkpoint_bytes


def test_a_cpu_rank_holds_its_whole_plan_and_its_snapshots():
    spec = _spec(device="cpu", parallelism={"dp": 2}, model={"preset": "gpt-tiny"})
    memory = estimate(spec).memory
    host = host_plan(spec)
    assert host.state == memory.total and host.checkpoint_staging == 0  # async is off on CPU by default
    assert host.snapshots == SNAPSHOTS_KEPT * memory.snapshot_bytes  # gloo: an in-place repair reads them
    assert memory.snapshot_bytes == memory.checkpoint_bytes  # the GPT's head is its own parameter
    assert host_plan(_spec(device="cpu", parallelism={"dp": 2}, model={"preset": "gpt-tiny"},
                           fault_tolerance={"in_place": False})).snapshots == 0  # fmt: skip


def test_the_figure_is_the_most_over_the_elastic_range():
    """ZeRO shards the state over dp: after a shrink to min_dp each rank holds more, and Ray must have
    reserved that from the start (the placement group is not re-sized down to the byte)."""
    at_8 = host_plan(_spec(parallelism={"dp": 8, "zero": 3}))
    shrinkable = host_plan(_spec(parallelism={"dp": 8, "zero": 3}, resources={"min_dp": 2}))
    at_2 = host_plan(_spec(parallelism={"dp": 2, "zero": 3}, resources={"max_dp": 8}))
    assert shrinkable.checkpoint_staging == at_2.checkpoint_staging == pytest.approx(4 * at_8.checkpoint_staging)


def test_host_memory_is_filled_in_rounded_up_and_a_lower_one_is_refused():
    spec = _spec()
    figure = host_memory_gb(host_plan(spec).total)
    assert figure == math.ceil(host_plan(spec).total / GiB * 100) / 100
    resolved = resolve_host_memory(spec)
    assert resolved.resources.host_memory_gb == figure
    assert resolve_host_memory(resolved) is resolved  # a given value is the job's: kept
    assert check_plan(resolved) == []
    assert check_plan(_spec(resources={"host_memory_gb": figure + 100})) == []  # more is the job's right
    [problem] = check_plan(_spec(resources={"host_memory_gb": 1}))
    assert problem.field == "resources.host_memory_gb"
    assert problem.message == (
        f"each rank holds {figure:g} GiB of host memory (init draw 0.98, checkpoint staging 14.79), more than "
        "resources.host_memory_gb=1."
    )
    assert (
        problem.fix == f"raise resources.host_memory_gb to at least {figure:g}, or leave it out (the planner's figure)"
    )
    assert host_memory_gb(1) == 0.01  # never below what the field accepts


def test_the_plan_shows_the_parts_and_what_ray_reserves():
    report = plan_report(_spec(resources={"min_dp": 4}))
    host = report["host_memory"]
    assert host["bytes"]["total"] == sum(v for k, v in host["bytes"].items() if k != "total")
    assert host["gib"]["snapshots"] == pytest.approx(27.623, abs=1e-3)
    assert host["reserved_gib"] == host_memory_gb(host["bytes"]["total"]) == pytest.approx(43.4)
    assert plan_report(_spec(resources={"host_memory_gb": 50}))["host_memory"]["reserved_gib"] == 50


def test_host_memory_reads_the_device_plan():
    memory = estimate(_spec()).memory
    parts = host_memory(memory, device="cuda", async_checkpoints=True, snapshots=3)
    assert (parts.state, parts.init_draw) == (0, memory.host_bytes)
    assert (parts.checkpoint_staging, parts.snapshots) == (memory.checkpoint_bytes, 3 * memory.snapshot_bytes)
    on_cpu = host_memory(memory, device="cpu", async_checkpoints=False, snapshots=0)
    assert (on_cpu.state, on_cpu.total) == (memory.total, memory.total)
