"""Async saves stage into host buffers that outlive each save (workers/checkpoints/checkpoint.py ``AsyncCheckpointer``).

Found on an H100 by ``make gpu-check``: torch 2.11's ``async_save`` closes the stager it was given after
each upload, and the job's second save then failed inside the stager (``KeyError: <class 'type'>``).
Here, in one process on CPU: two saves in a row through one checkpointer, with the stager closed the way
that torch closes it, each restore the values of its own step (the reused buffers hold the new values,
never the previous save's). And the buffers made ahead of the first save (``ReusedStager.allocate``: the
way that stalls training least on an H100) are the very ones DCP's copier stages into, for a trainer's
whole state, plain tensors and FSDP2's DTensor shards alike.
"""

from __future__ import annotations

import torch
from torch import nn

from etrain.workers.checkpoints.checkpoint import AsyncCheckpointer, load_checkpoint
from etrain.workers.checkpoints.checkpoint_commit import commit, step_dir
from etrain.workers.protocol.run_config import ParallelConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import TINY_LLAMA, small_config


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _saved(tmp_path, checkpointer, step, model, optimizer):
    report = checkpointer.save(step_dir(tmp_path, step), [model], [optimizer], {"step": step}).wait(timeout_s=60)
    commit(step_dir(tmp_path, step), step, "single", 1, [report])
    return {name: value.clone() for name, value in model.state_dict().items()}


def _restored(tmp_path, step):
    torch.manual_seed(99)
    model = nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert load_checkpoint(step_dir(tmp_path, step), [model], [optimizer])["step"] == step
    return model.state_dict()


def _trained_once():
    """A seeded model one AdamW step in (so the optimizer has state), and an async checkpointer."""
    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, optimizer)
    return model, optimizer, AsyncCheckpointer()


def test_two_async_saves_through_one_stager_survive_dcp_closing_it_and_keep_their_own_values(tmp_path):
    model, optimizer, checkpointer = _trained_once()
    try:
        first = _saved(tmp_path, checkpointer, 1, model, optimizer)
        checkpointer._stager.close()  # what torch 2.11's async_save does after every upload
        _train_step(model, optimizer)
        second = _saved(tmp_path, checkpointer, 2, model, optimizer)
    finally:
        checkpointer.close()
    assert any(not torch.equal(first[name], second[name]) for name in first)  # the step changed the weights
    for step, expected in ((1, first), (2, second)):
        restored = _restored(tmp_path, step)
        for name, value in expected.items():
            assert torch.equal(restored[name], value), (step, name)


def test_buffers_prepared_ahead_hold_the_values_of_the_save_not_of_the_preparation(tmp_path):
    """``prepare`` allocates the buffers in the background (nothing copied); the save that follows, after
    more training, must write the state as it is at the save."""
    model, optimizer, checkpointer = _trained_once()
    try:
        checkpointer.prepare([model], [optimizer])
        prepared = {name: value.clone() for name, value in model.state_dict().items()}
        _train_step(model, optimizer)
        saved = _saved(tmp_path, checkpointer, 2, model, optimizer)
    finally:
        checkpointer.close()
    assert all(not torch.equal(prepared[name], saved[name]) for name in saved)
    restored = _restored(tmp_path, 2)
    for name, value in saved.items():
        assert torch.equal(restored[name], value), name


def test_the_stager_keeps_its_buffers_and_copy_table_when_dcp_closes_its_copier_after_each_staging():
    """torch 2.11's ``DefaultStager._stage`` closes its copier (``_state_dict_stager``) after every
    staging: that dropped the host buffers and the copy table, and the next staging of a state holding a
    class object failed with ``KeyError: <class 'type'>`` (an H100 job's first save, its buffers prepared
    ahead). Emulated here the way that torch does it; the second staging reuses the first's buffers."""
    from etrain.workers.checkpoints.checkpoint import _reused_stager

    weight = torch.arange(6.0)
    state = {"model": {"w": weight}, "optim": {"kind": torch.optim.AdamW, "lr": 0.1}}
    stager = _reused_stager(pinned=False)
    try:
        first = stager.stage(state)
        stager._state_dict_stager.close()  # what torch 2.11 does after every staging
        stager.close()  # and what its async_save does after every upload
        weight.add_(1.0)
        second = stager.stage(state)
    finally:
        stager.release()
    assert second["optim"]["kind"] is torch.optim.AdamW
    assert torch.equal(second["model"]["w"], torch.arange(6.0) + 1.0)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # the same host buffer, reused
    assert second["model"]["w"].data_ptr() != weight.data_ptr()  # a copy, not the live tensor


