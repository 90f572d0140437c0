"""Gradient clipping scales each gradient's local tensor: the same numbers as torch's own clipping.

``etrain.workers.engine.optim.clip_grad_norm_`` multiplies the local tensors of DTensor gradients (shards,
replicas) and plain gradients by the clipping coefficient, instead of going through DTensor's dispatch
once per gradient. The outside reference is ``torch.nn.utils.clip_grads_with_norm_`` on copies of the same
gradients, with the same total norm: every gradient must come out bit for bit the same, on two real gloo
ranks, for a norm that binds and for one that does not.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests.dist_utils import run_distributed


def _clip_both_ways(rank: int, world_size: int, max_norm: float) -> list[tuple[str, bool, float]]:
    from etrain.workers.engine.optim import clip_grad_norm_

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)  # every rank draws the same whole tensors, then keeps its piece

    def parameters() -> list[nn.Parameter]:
        made = []
        for shape, placement in (((6, 4), Shard(0)), ((4, 6), Shard(1)), ((5,), Replicate()), ((3, 3), None)):
            whole, grad = torch.randn(shape), torch.randn(shape) * 3
            if placement is None:  # a plain parameter beside the DTensors (another mesh, or none)
                param, param.grad = nn.Parameter(whole), grad
            else:
                param = nn.Parameter(distribute_tensor(whole, mesh, [placement]))
                param.grad = distribute_tensor(grad, mesh, [placement])
            made.append(param)
        return made

    ours = parameters()
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    for mine, other in zip(ours, theirs):
        other.grad = mine.grad.detach().clone()
    total = clip_grad_norm_(ours, max_norm)
    torch.nn.utils.clip_grads_with_norm_(theirs, max_norm, total, foreach=False)

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    return [
        (type(p.grad).__name__, torch.equal(whole(p.grad), whole(q.grad)), float(total)) for p, q in zip(ours, theirs)
    ]


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["binding", "not-binding"])
def test_clipping_local_tensors_equals_torchs_clipping_bit_for_bit(max_norm):
    results = run_distributed(_clip_both_ways, 2, max_norm)
    for rank_results in results:
        assert [kind for kind, _, _ in rank_results] == ["DTensor", "DTensor", "DTensor", "Tensor"]
        assert all(equal for _, equal, _ in rank_results), rank_results
    norms = {norm for rank_results in results for _, _, norm in rank_results}
    assert len(norms) == 1 and norms.pop() > 0.5  # every rank clipped by the same norm, one that binds at 0.5
