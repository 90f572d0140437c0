"""Which rank a hung job is waiting for: the verdict on the ranks' own reports of where they are.

When no step completes for ``heartbeat_timeout_s``, the supervisor asks every rank of the group where its
training thread is (``TrainWorker.where``: the step and the Python frames of that thread, read from
another thread of the rank's process). A hang in a data-parallel, tensor or pipeline job almost always
has one rank that stopped doing its own work (stuck in I/O, a data loader, a deadlocked lock, a drill)
while every other rank waits for it inside a collective. So:

* a rank whose frames are inside torch's communication or autograd (``torch/distributed/``,
  ``torch/autograd/``: DDP's and FSDP's collectives run inside backward; pipeline sends and receives;
  etrain's step-boundary exchange), or in the step's host read (``workers/engine/host_read.py``: on
  NCCL a collective only queues a kernel, and the host waits for its peers where it reads the loss)
  **waits on peers**;
* a rank that did not answer (its process holds the GIL, or is gone) or whose thread is anywhere else
  **stopped by itself**: the culprit.

Exactly one stopped rank is the culprit. Several: the one at the lowest step, then the lowest rank
(the others may merely be slower to reach the collective). None (every rank waits: a lost message, a
network fault, a device hang inside a kernel): no culprit, and the job is relaunched as before.

Pure: no Ray, no torch. ``service/runtime/supervisor_actor.py`` gathers the reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Frame", "HangVerdict", "RankWhere", "find_culprit", "format_frames", "waits_on_peers"]

#: Path fragments of the frames where a rank waits for its peers (``/`` and ``\\`` both accepted).
WAITING_IN = ("torch/distributed/", "torch/autograd/", "workers/rank/step_exchange.py", "workers/engine/host_read.py")
#: How many of the culprit's innermost frames the event and the rank log show.
SHOWN_FRAMES = 6


@dataclass(frozen=True)
class Frame:
    """One frame of a stack, innermost last (as ``traceback.extract_stack`` orders them)."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


@dataclass(frozen=True)
class RankWhere:
    """Where one rank's training thread is: the step it is in (None before its first) and its frames."""

    step: int | None
    frames: tuple[Frame, ...]


@dataclass(frozen=True)
class HangVerdict:
    """``rank`` is the culprit (None: no single rank stopped by itself); ``detail`` says why, in words."""

    rank: int | None
    detail: str
    frames: tuple[Frame, ...] = ()


def waits_on_peers(frames: Sequence[Frame]) -> bool:
    """True when some frame is inside torch's communication or autograd, etrain's step exchange, or the
    step's host read (where an NCCL rank's host waits behind its peers' kernels)."""
    return any(part in frame.file.replace("\\", "/") for frame in frames for part in WAITING_IN)


def format_frames(frames: Sequence[Frame], limit: int = SHOWN_FRAMES) -> str:
    """The innermost ``limit`` frames, innermost first, one per ``; ``-separated item."""
    return "; ".join(str(frame) for frame in reversed(frames[-limit:]))


def find_culprit(reports: Mapping[int, RankWhere | None]) -> HangVerdict:
    """The rank the others wait for, from every rank's report (None: it did not answer)."""
    silent = sorted(rank for rank, where in reports.items() if where is None)
    stopped = sorted(
        (rank for rank, where in reports.items() if where is not None and not waits_on_peers(where.frames)),
        key=lambda rank: (_step(reports[rank]), rank),
    )
    waiting = len(reports) - len(silent) - len(stopped)
    if stopped:
        rank = stopped[0]
        where = reports[rank]
        others = f"{waiting} rank(s) wait in collectives" + (f", {len(silent)} did not answer" if silent else "")
        return HangVerdict(
            rank=rank,
            detail=f"rank {rank} stopped at step {_step_text(where)} outside any collective ({others}); "
            f"its stack: {format_frames(where.frames)}",
            frames=where.frames,
        )
    if silent and waiting:
        rank = silent[0]
        return HangVerdict(
            rank=rank,
            detail=f"rank {rank} did not answer (its process may hold the GIL or be gone); "
            f"{waiting} rank(s) wait in collectives",
        )
    if silent:
        return HangVerdict(rank=None, detail=f"no rank answered ({len(silent)} asked)")
    return HangVerdict(
        rank=None,
        detail=f"all {waiting} ranks wait in collectives: no single rank stopped (a lost message, the network "
        "or a device)",
    )


def _step(where: RankWhere | None) -> int:
    return -1 if where is None or where.step is None else where.step


def _step_text(where: RankWhere | None) -> str:
    return "?" if where is None or where.step is None else str(where.step)
