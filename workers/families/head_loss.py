"""The output projection and the loss, in chunks of tokens, so the full logits never exist.

Why: the logits are a large-vocabulary model's largest activation. One micro-batch of 4 × 2,048 tokens
over Llama 3's 128,256-token vocabulary is 2.1 GB of bf16 logits, 4.2 GB as the fp32 copy the loss
reads, and the loss's backward holds two more fp32 buffers of that size: ~12 GiB of a 49 GiB peak
measured on an H100. Here the projection and the cross-entropy run one chunk of tokens at a time, each
chunk under ``torch.utils.checkpoint``: the forward keeps only the chunk's hidden states (not its
logits), and the backward recomputes one chunk's logits, takes their gradient and frees them before
the next. Peak memory is one chunk's logits; the price is one more forward of the output matmul
(2·tokens·d·vocab FLOPs, ~5% of a 1B model's step, ~2% of an 8B's).

Why by hand: torch has no fused linear-cross-entropy; Liger's and Apple's cut-cross-entropy kernels
are CUDA/Triton only and do not compose with DTensor's vocab-parallel loss. Checkpointing each chunk
through the head *module* keeps every composition the engine already has: tensor parallelism's
vocab-sharded head and ``loss_parallel`` (the chunk's logits are a ``Shard(-1)`` DTensor), sequence
parallelism (each chunk takes every rank's local positions, see :func:`_chunks`), FSDP2 and DDP (the head runs inside the root module's forward, so
its parameters are gathered there and its gradient is reduced with the rest) and autocast.

The loss is the mean over every token of the micro-batch, the same number ``cross_entropy_loss``
gives on the whole logits up to the order of the fp32 sums (tests/integration/test_throughput_options.py).

Under ``training.compile`` the cross-entropy itself (the fp32 upcast, log-softmax and target pick, whole
logits or one chunk's) is compiled too, as torchtitan compiles its loss: eagerly it is four passes over
fp32 copies of the logits, and it keeps the fp32 log-softmax (4 bytes per logit) for the backward and
builds two more fp32 buffers there; compiled, the upcast is fused into the reductions, the backward keeps
the logits as they came (2 bytes under bf16) and two numbers per token, and writes the gradient straight
in the logits' dtype (counted from what the partitioner saves: tests/unit/test_planner.py). The
vocab-parallel loss under tensor parallelism (a DTensor under ``loss_parallel``) stays eager.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from etrain.workers.families.model import cross_entropy_loss, token_cross_entropy

__all__ = ["head_loss"]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def head_loss(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int,
    compile_backend: str | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``head(hidden)`` against ``targets``; in chunks when ``chunk_tokens > 0``.

    ``hidden``: ``[batch, seq, d]``, the final norm's output; under sequence parallelism a DTensor
    sharded on the sequence, of which each chunk takes this rank's local positions (the head's
    tensor-parallel style gathers them over the tp ranks). ``targets``: ``[batch, seq]``.
    ``chunk_tokens`` counts tokens of the whole (gathered) sequence. ``compile_backend``: the
    cross-entropy compiled with this torch.compile backend (``training.compile``), or eager (None).
    """
    loss_of = _loss_function(compile_backend)
    if chunk_tokens <= 0:
        return loss_of(head(hidden), targets)
    shards = 1
    if isinstance(hidden, DTensor):
        for placement, size in zip(hidden.placements, hidden.device_mesh.shape):
            if placement.is_shard(1):
                shards *= size
            elif not placement.is_replicate():
                raise ValueError(
                    f"the chunked loss needs the hidden states sharded by sequence, got {hidden.placements}"
                )
        hidden = hidden.to_local()
    batch, local_seq = hidden.shape[0], hidden.shape[1]
    # Targets in the order the head's sequence all-gather produces a chunk: shard-major.
    by_shard = targets.reshape(batch, shards, local_seq)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for rows, cols in _chunks(batch, local_seq, max(1, chunk_tokens // shards)):
        chunk_targets = by_shard[rows, :, cols].reshape(rows.stop - rows.start, -1)
        tokens = chunk_targets.numel()
        # preserve_rng_state=False: nothing random runs here (no dropout in any family).
        loss = checkpoint(
            _chunk_loss,
            head,
            hidden[rows, cols],
            chunk_targets,
            loss_of,
            use_reentrant=False,
            preserve_rng_state=False,
        )
        total = total + loss * tokens
    return total / targets.numel()


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, loss_of: Loss) -> torch.Tensor:
    return loss_of(head(hidden), targets)


def _loss_function(compile_backend: str | None) -> Loss:
    """``cross_entropy_loss``, with plain (not vocab-sharded) logits compiled by ``compile_backend``."""
    if compile_backend is None:
        return cross_entropy_loss
    compiled = _compiled_cross_entropy(compile_backend)

    def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if isinstance(logits, DTensor):  # vocab-parallel: loss_parallel's own cross-entropy, eager
            return cross_entropy_loss(logits, targets)
        return compiled(logits, targets)

    return loss_of


@functools.cache
def _compiled_cross_entropy(backend: str) -> Loss:
    # fullgraph: the loss is four ops and must not break; dynamic=False: a job sees at most two shapes
    # (a micro-batch, or a chunk and the last, shorter chunk), each compiled once.
    return torch.compile(token_cross_entropy, backend=backend, fullgraph=True, dynamic=False)


def _chunks(batch: int, seq: int, tokens: int) -> Iterator[tuple[slice, slice]]:
    """(rows, positions) slices of a ``[batch, seq]`` grid, each about ``tokens`` tokens: whole rows
    grouped while a row fits in a chunk, else each row cut into equal runs of positions. A chunk is
    always a rectangle, so a sequence-sharded chunk gathers into whole runs of each shard's positions."""
    if tokens >= seq:
        rows = max(1, tokens // seq)
        for start in range(0, batch, rows):
            yield slice(start, min(batch, start + rows)), slice(0, seq)
        return
    pieces = -(-seq // tokens)
    width = -(-seq // pieces)
    for row in range(batch):
        for start in range(0, seq, width):
            yield slice(row, row + 1), slice(start, min(seq, start + width))
