"""Fault drills on a rank: the plugin a rank loads only when its launch plan enables drills.

Why a plugin: drills (kill, slow down or hang a rank on purpose) exist to test recovery, never to train.
A rank imports this module only when :attr:`LaunchPlan.chaos_enabled` is set (the server setting
``enable_chaos``, ``ETRAIN_ENABLE_CHAOS``); otherwise nothing of it is on the training path: no callback
in the trainer, no state, and the rank refuses ``chaos`` calls (``workers/rank/worker.py``).

The orders themselves are messages (:class:`~etrain.workers.protocol.messages.ChaosOrder`); here is the
code that fires them. One :class:`RankDrills` per rank process, kept across the attempts that process
runs (an in-place repair keeps it): an order is armed once, keyed by id (it may be delivered twice, in
the launch plan and by a call), and fired once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from etrain.workers.protocol.messages import ChaosOrder

__all__ = ["ChaosCallback", "RankDrills"]


class RankDrills:
    """One rank's armed drills and what the fired ones left behind (a slow factor, a hang, held memory).

    ``report(order, step)`` tells the supervisor an order fired, and returns once it accepted (or gave
    up): it must know before the process disappears, so that a restart does not fire the order again.
    Control calls (``receive``) arrive on the actor's other threads while the training thread fires due
    orders; the lock guards the armed orders.
    """

    def __init__(self, *, rank: int, report: Callable[[ChaosOrder, int | None], None], busy_wait: bool = False):
        """``busy_wait``: a slowed rank spins instead of sleeping (see :class:`ChaosCallback`)."""
        self.rank = rank
        self._report = report
        self.slow_factor = 1.0
        self.busy_wait = busy_wait
        self.hung = threading.Event()
        #: a fired hold_host_memory's allocation, until the job ends (or this process does: a relaunch drops it)
        self.held_memory: list[bytes] | None = None
        self._health_failure: str | None = None  # a fired fail_health_check, for the attempt's check
        self._pending: dict[int, ChaosOrder] = {}  # by order id: delivered twice, fired once
        self._lock = threading.Lock()
        self.callback = ChaosCallback(self)

    def receive(self, order: ChaosOrder) -> None:
        """Arm an order (``at_step``, or a save to fire in), or fire it at once (neither)."""
        if order.at_step is None and order.during == "step":
            self.fire(order)
        else:
            self.arm(order)

    def arm(self, order: ChaosOrder) -> None:
        """Keep an order of this rank until it is due (one already armed or fired stays as it is)."""
        if order.rank == self.rank:
            with self._lock:
                self._pending.setdefault(order.id, order)

    def fire_due(self, step: int, during: str = "step") -> None:
        """Fire the armed drills due at this moment: the start of ``step``, or (``during`` a save) the
        save after ``step`` completed steps, the first at or after their ``at_step``:
        ``checkpoint_write`` (shards written, not reported: the step never commits) or
        ``checkpoint_commit`` (reported: the supervisor commits without this rank)."""
        with self._lock:
            due = [
                order
                for order in self._pending.values()
                if order.during == during and (order.at_step is None or order.at_step <= step)
            ]
            for order in due:
                del self._pending[order.id]
        for order in due:
            self.fire(order, step=step)

    def health_failure(self, start_step: int) -> str | None:
        """What this attempt's health check must report as failed (a ``fail_health_check`` drill due at an
        attempt starting at ``start_step``), once; None: nothing, measure for real."""
        self.fire_due(start_step, during="health_check")
        failure, self._health_failure = self._health_failure, None
        return failure

    def _report_quietly(self, order: ChaosOrder, step: int | None) -> None:
        try:
            self._report(order, step)
        except Exception:  # the drill still fires; the supervisor may re-arm it, which the test will show
            pass

    def fire(self, order: ChaosOrder, step: int | None = None) -> None:
        if order.action == "hold_host_memory":
            self._hold(order, step)
            return
        self._report_quietly(order, step)
        if order.action == "kill_rank":
            os.kill(os.getpid(), signal.SIGKILL)
        elif order.action == "kill_actor":
            import ray

            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        elif order.action == "slow_rank":
            self.slow_factor = float(order.factor)
        elif order.action == "hang_rank":
            self.hung.set()
        elif order.action == "fail_health_check":
            self._health_failure = f"fault drill {order.id}: fail_health_check (the device answers as a broken one)"
        else:  # validated by the API; an unknown action here is a bug
            raise AssertionError(f"unknown chaos action {order.action!r}")

    def _hold(self, order: ChaosOrder, step: int | None) -> None:
        """``hold_host_memory``: the memory is taken before the report, so that chaos_fired means it is held; a new
        size replaces the old (let go first), it does not add to it. More than there is (``MemoryError``) is
        reported all the same (never re-armed), and the error rises."""
        self.held_memory = None
        try:
            self.held_memory = _written_bytes(int(order.gib * (1 << 30))) or None
        finally:
            self._report_quietly(order, step)


_HOLD_PIECE_BYTES = 64 << 20


def _written_bytes(nbytes: int) -> list[bytes]:
    """``nbytes`` of written memory (the rank's own anonymous pages, which its sampler reads) in 64 MiB pieces:
    each piece is one C call, so the interpreter lets the rank's other threads (training, heartbeats) run
    between them. A ``MemoryError`` lets go of what was taken and rises (the drill asked for more than there is)."""
    pieces = []
    while nbytes > 0:
        pieces.append(b"\x01" * min(nbytes, _HOLD_PIECE_BYTES))
        nbytes -= len(pieces[-1])
    return pieces


class ChaosCallback:
    """Trainer callback carrying out a rank's drills inside the timed compute region.

    ``slow_rank`` makes each micro-step take ``factor x`` its normal compute: ``on_compute`` runs
    at the start of a micro-step's timed region and sleeps ``(factor - 1) x`` the rank's own
    per-micro-step compute, measured on the previous step without the sleep it added. So the rank's
    measured compute really grows by ``factor`` (what straggler detection must see) while its
    peers only wait. ``hang_rank`` blocks the training thread without exiting.

    With ``RankDrills.busy_wait`` the slowed rank spins on its core for that time instead of sleeping: where
    ranks outnumber cores (four ranks on the 2-core test machine) a sleeping rank gives its share of the
    cores to its peers, which then compute faster, so the slowdown they are compared with falls short of
    ``factor`` (measured: 1.29x of the rank's own healthy time for 1.5x under PP x DP); a slow device keeps
    its rank's share. The benchmark's measured traces use it (``benchmarks/stragglers.py``); the service's
    drills sleep, which costs no CPU.
    """

    def __init__(self, drills: RankDrills):
        self._drills = drills
        self._per_micro_s = 0.0  # last step's compute per micro-step, drill sleep excluded
        self._slept_s = 0.0
        self._micro_steps = 0

    def on_step_start(self, trainer, step: int) -> None:
        self._drills.fire_due(step)
        self._slept_s = 0.0
        self._micro_steps = 0

    def on_compute(self, trainer, step: int, micro_step: int) -> None:
        drills = self._drills
        self._micro_steps += 1
        if drills.slow_factor > 1.0 and self._per_micro_s > 0:
            delay = self._per_micro_s * (drills.slow_factor - 1.0)
            if drills.busy_wait:
                until = time.perf_counter() + delay
                while time.perf_counter() < until:
                    pass
            else:
                time.sleep(delay)
            self._slept_s += delay
        while drills.hung.is_set():
            time.sleep(0.5)

    def on_step_end(self, trainer, metrics) -> None:
        if self._micro_steps:
            self._per_micro_s = max(0.0, metrics.compute_s - self._slept_s) / self._micro_steps
