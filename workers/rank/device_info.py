"""What an accelerator offers and which one a process runs on, read where it is.

Two jobs, both about the GPUs of the process that calls them, with torch and Ray imported inside the
functions (the module loads without either: the service ships :func:`gpu_memory_bytes` to a worker):

* :func:`gpu_memory_bytes`, the body of the control plane's probe task. Ray reports how many GPUs a
  node has and their type (``accelerator_type:H100``), not their memory, which is what the planner
  checks a layout against; so the control plane runs it as a one-GPU Ray task
  (``etrain.service.runtime.supervisor_actor.probe_gpu_memory_gib``) once per accelerator type.
* A rank's GPUs (:class:`RankGpus`, what ``TrainWorker`` asks). A rank learns them from one source: its
  bundle's ids, read by a task in the bundle and handed over when the rank is created cold or when a warm
  spare is assigned (a rank holds no GPU in Ray's books, so ``ray.get_gpu_ids()`` is empty there: the
  bundle's reservation accounts for it, and the rank's process outlives the placement group when an
  in-place resize replaces it); an actor created with ``num_gpus`` learns Ray's (:func:`ray_gpu_ids`). :func:`pin_visible_gpus` makes them the
  process's ``CUDA_VISIBLE_DEVICES`` *before* CUDA starts: Ray sets that variable only when it creates
  an actor with GPUs, never for a ``num_gpus=0`` actor nor for an actor's method calls
  (``ray._private.utils.set_visible_accelerator_ids``), and CUDA reads it once, when the driver starts.
  So the rank's first GPU is device 0 of its process, every thread's default. :class:`CudaWarmup` then
  creates the CUDA context on it and runs the first kernels on a thread of their own, while the rank
  is handed its job and rendezvouses.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CudaWarmup",
    "RankGpus",
    "cuda_started",
    "start_cuda_driver",
    "warmup_summary",
    "gpu_memory_bytes",
    "pin_visible_gpus",
    "ray_bundle",
    "ray_gpu_ids",
    "VISIBLE_DEVICES",
]

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def gpu_memory_bytes() -> int | None:
    """Total memory of the first visible CUDA device in bytes (``torch.cuda.mem_get_info``), or None
    when this process sees no GPU."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return None
    _free, total = torch.cuda.mem_get_info(0)
    return int(total)


def ray_gpu_ids() -> list[str]:
    """The GPU ids Ray assigned to this actor or task (``ray.get_gpu_ids()``, as strings); none outside
    Ray, or for an actor created without GPUs (a warm spare)."""
    if "ray" not in sys.modules:  # a rank built by a test or torchrun: Ray never gave it anything
        return []
    import ray

    if not ray.is_initialized():
        return []
    return [str(gpu) for gpu in ray.get_gpu_ids()]


def ray_bundle(index: int) -> str:
    """Which bundle holds this actor, for messages: "bundle ``index`` of placement group <id>" (the worker
    group puts rank R in bundle R), or "no placement group" (a spare before assign, a test)."""
    ray = sys.modules.get("ray")
    group = ray.get_runtime_context().get_placement_group_id() if ray is not None and ray.is_initialized() else None
    return f"bundle {index} of placement group {group}" if group else "no placement group"


