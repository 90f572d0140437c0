"""A process that trains a second time on new process groups (an in-place repair's survivors start a new
attempt in their process; a tenant's next job runs in the ranks its last job gave back) trains exactly as a
fresh one.

Torch's DTensor caches key device meshes by ranks, layout and names, not by the groups they hold, so
without ``forget_mesh_state`` the second run is answered with the first run's mesh and its destroyed groups,
and fails at its first collective wherever the new groups got other names. Each case creates a few groups
between the runs, as a worker whose first attempt made its exchange or async-writer groups does.

Every kind of layout is run twice (TP, pipeline stages, ring attention, the experts' token exchange, each
under FSDP2, and context with expert parallelism), and a ring-attention run and an expert-parallel one in turn:
what these prove is why a tenant's returned ranks serve its next job whatever either job's layout
(``service/decisions/returned_ranks.py``).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch.distributed as dist

from etrain.workers.families import MODEL_PRESETS
from etrain.workers.protocol.run_config import ModelConfig, ParallelConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import TINY_LLAMA, _train, small_config

#: The tiny Qwen3-MoE of the expert-parallel tests (8 experts, top-2, a router loss that moves the router).
MOE = dataclasses.replace(ModelConfig(**MODEL_PRESETS["qwen3-moe-tiny"]), seq_len=16, router_aux_loss_coef=0.01)
LAYOUTS = {
    "dp2-tp2-zero3": (ParallelConfig(dp=2, tp=2, zero=3), TINY_LLAMA),  # FSDP2 over a TP-sharded model
    "pp2-dp2-zero3": (ParallelConfig(pp=2, dp=2, zero=3), TINY_LLAMA),  # pipeline stages sharded by FSDP2
    "cp2-zero3": (ParallelConfig(cp=2, zero=3), TINY_LLAMA),  # ring attention over the sequence's shards
    "dp2-ep2-zero3": (ParallelConfig(dp=2, ep=2, zero=3), MOE),  # the experts' token exchange
    "dp2-cp2-ep2": (ParallelConfig(dp=2, cp=2, ep=2), MOE),  # both: an ep group per cp index
}
GROUPS_BETWEEN = 5


def _train_in_turn(rank: int, world_size: int, configs) -> list[tuple[list[float], list[float]]]:
    """Train each config in turn in this very process and thread; between two runs, leave the process groups
    as a finished attempt does and join new ones (other group names). Each run's (losses, grad norms)."""
    results = []
    for attempt, config in enumerate(configs):
        if attempt:
            store = dist.distributed_c10d._get_default_store()
            dist.destroy_process_group()
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(f"attempt-{attempt}", store),
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=90),
            )
            for _ in range(GROUPS_BETWEEN):
                dist.new_group(list(range(world_size)))
        run = _train(rank, world_size, config)
        assert len(run.losses) == config.training.steps, (rank, attempt, run.losses)
        results.append((run.losses, run.grad_norms))
    return results


def _config(layout: str):
    parallel, model = LAYOUTS[layout]
    return small_config(steps=3, parallel=parallel, model=model)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_a_second_run_on_new_groups_in_the_same_processes_trains_exactly_like_the_first(layout: str) -> None:
    config = _config(layout)
    results = run_distributed(_train_in_turn, config.parallel.world_size, [config, config], timeout_s=150)
    for rank, (first, second) in enumerate(results):
        assert second == first, (rank, first, second)  # losses and grad norms, bit for bit


def test_a_run_after_another_layout_in_the_same_processes_trains_exactly_like_a_fresh_one() -> None:
    """Ring attention, then the experts' token exchange under FSDP2, then each again: neither leaves anything
    behind that changes the other (a tenant's next job in its returned ranks has any layout)."""
    ring, experts = _config("cp2-zero3"), _config("dp2-ep2-zero3")
    results = run_distributed(_train_in_turn, 2, [ring, experts, ring, experts], timeout_s=150)
    for rank, (ring_fresh, experts_fresh, ring_again, experts_again) in enumerate(results):
        assert ring_again == ring_fresh, (rank, ring_fresh, ring_again)
        assert experts_again == experts_fresh, (rank, experts_fresh, experts_again)
