"""A warm spare imports, ahead of its job, what the job's first step would otherwise import on the critical path.

Measured in a fresh interpreter (``sys.modules`` is the evidence, so the test's own process, which has
imported everything already, cannot be used): a spare on a CPU node leaves the compiler alone (compile is
off by default there), a spare on a GPU node imports it, and a compiled Trainer built afterwards imports
almost nothing more while it wraps its blocks.
"""

from __future__ import annotations

import json
import subprocess
import sys

_SCRIPT = r"""
import json, sys
from etrain.workers.rank.spare import SpareRank
import torch
seen = {}
cpu_spare = SpareRank(gpu_node=False)
seen["cpu_node_imported"] = cpu_spare.compiler_imported
seen["cpu_node_has_inductor"] = "torch._inductor.compile_fx" in sys.modules
gpu_spare = SpareRank(gpu_node=True)  # on a CPU-only torch: no CUDA either way
seen["gpu_node_imported"] = gpu_spare.compiler_imported
seen["gpu_node_has_inductor"] = "torch._inductor.compile_fx" in sys.modules

from etrain.workers.engine.train import Trainer
from etrain.workers.protocol.run_config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainingConfig
config = RunConfig(
    job_id="spare-test",
    model=ModelConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=8),
    data=DataConfig(kind="synthetic"),
    parallel=ParallelConfig(),
    training=TrainingConfig(steps=1, global_batch=1, micro_batch=1, compile=True),
)
before = set(sys.modules)
Trainer(config, rank=0, world_size=1, device=torch.device("cpu"))
seen["trainer_new_modules"] = sorted(set(sys.modules) - before)
seen["cuda_initialized"] = torch.cuda.is_initialized()
print(json.dumps(seen))
"""


def test_a_gpu_node_spare_imports_the_compiler_and_a_cpu_node_spare_does_not():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["cpu_node_imported"] is False and seen["cpu_node_has_inductor"] is False, seen
    assert seen["gpu_node_imported"] is True and seen["gpu_node_has_inductor"] is True, seen
    assert seen["cuda_initialized"] is False
    # Without the spare's imports the Trainer's build imported 401 modules here (torch 2.13); what is left is
    # a handful the warm-up cannot know of (none of the compiler's).
    compiler_modules = [
        name for name in seen["trainer_new_modules"] if name.startswith(("torch._inductor", "torch._dynamo"))
    ]
    assert compiler_modules == [], compiler_modules
    assert len(seen["trainer_new_modules"]) < 20, seen["trainer_new_modules"]
