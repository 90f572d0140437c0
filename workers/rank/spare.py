"""A warm spare rank: a Ray actor process with torch and the engine already imported, no job yet.

Starting a rank cold costs a new Python interpreter, ``import torch`` and the engine's modules
(3-7 s on a 2-core machine, measured), on every first launch and every replacement. A spare pays
that once, ahead of time, while it holds nothing: it is created with ``num_cpus=0`` and no GPUs, so
it never counts against any job's resources, and it does not touch CUDA, so it holds no GPU memory.
When a job's placement group is ready, the worker group takes a spare on the node of each bundle
(``service/runtime/spares.py``) and :meth:`SpareRank.assign` turns it into that job's rank: the bundle's
reservation is what accounts for the rank's CPUs and GPUs, so Ray gives the spare no GPU ids
(``ray.get_gpu_ids()`` is empty in it) and leaves its ``CUDA_VISIBLE_DEVICES`` alone. ``assign`` hands the
bundle's GPU ids to the rank, which takes them as its only source, pins the process to them and
starts the CUDA context on them in the background (``TrainWorker._init_gpus``,
``workers/rank/device_info.py``). That works only because nothing before ``assign`` starts CUDA, which
would fix the visible GPUs for good: ``PYTORCH_NVML_BASED_CUDA_CHECK`` makes ``torch.cuda.is_available()``
answer from NVML, and on a node with GPUs the warm-up stops short of a training step
(:func:`_warm_up` says why).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from etrain.workers.engine.compile import use_node_cache
from etrain.workers.rank.worker import TrainWorker

#: torch's switch for answering ``torch.cuda.is_available()`` from NVML instead of starting CUDA.
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


class SpareRank(TrainWorker):
    """A :class:`TrainWorker` whose process starts before its job exists."""

    def __init__(self, *, gpu_node: bool = False, warm_up: bool = True) -> None:
        """``gpu_node``: whether the node has GPUs (the pool knows it from Ray); the job comes in assign().
        ``warm_up``: False for a rank process the pool starts for a launch that waits for it
        (``SparePool.start_cold``): the warm-up would only move the first step's set-up ahead of the job's."""
        started = time.monotonic()
        # Before torch loads: an availability check answers from NVML, not by starting CUDA; the compile
        # cache is the node's etrain folder (importing torch._dynamo would fix inductor's default).
        os.environ.setdefault(NVML_CHECK, "1")
        use_node_cache()
        # What a rank needs before its first step; imported now so a replacement pays none of it.
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401

        import etrain.workers.checkpoints.checkpoint  # noqa: F401
        import etrain.workers.engine.train  # noqa: F401

        self.warm_step = warm_up and not (gpu_node and torch.backends.cuda.is_built())
        if warm_up:
            _warm_up(train_step=self.warm_step)
        self.compiler_imported = warm_up and gpu_node and _import_the_compiler()
        # The global generator as a new spare's is after its warm-up: a released one goes back to it, so a
        # job meets the same numbers in a reused process as in a fresh one.
        self._fresh_rng = torch.random.get_rng_state()
        self.warmup_s = time.monotonic() - started
        self.assigned = False
        self.jobs_served = 0  # jobs this process has served (a returned rank serves its tenant's next one)

    def ready(self) -> dict[str, Any]:
        """Where the spare runs and what its warm-up cost (answers once ``__init__`` is done)."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "warmup_s": round(self.warmup_s, 3),
            "warm_step": self.warm_step,
            "compiler_imported": self.compiler_imported,
        }

    def assign(
        self,
        *,
        job_id: str,
        rank: int,
        world_size: int,
        supervisor: Any,
        gpu_ids: list[str] | None = None,
        bundle: str = "",
    ) -> int:
        """Become rank ``rank`` of ``job_id``; ``gpu_ids``: the GPU ids Ray reserved for the bundle (none
        for a bundle without GPUs), ``bundle``: which bundle it is. Returns how many
        jobs this process served before (0: a fresh spare).

        A spare serves one job at a time: again only after :meth:`release` (its job finished, and the pool
        hands it to the same tenant's next job).
        """
        if self.assigned:
            raise RuntimeError(f"this spare already serves job {self.job_id}")
        TrainWorker.__init__(
            self,
            job_id=job_id,
            rank=rank,
            world_size=world_size,
            supervisor=supervisor,
            gpu_ids=list(gpu_ids or []),
            bundle=bundle,
            spare=True,
        )
        self.assigned = True
        served, self.jobs_served = self.jobs_served, self.jobs_served + 1
        return served

    def release(self) -> dict[str, Any]:
        """Leave the finished job, for the same tenant's next one (``service/decisions/returned_ranks.py``):
        ``{"pid", "reusable", "why"}``. Not reusable while an attempt runs, with GPUs (a CUDA context stays
        bound to the GPUs it started on), or holding more than :data:`REUSE_MAX_RSS_BYTES` after the job's
        memory is freed; the pool stops such a process.

        What a job leaves in the process is dropped here; the next ``assign`` sets every per-job field anew
        (``TrainWorker.__init__``), and the next attempt leaves no process group behind and seeds its own
        generators as any attempt does. Kept on purpose: the imported modules and the kernels' set-up, which
        are the reason to reuse the process. Which jobs' ranks are offered at all (those without GPUs) the
        worker group decides (``service/decisions/returned_ranks.py``).
        Compiled graphs are dropped (``torch._dynamo.reset``): their guards name the last job's modules, and
        a process that kept them through many jobs would reach dynamo's recompile limit and run eagerly.
        """
        import gc

        import torch

        if getattr(self, "_running", False):
            return self._released(False, "an attempt is running")
        if getattr(self, "_gpus", None) is not None and self._gpus.ids:
            return self._released(False, "it runs on GPUs")
        if torch.cuda.is_initialized():
            return self._released(False, "it started CUDA")
        self.assigned = False
        self._snapshots, self._drills, self._plan, self._saves, self._log = {}, None, None, None, None
        self._supervisor = None
        torch.random.set_rng_state(self._fresh_rng)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        gc.collect()
        _return_freed_memory()
        rss = _resident_bytes()
        if rss > REUSE_MAX_RSS_BYTES:
            return self._released(False, f"it holds {rss >> 20} MiB after the job")
        return self._released(True, "")

    def _released(self, reusable: bool, why: str) -> dict[str, Any]:
        return {"pid": os.getpid(), "reusable": reusable, "why": why}


