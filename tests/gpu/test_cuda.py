"""The NCCL / CUDA / bf16 paths (`make test-gpu`). Skipped on machines without CUDA.

* one GPU: the fp32 CUDA trainer matches the CPU reference started from the same weights (different
  kernels: 1e-4 relative), and a bf16 (autocast) run trains and stays close to fp32; the step's timing
  comes from CUDA events (no per-micro-step synchronisation) and AdamW is the fused kernel; a
  mid-sized model initialises on the GPU in well under a second, the same values every build; a warm
  spare's warm-up leaves CUDA alone, and ``assign`` pins it to the GPU it is given, with the context
  made in the background;
* two or more GPUs: DDP, ZeRO-3, TP (vocab-parallel loss) and ZeRO-3 with CPU offload over NCCL
  match one GPU to the equivalence tolerance; bf16 under FSDP2 is its MixedPrecisionPolicy (fp32
  master weights and AdamW state) and follows fp32;
* four or more GPUs: HSDP (2 replicas × 2 shards) matches one GPU.

NCCL needs one GPU per rank (two ranks on one device are refused), so each multi-rank test skips,
naming the count it needs, on a machine with fewer GPUs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from etrain.workers import families
from etrain.workers.engine.mesh import backend_for
from etrain.workers.protocol.run_config import ModelConfig, ParallelConfig
from tests.equivalence_utils import small_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _losses(config, device: str) -> list[float]:
    from etrain.workers.engine.train import Trainer

    trainer = Trainer(config, rank=0, world_size=1, device=torch.device(device))
    return [trainer.train_step(step).loss for step in range(config.training.steps)]


def _trainer(config, device: str):
    from etrain.workers.engine.train import Trainer

    return Trainer(config, rank=0, world_size=1, device=torch.device(device))


def test_cuda_fp32_matches_cpu():
    """A CUDA rank draws its initial weights on the GPU (workers/engine/init.py): other numbers than a CPU
    rank's. So the CPU run starts from the GPU's weights, and then follows the same curve."""
    config = small_config(steps=6)
    cpu_trainer, gpu_trainer = _trainer(config, "cpu"), _trainer(dataclasses.replace(config, device="cuda"), "cuda")
    with torch.no_grad():
        for (name, cpu_param), gpu_param in zip(
            cpu_trainer.model_parts[0].named_parameters(), gpu_trainer.model_parts[0].parameters()
        ):
            assert cpu_param.shape == gpu_param.shape, name
            cpu_param.copy_(gpu_param.cpu())
    cpu = [cpu_trainer.train_step(step).loss for step in range(config.training.steps)]
    gpu = [gpu_trainer.train_step(step).loss for step in range(config.training.steps)]
    for step, (a, b) in enumerate(zip(cpu, gpu), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: cpu {a} vs cuda {b}"


def test_bf16_trains_close_to_fp32():
    config = dataclasses.replace(small_config(steps=8), device="cuda")
    fp32 = _losses(config, "cuda")
    bf16 = _losses(config.replace(training=dataclasses.replace(config.training, precision="bf16")), "cuda")
    assert bf16[-1] < bf16[0], bf16
    for step, (a, b) in enumerate(zip(fp32, bf16), start=1):
        assert abs(a - b) <= 3e-2 * abs(a), f"step {step}: fp32 {a} vs bf16 {b}"


def test_cuda_step_timing_and_fused_adamw():
    from etrain.workers.engine.train import Trainer

    config = dataclasses.replace(small_config(steps=3), device="cuda")
    trainer = Trainer(config, rank=0, world_size=1, device=torch.device("cuda"))
    history = [trainer.train_step(step) for step in range(3)]
    assert trainer.optimizers[0].defaults["fused"] is True
    for metrics in history:
        assert metrics.timing_synced  # one process: nothing to wait for
        # Events inside the step, read after its one host read: within the host-timed step.
        assert 0 < metrics.compute_s <= metrics.step_s + 1e-3 and metrics.comm_wait_s >= 0


#: A mid-sized Llama (0.78 B parameters, Llama 3's vocabulary): drawn on a CPU core it took seconds.
MID_LLAMA = ModelConfig(
    arch="llama", n_layers=4, d_model=2048, n_heads=16, n_kv_heads=8, d_ff=8192, vocab_size=128256, seq_len=256
)


def test_a_cuda_trainer_initialises_on_the_gpu_fast_and_the_same_every_time():
    import time

    from etrain.workers.engine.init import initial_value

    config = dataclasses.replace(small_config(steps=1, model=MID_LLAMA), device="cuda")
    torch.ones(1, device="cuda").sum().item()  # the CUDA context is not what is measured
    builds, seconds = [], []
    for _ in range(2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        trainer = _trainer(config, "cuda")
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        builds.append({name: param.detach().clone() for name, param in trainer.model_parts[0].named_parameters()})
        del trainer
    assert max(seconds) < 1.5, (
        f"Trainer builds of {families.num_params(MID_LLAMA) / 1e9:.2f} B parameters took {seconds}"
    )
    first, second = builds
    assert first.keys() == second.keys()
    for name, value in first.items():
        assert value.is_cuda and torch.equal(value, second[name]), name
    # Drawn on the GPU by the parameter's own generator; a CPU rank's numbers are others.
    embedding = first["tok_embeddings.weight"]
    drawn = initial_value(
        "tok_embeddings.weight",
        tuple(embedding.shape),
        seed=config.training.seed,
        n_layers=MID_LLAMA.n_layers,
        device=torch.device("cuda", torch.cuda.current_device()),
    )
    assert torch.equal(embedding, drawn)
    cpu = initial_value("tok_embeddings.weight", (16, MID_LLAMA.d_model), seed=config.training.seed, n_layers=4)
    assert not torch.equal(cpu, drawn[:16].cpu())


_SPARE_LEAVES_CUDA_ALONE = r"""
import json, os, sys, torch
from etrain.workers.rank.spare import SpareRank
spare = SpareRank(gpu_node=True)  # what a spare on a GPU node does before any job
seen = {"initialized": torch.cuda.is_initialized()}
os.environ["CUDA_VISIBLE_DEVICES"] = sys.argv[1]  # a CUDA driver started before this line would not see it
print(json.dumps(seen | {"devices_seen": torch._C._cuda_getDeviceCount()}))
"""

_SPARE_TAKES_ITS_GPU = r"""
import json, sys, torch
from etrain.workers.rank.spare import SpareRank
from tests.equivalence_utils import small_config
spare = SpareRank(gpu_node=True)
spare.assign(job_id="gpu-spare", rank=0, world_size=1, supervisor=None, gpu_ids=[sys.argv[1]], bundle="bundle 0 (test)")
device = spare._device(small_config(steps=1).replace(device="cuda"))
ones = torch.ones(8, 8, device=device)
warmup = spare._gpus.warmup.wait(120)
print(json.dumps(spare.devices() | {"device": str(device), "sum": (ones @ ones).sum().item(), "warmup": warmup,
                                    "uuid": str(torch.cuda.get_device_properties(0).uuid)}))
