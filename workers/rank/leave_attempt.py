"""A rank that leaves a failed attempt lets go of its process groups at once, so that peers still waiting on
it in a collective fail now instead of waiting for good.

Why: on gloo a collective fails at once when a peer's *connection* closes, but not while the peer is alive
and merely elsewhere. In a 2-D layout a survivor can wait on a peer that has left (HSDP with shard groups of
two: when rank 3 dies, ranks 1 and 2 fail their collectives with it and leave, while rank 0 waits on them),
and the repair then had to replace it after a grace (``service/decisions/in_place_waits.py``). Destroying the
groups is not enough: a gloo group's connections close when the group object is freed, and the failed
attempt's objects keep it alive. Measured on four gloo ranks of a real Trainer (dp4 ZeRO-3, HSDP 2 × 2, rank
3 SIGKILLed): the survivors' collectives ended only as each peer's process exited (rank 1's after 40 s, rank
0's after 80 s, chained), and at once (0.4-0.5 s) once these references were gone:

* the failure's traceback: its frames hold the Trainer, some through closures (a comprehension's cell), which
  clearing the frames' locals does not release, so the traceback is dropped (the caller logs its text first:
  :func:`failure_text`);
* torch's DTensor caches, keyed by device meshes, which hold their groups (``forget_mesh_state``);
* the cycles among the Trainer's modules, hooks and meshes (``gc.collect``).

Only for a collective failure (``is_collective_failure``: a peer died or left), where the traceback says
nothing the error's first line does not; a job's own error keeps its traceback for the supervisor's event.
"""

from __future__ import annotations

import gc
import traceback

from etrain.workers.protocol.errors import is_collective_failure

__all__ = ["failure_text", "release_failed_attempt"]


def failure_text(failure: BaseException) -> str:
    """The failure and its whole traceback, as the rank log shows it."""
    return "".join(traceback.format_exception(failure)).rstrip()


def release_failed_attempt(failure: BaseException) -> bool:
    """After the attempt's groups were destroyed and its objects dropped by the caller: drop what else keeps
    them (the traceback of ``failure`` and of the errors chained to it, torch's mesh caches, cycles), where
    ``failure`` is a collective failure; returns whether it did. Never raises."""
    if not is_collective_failure(failure):
        return False
    try:
        from etrain.workers.engine.mesh import forget_mesh_state

        seen: set[int] = set()
        error: BaseException | None = failure
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            error.__traceback__ = None
            error = error.__cause__ or error.__context__
        forget_mesh_state()
        gc.collect()
        return True
    except Exception:  # noqa: BLE001 - best effort: at worst a peer waits out the repair's grace
        return False
