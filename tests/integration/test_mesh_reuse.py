"""A process that trains a second time on new process groups (an in-place repair's survivors start a new
attempt in their process; a tenant's next job runs in the ranks its last job gave back) trains exactly as a
fresh one.

Torch's DTensor caches key device meshes by ranks, layout and names, not by the groups they hold, so
without ``forget_mesh_state`` the second run is answered with the first run's mesh and its destroyed groups,
and fails at its first collective wherever the new groups got other names. Each case creates a few groups
between the runs, as a worker whose first attempt made its exchange or async-writer groups does.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from etrain.workers.protocol.run_config import ParallelConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import TINY_LLAMA, _train, small_config

LAYOUTS = {
    "dp2-tp2-zero3": ParallelConfig(dp=2, tp=2, zero=3),  # FSDP2 over a TP-sharded model
    "pp2-dp2-zero3": ParallelConfig(pp=2, dp=2, zero=3),  # pipeline stages sharded by FSDP2
}
GROUPS_BETWEEN = 5


def _train_twice(rank: int, world_size: int, config) -> tuple[list[float], list[float], list[float], list[float]]:
    """Train, leave the process groups as a finished attempt does, join new ones (other group names), train
    again in this very process and thread."""
    first = _train(rank, world_size, config)
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("second", store), rank=rank, world_size=world_size, timeout=timedelta(seconds=90)
    )
    for _ in range(GROUPS_BETWEEN):
        dist.new_group(list(range(world_size)))
    second = _train(rank, world_size, config)
    return first.losses, second.losses, first.grad_norms, second.grad_norms


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_a_second_run_on_new_groups_in_the_same_processes_trains_exactly_like_the_first(layout: str) -> None:
    config = small_config(steps=3, parallel=LAYOUTS[layout], model=TINY_LLAMA)
    results = run_distributed(_train_twice, config.parallel.world_size, config, timeout_s=150)
    for rank, (first_losses, second_losses, first_norms, second_norms) in enumerate(results):
        assert len(first_losses) == 3, (rank, first_losses)
        assert second_losses == first_losses, (rank, first_losses, second_losses)  # bit for bit
        assert second_norms == first_norms, (rank, first_norms, second_norms)
