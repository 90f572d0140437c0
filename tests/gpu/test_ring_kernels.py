"""The ring's blocks in torch's CUDA flash kernel, as ``tests/unit/test_ring_kernels.py`` checks the CPU one:
each kind of block the ring computes, forward against the math path and backward, given the whole softmax's
output and log-sum-exp, against autograd in fp32 (``tests/ring_kernel_utils.py``). Skipped without CUDA."""

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
