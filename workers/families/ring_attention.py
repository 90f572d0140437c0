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
   block of rank ``i − s``, whose positions it knows. The next block's exchange starts before the current
   block computes and is waited on after it, so the transfer overlaps the compute.
2. Only the rows that see each other are computed (:func:`_visible`): the rank's own block whole, under the
   causal mask by true position (query position >= key position); an earlier rank's block, every query
   against the first half of its keys; a later rank's, the second half of the queries against all its keys,
   both unmasked: each block after the first costs half of a whole one. Each block's attention comes
   with its log-sum-exp, and the blocks are merged by the online softmax (``lse = logaddexp(lse, lse_b)``,
   outputs reweighed by ``exp(lse_old − lse)`` and ``exp(lse_b − lse)``) on the rows the block reached,
   which equals the softmax over the whole sequence. The causal mask is finite (``-1e30``), which keeps the
   backward free of ``inf − inf``.

Backward (:class:`_RingAttention`, an ``autograd.Function``, the scheme of flash ring attention): the
forward saves only this rank's ``q``, ``k``, ``v``, the output and the merged log-sum-exp. The backward sends
the K/V blocks round the ring again (the next one travelling while the current one computes), each with the
dK/dV its earlier holders accumulated for it (sent on once this rank added its share: that exchange waits);
each rank recomputes a block's probabilities from the saved log-sum-exp (the whole sequence's softmax) on
the same rows as the forward, adds its queries' share of that block's dK/dV and keeps its own dQ; a last
step hands every block's dK/dV back to its owner. Every rank runs the same steps in the same order, so the
exchanges pair up.

Why not torch's ``torch.distributed.tensor.experimental.context_parallel``: its ring is a handler for the
CUDA attention kernels only (``_scaled_dot_product_flash_attention``, ``_efficient_attention``,
``_cudnn_attention`` and their backwards; torch 2.13's ``_context_parallel/_attention.py``). On CPU,
``scaled_dot_product_attention`` dispatches to ``_scaled_dot_product_flash_attention_for_cpu`` or the math
path, which it does not intercept, so on CPU/gloo (where every layout is proven equal to one process) it
does not run. This ring is written on ``torch.distributed`` point-to-point ops, which gloo and NCCL both
carry.

Under ``training.compile`` the ring runs eagerly between the block's compiled graphs
(``torch.compiler.disable``: dynamo breaks the graph around it, and the block is compiled without
``fullgraph``); the projections, RoPE, the norms and the MLP stay compiled.

Cost: each block is the math path, its fp32 scores computed, used and dropped (in the forward, and again
in the backward), so the activations kept per layer are linear in ``S/cp`` (the planner counts them) and the
transient is the largest block's scores, the rank's own ``[batch, heads, S/cp, S/cp]`` (the others are half
of that). A rank multiplies ``c² + (cp − 1)·c²/2`` query-key pairs per head (``c = S/cp``; computing every
block whole was ``cp·c²``: 5/8 of it at cp=4, tested with torch's FLOP counter); of those, half of the own
block's are masked. Communication per layer: the forward sends K and V ``cp − 1`` times (``(cp − 1)/cp`` of the
sequence's K/V), overlapped with the compute; the backward sends them again, overlapped too, plus their fp32
gradients ``cp`` times, which wait. On GPU a flash kernel that returns its log-sum-exp
(``aten._scaled_dot_product_flash_attention``, per block) would remove the scores' transient and the masked
half of the own block.
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


def _start_exchange(
    tensor: torch.Tensor, group: dist.ProcessGroup, send_to: int, recv_from: int
) -> tuple[torch.Tensor, list]:
    """Start sending ``tensor`` to group rank ``send_to`` while receiving one like it from ``recv_from``;
    returns the receive buffer and the requests to wait on (:func:`_finish`). ``tensor`` must not change
    until then. Every rank starts its exchanges in the same order, so the sends and receives pair up."""
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, group=group, group_peer=send_to),
        dist.P2POp(dist.irecv, received, group=group, group_peer=recv_from),
    ]
    return received, dist.batch_isend_irecv(ops)


def _finish(exchange: tuple[torch.Tensor, list]) -> torch.Tensor:
    received, requests = exchange
    for request in requests:
        request.wait()
    return received


def _exchange(tensor: torch.Tensor, group: dist.ProcessGroup, send_to: int, recv_from: int) -> torch.Tensor:
    """Send ``tensor`` to group rank ``send_to`` while receiving one like it from ``recv_from``."""
    return _finish(_start_exchange(tensor, group, send_to, recv_from))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, positions: torch.Tensor | None) -> torch.Tensor:
    """``q·kᵀ·scale`` (fp32); with ``positions`` (the rank's own block: queries and keys at the same true
    positions) under the causal mask, a key after the query scoring :data:`_MASKED`."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if positions is None:
        return scores
    return scores.masked_fill(positions[:, None] < positions[None, :], _MASKED)


def _repeat(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention: each kv head serves ``n_rep`` consecutive query heads."""
    return t.repeat_interleave(n_rep, dim=1) if n_rep > 1 else t


