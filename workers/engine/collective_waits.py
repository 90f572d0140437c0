"""Time spent blocked waiting for a collective's result, so compute time can exclude it.

Why: under tensor parallelism and FSDP2 (ZeRO-2/3) the collectives are *inside* forward and
backward: every TP layer all-reduces its output, every FSDP2 unit all-gathers its parameters. A rank
whose peer is slow blocks in those collectives, inside its compute span, so span time alone makes
the waiting peers look exactly as slow as the slow rank (measured on two gloo ranks at tp=2 and at
ZeRO-3 dp=2: both ranks report the same ``compute_s``) and the straggler detector cannot tell who
is slow. The one world-wide sync point of a timing-sync step (``workers/engine/train.py``) only absorbs a
wait that builds up *before* it, which is enough for DDP (its only collective is the gradient
all-reduce of the last backward, after that point) but not for collectives spread through the
forward pass: a slow device is slow in every kernel, so its peers wait at every layer.

How: while a :class:`CollectiveWaitClock` is armed (the trainer arms it on timing-sync steps only),
the two Python places where a collective's result is *waited for* are timed:

* ``torch.distributed._functional_collectives.wait_tensor``: every wait of the functional
  collectives, which is what DTensor (TP, sequence parallel, ``loss_parallel``) uses; an
  ``AsyncCollectiveTensor`` calls it on first use of its value;
* ``torch.distributed.Work.wait``: every wait of a ``torch.distributed`` collective issued from
  Python (synchronous calls wait through it too), which is what FSDP2 uses for its all-gathers and
  reduce-scatters on gloo.

The compute timers then subtract the waits that fell inside their spans. The cost is one
``perf_counter`` pair per wait (a few hundred per step for a small model) on timing-sync steps, and
one global read per wait on the others: nothing is added to the collectives themselves, and no
extra collective runs. The rejected alternative, a barrier before every micro-step, is as cheap but
wrong: it absorbs a wait that builds up before the micro-step, not the waits at each layer of a
uniformly slow rank.

Scope and limits, honestly:

* On CPU (gloo) a wait blocks the host, so host timers measure it exactly. Only waits on the thread
  that armed the clock count: CPU autograd runs the backward on that thread, and the asynchronous
  checkpoint's own collectives run on another one (``workers/checkpoints/checkpoint.py``) and are not this
  step's.
* On CUDA a wait makes the current stream wait for the NCCL stream; the clock records a pair of
  CUDA events around it, whose interval is that stall, read after the step's one host read (free).
  The backward runs on autograd's device threads there, so waits on any thread count. FSDP2 on CUDA
  waits for its all-gathers through stream events rather than ``Work.wait``; those waits are not
  seen here and still count as compute (a ZeRO-2/3 peer of a slow GPU may then look slow too).
* Collectives waited inside C++ (DDP's reducer) are not seen. Without a pipeline, DDP's all-reduce
  comes after the timing-sync point, which has already absorbed the wait. Under a pipeline the
  stage's DP ranks meet first in the last backward chunk; ``workers/engine/pipeline.py`` aligns them with a
  scalar all-reduce just before it, outside the timed chunk, so what remains inside is at most the
  slow rank's extra time in that one chunk.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = ["CollectiveWaitClock", "WaitMark"]

_armed: CollectiveWaitClock | None = None  # the clock that counts waits now (one trainer per process)
_install_lock = threading.Lock()
_installed = False
_depth = threading.local()  # nested hooked waits count once (the outermost)


@dataclass(frozen=True)
class WaitMark:
    """A point on a clock's timeline: waits recorded before it (host seconds, CUDA event pairs)."""

    seconds: float
    events: int


class CollectiveWaitClock:
    """Accumulates collective waits while armed; compute timers subtract what fell inside a span.

    Use :meth:`armed` around a step, :meth:`mark` at the start and end of each compute span, and
    :meth:`between` to get the waits of that span (on CUDA read it after the step's host read).
    """

    def __init__(self, device: torch.device):
        _install()
        self._cuda = torch.device(device).type == "cuda"
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._owner: int | None = None
        self.waits = 0  # waits timed since construction (for tests and profiles)

    @contextlib.contextmanager
    def armed(self, enabled: bool = True) -> Iterator[None]:
        """Count waits inside the block (no-op when ``enabled`` is False). Arming forgets the waits
        of the previous armed block: read its spans (:meth:`between`) before arming again."""
        global _armed
        if not enabled:
            yield
            return
        self.reset()
        previous, _armed = _armed, self
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            _armed = previous
            self._owner = None

    @property
    def armed_now(self) -> bool:
        """Whether this clock counts waits at the moment (a timing-sync step's compute)."""
        return _armed is self

    def mark(self) -> WaitMark:
        with self._lock:
            return WaitMark(self._seconds, len(self._events))

    def between(self, start: WaitMark, end: WaitMark) -> float:
        """Seconds of waiting recorded between two marks (on CUDA: reads completed events)."""
        seconds = end.seconds - start.seconds
        pairs = self._events[start.events : end.events]
        if pairs:
            pairs[-1][1].synchronize()  # complete once the step's host read has waited for the stream
            seconds += sum(begin.elapsed_time(finish) for begin, finish in pairs) / 1000.0
        return max(0.0, seconds)

    def reset(self) -> None:
        """Forget recorded waits (marks taken before are invalid afterwards)."""
        with self._lock:
            self._seconds = 0.0
            self._events.clear()

    def _counts_here(self) -> bool:
        return self._cuda or threading.get_ident() == self._owner

    def _time(self, wait: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._cuda:
            begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            try:
                return wait(*args, **kwargs)
            finally:
                finish.record()
                with self._lock:
                    self._events.append((begin, finish))
                    self.waits += 1
        started = time.perf_counter()
        try:
            return wait(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                self._seconds += elapsed
                self.waits += 1


def _timed(wait: Callable[..., Any]) -> Callable[..., Any]:
    def timed_wait(*args: Any, **kwargs: Any) -> Any:
        clock = _armed
        if clock is None or getattr(_depth, "value", 0) or not clock._counts_here():
            return wait(*args, **kwargs)
        _depth.value = 1
        try:
            return clock._time(wait, args, kwargs)
        finally:
            _depth.value = 0

    timed_wait.__wrapped__ = wait  # type: ignore[attr-defined]
    timed_wait.__doc__ = wait.__doc__
    timed_wait._etrain_timed = True  # type: ignore[attr-defined]
    return timed_wait


def _install() -> None:
    """Wrap the two wait points once per process; unarmed, the wrappers only call through."""
    global _installed
    with _install_lock:
        if _installed:
            return
        if not getattr(funcol.wait_tensor, "_etrain_timed", False):
            funcol.wait_tensor = _timed(funcol.wait_tensor)
        work = dist.distributed_c10d.Work
        if not getattr(work.wait, "_etrain_timed", False):
            work.wait = _timed(work.wait)
        _installed = True
