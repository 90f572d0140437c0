"""One rank's saves (workers/rank/rank_saves.py) tell the user when an async save waited for the write before it.

Real ``AsyncCheckpointer`` saves of ~50 MB of state (a 2048 x 2048 linear layer and its AdamW moments) to a
real folder, back to back, so the second waits for the first's write; the supervisor is a recorder of the
calls the rank makes on it (its Ray handle's ``.remote``), ``ray.get`` the identity on what it returns.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import ray
import torch
from torch import nn

from etrain.workers.checkpoints import checkpoint_cadence
from etrain.workers.protocol.messages import LaunchPlan
from etrain.workers.rank.rank_saves import RankSaves
from etrain.workers.rank.step_control import ControlRequests
from tests.equivalence_utils import small_config
from tests.rank_stubs import SupervisorRecorder


class _Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(2048, 2048)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.model(torch.randn(2, 2048)).sum().backward()
        self.optimizer.step()

    def state_for_checkpoint(self):
        return [self.model], [self.optimizer], {"step": 0}

    def save(self, directory: str):  # a synchronous save, as ``Trainer.save``
        from etrain.workers.checkpoints.checkpoint import save_checkpoint

        return save_checkpoint(directory, *self.state_for_checkpoint())


def _saves(tmp_path, supervisor, **checkpoint) -> RankSaves:
    config = small_config()
    config = dataclasses.replace(
        config,
        checkpoint=dataclasses.replace(config.checkpoint, path=str(tmp_path), **({"async_save": True} | checkpoint)),
    )
    return RankSaves(
        rank=0,
        plan=LaunchPlan(attempt=1, config=config, start_step=0, resume_dir=None),
        device_type="cpu",
        supervisor=supervisor,
        control=ControlRequests(),
        drills_due=lambda step, moment: None,
        keep_snapshot=lambda trainer, step: None,
    )


def _two_saves(tmp_path, monkeypatch, *, every_steps: int, final: bool) -> tuple[SupervisorRecorder, str]:
    """Steps 2 and 4 saved back to back (the second waits for the first's write), with any measurable wait
    worth a note; the supervisor's recorded calls and the rank log's words for the second save."""
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(checkpoint_cadence, "QUEUED_NOTE_MIN_S", 0.01)
    supervisor, trainer = SupervisorRecorder(), _Trainer()
    saves = _saves(tmp_path, supervisor, every_steps=every_steps)
    try:
        saves.save(trainer, 2, final=False)
        said = saves.describe(saves.save(trainer, 4, final=final))
    finally:
        saves.close(None)
    return supervisor, said


def test_a_save_queued_behind_the_previous_write_is_said_once_with_the_cadence_that_fits(tmp_path, monkeypatch):
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(checkpoint_cadence, "QUEUED_NOTE_MIN_S", 0.01)  # any measurable wait: this is the plumbing
    supervisor, trainer = SupervisorRecorder(), _Trainer()
    saves = _saves(tmp_path, supervisor, every_steps=2)
    try:
        first = saves.save(trainer, 2, final=False)
        assert "waiting for the previous" not in saves.describe(first)
        second = saves.save(trainer, 4, final=False)  # the first's ~50 MB are still being written and hashed
        said = saves.describe(second)
        saves.save(trainer, 6, final=False)  # waits again: no second note in the attempt
    finally:
        saves.close(None)
    assert "s of it waiting for the previous save's write)" in said, said
    notes = [args for method, args in supervisor.calls if method == "report_note"]
    assert len(notes) == 1, supervisor.calls
    attempt, kind, text = notes[0]
    assert (attempt, kind) == (1, "checkpoint_interval")
    assert text.startswith("step 4's save waited ") and "for step 2's write" in text, text
    assert "set checkpoint.every_steps >= " in text and text.endswith("(or auto)"), text
    reported = sorted(args[2] for method, args in supervisor.calls if method == "report_checkpoint")
    assert reported == [2, 4, 6]  # every save's shards were reported once written


@pytest.mark.parametrize(
    ("every_steps", "final"),
    [(2, True), (0, False)],
    ids=["the final save: the job's end, not training's", "saves only on request: no cadence to advise on"],
)
def test_a_queued_save_with_no_cadence_to_advise_on_makes_no_note(tmp_path, monkeypatch, every_steps, final):
    supervisor, said = _two_saves(tmp_path, monkeypatch, every_steps=every_steps, final=final)
    waited = float(re.search(r"\(([0-9.]+)s of it waiting for the previous save's write\)", said).group(1))
    assert waited >= 0.01, said  # the rank log still splits the wait out
    assert [method for method, _ in supervisor.calls if method == "report_note"] == []


@pytest.mark.parametrize("async_save", [False, True], ids=["saves otherwise synchronous (CPU)", "async saves (CUDA)"])
def test_a_held_save_writes_the_copy_in_the_background_and_lands_before_the_next_save(
    tmp_path, monkeypatch, async_save
):
    """The save an in-place repair makes again (``RankSaves.save_held``): it blocks training for less than the
    next save of the same state, writes the snapshot's values (not the live ones, which moved on), and its
    report reaches the supervisor before the next save's."""
    import torch.distributed.checkpoint as dcp

    from etrain.workers.checkpoints.checkpoint_commit import step_dir
    from etrain.workers.checkpoints.checkpoint_state import collect_state
    from etrain.workers.checkpoints.snapshot import take_snapshot

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    supervisor, trainer = SupervisorRecorder(), _Trainer()
    snapshot = take_snapshot(2, [trainer.model], [trainer.optimizer], {"step": 2})
    trainer.model(torch.randn(2, 2048)).sum().backward()
    trainer.optimizer.step()  # the live state moves on; the held save must not write it
    trainer.state_for_checkpoint = lambda: ([trainer.model], [trainer.optimizer], {"step": 2})
    saves = _saves(tmp_path, supervisor, async_save=async_save, every_steps=2)
    try:
        held_blocked = saves.save_held(trainer, snapshot)
        said = saves.describe(held_blocked, held=True)
        trainer.state_for_checkpoint = lambda: ([trainer.model], [trainer.optimizer], {"step": 4})
        next_blocked = saves.save(trainer, 4, final=False)  # waits for the held write (async: and stages a copy)
    finally:
        saves.close(None)
    assert said.startswith("save started from the copy in memory"), said
    assert held_blocked < next_blocked, (held_blocked, next_blocked)
    assert [args[2] for args in supervisor.args_of("report_checkpoint")] == [2, 4]  # in order: 2 landed first
    fresh = _Trainer()
    loaded = collect_state([fresh.model], [fresh.optimizer]).state
    dcp.load(loaded, checkpoint_id=step_dir(str(tmp_path), 2))
    for key, value in snapshot.state["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    live = collect_state([trainer.model], [trainer.optimizer]).state["model"]
    assert not all(torch.equal(loaded["model"][key], live[key]) for key in live)
