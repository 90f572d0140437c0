"""One block of the ring (``workers/families/ring_attention.py``) through a fused kernel, checked against
autograd on the whole softmax (shared by the CPU test and the CUDA one, which runs where a GPU is).

Each case is a block the ring computes: a rank's own block under the causal mask, an earlier rank's (every
query row against the first half of its keys) and a later rank's (the second half of the rows against all
its keys). The block is part of a longer softmax: every row also sees a second block of keys, so the
block's kernel backward must take the *whole* softmax's output and log-sum-exp, as the ring's does. The
reference is autograd through ``softmax(q·[k, k₂]ᵀ·scale)·[v, v₂]`` in fp32 from the same (rounded) inputs.
"""

from __future__ import annotations

import math

import torch

BATCH, HEADS, LENGTH, HEAD_DIM = 2, 4, 16, 16
CASES = {
    "own": (slice(0, LENGTH), slice(0, LENGTH), True),
    "earlier": (slice(0, LENGTH), slice(0, LENGTH // 2), False),
    "later": (slice(LENGTH // 2, LENGTH), slice(0, LENGTH), False),
}


def block_errors(device: str, dtype: torch.dtype) -> dict[str, float]:
    """Largest |kernel − reference| per case and quantity (out, lse, dq, dk, dv), relative to the
    reference's largest magnitude; raises if no kernel runs for ``dtype`` on ``device``."""
    from etrain.workers.families.ring_attention import _block_backward, _block_forward, _cuda_flash_extras, block_kernel

    kernel = block_kernel(torch.device(device), dtype, HEAD_DIM)
    if kernel == "math":
        raise AssertionError(f"no kernel for {dtype} on {device}")
    scale = 1.0 / math.sqrt(HEAD_DIM)
    extras = _cuda_flash_extras(torch.device(device)) if kernel == "cuda_flash" else ()  # as the ring passes them
    generator = torch.Generator().manual_seed(11)
    errors: dict[str, float] = {}
    for case, (rows, keys, causal) in CASES.items():
        q, k, v, k2, v2 = (torch.randn(BATCH, HEADS, LENGTH, HEAD_DIM, generator=generator) for _ in range(5))
        q, k, v = q[:, :, rows], k[:, :, keys], v[:, :, keys]
        grad = torch.randn(q.shape, generator=generator)
        inputs = [t.to(device=device, dtype=dtype).contiguous() for t in (q, k, v, k2, v2, grad)]
        # the reference, in fp32 from the same rounded values: the block and the second block in one softmax
        leaves = [t.float().requires_grad_() for t in inputs[:5]]
        qr, kr, vr, k2r, v2r = leaves
        scores = torch.matmul(qr, kr.transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -math.inf)
        whole = torch.cat((scores, torch.matmul(qr, k2r.transpose(-1, -2)) * scale), dim=-1)
        lse = torch.logsumexp(whole, dim=-1).detach()
        out = torch.matmul(torch.softmax(whole, dim=-1), torch.cat((vr, v2r), dim=2))
        out.backward(inputs[5].float())
        # the block alone, forward: against the math path's block (the same rows and keys)
        block_out, block_lse = _block_forward(kernel, *inputs[:3], causal=causal, scale=scale)
        want_out, want_lse = _block_forward("math", *(t.float() for t in inputs[:3]), causal=causal, scale=scale)
        errors[f"{case} out"] = _relative(block_out, want_out)
        errors[f"{case} lse"] = _relative(block_lse, want_lse)
        # backward: the kernel's share of the gradients given the whole softmax, plus the second block's
        whole_out = out.detach().to(dtype)
        got_q, got_k, got_v = _block_backward(
            kernel, extras, inputs[5], *inputs[:3], whole_out, lse, causal=causal, scale=scale
        )
        other_q, _, _ = _block_backward(
            "math", (), inputs[5], inputs[0], inputs[3], inputs[4], whole_out, lse, causal=False, scale=scale
        )
        errors[f"{case} dq"] = _relative(got_q.float() + other_q.float(), qr.grad)
        errors[f"{case} dk"] = _relative(got_k, kr.grad)
        errors[f"{case} dv"] = _relative(got_v, vr.grad)
    return errors


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.detach().float()
    return ((got.detach().float() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
