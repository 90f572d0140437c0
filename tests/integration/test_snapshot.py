"""In-memory snapshots (workers/checkpoints/snapshot.py) on two real gloo ranks: a restore from memory, and a
replacement rank's state received from its data-parallel replica, are bit-identical to the restore of
the same step's checkpoint from storage, and continue the run exactly. Layouts that shard state
across dp (ZeRO-3) have no replica, and every rank falls back to storage together; under HSDP a shard's
replica is the same shard in another replica group, and under expert parallelism a rank that holds other
experts is no replica."""

from __future__ import annotations

import torch
import torch.distributed as dist

from etrain.workers.protocol.run_config import ParallelConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import TINY_LLAMA_TIED, small_config


def _trainer_of(config, rank, world_size):
    from etrain.workers.engine.train import Trainer

    return Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))


def _trainer(rank, world_size, parallel, steps):
    return _trainer_of(small_config(parallel=parallel, steps=steps), rank, world_size)


def _local_state(trainer) -> dict[str, torch.Tensor]:
    from etrain.workers.checkpoints.checkpoint_state import collect_state

    state = collect_state(trainer.model_parts, trainer.optimizers).state
    return {
        f"{section}/{key}": (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
        for section, values in state.items()
        for key, value in values.items()
        if torch.is_tensor(value)
    }


def _snapshot_bytes(snapshot) -> int:
    """The bytes of host memory a snapshot's tensors hold (a storage held under two names counted once)."""
    storages = {
        value.untyped_storage().data_ptr(): value.untyped_storage().nbytes()
        for values in snapshot.state.values()
        for value in values.values()
        if torch.is_tensor(value)
    }
    return sum(storages.values())


def _planned_memory(parallel: ParallelConfig, model=None):
    """The planner's memory plan of one rank (its ``snapshot_bytes``: what each in-memory copy of its state takes,
    ``service/planning/plan_host.py``) for small_config's model under ``parallel``."""
    from etrain.service.planning.estimate import Case, evaluate
    from etrain.service.planning.spec import ParallelismSpec

    config = small_config(parallel=parallel, **({"model": model} if model is not None else {}))
    layout = ParallelismSpec(dp=parallel.dp, zero=parallel.zero, dp_replicate=parallel.dp_replicate)
    case = Case(
        model=config.model,
        layout=layout,
        global_batch=config.training.global_batch,
        micro_batch=config.training.micro_batch,
        precision="fp32",
        checkpointing="none",
        device="cpu",
        device_memory_bytes=8 * 1024**3,
        cpus_per_worker=1.0,
    )
    return evaluate(case).memory


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
    from etrain.workers.checkpoints.snapshot import (
        replica_holder_groups,
        resume_from_snapshot,
        share_snapshots,
        take_snapshot,
    )

    directory = f"{root}/step_00000003"
    first = _trainer(rank, world_size, ParallelConfig(dp=2), steps=6)
    first.run(0, 3)
    _save_committed(first, rank, world_size, directory, 3)
    snapshot = take_snapshot(3, *first.state_for_checkpoint())
    straight = [m.loss for m in first.run(3, 5)]  # the state moves on past the snapshot
    live = take_snapshot(5, *first.state_for_checkpoint())  # what a survivor keeps when step 6 fails
    straight += [m.loss for m in first.run(5, 6)]
    pair = replica_holder_groups(ParallelConfig(dp=2), first.topology)  # DDP: both ranks hold the same state

    # Rank 1 is a replacement: it has no snapshot and receives rank 0's.
    received, origin = share_snapshots({3: snapshot} if rank == 0 else {}, pair, floor=3, below=6)
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
    _, own_origin = share_snapshots({3: snapshot}, pair, floor=3, below=6)
    # ZeRO-3 shards state across dp: no replica, so both ranks go to storage.
    alone = replica_holder_groups(ParallelConfig(dp=2, zero=3), first.topology)
    _, zero3_origin = share_snapshots({3: snapshot} if rank == 0 else {}, alone, floor=3, below=6)
    # A snapshot of a step before the commit counts as none.
    _, stale_origin = share_snapshots({3: snapshot}, pair, floor=4, below=6)

    # The survivor's live state at step 5 is newer than the commit at 3: the replacement receives it, and the
    # run goes on from step 5 exactly as if it had never stopped.
    held = {3: snapshot, 5: live} if rank == 0 else {}
    newest, newest_origin = share_snapshots(held, pair, floor=3, below=6)
    from_live = _trainer(rank, world_size, ParallelConfig(dp=2), steps=6)
    live_next = resume_from_snapshot(from_live, newest)
    after_live = [m.loss for m in from_live.run(live_next, 6)]
    # The last step is never skipped (its final save is still to come): below=5 leaves step 3.
    capped, _ = share_snapshots(held if rank == 0 else {3: snapshot}, pair, floor=3, below=5)
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
        "groups": (pair, alone),
        "snapshot_bytes": _snapshot_bytes(snapshot),
        "tied": _tied(rank, world_size),
    }


