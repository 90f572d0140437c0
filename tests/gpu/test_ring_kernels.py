"""The ring's blocks in torch's CUDA flash kernel, as ``tests/unit/test_ring_kernels.py`` checks the CPU one:
each kind of block the ring computes, forward against the math path and backward, given the whole softmax's
output and log-sum-exp, against autograd in fp32 (``tests/ring_kernel_utils.py``); and the whole ring op
(``etrain::ring_attention``) on one rank in bf16, forward and backward (its CUDA backward's extras from
``_cuda_flash_extras``), against causal SDPA, eagerly and inside a graph compiled by inductor
(``fullgraph``: the op through its fake, as in a compiled block). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.ring_kernel_utils import block_errors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_block_in_the_cuda_flash_kernel_equals_the_whole_softmaxs_share(dtype):
    errors = block_errors("cuda", dtype)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 2e-2, (worst, errors[worst], errors)


def _whole_ring_on_one_gpu(rank: int, world_size: int, compiled: bool) -> dict[str, float]:
    """The ring op on one rank (its own block alone: no exchange) in bf16 on the GPU, forward and backward
    through ``etrain::ring_attention`` (the CUDA kernel's backward with ``_cuda_flash_extras``), against
    causal SDPA on the same bf16 inputs: relative |Δ| of the output and dQ/dK/dV. ``compiled``: the op called
    from a function that inductor compiles whole."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from etrain.workers.families.ring_attention import ring_attention

    generator = torch.Generator().manual_seed(3)
    shapes = [(2, 8, 64, 64), (2, 2, 64, 64), (2, 2, 64, 64), (2, 8, 64, 64)]  # grouped-query: 8 on 2
    q, k, v, grad = (torch.randn(s, generator=generator).to("cuda", torch.bfloat16) for s in shapes)
    mine = [t.clone().requires_grad_() for t in (q, k, v)]

    def attend(q, k, v):
        return ring_attention(q, k, v, group=dist.group.WORLD, seq_len=64)

    if compiled:
        attend = torch.compile(attend, backend="inductor", fullgraph=True)
    got = attend(*mine)
    got.backward(grad)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(
        ref[0], ref[1].repeat_interleave(4, 1), ref[2].repeat_interleave(4, 1), is_causal=True
    )
    want.backward(grad)
    errors = {"out": _relative(got, want)}
    for name, a, b in zip("qkv", mine, ref):
        errors[f"d{name}"] = _relative(a.grad, b.grad)
    return errors


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.detach().float()
    return ((got.detach().float() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_ring_op_on_a_gpu_equals_sdpa(compiled):
    from tests.dist_utils import run_distributed

    (errors,) = run_distributed(_whole_ring_on_one_gpu, 1, compiled, timeout_s=240)
    assert max(errors.values()) <= 2e-2, errors