#: A returned rank holding more host memory than this after its job is stopped rather than kept idle.
REUSE_MAX_RSS_BYTES = 2 << 30


def _return_freed_memory() -> None:
    """Give the memory the job freed back to the system (glibc keeps freed heap for the process otherwise)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        pass


def _resident_bytes() -> int:
    """This process's resident memory (Linux; 0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _import_the_compiler() -> bool:
    """Import what a job's first ``torch.compile`` imports (dynamo's backends, inductor, triton where it
    is installed); returns whether it could. Done on nodes with GPUs only, where ``training.compile`` is on
    by default (``service/planning/spec.py``); a CPU job compiles only when asked, and there the imports
    would cost every spare 1.8 s of CPU and ~45 MiB for nothing.

    Measured on the 2-core machine with a warm compile cache (a compiled two-block GPT after a spare's
    warm-up, three runs each): the Trainer's build 0.30-0.46 s -> 0.04-0.09 s (it imported 400 modules when
    it wrapped the blocks) and build + first step 2.9-3.9 s -> 1.2-1.9 s (these imports and the torch key
    below). On a GPU node that time is on the path of
    every first launch and every recovery from a spare (the rank log's ``trainer`` phase and its first
    step). Importing starts no CUDA: what these modules need of a device they ask when they compile
    (tests/gpu/test_cuda.py checks a spare's warm-up on a GPU node leaves the driver unstarted).
    """
    import importlib.util

    try:
        import torch._dynamo
        import torch._inductor.compile_fx  # noqa: F401
        import torch._inductor.compiler_bisector  # noqa: F401  (what wrapping a module in compile imports)
        from torch._inductor.codegen.common import init_backend_registration

        torch._dynamo.list_backends()  # the backend registry imports every backend's module on first use
        init_backend_registration()  # inductor's per-device code generators, registered on its first compile
        # The compile caches' key for this torch: a hash of every torch source file, computed once per process
        # by the first compile (0.85 s of a warm-cache first step on the 2-core machine, dynamo's timing).
        from torch._inductor.codecache import torch_key

        torch_key()
        if importlib.util.find_spec("triton") is not None:
            import torch._inductor.runtime.triton_heuristics  # noqa: F401  (imports triton)
    except Exception:  # noqa: BLE001 - an optimisation only: the job's first compile imports what is missing
        return False
    return True


#: The warm-up model: the smallest GPT the engine builds (one layer, 8 wide), trained for one step.
WARMUP_MODEL = dict(n_layers=1, d_model=8, n_heads=2, vocab_size=16, seq_len=4)


def _warm_up(*, train_step: bool) -> None:
    """Build a one-process :class:`Trainer` on a tiny GPT on the CPU and, with ``train_step``, train it one step.

    A first Trainer pays for what torch loads lazily, not at import: building a model under a device
    context imports ``torch._dynamo`` (0.5-0.7 s, measured), and the first forward, backward and
    AdamW step set up their kernels and caches. Measured on the 2-core machine, a rank's Trainer took
    1.4 s to build without this and 0.06-0.18 s after it (the rank log's start-up line). It runs on the
    CPU only, in a single process (no process group), and leaves nothing behind: the job's Trainer
    seeds every generator it uses itself.

    On a node with GPUs (and a torch built with CUDA) the step is left out: the first training step
    starts the CUDA driver even on the CPU (below Python: none of torch's Python CUDA calls is made; the
    autograd engine counts every device type's devices when it starts its threads), and a driver
    started before ``assign`` keeps the GPUs it saw then. Measured on an H100 (torch 2.11): after the
    step, a spare saw every GPU whatever ``CUDA_VISIBLE_DEVICES`` said later (so every spare of a node
    would have run on GPU 0), and with the GPUs hidden during the step, none. Building the Trainer
    (the larger part of the saving) starts nothing.
    """
    import torch

    from etrain.workers.engine.train import Trainer
    from etrain.workers.protocol.run_config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainingConfig

    config = RunConfig(
        job_id="spare-warmup",
        model=ModelConfig(**WARMUP_MODEL),
        data=DataConfig(kind="synthetic"),
        parallel=ParallelConfig(),
        training=TrainingConfig(steps=1, global_batch=1, micro_batch=1),
    )
    threads = torch.get_num_threads()
    try:
        trainer = Trainer(config, rank=0, world_size=1, device=torch.device("cpu"))
        if train_step:
            trainer.train_step(0)
    finally:
        torch.set_num_threads(threads)
