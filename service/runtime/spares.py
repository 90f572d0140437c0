"""The warm spare pool: pre-started rank processes per node, handed to worker groups on demand.

One detached actor per Ray cluster (``etrain/spares``, on the head node, no CPUs), created by the
control plane at start (``ensure_pool``) and shared by every job. It keeps ready
:class:`etrain.workers.rank.spare.SpareRank` actors on each alive node that can run ranks (a node with CPUs
or GPUs): ``ETRAIN_WARM_SPARES_PER_NODE`` of them, or by default (``auto``) one per GPU plus one on a GPU
node and up to three on a CPU-only node (``etrain.service.decisions.capacity.spares_for_node``). It refills
a node a few seconds after one of its spares is taken, and forgets spares whose node died.
A worker group whose placement group is ready asks for one spare per bundle on that bundle's node
(``take``): a ready spare, else one still warming up there (it started before the launch did), else none,
and the rank starts cold: for a tenant's job without GPUs, in a process the pool starts then
(``start_cold``), so that it can come back like a spare (below). The pool never holds a launch back for
longer than a spare's remaining warm-up.

Spares are owned by the pool actor (which lives as long as the cluster, detached like the job
supervisors), so a job's ranks never share fate with a control-plane restart. The pool keeps no handle to a
spare it handed out: the worker group's is the last, so a rank from the pool dies with its supervisor as a
cold rank does with its owner. A spare costs one idle process with torch imported (~300 MB of host memory)
and no logical resources.

A job that finished cleanly gives its ranks from the pool back (``give_back``: spares and the cold ranks the
pool started for it): each one that can be reused
(no GPUs, ``SpareRank.release``) is kept for the same tenant's next job on its node, the first choice of
``take`` for that tenant (``etrain.service.decisions.returned_ranks`` says why and keeps the bounds).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from etrain.service.decisions.capacity import spares_for_node
from etrain.service.decisions.returned_ranks import ReturnedRanks, returned_per_node
from etrain.workers.protocol.messages import SPARE_ACTOR_CLASS, load_actor_class

log = logging.getLogger(__name__)

POOL_NAME = "etrain/spares"
NAMESPACE = "etrain"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource
REFILL_INTERVAL_S = 1.0
#: A node is refilled this long after a spare was taken from it, not at once: a new spare's start
#: (interpreter, ``import torch``, a warm-up step: 3-5 s of a core) would otherwise compete for the
#: node's CPUs with the very launch or repair that took the spare. Measured on the 2-core machine,
#: an immediate refill made a warm launch's rank hand-over 0.4-0.5 s slower.
REFILL_DELAY_AFTER_TAKE_S = 5.0
TAKE_TIMEOUT_S = 5.0
MAX_HANDED_PIDS = 1000


class SparePool:
    """Keeps warm spares on every node that can run ranks: ``per_node`` each, or ``None`` for ``auto``."""

    def __init__(self, per_node: int | None):
        self.per_node = None if per_node is None else max(0, int(per_node))
        self._lock = threading.Lock()
        # node id -> (warm spare, its process id: what an operator can look up), oldest first
        self._ready: dict[str, list[tuple[Any, int]]] = {}
        self._handed_pids: deque[int] = deque(maxlen=MAX_HANDED_PIDS)  # the last spares handed out, oldest first
        self._warming: dict[str, list[tuple[Any, Any]]] = {}  # node id -> (spare, its ready() ref)
        self._handed_warming: list[Any] = []  # ready() refs of spares handed over while still warming up
        self._taken = 0
        self._reused = 0
        # Ranks of finished jobs, for their tenant's next jobs (service/decisions/returned_ranks.py).
        self._returned: ReturnedRanks[Any] = ReturnedRanks()
        self._returned_bounds: dict[str, int] = {}  # node id -> returned ranks it keeps, from its resources
        self._taken_at: dict[str, float] = {}  # node id -> monotonic time of its last take
        self._closed = threading.Event()
        self._wake = threading.Event()
        threading.Thread(target=self._refill_loop, name="spare-refill", daemon=True).start()

    def configure(self, per_node: int | None) -> None:
        """A restarted control plane may ask for another pool size; extra spares are retired (at the next
        refill, which knows each node's target)."""
        with self._lock:
            self.per_node = None if per_node is None else max(0, int(per_node))
        self._wake.set()

    def take(self, nodes: list[str], tenant: str = "") -> list[Any]:
        """One spare per entry of ``nodes`` (a node id per rank): a rank that ``tenant``'s earlier job gave
        back on that node, else a ready one, else the oldest one still warming up there, else None (the rank
        starts cold).

        A spare still warming up is handed over rather than left to finish beside a new cold process: it
        started earlier, so it is ready sooner, and a cold rank beside it would be a second interpreter and
        torch import competing for the same CPUs. The first launch after the control plane starts meets
        this on every node (one test: 4 ranks on 3 fresh nodes placed in 22.6 s with the old take, and in
        26.9 s with 2 handed over while warming: on 2 noisy cores one run each does not separate them).
        The rank's ``assign`` waits behind the spare's warm-up, as Ray runs an actor's calls after its
        constructor; a spare whose warm-up fails fails that call, as a cold rank's failed start would.
        """
        handed: list[Any] = []
        with self._lock:
            for node in nodes:
                if self.per_node == 0:
                    handed.append(None)
                    continue
                reused = self._returned.take(node, tenant)
                if reused is not None:  # no refill: the pool's own spares stay as they were
                    self._reused += 1
                    handed.append(reused)
                    continue
                ready, warming = self._ready.get(node), self._warming.get(node)
                if not (ready or warming):
                    handed.append(None)
                    continue
                self._taken_at[node] = time.monotonic()
                self._taken += 1
                if ready:
                    spare, pid = ready.pop(0)
                    self._handed_pids.append(pid)
                else:
                    spare, ref = warming.pop(0)
                    self._handed_warming.append(ref)  # its pid joins handed_pids once its warm-up answers
                handed.append(spare)
        self._wake.set()
        return handed

    def start_cold(self, nodes: list[str]) -> list[Any]:
        """A rank process started now on each of ``nodes``, for ranks no spare or returned rank could serve
        (None for each where the pool is off). It starts without the spare's warm-up, since a launch waits
        for it, and the pool does not keep it: it is made here only so that the pool owns it, as it owns
        the spares. A cold rank that a job's supervisor made dies with that supervisor, so it could never
        serve the tenant's next job (``give_back``); one made here can."""
        with self._lock:
            if self.per_node == 0:
                return [None] * len(nodes)
        return [_start_spare(node, gpu_node=False, warm_up=False) for node in nodes]

    def give_back(self, ranks: list[dict[str, Any]], tenant: str) -> int:
        """Keep the released ranks of ``tenant``'s finished job (each ``{"actor", "node", "pid"}``: its
        ``SpareRank.release`` said it can be reused) for that tenant's next jobs; stops the ones beyond a
        node's bound. Returns how many it kept."""
        now, stop = time.monotonic(), []
        with self._lock:  # with the pool off, every node's bound is 0: every rank is stopped
            for rank in ranks:
                bound = self._returned_bounds.get(rank["node"], 0)
                stop += self._returned.add(
                    rank["node"], tenant, rank["actor"], pid=int(rank["pid"]), now=now, per_node=bound
                )
        for actor in stop:
            _kill(actor)
        return len(ranks) - len(stop)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "per_node": "auto" if self.per_node is None else self.per_node,
                "taken": self._taken,
                "reused": self._reused,
                "returned": self._returned.counts(),
                "returned_pids": self._returned.pids(),
                "ready": {node: len(spares) for node, spares in self._ready.items() if spares},
                "handed_pids": list(self._handed_pids),
                "ready_pids": sorted(pid for spares in self._ready.values() for _, pid in spares),
                "warming": {node: len(spares) for node, spares in self._warming.items() if spares},
            }

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        with self._lock:
            for spares in self._ready.values():
                for spare, _ in spares:
                    _kill(spare)
            for warming in self._warming.values():
                for spare, _ in warming:
                    _kill(spare)
            for returned in self._returned.pop_all():
                _kill(returned)
            self._ready.clear()
            self._warming.clear()

    # --- refill ----------------------------------------------------------------------------------

    def _refill_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self._refill()
            except Exception as err:  # the GCS can be briefly unreachable (node loss): try again
                log.warning("spare refill failed: %s", err)
            self._wake.wait(REFILL_INTERVAL_S)
            self._wake.clear()

    def _refill(self) -> None:
        alive = [node for node in ray.nodes() if node.get("Alive") and _runs_ranks(node)]
        nodes = [node["NodeID"] for node in alive]
        gpu_nodes = {node["NodeID"] for node in alive if (node.get("Resources") or {}).get("GPU", 0) > 0}
        targets = {node["NodeID"]: spares_for_node(node.get("Resources") or {}, self.per_node) for node in alive}
        bounds = {node["NodeID"]: returned_per_node(node.get("Resources") or {}) for node in alive}
        with self._lock:
            self._record_handed_warming()
            self._returned_bounds = bounds if self.per_node != 0 else {}
            stale = self._returned.keep_nodes(set(nodes))  # died with their node
            stale += self._returned.expire(time.monotonic()) + self._returned.trim(self._returned_bounds)
            for actor in stale:
                _kill(actor)
            for gone in set(self._ready) | set(self._warming):
                if gone not in nodes:  # its node died: the spares died with it
                    self._ready.pop(gone, None)
                    self._warming.pop(gone, None)
            for node in nodes:
                warming = self._warming.setdefault(node, [])
                if warming:
                    done, _ = ray.wait([ref for _, ref in warming], num_returns=len(warming), timeout=0)
                    for spare, ref in list(warming):
                        if ref in done:
                            warming.remove((spare, ref))
                            try:
                                pid = ray.get(ref, timeout=1)["pid"]
                            except Exception as err:
                                log.warning("a spare on node %s failed to start: %s", node[:12], err)
                                continue
                            self._ready.setdefault(node, []).append((spare, pid))
                if time.monotonic() - self._taken_at.get(node, -REFILL_DELAY_AFTER_TAKE_S) < REFILL_DELAY_AFTER_TAKE_S:
                    continue  # a launch or repair on this node is starting now: refill after it
                ready = self._ready.get(node, [])
                while len(ready) > targets[node]:  # the pool was made smaller
                    _kill(ready.pop()[0])
                missing = targets[node] - len(ready) - len(warming)
                for _ in range(max(0, missing)):
                    spare = _start_spare(node, gpu_node=node in gpu_nodes)
                    warming.append((spare, spare.ready.remote()))

    def _record_handed_warming(self) -> None:
        """The pids of spares handed over while warming up, once their warm-up has answered (under the lock)."""
        if not self._handed_warming:
            return
        done, self._handed_warming = ray.wait(self._handed_warming, num_returns=len(self._handed_warming), timeout=0)
        for ref in done:
            try:
                self._handed_pids.append(ray.get(ref, timeout=1)["pid"])
            except Exception:  # its warm-up failed: the rank's assign call reports it to the worker group
                pass


