"""A rank process before its job: a warm spare imports what the job's first step would otherwise import on the
critical path, and every rank process compiles into the node's etrain cache folder.

Measured in fresh interpreters (``sys.modules`` and ``os.environ`` are the evidence, so the test's own
process, which has imported everything already, cannot be used): a spare on a CPU node leaves the compiler
alone (compile is off by default there), a spare on a GPU node imports it, and a compiled Trainer built
afterwards imports almost nothing more while it wraps its blocks. ``ETRAIN_COMPILE_CACHE_DIR`` holds in a
spare and in a cold rank: importing ``torch._dynamo`` (any Trainer build does) sets inductor's default
folder, which used to be taken for the operator's choice (the H100's ranks compiled into
``/tmp/torchinductor_root``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_SCRIPT = r"""
import json, os, sys
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
seen["inductor_cache_dir"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
print(json.dumps(seen))
"""

_COLD_RANK = r"""
import json, os
from etrain.workers.rank.worker import TrainWorker
TrainWorker(job_id="cold-test", rank=0, world_size=1, supervisor=None, bundle="no bundle (test)")
import torch._dynamo  # what the rank's Trainer build imports first
print(json.dumps({"inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}))
"""


def _fresh_python(script: str, cache: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TORCHINDUCTOR_CACHE_DIR"}
    env["ETRAIN_COMPILE_CACHE_DIR"] = cache
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_gpu_node_spare_imports_the_compiler_and_a_cpu_node_spare_does_not(tmp_path):
    cache = str(tmp_path / "node-compile-cache")
    seen = _fresh_python(_SCRIPT, cache)
    assert seen["inductor_cache_dir"] == cache, seen["inductor_cache_dir"]
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


def test_a_cold_rank_compiles_into_the_nodes_etrain_cache(tmp_path):
    cache = str(tmp_path / "node-compile-cache")
    assert _fresh_python(_COLD_RANK, cache) == {"inductor_cache_dir": cache}


_RELEASE = r"""
import json, os
from etrain.workers.rank.spare import SpareRank

spare = SpareRank(gpu_node=False)
first = spare.assign(job_id="job-1", rank=0, world_size=2, supervisor=None)
spare._running = True  # an attempt under way: never released
running = spare.release()
spare._running = False
released = spare.release()
second = spare.assign(job_id="job-2", rank=1, world_size=2, supervisor=None)
print(json.dumps({"first": first, "running": running, "released": released, "second": second,
                  "rank": spare.rank, "job": spare.job_id, "pid": os.getpid()}))
"""


def test_a_released_rank_serves_the_next_job_as_a_new_rank_and_counts_the_jobs_it_served():
    """``release`` refuses while an attempt runs; after it, ``assign`` makes the same process another job's rank
    and says it served one job before (what the ``placed`` event counts as kept from the tenant's earlier jobs)."""
    out = subprocess.run([sys.executable, "-c", _RELEASE], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["first"] == 0 and answer["second"] == 1, answer
    assert answer["running"] == {"pid": answer["pid"], "reusable": False, "why": "an attempt is running"}, answer
    assert answer["released"] == {"pid": answer["pid"], "reusable": True, "why": ""}, answer
    assert (answer["rank"], answer["job"]) == (1, "job-2"), answer
