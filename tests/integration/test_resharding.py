"""Issue #3 acceptance: a checkpoint saved under one layout resumes under another, exactly.

Save at step k under layout A (every rank writes its DCP shards; the manifest is committed), resume
under layout B, and every loss after k matches the uninterrupted single-process run within the
equivalence tolerance, as do the final parameters. DCP reshards by parameter name (FQN), which the
model keeps identical under every layout; optimizer state, RNG and the data position come along.
The Llama (``TINY_LLAMA``: GQA, q/k/v biases, q/k norms) reshards across the 3D → DP, ZeRO-3 →
ZeRO-1 and TP → one-process pairs too: its own parameter names and TP placements go through DCP.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from etrain.workers.protocol.run_config import ParallelConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import LOSS_RTOL, MODELS, PARAM_ATOL, run_reference, small_config
from tests.state_utils import full_state_dict

STEPS, SAVE_AT = 8, 4


def _train_and_save(rank: int, world_size: int, config, root: str) -> list[float]:
    import torch.distributed as dist

    from etrain.workers.checkpoints.checkpoint_commit import commit, step_dir
    from etrain.workers.engine.train import Trainer

    trainer = Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))
    losses = [m.loss for m in trainer.run(0, SAVE_AT)]
    directory = step_dir(root, SAVE_AT)
    report = trainer.save(directory)
    reports = [None] * world_size
    dist.all_gather_object(reports, report)
    if rank == 0:  # what the supervisor does once every rank has reported
        commit(directory, step=SAVE_AT, layout=config.parallel.describe(), world_size=world_size, reports=reports)
    dist.barrier()
    return losses


def _restore_and_train(rank: int, world_size: int, config, root: str) -> dict:
    from etrain.workers.checkpoints.checkpoint_commit import step_dir
    from etrain.workers.engine.train import Trainer

    trainer = Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))
    next_step = trainer.restore(step_dir(root, SAVE_AT))
    losses = [m.loss for m in trainer.run(next_step, STEPS)]
    return {"next_step": next_step, "losses": losses, "params": full_state_dict(trainer)}


@pytest.fixture(scope="module")
def references() -> dict:
    """The uninterrupted single-process run of each model, computed once."""
    return {}


def _reference(references: dict, model: str):
    if model not in references:
        references[model] = run_reference(small_config(steps=STEPS, model=MODELS[model]))
    return references[model]


PAIRS = [
    ("3d-to-dp2", ParallelConfig(pp=2, dp=2, tp=2), ParallelConfig(dp=2)),
    ("dp4-to-dp2", ParallelConfig(dp=4), ParallelConfig(dp=2)),
    ("tp2-to-tp1", ParallelConfig(tp=2), ParallelConfig()),
    ("zero3-to-zero1", ParallelConfig(dp=2, zero=3), ParallelConfig(dp=2, zero=1)),
    (
        "pp2-interleaved-to-zero2",
        ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2),
        ParallelConfig(dp=2, zero=2),
    ),
]


LLAMA_PAIRS = ("3d-to-dp2", "zero3-to-zero1", "tp2-to-tp1")
CASES = [("gpt", *pair) for pair in PAIRS] + [("llama", *pair) for pair in PAIRS if pair[0] in LLAMA_PAIRS]


@pytest.mark.parametrize("model, name, before, after", CASES, ids=[f"{case[0]}-{case[1]}" for case in CASES])
def test_resume_in_another_layout_matches_the_uninterrupted_run(tmp_path, references, model, name, before, after):
    reference = _reference(references, model)
    base = small_config(steps=STEPS, model=MODELS[model])
    first = run_distributed(
        _train_and_save, before.world_size, dataclasses.replace(base, parallel=before), str(tmp_path), timeout_s=240
    )
    second = run_distributed(
        _restore_and_train, after.world_size, dataclasses.replace(base, parallel=after), str(tmp_path), timeout_s=240
    )

    for step, got in enumerate(first[0]):
        want = reference.losses[step]
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"{name} before save, step {step}: {got} vs {want}"
    for result in second:
        assert result["next_step"] == SAVE_AT
        for offset, got in enumerate(result["losses"]):
            want = reference.losses[SAVE_AT + offset]
            assert abs(got - want) <= LOSS_RTOL * abs(want), (
                f"{name} after resume, step {SAVE_AT + offset}: {got} vs uninterrupted {want}"
            )
    params = second[0]["params"]
    assert params.keys() == reference.params.keys()
    worst = max((params[k] - reference.params[k]).abs().max().item() for k in params)
    assert worst <= PARAM_ATOL, f"{name}: final parameters differ by {worst:.3g}"