def _runs_ranks(node: dict[str, Any]) -> bool:
    resources = node.get("Resources") or {}
    return resources.get("CPU", 0) > 0 or resources.get("GPU", 0) > 0


def _start_spare(node: str, *, gpu_node: bool, warm_up: bool = True) -> Any:
    """A spare on ``node``; on a node with GPUs it must not start CUDA before ``assign`` (workers/rank/spare.py).
    ``warm_up``: False for a rank a launch waits for (``SparePool.start_cold``)."""
    return (
        ray.remote(load_actor_class(SPARE_ACTOR_CLASS))
        .options(
            num_cpus=0,
            num_gpus=0,
            max_restarts=0,
            max_concurrency=4,  # as a rank: run() on one thread, control calls on others
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        )
        .remote(gpu_node=gpu_node, warm_up=warm_up)
    )


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:
        pass


def ensure_pool(per_node: int | None) -> Any | None:
    """Create the cluster's spare pool (or resize the live one); None when spares are off. ``per_node``:
    spares per node, or None for ``auto`` (one per GPU, one on a CPU-only node)."""
    if per_node is not None and per_node <= 0:
        pool = find_pool()
        if pool is not None:
            pool.configure.remote(0)
        return None
    pool = (
        ray.remote(SparePool)
        .options(
            name=POOL_NAME,
            namespace=NAMESPACE,
            lifetime="detached",
            num_cpus=0,
            resources={HEAD_NODE_RESOURCE: 0.001},
            max_concurrency=8,
            get_if_exists=True,
        )
        .remote(per_node)
    )
    pool.configure.remote(per_node)
    return pool


