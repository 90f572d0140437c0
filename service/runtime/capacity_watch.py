"""The cluster's side of a job's elasticity: how many replicas it could run now, and late node verdicts.

The supervisor actor (service/runtime/supervisor_actor.py) turns both into state-machine events:
CapacityChanged when what fits changes (or when asked), NodeLossConfirmed when a node whose rank was
lost as a process fault is declared dead afterwards ([8] in service/decisions/supervisor.py). Both read
Ray's node table, which may be briefly unreachable right after a node loss: a failed read is logged
and tried again at the next turn, never fatal. What fits is counted by the pure
service/decisions/capacity.py; only the reads are here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator

import ray

from etrain.service.decisions.capacity import rank_slots, replicas_that_fit
from etrain.service.decisions.supervisor_events import CapacityChanged, NodeLossConfirmed

log = logging.getLogger(__name__)

__all__ = ["AWAITING_CHECK_S", "NODE_CHECK_INTERVAL_S", "UNCONFIRMED_WATCH_S", "CapacityWatch"]

# How long a node whose rank was lost as a process fault is watched for a late death verdict (Ray's
# health check declares a node dead after period x failure threshold: 5 s x 5 by default), and how
# often the node table is read meanwhile.
UNCONFIRMED_WATCH_S = 60.0
NODE_CHECK_INTERVAL_S = 0.5
# How often capacity is read while the job waits for it (a lost node, a placement that timed out), whatever
# elastic.check_interval_s says: right after a node loss Ray frees the dead group's resources a moment
# after the first read, and a spare node then sat unused until the next check, 30 s by default.
AWAITING_CHECK_S = 1.0


class CapacityWatch:
    """Capacity checks and node watches of one job; used on the actor's control thread only.

    ``held()`` is ``{node: bundles}`` of the job's current group's placement group, one bundle of
    ``per_rank`` per rank, counted from the moment Ray reserves it (``WorkerGroup.bundles_per_node``): what
    it would give back to a relaunch, and what the node's free resources already exclude. None while that
    reservation is under way: no capacity can be read then, and the check is made again at the next turn.
    """

    def __init__(
        self,
        *,
        per_rank: dict[str, float],
        tp: int,
        pp: int,
        interval_s: float,
        held: Callable[[], dict[str, int] | None],
    ):
        self._per_rank = per_rank
        self._tp, self._pp = tp, pp
        self._interval_s = interval_s  # elastic.check_interval_s
        self._held = held
        self._last: int | None = None  # the capacity last reported
        self._next_check = 0.0
        # Nodes of ranks lost as process faults (restart charged at once), watched until the cluster
        # declares them dead (refund) or UNCONFIRMED_WATCH_S pass: node -> (attempt, watch until).
        self._unconfirmed: dict[str, tuple[int, float]] = {}
        self._next_node_check = 0.0

    def check_soon(self) -> None:
        """Check at the next turn (a node was lost, or a placement timed out)."""
        self._next_check = 0.0

    def due(self, now: float) -> bool:
        return now >= self._next_check

    def check(self, *, force: bool, excluded: Collection[str], awaiting: bool) -> CapacityChanged | None:
        """CapacityChanged when what fits changed since the last report, or ``force`` (a node was excluded),
        or the job waits for a report (``awaiting``); None otherwise or when the cluster cannot be read."""
        interval = min(self._interval_s, AWAITING_CHECK_S) if awaiting else self._interval_s
        self._next_check = time.time() + interval
        try:
            available = self.available_dp(excluded)
        except Exception as err:  # the GCS may be briefly unreachable after a node loss
            log.warning("capacity check failed: %s", err)
            return None
        if available is None:  # the job's own placement group is being reserved: read it once it is
            self._next_check = 0.0
            return None
        if force or available != self._last or awaiting:
            self._last = available
            return CapacityChanged(available_dp=available)
        return None

    def available_dp(self, excluded: Collection[str]) -> int | None:
        """Replicas this job could run now: free resources per live node plus what the job's own placement
        group holds there (its own ranks never make the job look short of room).

        None when the job's own holding is not known for the whole read (its group is reserving its
        placement group, or the reservation completed during the read): free resources read then may or
        may not exclude the job's bundles, and a guess either way is a false ``capacity_low`` or a false
        room to grow.
        """
        from ray._private.state import available_resources_per_node

        before = self._held()
        free_per_node = available_resources_per_node()
        nodes = ray.nodes()
        held = self._held()
        if before is None or held is None or held != before:
            return None
        slots: dict[str, int] = {}
        for node in nodes:
            node_id = node["NodeID"]
            if not node.get("Alive") or node_id in excluded:
                continue
            free = dict(free_per_node.get(node_id, {}))
            for name, amount in self._per_rank.items():
                free[name] = free.get(name, 0.0) + amount * held.get(node_id, 0)
            slots[node_id] = rank_slots(free=free, per_rank=self._per_rank)
        return replicas_that_fit(slots, tp=self._tp, pp=self._pp)

    def watch(self, node: str, attempt: int, now: float) -> None:
        """A rank of ``attempt`` on ``node`` was lost and charged as a process fault: watch the node."""
        self._unconfirmed[node] = (attempt, now + UNCONFIRMED_WATCH_S)

    def confirmed(self, now: float, *, excluded: Collection[str], fallback_dp: int) -> Iterator[NodeLossConfirmed]:
        """NodeLossConfirmed for each watched node the cluster now declares dead (lazily: the caller applies
        one before the next capacity is read). ``fallback_dp``: the capacity to report if it cannot be read."""
        if not self._unconfirmed or now < self._next_node_check:
            return
        self._next_node_check = now + NODE_CHECK_INTERVAL_S
        try:
            alive = {node["NodeID"]: bool(node.get("Alive")) for node in ray.nodes()}
        except Exception as err:  # the GCS may be briefly unreachable after a node loss
            log.warning("node table unavailable: %s", err)
            return
        for node, (attempt, until) in list(self._unconfirmed.items()):
            if not alive.get(node, False):
                del self._unconfirmed[node]
                self._next_check = 0.0
                try:
                    available = self.available_dp(excluded)
                except Exception:
                    available = None
                yield NodeLossConfirmed(
                    node=node, failed_attempt=attempt, available_dp=fallback_dp if available is None else available
                )
            elif now > until:
                del self._unconfirmed[node]  # the node lives: it was the process after all
