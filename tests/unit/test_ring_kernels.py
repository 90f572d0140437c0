"""The ring's blocks in torch's CPU flash kernel (``workers/families/ring_attention.py``): each kind of block
the ring computes, forward against the math path and backward, given the whole softmax's output and
log-sum-exp, against autograd (``tests/ring_kernel_utils.py``; ``tests/gpu/test_ring_kernels.py`` runs the
same on CUDA's flash kernel). Which computation runs where, as the ranks and the planner both read it."""

from __future__ import annotations

import pytest
import torch

from etrain.workers.families.base import ring_block_kernel
from tests.ring_kernel_utils import block_errors


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_a_block_in_the_cpu_flash_kernel_equals_the_whole_softmaxs_share(dtype, tolerance):
    errors = block_errors("cpu", dtype)
    assert len(errors) == 15
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, (worst, errors[worst], errors)


def test_which_computation_runs_a_block():
    assert ring_block_kernel("cpu", fp32=True, head_dim=3) == "cpu_flash"
    assert ring_block_kernel("cpu", fp32=False, head_dim=128) == "cpu_flash"
    assert ring_block_kernel("cuda", fp32=False, head_dim=128) == "cuda_flash"  # Llama 3's heads in bf16
    assert ring_block_kernel("cuda", fp32=False, head_dim=256) == "cuda_flash"
    # torch's CUDA flash kernel: no fp32, head_dim a multiple of 8 up to 256
    assert ring_block_kernel("cuda", fp32=True, head_dim=128) == "math"
    assert ring_block_kernel("cuda", fp32=False, head_dim=260) == "math"
    assert ring_block_kernel("cuda", fp32=False, head_dim=100) == "math"
