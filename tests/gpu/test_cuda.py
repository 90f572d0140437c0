"""The NCCL / CUDA / bf16 paths (`make test-gpu`). Skipped on machines without CUDA.

* one GPU: the fp32 CUDA trainer matches the CPU reference (different kernels: 1e-4 relative), and
  a bf16 (autocast) run trains and stays close to fp32;
* two or more GPUs: DDP, ZeRO-3 and TP over NCCL match one GPU to the equivalence tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.equivalence_utils import small_config
from workers.config import ParallelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _losses(config, device: str) -> list[float]:
    from workers.train import Trainer

    trainer = Trainer(config, rank=0, world_size=1, device=torch.device(device))
    return [trainer.train_step(step).loss for step in range(config.training.steps)]


def test_cuda_fp32_matches_cpu():
    config = small_config(steps=6)
    cpu = _losses(config, "cpu")
    gpu = _losses(dataclasses.replace(config, device="cuda"), "cuda")
    for step, (a, b) in enumerate(zip(cpu, gpu), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: cpu {a} vs cuda {b}"


def test_bf16_trains_close_to_fp32():
    config = dataclasses.replace(small_config(steps=8), device="cuda")
    fp32 = _losses(config, "cuda")
    bf16 = _losses(config.replace(training=dataclasses.replace(config.training, precision="bf16")), "cuda")
    assert bf16[-1] < bf16[0], bf16
    for step, (a, b) in enumerate(zip(fp32, bf16), start=1):
        assert abs(a - b) <= 3e-2 * abs(a), f"step {step}: fp32 {a} vs bf16 {b}"


def _nccl_rank(rank: int, world_size: int, config) -> list[float]:
    from workers.train import Trainer

    torch.cuda.set_device(rank)
    trainer = Trainer(config, rank=rank, world_size=world_size, device=torch.device("cuda", rank))
    return [trainer.train_step(step).loss for step in range(config.training.steps)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(
    "parallel",
    [ParallelConfig(dp=2), ParallelConfig(dp=2, zero=3), ParallelConfig(tp=2)],
    ids=["ddp2", "zero3-dp2", "tp2"],
)
def test_nccl_layouts_match_one_gpu(parallel):
    from tests.dist_utils import run_distributed

    base = dataclasses.replace(small_config(steps=6), device="cuda")
    reference = _losses(base, "cuda")
    results = run_distributed(_nccl_rank, 2, base.replace(parallel=parallel), backend="nccl", timeout_s=300)
    for losses in results:
        for step, (a, b) in enumerate(zip(reference, losses), start=1):
            assert abs(a - b) <= 1e-5 * abs(a), f"{parallel.describe()} step {step}: one GPU {a} vs {b}"