def _tied(rank: int, world_size: int) -> dict:
    """A Llama with tied input/output embeddings under DDP: its snapshot holds the one tensor under both names
    once, and a replacement that receives it (pickled over gloo) resumes exactly, its embedding and head still
    one parameter."""
    from etrain.workers.checkpoints.snapshot import (
        replica_holder_groups,
        resume_from_snapshot,
        share_snapshots,
        take_snapshot,
    )

    config = small_config(parallel=ParallelConfig(dp=2), model=TINY_LLAMA_TIED, steps=3)
    first = _trainer_of(config, rank, world_size)
    first.run(0, 1)
    snapshot = take_snapshot(1, *first.state_for_checkpoint())
    straight = [m.loss for m in first.run(1, 3)]
    pair = replica_holder_groups(ParallelConfig(dp=2), first.topology)
    received, origin = share_snapshots({1: snapshot} if rank == 0 else {}, pair, floor=1, below=3)
    second = _trainer_of(config, rank, world_size)
    resumed = [m.loss for m in second.run(resume_from_snapshot(second, received), 3)]
    model = second.model_parts[0]
    names = len(list(model.named_parameters(remove_duplicate=False)))
    return {
        "bytes": _snapshot_bytes(snapshot),
        "copies": (len(snapshot.state["model"]), len({id(value) for value in snapshot.state["model"].values()})),
        # what the replacement received over gloo (pickled): still one tensor under both names
        "received": (len(received.state["model"]), len({id(value) for value in received.state["model"].values()})),
        "origin": origin,
        "straight": straight,
        "resumed": resumed,
        "parameters": (names, len(list(model.parameters()))),
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
        assert report["groups"] == ([(0, 1)], [(0,), (1,)])
    # each copy of a rank's state is what the planner reserves host memory for, per copy (plan_host.py): its
    # fp32 parameters and AdamW states, 12 bytes per parameter; beyond them only AdamW's step counters (4 bytes
    # per tensor: 276 of 666,132 here)
    planned = _planned_memory(ParallelConfig(dp=2)).snapshot_bytes
    held = [r["snapshot_bytes"] for r in reports]
    assert all(planned <= b <= 1.001 * planned for b in held), (planned, held)
    # A tied embedding is one parameter under two names: the copy holds it once (before, twice: 8,192 bytes more
    # here, 0.98 GiB for Llama-3.2-1B), and so does the plan, while DCP's staging still holds both names
    tied = _planned_memory(ParallelConfig(dp=2), model=TINY_LLAMA_TIED)
    assert tied.checkpoint_bytes - tied.snapshot_bytes == 4 * TINY_LLAMA_TIED.vocab_size * TINY_LLAMA_TIED.d_model
    for report in reports:
        copy = report["tied"]
        assert tied.snapshot_bytes <= copy["bytes"] <= 1.001 * tied.snapshot_bytes, (tied, copy["bytes"])
        assert copy["copies"][1] == copy["copies"][0] - 1  # the embedding and the head: one copy
        assert copy["received"] == copy["copies"]  # rank 1's arrived from rank 0 so, and rank 0 kept its own
        assert copy["resumed"] == copy["straight"] and len(copy["resumed"]) == 2  # exact, from rank 0's copy
        assert copy["parameters"][1] == copy["parameters"][0] - 1  # still tied after the restore
    assert [r["tied"]["origin"] for r in reports] == ["own memory", "rank 0's memory"]


def _expert_parallel(rank: int, world_size: int) -> dict:
    """DDP with the experts split over ep=2: the two dp ranks hold different experts, so neither's state is a
    replica of the other's. Before the holder groups counted experts, a replacement for rank 1 received rank
    0's snapshot (the same keys and shapes, the other half of the experts) and trained on silently wrong
    weights; now both ranks restore from storage."""
    import dataclasses
    import hashlib

    import torch.distributed as dist

    from etrain.workers.checkpoints.snapshot import has_replicas, replica_holder_groups, share_snapshots, take_snapshot
    from etrain.workers.families import MODEL_PRESETS
    from etrain.workers.protocol.run_config import ModelConfig

    moe = dataclasses.replace(ModelConfig(**MODEL_PRESETS["qwen3-moe-tiny"]), seq_len=16)
    parallel = ParallelConfig(dp=2, ep=2)
    trainer = _trainer_of(small_config(parallel=parallel, steps=2, model=moe), rank, world_size)
    trainer.run(0, 2)
    state = _local_state(trainer)
    digests = {key: hashlib.sha256(value.numpy().tobytes()).hexdigest() for key, value in state.items()}
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, digests)
    differing = sorted(key for key in digests if everyone[0].get(key) != everyone[1].get(key))
    groups = replica_holder_groups(parallel, trainer.topology)
    snapshot = take_snapshot(2, *trainer.state_for_checkpoint())
    received, origin = share_snapshots({2: snapshot} if rank == 0 else {}, groups, floor=2, below=4)
    return {
        "differing": differing,
        "keys": len(digests),
        "groups": groups,
        "replicas": has_replicas(parallel),
        "origin": origin,
        "received": received is not None,
    }