def cuda_started() -> bool:
    """Whether torch has initialised CUDA in this process, after which ``CUDA_VISIBLE_DEVICES`` is fixed.

    Only torch's own flag: the driver can also be started behind torch's back (a device count, a stream
    query), which no cheap probe tells apart (torch loads the driver's library at import, measured), so
    the ways into it are closed instead (``workers/rank/spare.py``)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def pin_visible_gpus(gpu_ids: Sequence[str], *, who: str) -> None:
    """Make ``gpu_ids`` this process's ``CUDA_VISIBLE_DEVICES`` (a no-op when they already are).

    Raises when CUDA already started in this process on another set: it would keep that set, and the
    rank would run on a GPU that is not its bundle's. ``who`` names the rank in that message.
    """
    wanted = ",".join(str(gpu) for gpu in gpu_ids)
    current = os.environ.get(VISIBLE_DEVICES)
    if current == wanted:
        return
    if cuda_started():
        raise RuntimeError(
            f"{who}: cannot pin the process to GPUs {wanted}: CUDA already started in it with "
            f"{VISIBLE_DEVICES}={current!r}, which it keeps for the life of the process"
        )
    os.environ[VISIBLE_DEVICES] = wanted


class CudaWarmup:
    """Create the CUDA context on device 0 and run a first matmul, on a background thread.

    A rank's first CUDA call pays for the driver's start, the context on its GPU, cuBLAS's handle and
    workspace and the first kernels' loading (tenths of a second to seconds). Started as soon as the
    rank knows its GPUs (a cold rank's ``__init__``, a spare's ``assign``), this runs while the worker
    group hands out the job and the ranks rendezvous; the rank's own first CUDA call then finds the
    context made, or waits for the rest of it in whatever start-up phase makes that call (so the rank
    log's phases still say where the time went). Nothing random is drawn (the job's generators are
    untouched) and nothing is kept but the context and torch's caches. A process that sees no CUDA
    device just records that (a CPU rank on a node that declares GPUs, a test).
    """

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._seconds: float | None = None
        self._driver: dict[str, Any] | None = None
        self.outcome = "running"
        self._thread = threading.Thread(target=self._run, name="cuda-warmup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            # The driver's start and the context first, without the GIL: torch makes both while it holds
            # the GIL (its lazy CUDA init and ``set_device``), which kept the rank's every Ray call and its
            # rendezvous waiting on this thread for the whole start (tenths of a second to seconds).
            self._driver = start_cuda_driver()
            import torch

            if not torch.cuda.is_available():
                built = "" if torch.backends.cuda.is_built() else f" (torch {torch.__version__} is built without CUDA)"
                self.outcome = f"no CUDA device visible{built}"
                return
            torch.cuda.set_device(0)
            ones = torch.ones(64, 64, device="cuda")
            (ones @ ones).sum().item()  # the context, cuBLAS and a first kernel, and a sync
            self.outcome = "ready"
        except Exception as err:  # noqa: BLE001 - reported by state() and by the rank's first CUDA call
            self.outcome = f"failed: {type(err).__name__}: {err}"
        finally:
            self._seconds = time.monotonic() - self._started

    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> str:
        self._thread.join(timeout_s)
        return self.outcome

    def state(self) -> dict[str, Any]:
        """``outcome`` (running, ready, no CUDA device visible, failed: ...), its seconds so far, and what
        the GIL-free driver start did (:func:`start_cuda_driver`)."""
        seconds = self._seconds if self._seconds is not None else time.monotonic() - self._started
        return {"outcome": self.outcome, "seconds": round(seconds, 3), "driver": self._driver}


#: The CUDA driver API's library, as the NVIDIA driver installs it (what the CUDA runtime itself opens).
CUDA_DRIVER_LIBRARY = "libcuda.so.1"


def start_cuda_driver(library: str = CUDA_DRIVER_LIBRARY) -> dict[str, Any]:
    """Start the CUDA driver and make device 0's primary context, through the driver API, without the GIL.

    ctypes releases the GIL around every foreign call, so the process's other threads (the Ray calls
    that hand the rank its job, the rendezvous) run while the driver starts and the context is made;
    torch's own first CUDA calls then find both done. It is the same context torch uses (the runtime
    API works in each device's primary context); the reference taken here is kept for the process's
    life, as torch's is. ``CUDA_MODULE_LOADING`` is set first, as torch would before its own start: the
    driver reads it once, in ``cuInit``, and eager loading would load every kernel of every library.

    Returns what happened, for the rank log: ``{"outcome": "ready" | "no CUDA driver" | "failed: ...",
    "init_s", "context_s"}``. Any failure is left for torch's own calls to meet and report.
    """
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    try:
        driver = ctypes.CDLL(library)
        init, device_get, retain = driver.cuInit, driver.cuDeviceGet, driver.cuDevicePrimaryCtxRetain
    except (OSError, AttributeError):  # no driver installed (a CPU node), or a library without its API
        return {"outcome": "no CUDA driver"}
    started = time.monotonic()
    status = init(0)
    initialised = time.monotonic()
    if status != 0:
        return {"outcome": f"failed: cuInit returned {status}", "init_s": round(initialised - started, 3)}
    device, context = ctypes.c_int(), ctypes.c_void_p()
    status = device_get(ctypes.byref(device), 0)
    if status == 0:
        status = retain(ctypes.byref(context), device)
    made = time.monotonic()
    timings = {"init_s": round(initialised - started, 3), "context_s": round(made - initialised, 3)}
    if status != 0:
        return {"outcome": f"failed: the primary context of device 0: CUresult {status}"} | timings
    return {"outcome": "ready"} | timings


class RankGpus:
    """A rank's GPUs: learnt from one source, pinned at once, the CUDA context warmed in the background.

    ``gpu_ids``: the bundle's ids, handed to a rank at creation or to a warm spare in ``assign``
    (``spare``); None: Ray's own for this actor (one created with GPUs of its own: a test, a probe). ``who``
    and ``bundle`` name the rank in messages.
    """

    def __init__(self, *, who: str, gpu_ids: Sequence[str] | None, bundle: str, spare: bool = False):
        self.who, self.bundle = who, bundle
        if gpu_ids is None:
            self.source = "Ray's, for this actor"
        elif spare:
            self.source = "the bundle's, from assign (a warm spare)"
        else:
            self.source = "the bundle's, read by a task in it (a cold rank)"
        self.ids = [str(gpu) for gpu in (ray_gpu_ids() if gpu_ids is None else gpu_ids)]
        self.warmup: CudaWarmup | None = None
        if self.ids:
            pin_visible_gpus(self.ids, who=who)
            self.warmup = CudaWarmup()

    def state(self) -> dict[str, Any]:
        return {
            "gpu_ids": list(self.ids),
            "source": self.source,
            "bundle": self.bundle,
            "cuda_visible_devices": os.environ.get(VISIBLE_DEVICES),
            "cuda_warmup": self.warmup.state() if self.warmup is not None else None,
        }

    def warmup_summary(self) -> str:
        """The CUDA warm-up for the rank log's start-up line ("" on a rank without GPUs)."""
        return "" if self.warmup is None else warmup_summary(self.warmup.state())

    def device(self, kind: str) -> Any:
        """The rank's torch device for a job on ``kind`` ("cpu" or "cuda"): the CPU, or ``cuda:0``.

        A cuda rank without GPUs is an error that names the rank, its bundle and ids. While the warm-up
        is still making the CUDA context this does not wait for it: device 0 is the warm-up thread's
        device and every other thread's default, and the rank's first CUDA call (building the Trainer,
        inside the start-up phases the rank log reports) waits for whatever is left.
        """
        import torch

        if kind != "cuda":
            return torch.device("cpu")
        where = (
            f"{self.who} ({self.bundle}; GPU ids {self.ids}, {self.source}; "
            f"{VISIBLE_DEVICES}={os.environ.get(VISIBLE_DEVICES)!r})"
        )
        if not self.ids:
            raise RuntimeError(
                f"a cuda rank was scheduled without a GPU: {where}; a cuda job needs resources.gpus_per_worker > 0"
            )
        pin_visible_gpus(self.ids, who=where)  # still ours: nothing may have re-pinned the process
        if self.warmup is not None and self.warmup.running():
            return torch.device("cuda", 0)
        if self.warmup is not None and self.warmup.outcome != "ready":
            raise RuntimeError(f"{where} cannot use its GPU: {self.warmup.outcome}")
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)


def warmup_summary(state: dict[str, Any]) -> str:
    """``CudaWarmup.state()`` as the rank log's start-up line ends (``benchmarks/gpu/measures.py`` reads it)."""
    driver = state.get("driver") or {}
    split = ", ".join(f"{name[:-2]} {driver[name]:.2f}s" for name in ("init_s", "context_s") if name in driver)
    return (
        f"; cuda warm-up {state['outcome']} in {state['seconds']:.2f}s "
        f"(driver without the GIL: {driver.get('outcome', 'not yet')}{': ' + split if split else ''})"
    )