"""

_WARM_UP_LEAVES_THE_GIL = r"""
import json, time, torch
from etrain.workers.rank.device_info import CudaWarmup
warmup, ticks = CudaWarmup(), [time.monotonic()]
while warmup.running():  # what the rank's other threads (its Ray calls, the rendezvous) get meanwhile
    time.sleep(0.002)
    ticks.append(time.monotonic())
print(json.dumps({"state": warmup.state(), "longest_gap_s": max(b - a for a, b in zip(ticks, ticks[1:]))}))
"""


def _python(script: str, *args: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_pinned_async_saves_prepared_ahead_restore_each_saves_values(tmp_path):
    """Async saves of a CUDA state through reused pinned buffers (``AsyncCheckpointer(pinned=True)``):
    buffers prepared ahead, two saves in a row (torch 2.11 closed the stager after the first: the second
    failed with ``KeyError: <class 'type'>`` on an H100), each restores its own step's values."""
    from torch import nn

    from etrain.workers.checkpoints.checkpoint import AsyncCheckpointer, load_checkpoint
    from etrain.workers.checkpoints.checkpoint_commit import commit, step_dir

    torch.manual_seed(0)
    model = nn.Linear(256, 256).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    checkpointer = AsyncCheckpointer(pinned=True, write_threads=4)
    expected = {}
    try:
        for step in (1, 2):
            model(torch.randn(8, 256, device="cuda")).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                checkpointer.prepare([model], [optimizer])
            report = checkpointer.save(step_dir(tmp_path, step), [model], [optimizer], {"step": step}).wait(60)
            commit(step_dir(tmp_path, step), step, "single", 1, [report])
            expected[step] = {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}
    finally:
        checkpointer.close()
    for step, values in expected.items():
        fresh = nn.Linear(256, 256).cuda()
        load_checkpoint(step_dir(tmp_path, step), [fresh], [torch.optim.AdamW(fresh.parameters(), lr=0.1)])
        for name, value in values.items():
            assert torch.equal(fresh.state_dict()[name].cpu(), value), (step, name)


def test_a_spares_warm_up_leaves_cuda_alone():
    """Before assign, a spare has not started CUDA, so the GPUs it will be given can still be chosen: the
    first device count after the warm-up follows ``CUDA_VISIBLE_DEVICES`` as set then, whether it hides
    every GPU (a driver started during the warm-up with every GPU visible would still see them: a CPU
    training step does that) or shows one (one started with the GPUs hidden would see none)."""
    assert _python(_SPARE_LEAVES_CUDA_ALONE, "") == {"initialized": False, "devices_seen": 0}
    shown = _python(_SPARE_LEAVES_CUDA_ALONE, str(torch.cuda.device_count() - 1))
    assert shown == {"initialized": False, "devices_seen": 1}, shown