def test_under_expert_parallelism_a_rank_holding_other_experts_is_no_replica():
    reports = run_distributed(_expert_parallel, 2, timeout_s=240)
    for report in reports:
        # The experts (and their AdamW moments) differ between the two dp ranks; the dense weights do not.
        assert report["differing"] and all("expert" in key for key in report["differing"]), report["differing"]
        assert len(report["differing"]) < report["keys"]
        assert report["groups"] == [(0,), (1,)] and report["replicas"] is False
        assert (report["origin"], report["received"]) == ("storage", False)


def _experts_over_cp_pairs(rank: int, world_size: int) -> dict:
    """dp2·cp2 with the experts split over ep=2 (four ranks, index ``dp_index · cp + cp_index``): each dp
    index's cp pair holds the same experts and dense weights, bit for bit, so it is a holder group; rank 1
    holds nothing and receives rank 0's state."""
    import dataclasses
    import hashlib

    import torch.distributed as dist

    from etrain.workers.checkpoints.snapshot import has_replicas, replica_holder_groups, share_snapshots, take_snapshot
    from etrain.workers.families import MODEL_PRESETS
    from etrain.workers.protocol.run_config import ModelConfig

    moe = dataclasses.replace(ModelConfig(**MODEL_PRESETS["qwen3-moe-tiny"]), seq_len=16)
    parallel = ParallelConfig(dp=2, cp=2, ep=2)
    trainer = _trainer_of(small_config(parallel=parallel, steps=2, model=moe), rank, world_size)
    trainer.run(0, 2)

    def digest() -> str:
        state = _local_state(trainer)
        return hashlib.sha256(b"".join(state[key].numpy().tobytes() for key in sorted(state))).hexdigest()

    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, digest())
    groups = replica_holder_groups(parallel, trainer.topology)
    snapshot = take_snapshot(2, *trainer.state_for_checkpoint())
    received, origin = share_snapshots({} if rank == 1 else {2: snapshot}, groups, floor=2, below=4)
    from etrain.workers.checkpoints.snapshot import resume_from_snapshot

    resume_from_snapshot(trainer, received)
    return {
        "digests": everyone,
        "groups": groups,
        "replicas": has_replicas(parallel),
        "origin": origin,
        "after": digest(),
    }


def test_under_context_parallelism_a_cp_peer_holding_the_same_experts_is_a_replica():
    reports = run_distributed(_experts_over_cp_pairs, 4, timeout_s=240)
    digests = reports[0]["digests"]
    assert digests[0] == digests[1] and digests[2] == digests[3] and digests[0] != digests[2]
    for report in reports:
        assert report["groups"] == [(0, 1), (2, 3)] and report["replicas"] is True
    assert [r["origin"] for r in reports] == ["own memory", "rank 0's memory", "own memory", "own memory"]
    assert reports[1]["after"] == digests[1]  # rank 1 holds rank 0's state: its own, bit for bit