def _staged_into_buffers_made_ahead(rank: int, world_size: int, config) -> dict:
    from etrain.workers.checkpoints.checkpoint import _reused_stager
    from etrain.workers.checkpoints.checkpoint import local_tensors as tensors
    from etrain.workers.checkpoints.checkpoint_state import collect_state
    from etrain.workers.engine.train import Trainer

    trainer = Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))
    assert trainer.materialize_optimizer_state()
    stager = _reused_stager(pinned=False)
    try:
        made = stager.allocate(collect_state(trainer.model_parts, trainer.optimizers).state)
        cache = stager._copier._cached_storage_mapping
        buffers = {host.data_ptr() for host in cache.values()}
        before, bytes_before = len(cache), sum(host.nbytes() for host in cache.values())
        trainer.train_step(0)  # the values change; the storages stay
        state = collect_state(trainer.model_parts, trainer.optimizers).state
        staged = tensors(stager.stage(state))
        live = tensors(state)
        return {
            "made": made,
            "buffers": before,
            "after": len(cache),
            "bytes_after": sum(host.nbytes() for host in cache.values()) - bytes_before,
            "staged": len(staged),
            "in_buffers": sum(t.untyped_storage().data_ptr() in buffers for t in staged),
            "equal": all(torch.equal(a, b) for a, b in zip(staged, live)),
            "copies": all(a.data_ptr() != b.data_ptr() for a, b in zip(staged, live) if a.numel()),
        }
    finally:
        stager.release()


def _assert_staged_ahead(result: dict) -> None:
    assert result["made"] > 0 and result["buffers"] > 0
    # The staging allocated nothing of its own but, under FSDP2, one 8-byte tensor outside the state's
    # dicts (a DTensor's metadata, deep-copied with it): DCP pins such a buffer itself, in no time.
    assert result["after"] - result["buffers"] <= 1 and result["bytes_after"] <= 8
    assert result["in_buffers"] == result["staged"] > 0  # every staged tensor is in a buffer made ahead
    assert result["equal"] and result["copies"]  # the values of the save, in host copies


def test_buffers_made_ahead_are_the_ones_a_trainers_whole_state_is_staged_into() -> None:
    _assert_staged_ahead(_staged_into_buffers_made_ahead(0, 1, small_config(steps=2, model=TINY_LLAMA)))


def test_buffers_made_ahead_serve_fsdp2_shards_too() -> None:
    config = small_config(steps=2, parallel=ParallelConfig(dp=2, zero=3))
    for result in run_distributed(_staged_into_buffers_made_ahead, 2, config):
        _assert_staged_ahead(result)


def test_a_save_that_comes_before_the_previous_write_landed_measures_its_wait(tmp_path):
    """The staging buffers are reused, so a save must wait for the write before it: that wait blocks
    training, and the rank tells the user when saves come faster than writes land
    (``checkpoint_cadence.queued_save_note``). ~200 MB of state, so a write takes a measurable time."""
    torch.manual_seed(0)
    model = nn.Linear(4096, 4096)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4096)).sum().backward()
    optimizer.step()
    checkpointer = AsyncCheckpointer()
    try:
        first = checkpointer.save(step_dir(tmp_path, 1), [model], [optimizer], {"step": 1})
        assert checkpointer.waited_for_previous_s < 0.05  # nothing was in flight
        assert not first.done()  # its ~200 MB are still being written and hashed
        second = checkpointer.save(step_dir(tmp_path, 2), [model], [optimizer], {"step": 2})
        assert first.done() and checkpointer.waited_for_previous_s >= 0.05  # it waited for the first write
        second.wait(timeout_s=60)
        checkpointer.save(step_dir(tmp_path, 3), [model], [optimizer], {"step": 3}).wait(timeout_s=60)
        assert checkpointer.waited_for_previous_s < 0.05  # the second write had landed
    finally:
        checkpointer.close()
    assert first.wait(timeout_s=1).files  # the first save wrote its files and reported them
