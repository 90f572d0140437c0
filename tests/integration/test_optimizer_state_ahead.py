"""AdamW's state made before the first step (``Trainer.materialize_optimizer_state``) trains exactly as
the lazily made one: the same losses and the same final parameters, bit for bit, on one process and
under ZeRO-3 (FSDP2 DTensor parameters) on two gloo ranks.

Why it matters: on CUDA an async checkpoint pins host buffers sized by the optimizer state while the
attempt's first step runs (``workers/rank/rank_saves.py``); that must not change a single number of the
training it hides behind.
"""

from __future__ import annotations

import torch

from etrain.workers.engine.optim import materialize_state
from etrain.workers.protocol.run_config import ParallelConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import TINY_LLAMA, small_config

STEPS = 4


def _train(rank: int, world_size: int, config, ahead: bool) -> dict:
    from etrain.workers.engine.train import Trainer

    trainer = Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))
    made = trainer.materialize_optimizer_state() if ahead else None
    state_before = {
        "entries": sum(len(o.state) for o in trainer.optimizers),
        "steps": sorted({float(s["step"]) for o in trainer.optimizers for s in o.state.values()}),
        "zero_moments": all(
            float(s[key].abs().max()) == 0.0
            for o in trainer.optimizers
            for s in o.state.values()
            for key in ("exp_avg", "exp_avg_sq")
        ),
        "grads": sum(p.grad is not None for m in trainer.model_parts for p in m.parameters()),
    }
    losses = [trainer.train_step(step).loss for step in range(STEPS)]
    params = {
        name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for m in trainer.model_parts
        for name, p in m.named_parameters()
    }
    steps_after = sorted({float(s["step"]) for o in trainer.optimizers for s in o.state.values()})
    return {"made": made, "before": state_before, "losses": losses, "params": params, "steps_after": steps_after}


def _assert_same_training(lazy: dict, ahead: dict) -> None:
    assert ahead["losses"] == lazy["losses"]  # bit for bit
    assert ahead["params"].keys() == lazy["params"].keys()
    for name, value in lazy["params"].items():
        assert torch.equal(ahead["params"][name], value), name
    assert ahead["steps_after"] == lazy["steps_after"] == [float(STEPS)]


def test_adamw_state_made_ahead_trains_bit_for_bit_as_the_lazy_one() -> None:
    config = small_config(steps=STEPS, model=TINY_LLAMA)
    lazy = _train(0, 1, config, False)
    ahead = _train(0, 1, config, True)
    assert ahead["made"] is True
    n_params = len(lazy["params"])
    # What the first step would have made: a state per parameter, step counters at 0, zero moments,
    # and no gradient left behind (the first step's accumulation starts from nothing).
    assert ahead["before"] == {"entries": n_params, "steps": [0.0], "zero_moments": True, "grads": 0}
    assert lazy["before"]["entries"] == 0
    _assert_same_training(lazy, ahead)


def test_adamw_state_made_ahead_under_zero3_trains_as_the_lazy_one() -> None:
    config = small_config(steps=STEPS, parallel=ParallelConfig(dp=2, zero=3))
    lazy = run_distributed(_train, 2, config, False)
    ahead = run_distributed(_train, 2, config, True)
    for rank in range(2):
        assert ahead[rank]["made"] is True
        assert ahead[rank]["before"]["steps"] == [0.0] and ahead[rank]["before"]["zero_moments"]
        _assert_same_training(lazy[rank], ahead[rank])


def test_only_a_plain_adamw_without_gradients_is_materialized() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    assert materialize_state(sgd) is False and not sgd.state  # another optimizer: left to its first step

    adamw = torch.optim.AdamW([weight], lr=0.1)
    weight.grad = torch.full((3,), 2.0)  # mid-step: a gradient to keep
    assert materialize_state(adamw) is False and not adamw.state
    assert torch.equal(weight.grad, torch.full((3,), 2.0))

    weight.grad = None
    assert materialize_state(adamw) is True
    assert torch.equal(weight.detach(), torch.ones(3))  # lr 0 for the making step: nothing moved
    assert adamw.param_groups[0]["lr"] == 0.1  # the learning rate is given back
    assert float(adamw.state[weight]["step"]) == 0.0
    assert materialize_state(adamw) is True  # a second call changes nothing