def find_pool() -> Any | None:
    try:
        return ray.get_actor(POOL_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def take_spares(nodes: list[str], tenant: str = "") -> list[Any]:
    """Spares for ranks on ``nodes`` (None where the node has none, or there is no pool), ``tenant``'s returned
    ranks first; never raises, bounded wait."""
    pool = find_pool()
    if pool is None or not nodes:
        return [None] * len(nodes)
    started = time.monotonic()
    try:
        return ray.get(pool.take.remote(nodes, tenant), timeout=TAKE_TIMEOUT_S)
    except Exception as err:
        log.warning("no spares after %.1fs: %s", time.monotonic() - started, err)
        return [None] * len(nodes)


def start_cold_ranks(nodes: list[str]) -> list[Any]:
    """Rank processes the pool starts now on ``nodes`` (``SparePool.start_cold``); None for each where there
    is no pool, it is off or it did not answer in time (the caller starts those ranks itself). Never raises."""
    pool = find_pool()
    if pool is None or not nodes:
        return [None] * len(nodes)
    try:
        return ray.get(pool.start_cold.remote(nodes), timeout=TAKE_TIMEOUT_S)
    except Exception as err:
        log.warning("the pool did not start %d cold rank(s): %s", len(nodes), err)
        return [None] * len(nodes)


def give_back_spares(ranks: list[dict[str, Any]], tenant: str) -> bool:
    """Hand a finished job's released ranks to the pool for ``tenant``'s next jobs; False (the caller stops
    them) when there is no pool or it did not answer in time. Never raises."""
    pool = find_pool()
    if pool is None:
        return False
    try:
        ray.get(pool.give_back.remote(ranks, tenant), timeout=TAKE_TIMEOUT_S)
        return True
    except Exception as err:
        log.warning("the pool did not take back %d rank(s): %s", len(ranks), err)
        return False