def test_a_spare_or_cold_ranks_cuda_warm_up_leaves_the_gil_to_its_other_threads():
    """The driver's start and the context are made through the driver API without the GIL
    (``start_cuda_driver``): torch makes them holding it, and the rank's other threads stood still for
    the whole start. The main thread here must never wait for most of the warm-up."""
    seen = _python(_WARM_UP_LEAVES_THE_GIL)
    state, driver = seen["state"], seen["state"]["driver"]
    print(seen)  # the figures, for docs/gpu.md
    assert state["outcome"] == "ready" and driver["outcome"] == "ready", seen
    assert seen["longest_gap_s"] < max(0.25, 0.5 * state["seconds"]), seen


def test_an_assigned_spare_runs_on_the_gpu_it_was_given():
    """``assign`` hands the bundle's GPU id to the rank: the process sees that GPU (alone) as device 0,
    the CUDA context is made in the background, and ``_device`` puts the rank there."""
    gpu = str(torch.cuda.device_count() - 1)  # the last GPU: on a machine with several, not the default one
    seen = _python(_SPARE_TAKES_ITS_GPU, gpu)
    assert seen["gpu_ids"] == [gpu] and seen["cuda_visible_devices"] == gpu, seen
    assert seen["device"] == "cuda:0" and seen["sum"] == 512.0 and seen["warmup"] == "ready", seen
    assert seen["uuid"] == str(torch.cuda.get_device_properties(int(gpu)).uuid), seen


def _nccl_rank(rank: int, world_size: int, config) -> dict:
    from etrain.workers.engine.train import Trainer

    torch.cuda.set_device(rank)
    trainer = Trainer(config, rank=rank, world_size=world_size, device=torch.device("cuda", rank))
    losses = [trainer.train_step(step).loss for step in range(config.training.steps)]
    states = [s for opt in trainer.optimizers for s in opt.state.values() if s]
    return {
        "losses": losses,
        "param_dtypes": sorted({str(p.dtype) for m in trainer.model_parts for p in m.parameters()}),
        "exp_avg_dtypes": sorted({str(s["exp_avg"].dtype) for s in states}),
    }


def _need_gpus(ranks: int) -> None:
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs (NCCL runs one rank per GPU), found {torch.cuda.device_count()}")


def _run_nccl(config) -> list[dict]:
    from tests.dist_utils import run_distributed

    ranks = config.parallel.world_size
    _need_gpus(ranks)
    backend = backend_for("cuda", cpu_offload=config.parallel.offload == "cpu")
    return run_distributed(_nccl_rank, ranks, config, backend=backend, timeout_s=300)


@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(dp=2),
        ParallelConfig(dp=2, zero=3),
        ParallelConfig(tp=2),
        ParallelConfig(dp=2, zero=3, offload="cpu"),
        ParallelConfig(dp=4, zero=3, dp_replicate=2),
    ],
    ids=["ddp2", "zero3-dp2", "tp2-loss-parallel", "zero3-dp2-offload", "hsdp-dp4"],
)
def test_nccl_layouts_match_one_gpu(parallel):
    base = dataclasses.replace(small_config(steps=6), device="cuda")
    config = base.replace(parallel=parallel)
    _need_gpus(parallel.world_size)
    reference = _losses(base, "cuda")
    for result in _run_nccl(config):
        for step, (a, b) in enumerate(zip(reference, result["losses"]), start=1):
            assert abs(a - b) <= 1e-5 * abs(a), f"{parallel.describe()} step {step}: one GPU {a} vs {b}"


def test_bf16_fsdp_mixed_precision_under_nccl():
    """bf16 + ZeRO-3: FSDP2's MixedPrecisionPolicy; master weights and AdamW moments stay fp32 and the
    loss follows the one-GPU fp32 curve within 3e-2 (the autocast test's band: bf16 kernels on GPU
    round differently from CPU ones, so the CPU test's tighter band is not assumed here)."""
    base = dataclasses.replace(small_config(steps=8), device="cuda")
    config = base.replace(
        parallel=ParallelConfig(dp=2, zero=3), training=dataclasses.replace(base.training, precision="bf16")
    )
    _need_gpus(2)
    fp32 = _losses(base, "cuda")
    for result in _run_nccl(config):
        assert result["param_dtypes"] == ["torch.float32"]
        assert result["exp_avg_dtypes"] == ["torch.float32"]
        bf16 = result["losses"]
        assert bf16[-1] < bf16[0], bf16
        for step, (a, b) in enumerate(zip(fp32, bf16), start=1):
            assert abs(a - b) <= 3e-2 * abs(a), f"step {step}: fp32 {a} vs bf16 {b}"