def _hsdp(rank: int, world_size: int, root: str) -> dict:
    """HSDP (ZeRO-3 over pairs, two replica groups): rank 3 is replaced and receives the state of rank 1, the
    same shard in the other replica group, bit-identical to the committed step on storage."""
    from etrain.workers.checkpoints.snapshot import (
        replica_holder_groups,
        resume_from_snapshot,
        share_snapshots,
        take_snapshot,
    )

    parallel = ParallelConfig(dp=4, zero=3, dp_replicate=2)
    directory = f"{root}/step_00000002"
    first = _trainer(rank, world_size, parallel, steps=4)
    first.run(0, 2)
    _save_committed(first, rank, world_size, directory, 2)
    snapshot = take_snapshot(2, *first.state_for_checkpoint())
    straight = [m.loss for m in first.run(2, 4)]
    groups = replica_holder_groups(parallel, first.topology)
    received, origin = share_snapshots({} if rank == 3 else {2: snapshot}, groups, floor=2, below=4)
    from_memory = _trainer(rank, world_size, parallel, steps=4)
    start = resume_from_snapshot(from_memory, received)
    memory_state = _local_state(from_memory)
    from_disk = _trainer(rank, world_size, parallel, steps=4)
    from_disk.restore(directory)
    disk_state = _local_state(from_disk)
    same_bits = sorted(memory_state) == sorted(disk_state) and all(
        torch.equal(memory_state[key], disk_state[key]) for key in disk_state
    )
    return {
        "groups": groups,
        "origin": origin,
        "start": start,
        "same_bits": same_bits,
        "resumed": [m.loss for m in from_memory.run(start, 4)],
        "straight": straight,
        "snapshot_bytes": _snapshot_bytes(snapshot),
    }


def test_under_hsdp_a_replacement_receives_its_shard_from_the_other_replica_group(tmp_path):
    reports = run_distributed(_hsdp, 4, str(tmp_path), timeout_s=300)
    assert [r["origin"] for r in reports] == ["own memory", "own memory", "own memory", "rank 1's memory"]
    for report in reports:
        assert report["groups"] == [(0, 2), (1, 3)]  # the same shard index in each replica group
        assert report["start"] == 2 and report["same_bits"]
        assert report["resumed"] == report["straight"]  # exact: the same continuation as never stopping
    # a shard of the state per rank, as the planner counts it (each rank's shard of every tensor, padded by FSDP2
    # where a dimension does not divide: within 1%)
    planned = _planned_memory(ParallelConfig(dp=4, zero=3, dp_replicate=2)).snapshot_bytes
    held = [r["snapshot_bytes"] for r in reports]
    assert all(abs(b - planned) <= 0.01 * planned for b in held), (planned, held)


def _another_layout(rank: int, world_size: int) -> dict:
    """A copy whose shapes are not this rank's (taken under another layout) is refused before anything is
    copied: the rank's state stays exactly what it was."""
    import dataclasses

    from etrain.workers.checkpoints.snapshot import restore_snapshot, take_snapshot
    from tests.equivalence_utils import TINY_GPT

    wide = _trainer_of(small_config(model=dataclasses.replace(TINY_GPT, d_model=64)), rank, world_size)
    narrow = _trainer_of(small_config(), rank, world_size)
    narrow.run(0, 1)
    before = _local_state(narrow)
    copy = take_snapshot(1, *wide.state_for_checkpoint())
    try:
        restore_snapshot(copy, narrow.model_parts, narrow.optimizers)
    except ValueError as err:
        error = str(err)
    else:
        error = None
    after = _local_state(narrow)
    return {"error": error, "unchanged": all(torch.equal(before[key], after[key]) for key in before)}


def test_a_copy_from_another_layout_is_refused_before_anything_is_copied():
    (report,) = run_distributed(_another_layout, 1, timeout_s=120)
    assert report["error"] and "was taken under another layout" in report["error"], report
    assert "on this rank" in report["error"] and "in the copy" in report["error"]
    assert report["unchanged"]


