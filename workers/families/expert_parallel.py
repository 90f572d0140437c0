"""Expert parallelism's token exchange: a mixture-of-experts layer whose experts are split over ``ep`` ranks.

The layout (``parallelism.ep``, torchtitan's composition; ``workers/engine/parallelize.py``'s ``apply_ep``):
the ``ep`` ranks are borrowed from the data-parallel dimension, each holds the experts
``[r · E/ep, (r + 1) · E/ep)`` of every MoE layer (a ``Shard(0)`` DTensor over the ``ep`` mesh dimension)
and its own tokens, routed by its own router as without expert parallelism. One layer's forward:

1. **Counts.** The (token, pick) rows arrive sorted by global expert id, with the picks per expert. The
   per-expert counts go to the ranks that own those experts (one ``all_to_all_single`` of ``E`` integers),
   and both sides read the split sizes on the host (one read of both, the only host sync).
2. **Dispatch.** The rows go to their experts' ranks (``all_to_all_single`` with those splits). A rank
   receives, per source rank, its rows sorted by local expert; it regroups them by local expert (a stable
   sort of (expert, source) labels), runs its grouped experts, and puts the outputs back in arrival order.
3. **Combine.** The outputs return to the ranks the rows came from (the reverse ``all_to_all_single``),
   in the order they were sent; the caller weighs them by the router and sums each token's k picks, as
   without expert parallelism.

Autograd: both exchanges are ``torch.distributed._functional_collectives.all_to_all_single_autograd``,
whose backward is the reverse all-to-all, so the gradient of a row flows back to the rank whose token it
is and the expert weights' gradient is summed over every token they ran, whichever rank sent it (the
engine then averages it over the ranks that hold the same experts). Checked on gloo (CPU) and NCCL: gloo
implements ``alltoall_base`` with uneven and zero splits.

Under ``training.compile`` the exchange (with the local experts it calls) runs eagerly between the
block's compiled graphs (``torch.compiler.disable``: dynamo breaks the graph around it, and the block is
compiled without ``fullgraph``): its split sizes are host integers that change every step, which a
compiled graph would have to specialise on or treat as unbacked symbols. The attention, the norms, the
router and the shared parts stay compiled; under activation checkpointing they compile inside the
checkpoint, or not at all under selective checkpointing (``etrain.workers.protocol.compiled_blocks``).

Capacity is unbounded: every (token, expert) pair the router picks is sent, computed and returned, none
is dropped, whatever the balance; a rank's expert batch is as large as the routing makes it (the memory
of an unbalanced layer is the planner's ``k · tokens`` rows times the imbalance, not bounded here).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

__all__ = [
    "copy_to_tensor_parallel",
    "exchange_experts",
    "gather_sequence_for_experts",
    "local_tensor",
    "reduce_from_tensor_parallel",
]


def local_tensor(weight: torch.Tensor) -> torch.Tensor:
    """A stacked expert weight as this rank computes with it: its local experts under expert parallelism
    (a ``Shard(0)`` DTensor's local shard, differentiable), the tensor itself otherwise."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: the identity forward; the backward sums the gradient over the tp group (each tp rank's
    experts saw every row and gave it the gradient of their slice of the expert width only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: the forward sums the tp ranks' partial outputs; the backward is the identity (every
    tp rank computes the same loss from the summed output, so each already holds the whole gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherSequenceForExperts(torch.autograd.Function):
    """Sequence parallelism into tensor-parallel experts: the tp ranks' sequence shards (``[b, s/tp, d]``)
    gathered once into the whole sequence, handed out twice. The router's copy gets a gradient that is whole
    and the same on every tp rank (the router is replicated): the backward keeps this rank's slice of it. The
    experts' copy gets this rank's partial gradient (its slice of every expert's width): the backward
    reduce-scatters it along the sequence. So the input's gradient costs one reduce-scatter, where summing
    the experts' part whole (an all-reduce) and then slicing costs twice the bytes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
        tp = dist.get_world_size(group)
        ctx.group, ctx.tp, ctx.rank = group, tp, dist.get_rank(group)
        batch, shard, d = x.shape
        gathered = x.new_empty(tp * batch, shard, d)  # rank-major along dim 0, as the collectives lay it out
        dist.all_gather_into_tensor(gathered, x.contiguous(), group=group)
        whole = gathered.view(tp, batch, shard, d).permute(1, 0, 2, 3).reshape(batch, tp * shard, d)
        # Two outputs for one gathered buffer: the second a view of the first (no copy); their gradients still
        # reach the backward apart. Nothing writes to either in place (the router reads one, the experts
        # index the other).
        return whole, whole.view_as(whole)

    @staticmethod
    def backward(ctx, grad_router: torch.Tensor | None, grad_experts: torch.Tensor | None):
        grad = None
        if grad_experts is not None:
            batch, seq, d = grad_experts.shape
            parts = grad_experts.reshape(batch, ctx.tp, seq // ctx.tp, d).permute(1, 0, 2, 3)
            parts = parts.reshape(ctx.tp * batch, seq // ctx.tp, d)  # rank-major along dim 0
            grad = parts.new_empty(batch, seq // ctx.tp, d)
            dist.reduce_scatter_tensor(grad, parts, group=ctx.group)
        if grad_router is not None:
            batch, seq, d = grad_router.shape
            mine = grad_router.reshape(batch, ctx.tp, seq // ctx.tp, d)[:, ctx.rank]
            grad = mine.clone() if grad is None else grad + mine
        return grad, None


# Written by hand: torch's differentiable all-reduce (``torch.distributed.nn``) sums in both directions,
# and DTensor, which would derive these, has no grouped matmul; compiled blocks run them eagerly.
@torch.compiler.disable(reason="a collective with a hand-written backward")
def copy_to_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Rows entering tensor-parallel experts (each tp rank holds a slice of every expert's width)."""
    return _CopyToTensorParallel.apply(x, group)


@torch.compiler.disable(reason="a collective with a hand-written backward")
def gather_sequence_for_experts(x: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence shard ``[b, s/tp, d]`` gathered whole over the tp ``group``: (the router's copy, the
    experts' copy), whose gradients are sliced and reduce-scattered (:class:`_GatherSequenceForExperts`)."""
    return _GatherSequenceForExperts.apply(local_tensor(x), group)


@torch.compiler.disable(reason="a collective with a hand-written backward")
def reduce_from_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Tensor-parallel experts' partial outputs, summed over the tp group."""
    return _ReduceFromTensorParallel.apply(x, group)


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x, output_splits, input_splits, group))


@torch.compiler.disable(reason="the split sizes are read on the host; compiled blocks run it eagerly")
def exchange_experts(
    rows: torch.Tensor,
    counts: torch.Tensor,
    run_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """The experts' outputs of ``rows`` (``[R, d]``, sorted by global expert id; ``counts``: ``[E]`` rows
    per expert, any numeric dtype) when the experts are split over ``group``'s ranks in rank order;
    ``run_local(x, offsets)`` runs this rank's experts on rows sorted by local expert (``offsets``: where
    each local expert's rows end, int32). Returns ``[R, d_out]`` in the order of ``rows``."""
    ep = dist.get_world_size(group)
    n_experts = counts.numel()
    local = n_experts // ep
    send = counts.detach().to(torch.int64).reshape(ep, local)  # send[j, e]: my rows for rank j's expert e
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # received[i, e]: rank i's rows for my expert e
    sizes = torch.stack([send.sum(dim=1), received.sum(dim=1)]).tolist()  # the one host read
    input_splits, output_splits = sizes[0], sizes[1]
    arrived = _all_to_all(rows, output_splits, input_splits, group)
    # Regroup by local expert: each arrived row's label is (source, expert); order by (expert, source).
    labels = torch.arange(ep * local, device=received.device).reshape(ep, local)
    labels = (labels % local) * ep + labels // local  # expert-major key of (source i, expert e)
    keys = torch.repeat_interleave(labels.reshape(-1), received.reshape(-1))
    order = torch.sort(keys, stable=True).indices
    offsets = torch.cumsum(received.sum(dim=0), dim=0).to(torch.int32)
    out = run_local(arrived[order], offsets)
    out = out[torch.argsort(order)]  # back to arrival order
    return _all_to_all(out, input_splits, output_splits, group)
