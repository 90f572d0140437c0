"""Every layout starts from the same numbers: a rank's shards of the initial weights, gathered, are the
one-process model's, bit for bit (``workers/engine/init.py``: a generator per parameter on the rank's device,
the full parameter drawn and the rank's slice kept).

Real gloo ranks build the real Trainer (meta device, TP / FSDP2 / pipeline stage, then materialised with
the Trainer's own device as ``rng_device``); on CPU the reference is ``build_model``, the whole model
drawn in one process. The same code path draws on a CUDA generator for a cuda Trainer
(tests/gpu/test_cuda.py).
"""

from __future__ import annotations

import torch

from etrain.workers.engine.init import build_model
from etrain.workers.protocol.run_config import ParallelConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import TINY_LLAMA, small_config
from tests.state_utils import full_state_dict

LAYOUTS = {"tp2": ParallelConfig(tp=2), "zero3-dp2": ParallelConfig(dp=2, zero=3), "pp2": ParallelConfig(pp=2)}


def _initial_states(rank: int, world_size: int, configs: dict) -> dict[str, dict[str, torch.Tensor]] | None:
    """Each layout's Trainer in turn on the same two ranks (one spawn for all), gathered on rank 0."""
    from etrain.workers.engine.train import Trainer

    states = {}
    for layout, config in configs.items():
        trainer = Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))
        states[layout] = full_state_dict(trainer)  # collective: every rank takes part
    return states if rank == 0 else None


def test_every_layout_starts_from_the_one_process_weights() -> None:
    configs = {
        layout: small_config(steps=1, model=TINY_LLAMA, parallel=parallel) for layout, parallel in LAYOUTS.items()
    }
    gathered = run_distributed(_initial_states, 2, configs)[0]
    expected = build_model(TINY_LLAMA, seed=configs["tp2"].training.seed).state_dict()
    for layout, state in gathered.items():
        assert state.keys() == expected.keys(), layout
        for fqn, value in expected.items():
            assert torch.equal(state[fqn], value), (layout, fqn)
