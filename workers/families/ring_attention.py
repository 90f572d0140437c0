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
   both unmasked: each block after the first costs half of a whole one. A rank's two chunks are in true
   order, so its own block's mask is the plain causal one over local indices. Each block's attention
   comes with its log-sum-exp from torch's flash kernel for the device (:func:`block_kernel`; the math
   path where none runs), and the blocks are merged in fp32 by the online softmax (``lse = logaddexp(lse,
   lse_b)``, outputs reweighed by ``exp(lse_old − lse)`` and ``exp(lse_b − lse)``) on the rows the block
   reached, which equals the softmax over the whole sequence.

Backward (:func:`_ring_backward`, the scheme of flash ring attention): the forward saves only this rank's
``q``, ``k``, ``v``, the output and the merged log-sum-exp. The backward sends
the K/V blocks round the ring again (the next one travelling while the current one computes), each with the
dK/dV its earlier holders accumulated for it (in flight while this rank computes its share of the block,
added to it after, and sent on);
each rank runs the block's kernel backward on the same rows as the forward with the saved output and
log-sum-exp (the whole sequence's softmax, so the kernel's probabilities are the whole softmax's), adds its
queries' share of that block's dK/dV and keeps its own dQ; a last
step hands every block's dK/dV back to its owner. Every rank runs the same steps in the same order, so the
exchanges pair up.

Why not torch's ``torch.distributed.tensor.experimental.context_parallel``: its ring is a handler for the
CUDA attention kernels only (``_scaled_dot_product_flash_attention``, ``_efficient_attention``,
``_cudnn_attention`` and their backwards; torch 2.13's ``_context_parallel/_attention.py``). On CPU,
``scaled_dot_product_attention`` dispatches to ``_scaled_dot_product_flash_attention_for_cpu`` or the math
path, which it does not intercept, so on CPU/gloo (where every layout is proven equal to one process) it
does not run. This ring is written on ``torch.distributed`` point-to-point ops, which gloo and NCCL both
carry.

The ring is one custom operator, ``etrain::ring_attention`` (returning the output and the log-sum-exp),
with its backward another, ``etrain::ring_attention_backward``: what works on operators sees it whole.
Selective activation checkpointing keeps its two outputs, as it keeps a fused attention kernel's, so the
backward's recompute of a block does not run the ring's exchanges again (full checkpointing does: it
replays the whole block). Under ``training.compile`` a block with the ring compiles as one graph
(``fullgraph``): dynamo traces the op through its fake (the group travels by name, a constant of the
graph) and inductor calls it as an opaque kernel between the fused projections, RoPE, norms and MLP, in
the same order on every rank. Before, the ring was ``torch.compiler.disable``-d; a graph break inside a
checkpointed block makes dynamo run that whole block eagerly, so under activation checkpointing nothing
of the block was compiled (on 2 CPU cores, cp=2, selective: 1.107–1.130 s a step compiled that way against
1.103 s eager; 0.958–0.964 s in one graph).

Cost: the activations kept per layer are linear in ``S/cp`` (the planner counts them). In a kernel a block's
scores never exist whole (the kernel's causal path also skips its masked tiles); on the math path (CUDA in
fp32, or fp32 q/k beside a bf16 v) the rank's own block's ``[batch, heads, S/cp, S/cp]`` fp32 scores are
the transient. A rank multiplies ``c² + (cp − 1)·c²/2`` query-key pairs per head (``c = S/cp``; computing
every block whole was ``cp·c²``: 5/8 of it at cp=4, counted in the tests with torch's FLOP counter).
Communication per layer: the forward sends K and V ``cp − 1`` times (``(cp − 1)/cp`` of the sequence's K/V),
overlapped with the compute; the backward sends them again plus their fp32 gradients ``cp`` times, each
overlapped with a block's compute (only the last gradient exchange, home, waits). The CUDA kernel path is checked against the math path by
``tests/gpu/test_ring_kernels.py``, not yet run on a GPU.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from etrain.workers.families.base import ring_block_kernel

__all__ = ["chunk_positions", "ring_attention", "shard_sequence"]

#: The math path's score of a masked (query, key) pair: finite, so no ``inf - inf`` appears in its backward.
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
    the causal mask is needed: (query rows, key rows, causal), rows being local indices along the sequence
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


def block_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """What computes a block of ``dtype`` on ``device`` (:func:`~etrain.workers.families.base.ring_block_kernel`,
    which the planner reads too): a fused kernel takes a block in tiles, so its scores never exist whole; the
    math path materialises them (the planner's ring transient)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "math"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "math"  # torch's flash kernel needs an Ampere-class GPU or newer (the planner assumes one)
    return ring_block_kernel(device.type, fp32=dtype == torch.float32, head_dim=head_dim)


def _math_forward(q, k, v, *, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:  # the rank's own block: its local order is its true order (two chunks, the earlier first)
        scores = scores.masked_fill(_above_diagonal(scores), _MASKED)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()), lse


def _math_backward(grad, q, k, v, out, lse, *, causal: bool, scale: float):
    q32, k32, v32, grad32 = q.float(), k.float(), v.float(), grad.float()
    scores = torch.matmul(q32, k32.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_above_diagonal(scores), _MASKED)
    probs = torch.exp(scores - lse.unsqueeze(-1))  # the whole sequence's probabilities (its log-sum-exp)
    # softmax backward: dS = P ∘ (dP − rowsum(dO ∘ O))
    delta = (grad32 * out.float()).sum(-1, keepdim=True)
    grad_scores = probs * (torch.matmul(grad32, v32.transpose(-1, -2)) - delta) * scale
    return (
        torch.matmul(grad_scores, k32),
        torch.matmul(grad_scores.transpose(-1, -2), q32),
        torch.matmul(probs.transpose(-1, -2), grad32),
    )


def _above_diagonal(scores: torch.Tensor) -> torch.Tensor:
    rows, keys = scores.shape[-2:]
    return torch.ones(rows, keys, dtype=torch.bool, device=scores.device).triu(1)


def _block_forward(kernel: str, q, k, v, *, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention: (output, fp32 log-sum-exp per query row)."""
    aten = torch.ops.aten
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if kernel == "cuda_flash":
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse
    return _math_forward(q, k, v, causal=causal, scale=scale)


def _block_backward(kernel: str, extras: tuple, grad, q, k, v, out, lse, *, causal: bool, scale: float):
    """One block's dQ, dK, dV given the *whole sequence's* output and log-sum-exp (flash ring attention: a
    block's probabilities are ``exp(q·kᵀ·scale − lse)`` with the merged log-sum-exp, so each block's share
    of the gradients comes out of the kernel's own backward). ``extras``: :func:`_cuda_flash_extras` for the
    CUDA kernel, else empty."""
    aten = torch.ops.aten
    if kernel != "math":  # as torch's own backward hands them over (derivatives.yaml: grad.contiguous()), and a
        grad, lse = grad.contiguous(), lse.contiguous()  # slice of the rows' log-sum-exp as the forward made it
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    if kernel == "cuda_flash":
        cum_q, cum_k, seed, offset = extras
        return aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale
        )
    return _math_backward(grad, q, k, v, out, lse, causal=causal, scale=scale)


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's forward: this rank's attention output (in ``q``'s dtype, laid out ``[batch, S/cp, heads,
    head_dim]`` in memory so that ``wo`` reads it as a view) and the merged fp32 log-sum-exp per query row
    (``[batch, heads, S/cp]``, contiguous). Each step computes only the rows that see each other
    (:func:`_visible`) in a fused kernel where one runs (:func:`block_kernel`): in ``q``, ``k`` and ``v``'s
    dtype where they share one, in fp32 otherwise (Qwen3's q/k norms hand over fp32 q and k under autocast),
    and the math path in fp32. The blocks merge in fp32. The next block's K/V travels while the current one
    computes (the exchange is started before, waited on after)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, heads, length, head_dim = q.shape
    n_rep = heads // k.shape[1]
    scale = 1.0 / math.sqrt(head_dim)
    if length * size != seq_len:
        raise ValueError(f"a cp rank holds {length} tokens of a {seq_len}-token sequence over {size} ranks")
    dtype = q.dtype if q.dtype == k.dtype == v.dtype else torch.float32
    kernel = block_kernel(q.device, dtype, head_dim)
    # the layouts are fixed here, not left to the first block's kernel, because the op's fake (what a
    # compiled graph plans with) must promise the same strides
    out = torch.empty((batch, length, heads, head_dim), dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.empty((batch, heads, length), dtype=torch.float32, device=q.device)
    with torch.autocast(q.device.type, enabled=False):
        query = q.to(dtype)
        kv = torch.stack((k, v))
        for step in range(size):
            arriving = _start_exchange(kv, group, (rank + 1) % size, (rank - 1) % size) if step < size - 1 else None
            rows, keys, causal = _visible(step, rank, length // 2, length)
            k_block, v_block = (_repeat(kv[i, :, :, keys].to(dtype), n_rep) for i in (0, 1))
            block_out, block_lse = _block_forward(
                kernel, query[:, :, rows], k_block, v_block, causal=causal, scale=scale
            )
            if step == 0:  # the rank's own block: every row
                out.copy_(block_out)
                lse.copy_(block_lse)
            else:
                merged = torch.logaddexp(lse[:, :, rows], block_lse)
                out[:, :, rows] = out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).unsqueeze(
                    -1
                ) + block_out.float() * torch.exp(block_lse - merged).unsqueeze(-1)
                lse[:, :, rows] = merged
            if arriving is not None:
                kv = _finish(arriving)
    return out.to(q.dtype), lse


def _ring_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ring's backward: the blocks go round again, each carrying the dK/dV its earlier holders
    accumulated for it, and a last step hands those to their owner. Each block's share comes from its
    kernel's backward on the forward's rows, given the whole sequence's output and log-sum-exp."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    n_rep = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    length = q.shape[2]
    dtype = q.dtype if q.dtype == k.dtype == v.dtype else torch.float32
    kernel = block_kernel(q.device, dtype, q.shape[-1])
    extras = _cuda_flash_extras(q.device) if kernel == "cuda_flash" else ()
    following, previous = (rank + 1) % size, (rank - 1) % size
    with torch.autocast(q.device.type, enabled=False):
        query, grad, output = q.to(dtype), grad_out.to(dtype), out.to(dtype)
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        # the gradient of the block held now, as its earlier holders accumulated it: in flight while this
        # rank computes its own share, added once both are here, then sent on (after the last step: home)
        passed_on = None
        for step in range(size):
            arriving = _start_exchange(kv, group, following, previous) if step < size - 1 else None
            rows, keys, causal = _visible(step, rank, length // 2, length)
            k_block, v_block = (_repeat(kv[i, :, :, keys].to(dtype), n_rep) for i in (0, 1))
            block_q, block_k, block_v = _block_backward(
                kernel,
                extras,
                grad[:, :, rows],
                query[:, :, rows],
                k_block,
                v_block,
                output[:, :, rows],
                lse[:, :, rows],
                causal=causal,
                scale=scale,
            )
            grad_q[:, :, rows] += block_q.float()
            if passed_on is None:  # the rank's own block, first: nobody held it before
                grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            else:
                grad_kv = _finish(passed_on)
            grad_kv[0, :, :, keys] += _fold(block_k.float(), n_rep)
            grad_kv[1, :, :, keys] += _fold(block_v.float(), n_rep)
            if size > 1:
                passed_on = _start_exchange(grad_kv, group, following, previous)
            if arriving is not None:
                kv = _finish(arriving)
        if passed_on is not None:  # the block held last is rank + 1's: its gradient went home, ours came
            grad_kv = _finish(passed_on)
    # copies, also where the dtype is already fp32: an op's outputs may not alias one another
    return grad_q.to(q.dtype), grad_kv[0].to(k.dtype, copy=True), grad_kv[1].to(v.dtype, copy=True)


_CUDA_FLASH_EXTRAS: dict[torch.device, tuple] = {}


def _cuda_flash_extras(device: torch.device) -> tuple:
    """What CUDA's flash backward takes back from its forward beyond the output and log-sum-exp: the
    cumulative sequence lengths (none for dense batches) and the dropout RNG's seed and offset (unused at
    dropout 0). The ring op returns only tensors its fake can promise, so these come from one tiny forward
    per device, in the form the kernel itself makes them."""
    if device not in _CUDA_FLASH_EXTRAS:
        tiny = torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16, device=device)
        found = torch.ops.aten._scaled_dot_product_flash_attention(tiny, tiny, tiny, 0.0, True, False)
        _CUDA_FLASH_EXTRAS[device] = (found[2], found[3], found[6], found[7])
    return _CUDA_FLASH_EXTRAS[device]


# The ring is one custom op (forward and backward), not an autograd.Function, so that what sees operators
# sees it whole: selective activation checkpointing keeps its output and log-sum-exp (the recompute in the
# backward does not run the ring's exchanges again), and a compiled block's fake tensors know its outputs.
# The process group travels by name (an op's arguments are tensors and plain values), as torch's functional
# collectives pass theirs.


@torch.library.custom_op("etrain::ring_attention", mutates_args=())
def _ring_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _ring_forward(q, k, v, _resolve_group(group_name), seq_len)


@_ring_attention_op.register_fake
def _(q, k, v, group_name, seq_len):
    batch, heads, length, head_dim = q.shape
    return (
        q.new_empty((batch, length, heads, head_dim)).transpose(1, 2),
        q.new_empty((batch, heads, length), dtype=torch.float32),
    )


@torch.library.custom_op("etrain::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ring_backward(grad, q, k, v, out, lse, _resolve_group(group_name))


@_ring_attention_backward_op.register_fake
def _(grad, q, k, v, out, lse, group_name):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the real ones


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, group_name, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.group_name = group_name
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    grad_q, grad_k, grad_v = torch.ops.etrain.ring_attention_backward(grad_out, q, k, v, out, lse, ctx.group_name)
    return grad_q, grad_k, grad_v, None, None


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _resolve_group(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


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
    out, _ = torch.ops.etrain.ring_attention(q, k, v, group.group_name, seq_len)
    return out
