"""In-memory snapshots (workers/checkpoints/snapshot.py) on two real gloo ranks: a restore from memory, and a
replacement rank's state received from its data-parallel replica, are bit-identical to the restore of
the same step's checkpoint from storage, and continue the run exactly. Layouts that shard state
across dp (ZeRO-3) have no replica, and every rank falls back to storage together."""

from __future__ import annotations

import torch

from etrain.workers.protocol.run_config import ParallelConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import small_config


def _trainer(rank, world_size, parallel, steps):
    from etrain.workers.engine.train import Trainer

    return Trainer(
        small_config(parallel=parallel, steps=steps), rank=rank, world_size=world_size, device=torch.device("cpu")
    )


def _local_state(trainer) -> dict[str, torch.Tensor]:
    from etrain.workers.checkpoints.checkpoint_state import collect_state

    state = collect_state(trainer.model_parts, trainer.optimizers).state
    return {
        f"{section}/{key}": (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
        for section, values in state.items()
        for key, value in values.items()
        if torch.is_tensor(value)
    }


def _save_committed(trainer, rank, world_size, directory, step):
    import torch.distributed as dist

    from etrain.workers.checkpoints.checkpoint_commit import commit

    report = trainer.save(directory)
    reports = [None] * world_size
    dist.all_gather_object(reports, report)
    if rank == 0:
        commit(directory, step, trainer.config.parallel.describe(), world_size, reports)
    dist.barrier()


def _scenarios(rank: int, world_size: int, root: str) -> dict:
    from etrain.workers.checkpoints.snapshot import replicated, resume_from_snapshot, share_snapshots, take_snapshot

    directory = f"{root}/step_00000003"
    first = _trainer(rank, world_size, ParallelConfig(dp=2), steps=6)
    first.run(0, 3)
    _save_committed(first, rank, world_size, directory, 3)
    snapshot = take_snapshot(3, *first.state_for_checkpoint())
    straight = [m.loss for m in first.run(3, 5)]  # the state moves on past the snapshot
    live = take_snapshot(5, *first.state_for_checkpoint())  # what a survivor keeps when step 6 fails
    straight += [m.loss for m in first.run(5, 6)]
    pair = [(0, 1)]

    # Rank 1 is a replacement: it has no snapshot and receives rank 0's.
    received, origin = share_snapshots(
        {3: snapshot} if rank == 0 else {}, pair, replicas=replicated(0, 2), floor=3, below=6
    )
    from_memory = _trainer(rank, world_size, ParallelConfig(dp=2), steps=6)
    memory_next = resume_from_snapshot(from_memory, received)
    memory_state = _local_state(from_memory)

    from_disk = _trainer(rank, world_size, ParallelConfig(dp=2), steps=6)
    disk_next = from_disk.restore(directory)
    disk_state = _local_state(from_disk)
    same_bits = sorted(memory_state) == sorted(disk_state) and all(
        torch.equal(memory_state[key], disk_state[key]) for key in disk_state
    )
    resumed = [m.loss for m in from_memory.run(memory_next, 6)]

    # Every rank has its own: nobody sends anything.
    _, own_origin = share_snapshots({3: snapshot}, pair, replicas=True, floor=3, below=6)
    # ZeRO-3 shards state across dp: no replica, so both ranks go to storage.
    _, zero3_origin = share_snapshots(
        {3: snapshot} if rank == 0 else {}, pair, replicas=replicated(3, 2), floor=3, below=6
    )
    # A snapshot of a step before the commit counts as none.
    _, stale_origin = share_snapshots({3: snapshot}, pair, replicas=True, floor=4, below=6)

    # The survivor's live state at step 5 is newer than the commit at 3: the replacement receives it, and the
    # run goes on from step 5 exactly as if it had never stopped.
    held = {3: snapshot, 5: live} if rank == 0 else {}
    newest, newest_origin = share_snapshots(held, pair, replicas=True, floor=3, below=6)
    from_live = _trainer(rank, world_size, ParallelConfig(dp=2), steps=6)
    live_next = resume_from_snapshot(from_live, newest)
    after_live = [m.loss for m in from_live.run(live_next, 6)]
    # The last step is never skipped (its final save is still to come): below=5 leaves step 3.
    capped, _ = share_snapshots(held if rank == 0 else {3: snapshot}, pair, replicas=True, floor=3, below=5)
    return {
        "origin": origin,
        "next": (memory_next, disk_next),
        "same_bits": same_bits,
        "keys": len(disk_state),
        "straight": straight,
        "resumed": resumed,
        "own": own_origin,
        "zero3": zero3_origin,
        "stale": stale_origin,
        "live": (newest.step, newest_origin, live_next, after_live, capped.step),
    }


def test_memory_restore_and_peer_transfer_equal_the_disk_checkpoint_bit_for_bit(tmp_path):
    reports = run_distributed(_scenarios, 2, str(tmp_path), timeout_s=240)
    assert [r["origin"] for r in reports] == ["own memory", "rank 0's memory"]
    for report in reports:
        assert report["next"] == (3, 3)
        assert report["same_bits"] and report["keys"] > 10, report["keys"]
        assert report["resumed"] == report["straight"]  # exact: the same continuation as never stopping
        assert (report["own"], report["zero3"], report["stale"]) == ("own memory", "storage", "storage")
    assert [r["live"][:3] for r in reports] == [(5, "own memory", 5), (5, "rank 0's memory", 5)]
    for report in reports:
        assert report["live"][3] == report["straight"][-1:]  # step 6 from the live state: the same loss, exactly
        assert report["live"][4] == 3
