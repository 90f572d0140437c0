"""Rank processes a finished job gave back to the warm pool, kept for its tenant's next jobs (pure).

Why: a rank's process costs a Python start, ``import torch`` and the engine's first-step set-up (the
optimizer's and the kernels'): 4-7 s of a core on a 2-core machine, paid by every rank of
every job even where a warm spare hides it from the start-up (the pool refills the spare, which pays it
again). A tenant's jobs often come one after another (a sweep, a resubmit, CI), so the processes of a job
that finished cleanly (its warm spares, and the ranks the pool started cold for it) go back to the pool
(``service/runtime/spares.py``) and serve that tenant's next jobs on the same node.

Only the same tenant's jobs: a process's memory has held the job's weights and data, and freed memory is
not cleared. Only processes without GPUs: a CUDA context is bound to the GPUs the process saw when it
started (``workers/rank/spare.py`` says why), so such a process could not serve a bundle with other GPUs.
After any layout: nothing a job's parallelism sets up outlives it in the process
(``tests/integration/test_mesh_reuse.py`` trains every kind of layout twice in the same processes, and ring
attention and the experts' exchange one after the other, bit for bit). The rank decides whether its
process can be reused (``SpareRank.release``); this keeps what it gave back within bounds: at most
``per_node`` processes per node (the oldest returned goes first) and none idle longer than ``idle_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

Item = TypeVar("Item")

#: How long a returned rank waits for its tenant's next job before it is stopped: long enough for the next
#: job of a sweep or a resubmit (a REST round trip, admission, a placement group), short enough that idle
#: processes do not hold a node's memory for long (~300-600 MB each with torch and a job's caches).
RETURNED_IDLE_S = 120.0
#: The most returned ranks one node keeps, whatever its CPUs (each is an idle process holding memory).
MAX_RETURNED_PER_NODE = 16


def returned_per_node(resources: dict[str, float]) -> int:
    """Returned ranks a node with Ray ``resources`` keeps: as many as CPU ranks can run there at once (a
    rank takes at least one CPU), at most :data:`MAX_RETURNED_PER_NODE`; none on a node with GPUs (its
    ranks hold GPUs and are never returned)."""
    if (resources.get("GPU", 0) or 0) > 0:
        return 0
    return max(0, min(int(resources.get("CPU", 0) or 0), MAX_RETURNED_PER_NODE))


@dataclass
class _Returned(Generic[Item]):
    item: Item
    tenant: str
    pid: int
    since: float


class ReturnedRanks(Generic[Item]):
    """Returned rank processes (``Item``: whatever the adapter keeps, an actor handle) by node and tenant."""

    def __init__(self, *, idle_s: float = RETURNED_IDLE_S) -> None:
        if idle_s < 0:
            raise ValueError(f"idle_s={idle_s} must be >= 0")
        self.idle_s = idle_s
        self._by_node: dict[str, list[_Returned[Item]]] = {}  # oldest returned first

    def add(self, node: str, tenant: str, item: Item, *, pid: int, now: float, per_node: int) -> list[Item]:
        """Keep ``item`` (a rank of ``tenant`` on ``node``); returns the items to stop: the oldest beyond
        ``per_node`` on that node (``item`` itself where ``per_node`` is 0, or where it has no tenant)."""
        if per_node <= 0 or not tenant:
            return [item]
        kept = self._by_node.setdefault(node, [])
        kept.append(_Returned(item, tenant, pid, now))
        over = max(0, len(kept) - per_node)
        evicted, self._by_node[node] = kept[:over], kept[over:]
        return [entry.item for entry in evicted]

    def take(self, node: str, tenant: str) -> Item | None:
        """The most recently returned rank of ``tenant`` on ``node`` (its caches are the freshest), or None."""
        kept = self._by_node.get(node, [])
        for index in range(len(kept) - 1, -1, -1):
            if tenant and kept[index].tenant == tenant:
                return kept.pop(index).item
        return None

    def expire(self, now: float) -> list[Item]:
        """Forget and return the items idle for ``idle_s`` or longer (the caller stops them)."""
        expired: list[Item] = []
        for node, kept in self._by_node.items():
            expired += [entry.item for entry in kept if now - entry.since >= self.idle_s]
            self._by_node[node] = [entry for entry in kept if now - entry.since < self.idle_s]
        return expired

    def keep_nodes(self, alive: set[str]) -> list[Item]:
        """Forget the items on nodes not in ``alive`` (they died with their node); returns them."""
        gone = [node for node in self._by_node if node not in alive]
        return [entry.item for node in gone for entry in self._by_node.pop(node)]

    def trim(self, per_node: dict[str, int]) -> list[Item]:
        """Forget and return the oldest items beyond each node's bound (``per_node``; a node missing: 0)."""
        evicted: list[Item] = []
        for node, kept in self._by_node.items():
            over = max(0, len(kept) - per_node.get(node, 0))
            evicted += [entry.item for entry in kept[:over]]
            self._by_node[node] = kept[over:]
        return evicted

    def pop_all(self) -> list[Item]:
        """Forget and return every item (the pool closes)."""
        items = [entry.item for kept in self._by_node.values() for entry in kept]
        self._by_node.clear()
        return items

    def counts(self) -> dict[str, int]:
        """Node -> returned ranks kept there (nodes with none left out)."""
        return {node: len(kept) for node, kept in self._by_node.items() if kept}

    def pids(self) -> list[int]:
        return sorted(entry.pid for kept in self._by_node.values() for entry in kept)