def _fold(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of :func:`_repeat`: the ``n_rep`` query heads' gradients summed onto their kv head."""
    if n_rep == 1:
        return t
    batch, heads, seq, dim = t.shape
    return t.view(batch, heads // n_rep, n_rep, seq, dim).sum(2)


def _visible(step: int, rank: int, half: int, length: int) -> tuple[slice, slice, bool]:
    """Which of this rank's query rows see which of the block's key rows at ring step ``step``, and whether
    the causal mask is needed: (query rows, key rows, masked), rows being local indices along the sequence
    (a rank holds chunk ``rank`` in rows ``:half`` and chunk ``2·cp − 1 − rank`` in rows ``half:``).

    The block of step ``s`` is rank ``j = rank − s``'s (mod cp). Step 0 is the rank's own block: every row
    is compared, under the causal mask. An earlier rank's block (``s <= rank``: ``j < rank``): its first
    chunk ``j`` precedes both of this rank's chunks and its second ``2·cp − 1 − j`` follows both, so every
    query row sees exactly the first half of the keys, unmasked. A later rank's (``s > rank``): its chunks
    both lie between this rank's two, so only the second half of the queries sees them, every key, unmasked.
    Computing only those halves skips what the mask would zero: each block after the first costs half of a
    full one (torch's ``context_parallel`` does the same for its load-balanced layout)."""
    if step == 0:
        return slice(0, length), slice(0, length), True
    if step <= rank:
        return slice(0, length), slice(0, half), False
    return slice(half, length), slice(0, length), False


class _RingAttention(torch.autograd.Function):
    """The ring's forward (online softmax over the blocks as they arrive) and its backward (the blocks go
    round again, each carrying the dK/dV accumulated for it, and a last step hands those to their owner).

    Saves only ``q``, ``k``, ``v`` (this rank's, kv heads unrepeated), the output and the fp32 log-sum-exp
    per query row, as a fused attention kernel does: a block's scores exist only while it is computed, in
    the forward and again in the backward (recomputed: one more ``q·kᵀ`` per block). Computes in fp32
    whatever the input dtype (autocast off inside), and returns the output in ``q``'s dtype. Each step
    computes only the rows that see each other (:func:`_visible`), and the next block's K/V travels while
    the current one computes (the exchange is started before, waited on after).
    """

    @staticmethod
    def forward(ctx, q, k, v, group, seq_len):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        n_rep = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        length = q.shape[2]
        with torch.autocast(q.device.type, enabled=False):
            q32 = q.float()
            positions = chunk_positions(seq_len, size, rank, device=q.device)
            kv = torch.stack((k, v))
            out = lse = None
            for step in range(size):
                arriving = _start_exchange(kv, group, (rank + 1) % size, (rank - 1) % size) if step < size - 1 else None
                rows, keys, masked = _visible(step, rank, length // 2, length)
                k_block, v_block = _repeat(kv[0, :, :, keys].float(), n_rep), _repeat(kv[1, :, :, keys].float(), n_rep)
                scores = _scores(q32[:, :, rows], k_block, scale, positions if masked else None)
                block_lse = torch.logsumexp(scores, dim=-1)
                block_out = torch.matmul(torch.exp(scores - block_lse.unsqueeze(-1)), v_block)
                if out is None:
                    out, lse = block_out, block_lse
                else:
                    merged = torch.logaddexp(lse[:, :, rows], block_lse)
                    out[:, :, rows] = out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).unsqueeze(
                        -1
                    ) + block_out * torch.exp(block_lse - merged).unsqueeze(-1)
                    lse[:, :, rows] = merged
                if arriving is not None:
                    kv = _finish(arriving)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.seq_len = group, seq_len
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, seq_len = ctx.group, ctx.seq_len
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        n_rep = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        length = q.shape[2]
        following, previous = (rank + 1) % size, (rank - 1) % size
        with torch.autocast(q.device.type, enabled=False):
            q32, grad32 = q.float(), grad_out.float()
            positions = chunk_positions(seq_len, size, rank, device=q.device)
            # softmax backward: dS = P ∘ (dP − rowsum(dO ∘ O)), with P the whole sequence's probabilities
            delta = (grad32 * out.float()).sum(-1, keepdim=True)
            grad_q = torch.zeros_like(q32)
            kv = torch.stack((k, v))
            grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for step in range(size):
                # the next block's K/V travels while this one computes; its gradient follows once accumulated
                arriving = _start_exchange(kv, group, following, previous) if step < size - 1 else None
                rows, keys, masked = _visible(step, rank, length // 2, length)
                k_block, v_block = _repeat(kv[0, :, :, keys].float(), n_rep), _repeat(kv[1, :, :, keys].float(), n_rep)
                q_rows, grad_rows = q32[:, :, rows], grad32[:, :, rows]
                scores = _scores(q_rows, k_block, scale, positions if masked else None)
                probs = torch.exp(scores - lse[:, :, rows].unsqueeze(-1))
                grad_v = torch.matmul(probs.transpose(-1, -2), grad_rows)
                grad_scores = probs * (torch.matmul(grad_rows, v_block.transpose(-1, -2)) - delta[:, :, rows]) * scale
                grad_q[:, :, rows] += torch.matmul(grad_scores, k_block)
                grad_k = torch.matmul(grad_scores.transpose(-1, -2), q_rows)
                grad_kv[0, :, :, keys] += _fold(grad_k, n_rep)
                grad_kv[1, :, :, keys] += _fold(grad_v, n_rep)
                if size > 1:  # on to the block's next holder; after the last step, home to its owner
                    grad_kv = _exchange(grad_kv, group, following, previous)
                if arriving is not None:
                    kv = _finish(arriving)
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None


@torch.compiler.disable(reason="point-to-point exchanges in an autograd.Function: compiled blocks run it eagerly")
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
    return _RingAttention.apply(q, k, v, group, seq_len)