def _held_saves(rank: int, world_size: int, root: str) -> dict:
    """For DDP (plain tensors), ZeRO-3 and TP (DTensors): the step-3 snapshot written by
    ``AsyncCheckpointer.save_held`` after the trainer moved on two steps equals the step-3 checkpoint that
    ``Trainer.save`` wrote from the live state, loaded back bit for bit; a held state of another layout is refused."""
    from etrain.workers.checkpoints.checkpoint import AsyncCheckpointer
    from etrain.workers.checkpoints.checkpoint_commit import commit
    from etrain.workers.checkpoints.snapshot import take_snapshot

    found = {}
    for name, parallel in (
        ("ddp", ParallelConfig(dp=2)),
        ("zero3", ParallelConfig(dp=2, zero=3)),
        ("tp", ParallelConfig(tp=2)),
    ):
        live_dir, held_dir = f"{root}/{name}-live/step_00000003", f"{root}/{name}-held/step_00000003"
        trainer = _trainer(rank, world_size, parallel, steps=6)
        trainer.run(0, 3)
        _save_committed(trainer, rank, world_size, live_dir, 3)
        snapshot = take_snapshot(3, *trainer.state_for_checkpoint())
        trainer.run(3, 5)  # the live state moves on: the held save must write the copy, not it
        writer = AsyncCheckpointer()
        report = writer.save_held(
            held_dir, trainer.model_parts, trainer.optimizers, snapshot.state, snapshot.extra
        ).wait(timeout_s=120)
        reports = [None] * world_size
        dist.all_gather_object(reports, report)
        if rank == 0:
            commit(held_dir, 3, parallel.describe(), world_size, reports)
        dist.barrier()
        wrong = dict(snapshot.state, model=dict(list(snapshot.state["model"].items())[1:]))
        try:
            writer.save_held(f"{root}/{name}-wrong", trainer.model_parts, trainer.optimizers, wrong, snapshot.extra)
            refused = ""
        except ValueError as err:
            refused = str(err)
        writer.close()
        states, nexts = [], []
        for directory in (live_dir, held_dir):
            loaded = _trainer(rank, world_size, parallel, steps=6)
            nexts.append(loaded.restore(directory))
            states.append(_local_state(loaded))
        found[name] = {
            "keys": len(states[0]),
            "same_bits": sorted(states[0]) == sorted(states[1])
            and all(torch.equal(states[0][key], states[1][key]) for key in states[0]),
            "next": nexts,
            "moved_on": not all(torch.equal(states[0][key], value) for key, value in _local_state(trainer).items()),
            "refused": refused,
        }
    return found


def test_a_held_snapshot_is_saved_exactly_as_the_live_state_was(tmp_path):
    reports = run_distributed(_held_saves, 2, str(tmp_path), timeout_s=300)
    for report in reports:
        for name, found in report.items():
            assert found["keys"] > 10 and found["same_bits"], (name, found)
            assert found["next"] == [3, 3] and found["moved_on"], (name, found)
            assert "not this layout's" in found["refused"], (name, found)


def _float8_hsdp(rank: int, world_size: int) -> dict:
    """Float8 linears under HSDP (torchao's emulation on CPU): FSDP2's local shards of the float8 weights are
    torchao's wrapper tensors, whose storage cannot be read. A snapshot copies them (under each name) and
    restores the rank's state exactly; when the copy keyed every tensor by its storage, the first save of such a
    job failed its attempt (a review found it, 2026-12-06)."""
    import dataclasses

    from etrain.workers.checkpoints.snapshot import restore_snapshot, take_snapshot
    from tests.equivalence_utils import TINY_LLAMA

    # wide enough that the MLP and attention output projections convert (tests/integration/test_float8.py)
    model = dataclasses.replace(TINY_LLAMA, n_layers=1, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512)
    config = small_config(steps=3, model=model, precision="bf16", float8=True, lr=1e-3)
    config = dataclasses.replace(config, parallel=ParallelConfig(dp=4, zero=3, dp_replicate=2))
    trainer = _trainer_of(config, rank, world_size)
    trainer.run(0, 1)
    wrapped = sum(
        type(param.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"
        for part in trainer.model_parts
        for param in part.parameters()
    )
    snapshot = take_snapshot(1, *trainer.state_for_checkpoint(), dp=4)
    plain = {key: value for key, value in _local_state(trainer).items() if type(value) is torch.Tensor}
    trainer.run(1, 2)  # the state moves on
    restore_snapshot(snapshot, trainer.model_parts, trainer.optimizers)
    back = _local_state(trainer)
    return {"wrapped": wrapped, "plain": len(plain), "same": all(torch.equal(back[k], v) for k, v in plain.items())}


def test_a_float8_hsdp_ranks_snapshot_copies_torchaos_wrapped_weights_and_restores_exactly():
    reports = run_distributed(_float8_hsdp, 4, timeout_s=300)
    for report in reports:
        assert report["wrapped"] >= 3, report  # the float8 weights are wrappers: what the copy must not trip on
        assert report["plain"] > 10 and report["same"], report
