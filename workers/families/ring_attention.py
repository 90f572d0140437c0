"""Context parallelism's ring attention: causal attention over a sequence split across ``cp`` ranks.

The layout (``parallelism.cp``; the engine's ``apply_cp`` hands each attention its cp process group):
every sequence of ``S`` tokens is cut into ``2·cp`` chunks of ``S / (2·cp)`` and rank ``i`` of a cp group
holds chunks ``i`` and ``2·cp − 1 − i`` (:func:`chunk_positions`), the load balance of torch's
``context_parallel`` and Megatron: under the causal mask an early chunk attends to few keys and a late
one to many, and each rank gets one of each, so every rank does the same work. Each token keeps its true
position (RoPE is applied at :func:`chunk_positions`, not at ``0 .. S/cp − 1``).

One attention's forward, on a rank holding queries ``q`` and keys/values ``k, v`` of its two chunks:

1. Block 0 is its own K/V. Then ``cp − 1`` times the K/V block moves one step round the ring (sent to
   rank ``i + 1``, received from rank ``i − 1``, one ``batch_isend_irecv`` of K and V stacked; grouped-query
   attention sends the ``n_kv_heads`` heads, not the repeated ones), so after step ``s`` a rank holds the
   block of rank ``i − s``, whose positions it knows.
2. Each block's attention is computed with the causal mask by true position (query position >= key
   position) and its log-sum-exp; the blocks are merged by the online softmax (``lse = logaddexp(lse,
   lse_b)``, outputs reweighed by ``exp(lse_old − lse)`` and ``exp(lse_b − lse)``), which equals the
   softmax over the whole sequence. A query row that sees nothing of a block (a late block for an early
   chunk) gets a log-sum-exp near ``-1e30``, so its weight underflows to exactly 0 (a finite mask keeps
   the backward free of ``inf − inf``).

Backward: everything above is ordinary autograd except the ring step, :class:`_RingShift`, whose backward
sends the gradient of the block it received back to the rank it came from (the reverse ring). So the
gradients of K and V travel back round the ring, each rank ends with dK/dV of its own chunks summed over
every query that saw them, and the backward makes the same ``cp − 1`` exchanges per layer as the
forward. Every rank runs the same graph, so the exchanges pair up in the same order on every rank.

Why not torch's ``torch.distributed.tensor.experimental.context_parallel``: its ring is a handler for the
CUDA attention kernels only (``_scaled_dot_product_flash_attention``, ``_efficient_attention``,
``_cudnn_attention`` and their backwards; torch 2.13's ``_context_parallel/_attention.py``). On CPU,
``scaled_dot_product_attention`` dispatches to ``_scaled_dot_product_flash_attention_for_cpu`` or the math
path, which it does not intercept, so on CPU/gloo (where every layout is proven equal to one process) it
does not run. This ring is written on ``torch.distributed`` point-to-point ops, which gloo and NCCL both
carry.

Cost (correctness first): each block's attention is the math path, ``[batch, heads, S/cp, S/cp]`` scores in
fp32 per block, kept for the backward, so attention memory is ``cp`` such blocks per layer, ``S²/cp`` per
rank instead of ``S²`` (the planner counts it); half of each off-diagonal block is masked out and computed
anyway (a block from a later rank is invisible to the rank's early chunk), about 2× the causal FLOPs of a
kernel that skips them. The exchange is not overlapped with the block's compute. On GPU a flash kernel
that returns its log-sum-exp (``aten._scaled_dot_product_flash_attention``), per chunk pair, and an
asynchronous ring would remove both; the communication volume (K and V of ``(cp − 1)/cp`` of the sequence,
forward and backward, per layer) stays the same.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["chunk_positions", "ring_attention", "shard_sequence"]

#: The score of a masked (query, key) pair: finite, so that a row with no visible key in a block has a
#: finite log-sum-exp (about this value) whose weight underflows to 0, and no ``inf - inf`` appears.
_MASKED = -1e30


def chunk_positions(seq_len: int, cp: int, index: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The true positions of the tokens cp rank ``index`` holds: chunks ``index`` and ``2·cp − 1 − index``
    of ``2·cp`` equal chunks of a ``seq_len`` sequence (``2·cp`` divides ``seq_len``)."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2·cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(index * chunk, (index + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - index) * chunk, (2 * cp - index) * chunk, device=device)
    return torch.cat((first, second))


def shard_sequence(tensor: torch.Tensor, cp: int, index: int, dim: int = 1) -> torch.Tensor:
    """``tensor``'s tokens (along ``dim``) that cp rank ``index`` holds (:func:`chunk_positions`)."""
    positions = chunk_positions(tensor.shape[dim], cp, index, device=tensor.device)
    return tensor.index_select(dim, positions)


def _exchange(tensor: torch.Tensor, group: dist.ProcessGroup, send_to: int, recv_from: int) -> torch.Tensor:
    """Send ``tensor`` to group rank ``send_to`` while receiving one like it from ``recv_from``."""
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, group=group, group_peer=send_to),
        dist.P2POp(dist.irecv, received, group=group, group_peer=recv_from),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class _RingShift(torch.autograd.Function):
    """One step round the ring: send to the next rank, receive from the previous one. Its backward is the
    reverse step: the gradient of what was received goes back to the rank it came from."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size = group, rank, size
        return _exchange(tensor.contiguous(), group, (rank + 1) % size, (rank - 1) % size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _exchange(grad.contiguous(), ctx.group, (ctx.rank - 1) % ctx.size, (ctx.rank + 1) % ctx.size)
        return back, None, None, None


def _block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``q`` over one K/V block by true positions: the block's normalised output
    (fp32) and its log-sum-exp per query row."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    visible = q_positions[:, None] >= k_positions[None, :]
    scores = scores.masked_fill(~visible, _MASKED)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs.to(v.dtype), v).float(), lse


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    seq_len: int,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence held by the cp ``group``.

    ``q``: ``[batch, heads, S/cp, head_dim]``, ``k``/``v``: ``[batch, kv_heads, S/cp, head_dim]`` (grouped-query:
    each kv head serves ``heads / kv_heads`` consecutive query heads), the tokens at
    ``chunk_positions(seq_len, cp, rank)`` with RoPE already applied at those positions. Returns
    ``[batch, heads, S/cp, head_dim]`` in ``q``'s dtype, what ``scaled_dot_product_attention(is_causal=True)``
    over the whole sequence gives at this rank's tokens.
    """
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    n_rep = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_positions = chunk_positions(seq_len, size, rank, device=q.device)
    kv = torch.stack((k, v))
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for step in range(size):
        if step > 0:
            kv = _RingShift.apply(kv, group, rank, size)
        source = (rank - step) % size
        k_block, v_block = kv[0], kv[1]
        if n_rep > 1:
            k_block = k_block.repeat_interleave(n_rep, dim=1)
            v_block = v_block.repeat_interleave(n_rep, dim=1)
        k_positions = chunk_positions(seq_len, size, source, device=q.device)
        block_out, block_lse = _block_attention(q, k_block, v_block, q_positions, k_positions, scale)
        if out is None:
            out, lse = block_out, block_lse
            continue
        merged = torch.logaddexp(lse, block_lse)
        out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(-1)
        lse = merged
    return out.to(q.dtype)
