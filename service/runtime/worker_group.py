"""One attempt's group of rank actors on Ray: place, start, watch, tear down.

Lives inside the supervisor actor. It owns exactly one placement group and ``world_size`` rank
actors, and turns what Ray reports about them into plain :class:`GroupOutcome` values that the
supervisor converts into state-machine events. Nothing here decides *what to do* about a failure.

Placement: one bundle per rank, in rank order (Megatron order puts each tensor-parallel group in
consecutive ranks). Under tensor parallelism each group's bundles are pinned to one node with room for the
whole group (a per-bundle label selector on ``ray.io/node-id``): ``PACK`` alone places bundle by bundle and
splits a group over a node with room for an odd number of ranks. Excluded nodes (evicted stragglers) are
kept out with the same selector.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from etrain.service.decisions.admission import tp_group_nodes
from etrain.service.decisions.capacity import rank_slots
from etrain.service.decisions.hangs import Frame, RankWhere
from etrain.service.decisions.in_place_waits import stuck_survivor_grace_s, survivor_exit_timeout_s
from etrain.service.runtime.spares import NAMESPACE, give_back_spares, start_cold_ranks, take_spares
from etrain.workers.protocol.errors import CheckpointError, EtrainError, UnhealthyRankError
from etrain.workers.protocol.messages import RANK_ACTOR_CLASS, ChaosOrder, LaunchPlan, load_actor_class
from etrain.workers.protocol.topology import Topology

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
# How long a placement with every tp group pinned to one node may wait before Ray places the bundles itself.
TP_PIN_GRACE_S = 10.0
RENDEZVOUS_TIMEOUT_S = 60.0
# How long a finished group waits for its ranks to leave their job (release: a garbage collection and a
# memory trim, well under a second) before it kills the ones that have not answered.
RELEASE_TIMEOUT_S = 10.0
# How long stop() waits for the GPU ranks it killed to be gone. Why wait: ray.kill only asks the node to end
# the process (a call on the actor fails at once, before it has), and the next attempt's ranks take the same
# GPUs (a relaunch, which is how a CUDA job survives a lost rank: NCCL's survivors cannot leave their
# collectives, so they are killed): a process still being torn down holds its device memory, and a new rank
# materialising a large model there would run out of it. torchrun and Ray Train likewise wait for the old
# workers to exit before starting new ones. CPU ranks are not waited for (host memory is the node's, not a
# device's a successor is pinned to, and the check costs a task per node).
EXIT_TIMEOUT_S = 10.0
# Failure classification is immediate on the recovery path and corrected later (issue #9): a rank
# whose actor died is a process fault at once, unless Ray's own death cause already says its node
# died; the runtime refunds the restart when the node table confirms a node loss afterwards
# (``service/runtime/supervisor_actor.py``, NodeLossConfirmed). Only when no restart is left does the final verdict
# wait, so that a node loss is never mistaken for the job's last allowed fault:
#
# A rank whose run() failed with a collective error is usually the *victim* of a peer that died.
# The group pings every rank at once (``ping`` on the rank actors answers in milliseconds while they
# live); the first rank whose ping fails with an actor death is the culprit. A rank that does not
# answer within PROBE_TIMEOUT_S is called lost (its process or node is gone or wedged).
PROBE_TIMEOUT_S = 2.0
# With no restart left, wait this long for the dead peer to surface before blaming the rank itself...
PEER_FAILURE_GRACE_S = 6.0
# ... and this long for the node's verdict before calling a loss a process fault (which would fail
# the job). Ray's node health check must be faster than this for node loss to be free (the tests
# use a 1 s period x 3 failures; production clusters tune health_check_* likewise).
NODE_DEATH_GRACE_S = 6.0


def rank_actor_name(job_id: str, attempt: int, rank: int) -> str:
    """A cold rank's actor name. The attempt is part of it: a lost rank that is wedged rather than dead
    may still hold its name while its replacement (in place) or the next group starts (ray.kill is
    asynchronous)."""
    return f"etrain/{job_id}/a{attempt}/rank{rank}"


@dataclass(frozen=True, kw_only=True)
class GroupOutcome:
    """What happened to the group since the last poll (at most one per poll)."""

    kind: Literal["finished", "worker_lost", "job_error", "unhealthy"]
    rank: int = -1
    node: str = ""
    cause: Literal["process", "actor", "node"] = "process"
    final_step: int = 0
    message: str = ""
    traceback: str = ""
    #: A ``job_error`` raised because a rank could not read or verify the checkpoint it had to restore
    #: (``CheckpointError``): after an in-place attempt, which checks only the manifest's signature up
    #: front, the supervisor relaunches with every file verified instead of failing the job.
    unreadable_checkpoint: bool = False


class WorkerGroup:
    """The rank actors of one attempt and their placement group."""

    def __init__(
        self,
        *,
        job_id: str,
        plan: LaunchPlan,
        world_size: int,
        resources_per_rank: dict[str, float],
        strategy: str,
        excluded_nodes: frozenset[str],
        supervisor: Any,
        tenant: str = "",
    ):
        """``tenant``: the job's; ranks from the warm pool go back to it for that tenant's next jobs when the
        group finishes (:meth:`stop`), and the pool hands this group that tenant's returned ranks first."""
        self.job_id = job_id
        self.plan = plan
        self.attempt = plan.attempt
        self.world_size = world_size
        self._resources = resources_per_rank
        self._strategy = strategy
        self._excluded = excluded_nodes
        self._supervisor = supervisor
        self.pg = None
        self.actors: list[Any] = []
        self.nodes: dict[int, str] = {}  # rank -> node id
        self._pids: dict[int, int] = {}  # rank -> its process id, from the last rendezvous
        self._bundle_nodes: dict[int, str] = {}  # bundle (= rank) -> node id, once the placement group is reserved
        self._reserving = False  # the placement group is requested and its bundles' nodes not yet recorded
        self._runs: dict[Any, int] = {}  # run ObjectRef -> rank
        self._results: dict[int, dict] = {}
        # rank -> when its ``run`` of this attempt returned (time.monotonic()), as ``poll`` collected it: an
        # in-place repair's grace for stuck survivors runs from the first survivor's return, which ``poll``
        # often saw before the repair began (a survivor's collective fails with the dead peer at once).
        self._returned: dict[int, float] = {}
        # A rank's collective failure being explained: (since, its outcome, ping ObjectRef -> rank still out).
        self._suspect: tuple[float, GroupOutcome, dict[Any, int]] | None = None
        self._stopped = False
        self._lost: tuple[float, GroupOutcome] | None = None  # a dead rank waiting for its node's verdict
        self.warm_ranks = 0  # ranks that started from a warm spare (service/runtime/spares.py)
        self.reused_ranks = 0  # of those, processes an earlier job of the tenant gave back
        self._tenant = tenant
        self._from_pool: set[str] = set()  # the actors that came from the pool (it owns their processes)
        self._finished = False  # every rank's run returned: the ranks are idle and may serve another job
        self._given_back = False
        self._pg_removed = False

    # --- start ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Place the bundles, create the rank actors, rendezvous on rank 0 and start ``run``.

        Raises :class:`PlacementTimeout` when the cluster cannot hold the group.
        """
        self._reserve()
        self.actors = self._rank_actors()
        if self._stopped:  # stop() ran while the ranks were being made: they are ours to kill
            self.stop()
            raise RuntimeError("worker group stopped while starting")
        self._rendezvous()

    def _reserve(self, pinned: dict[int, str] | None = None) -> None:
        """Create the placement group, wait until Ray reserves it, and record which node holds each bundle.

        ``pinned``: bundle -> the node it must be on (the ranks an in-place resize keeps). Under tensor
        parallelism the other bundles are pinned too, each tp group's to one node with room for all of it
        (:meth:`_whole_tp_groups`); where Ray cannot reserve that within TP_PIN_GRACE_S (the free resources
        read a moment ago were taken since), it is released and Ray places the bundles itself.

        From the request until the nodes are recorded, :meth:`bundles_per_node` says it does not know
        (None): Ray takes the bundles off the nodes' free resources a few milliseconds before the placement
        group table names their nodes, and a capacity check in between would count the job's own
        reservation as someone else's.
        """
        pinned = dict(pinned or {})
        self._reserving = True
        try:
            whole = self._whole_tp_groups(pinned)
            if whole:
                try:
                    self._place_bundles({**pinned, **whole}, timeout_s=min(TP_PIN_GRACE_S, PLACEMENT_TIMEOUT_S))
                    return
                except PlacementTimeout:
                    log.warning(
                        "job %s: tp groups pinned to %s could not be placed; Ray places them", self.job_id, whole
                    )
                    remove_placement_group(self.pg)
                    self.pg = None
            self._place_bundles(pinned, timeout_s=PLACEMENT_TIMEOUT_S)
        finally:
            self._reserving = False

    def _place_bundles(self, pinned: dict[int, str], *, timeout_s: float) -> None:
        """One placement group of ``world_size`` bundles, ``pinned`` ones on their nodes and none on an
        excluded node; raises PlacementTimeout when Ray has not reserved it within ``timeout_s``."""
        bundles = [dict(self._resources) for _ in range(self.world_size)]
        kwargs: dict[str, Any] = {}
        if self._excluded or pinned:
            free = {"ray.io/node-id": f"!in({','.join(sorted(self._excluded))})"} if self._excluded else {}
            kwargs["bundle_label_selector"] = [
                {"ray.io/node-id": pinned[index]} if index in pinned else dict(free) for index in range(len(bundles))
            ]
        self.pg = placement_group(
            bundles, strategy=self._strategy, name=f"etrain/{self.job_id}/a{self.attempt}", **kwargs
        )
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except GetTimeoutError as err:
            raise PlacementTimeout(
                f"{self.world_size} ranks of {self._resources} could not be placed within {timeout_s:.0f}s"
            ) from err
        self._bundle_nodes = self._reserved_nodes()

    def _whole_tp_groups(self, pinned: dict[int, str]) -> dict[int, str]:
        """Bundle -> node for every tensor-parallel group with no pinned bundle, each group on one node with
        room for all of it in the cluster's free resources now; empty without tensor parallelism or where
        the free resources hold no such placement.

        Why: Ray's PACK places bundle by bundle (one per rank, tp groups consecutive in Megatron order), so
        where a node has room for an odd number of ranks a tp group straddles two nodes, and each of its
        per-layer all-reduces crosses the network. Admission counted whole groups per node
        (service/decisions/admission.py); this places them so.
        """
        tp = self.plan.config.parallel.tp
        if tp <= 1 or self.world_size % tp:
            return {}
        open_groups = [g for g in range(self.world_size // tp) if not any(g * tp + i in pinned for i in range(tp))]
        if not open_groups:
            return {}
        try:
            from ray._private.state import available_resources_per_node

            free = available_resources_per_node()
        except Exception as err:  # no plan: Ray places the bundles itself, as it did before
            log.info("job %s: free resources unreadable (%s); Ray places the tp groups", self.job_id, err)
            return {}
        nodes = tp_group_nodes(
            free,
            self._resources,
            tp=tp,
            groups=len(open_groups),
            strategy=self._strategy,
            excluded=self._excluded,
            held=Counter(pinned.values()),  # a resize's kept ranks take their share first
        )
        if nodes is None:
            return {}
        return {group * tp + i: node for group, node in zip(open_groups, nodes) for i in range(tp)}

    def _rank_actors(self) -> list[Any]:
        """One actor per rank: a warm spare on the bundle's node where the pool has one, else a cold start.

        Either way the rank's process holds no logical resources of its own: it runs on its bundle's node
        while the bundle's reservation accounts for its CPUs and GPUs, and it is pinned to the bundle's
        GPUs (service/runtime/spares.py, workers/rank/spare.py). So a rank's process does not share the
        placement group's fate: an in-place resize ([11] in service/decisions/supervisor.py) replaces the
        placement group under the ranks it keeps (Ray kills the actors created *in* a removed group).
        """
        ranks = range(self.world_size)
        reading = self._read_bundle_gpu_ids(ranks)  # runs beside take_spares' round trip
        actors = self._start_ranks({rank: self._bundle_nodes.get(rank, "") for rank in ranks}, reading)
        return [actors[rank] for rank in ranks]

    def _start_ranks(
        self, nodes: dict[int, str], gpu_ids: Callable[[], dict[int, list[str]]], attempt: int | None = None
    ) -> dict[int, Any]:
        """rank -> its actor for the ranks on ``nodes`` (rank -> its bundle's node), for a launch, a repair or a
        resize: the pool's processes where it has them (:meth:`_pool_processes`), else cold actors, every spare's
        ``assign`` settled. ``gpu_ids`` waits for the bundles' GPU ids (:meth:`_read_bundle_gpu_ids`, started
        beforehand so that it runs beside the pool's round trip). Sets :attr:`warm_ranks`."""
        pooled, warm = self._pool_processes(nodes)
        ids = gpu_ids()
        actors, assigning = {}, {}
        for rank in nodes:
            actors[rank], pending = self._rank_actor(rank, pooled.get(rank), ids[rank], attempt)
            if pending is not None:
                assigning[rank] = pending
        self.warm_ranks = warm - self._settle_assignments(actors, assigning, ids, attempt)
        return actors

    def _settle_assignments(
        self,
        actors: dict[int, Any],
        assigning: dict[int, Any],
        gpu_ids: dict[int, list[str]],
        attempt: int | None = None,
    ) -> int:
        """Wait for the spares' ``assign`` calls (rank -> pending call); a spare that died before it could
        take its rank (stopped while idle, out of memory) is replaced in ``actors`` by a cold rank, as if the
        pool had had none. Returns how many were replaced, and sets :attr:`reused_ranks` (the spares that
        served an earlier job). Any other failure raises, as before."""
        self.reused_ranks = 0
        if not assigning:
            return 0
        ray.wait(list(assigning.values()), num_returns=len(assigning), timeout=RENDEZVOUS_TIMEOUT_S)
        replaced = 0
        for rank, ref in assigning.items():
            try:
                self.reused_ranks += int(ray.get(ref, timeout=1) > 0)
            except RayActorError as err:
                log.warning(
                    "job %s: the spare for rank %d is gone (%s); it starts cold", self.job_id, rank, _first_line(err)
                )
                actors[rank], _ = self._rank_actor(rank, None, gpu_ids[rank], attempt)
                replaced += 1
        return replaced

    def _read_bundle_gpu_ids(self, ranks: Iterable[int]) -> Callable[[], dict[int, list[str]]]:
        """Start reading the GPU ids Ray reserved for the bundles of ``ranks``; the returned call waits
        for them (rank -> ids; empty lists on a job without GPUs).

        The rank holds no GPU in Ray's books (the bundle's reservation does), so Ray gives it no ids: it
        runs on the ones Ray reserved for its bundle, which only a task *in* the bundle can read. Each
        such task needs a Ray worker process of its own (Ray starts one unless an idle one is waiting:
        0.2-0.6 s each on a 2-core machine), so every bundle's task is sent at once, not one by one.
        """
        ranks = list(ranks)
        num_gpus = self._resources.get("GPU", 0.0)
        if not num_gpus:
            return lambda: {rank: [] for rank in ranks}
        refs = [
            _gpu_ids_in_bundle.options(
                num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in ranks
        ]
        return lambda: dict(zip(ranks, ray.get(refs, timeout=RENDEZVOUS_TIMEOUT_S)))

    @property
    def _gives_back(self) -> bool:
        """Whether this group's ranks can serve the tenant's next job once it finished (:meth:`_give_back`):
        a tenant's, and without GPUs (a CUDA context keeps the GPUs it started on)."""
        return bool(self._tenant) and not self._resources.get("GPU", 0.0)

    def _pool_processes(self, nodes: dict[int, str]) -> tuple[dict[int, Any], int]:
        """(rank -> the pool's process for it, how many of those were warm) for ranks on ``nodes`` (rank -> node).

        Warm: a returned rank of the tenant or a spare (``take_spares``). For the other ranks, where this group
        gives its ranks back, a process the pool starts now (``start_cold_ranks``): the pool owns it as it owns
        its spares, so it outlives this job's supervisor and can serve the tenant's next job
        (:meth:`_give_back`). A rank missing from the answer starts cold here, owned by the supervisor.
        """
        taken = take_spares(list(nodes.values()), self._tenant)
        pooled = {rank: spare for rank, spare in zip(nodes, taken) if spare is not None}
        warm = len(pooled)
        missing = {rank: node for rank, node in nodes.items() if rank not in pooled and node}
        if missing and self._gives_back:
            started = start_cold_ranks(list(missing.values()))
            pooled.update({rank: actor for rank, actor in zip(missing, started) if actor is not None})
        return pooled, warm

    def _rank_actor(
        self, rank: int, spare: Any | None, gpu_ids: list[str], attempt: int | None = None
    ) -> tuple[Any, Any | None]:
        """(actor, its pending ``assign`` call or None): the pool's process (a spare, a returned rank or one it
        started cold for this rank) made rank ``rank``, or a cold actor started here (``gpu_ids``: its
        bundle's, :meth:`_read_bundle_gpu_ids`)."""
        bundle = f"bundle {rank} of placement group {self.pg.id.hex()}"
        if spare is not None:
            self._from_pool.add(_actor_key(spare))
            return spare, spare.assign.remote(
                job_id=self.job_id,
                rank=rank,
                world_size=self.world_size,
                supervisor=self._supervisor,
                gpu_ids=gpu_ids,
                bundle=bundle,
            )
        node = self._bundle_nodes.get(rank) or placement_group_table(self.pg).get("bundles_to_node_id", {}).get(rank)
        return _rank_actor_class().options(
            name=rank_actor_name(self.job_id, self.attempt if attempt is None else attempt, rank),
            namespace=NAMESPACE,
            num_cpus=0,
            num_gpus=0,
            max_restarts=0,
            max_concurrency=4,  # run() on one thread; chaos / checkpoint requests on others
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote(
            job_id=self.job_id,
            rank=rank,
            world_size=self.world_size,
            supervisor=self._supervisor,
            gpu_ids=gpu_ids,
            bundle=bundle,
        ), None

    def _rendezvous(self) -> None:
        """Learn where each rank runs, pick rank 0's address and a free port, start every ``run``."""
        infos = ray.get([actor.node_info.remote() for actor in self.actors], timeout=RENDEZVOUS_TIMEOUT_S)
        self.nodes = {info["rank"]: info["node_id"] for info in infos}
        self._pids = {info["rank"]: int(info["pid"]) for info in infos}
        master_addr = infos[0]["ip"]
        master_port = ray.get(self.actors[0].free_port.remote(), timeout=RENDEZVOUS_TIMEOUT_S)
        for rank, actor in enumerate(self.actors):
            self._runs[actor.run.remote(self.plan, master_addr, master_port)] = rank

    # --- repair in place ------------------------------------------------------------------------

    def repair(
        self,
        lost_rank: int,
        plan: LaunchPlan,
        *,
        memory_limit: Callable[[], int] | None = None,
        also_lost: Callable[[dict[int, str]], None] | None = None,
        step_s: float | None = None,
    ) -> None:
        """Run ``plan`` (the next attempt) on the same placement group: every rank but the lost ones keeps
        its actor (its process, its memory: it restores the committed step it saved itself), and each lost
        rank gets a new one (a warm spare where the pool has one).

        The lost ranks are ``lost_rank`` and any other whose process died in the same fault: a GPU fault, the
        OOM killer or a crashed host agent often takes several ranks of one node at once, a dead node all of
        its ranks, and their replicas elsewhere still hold their state. ``also_lost`` hears of those (rank ->
        why) before they are replaced. A rank whose node died is replaced on a node left, where its bundle is
        reserved again (:meth:`_replacement_nodes`). No room for it, or every rank lost, makes the repair fail
        (:class:`RepairError`): the caller relaunches every rank, on the capacity left.

        The survivors' ``run`` of the failed attempt must have returned first (their collectives
        failed with the dead peer). One still out :func:`stuck_survivor_grace_s` after the first survivor
        returned (``step_s``: the job's recent step time; it waits in a collective on a live peer that left
        the attempt, which gloo never fails) is replaced as well: its state comes from a replica's memory
        or, with every other rank, from storage. When no survivor returns within
        :func:`survivor_exit_timeout_s` the repair fails.

        ``memory_limit`` is asked once the survivors' runs returned (their last step reports are in by
        then): the newest step the ranks may resume at from memory (``LaunchPlan.memory_resume_limit``).
        """
        # the failed attempt's runs still out (not the lost rank's, if polled)
        grace_s, exit_s = stuck_survivor_grace_s(step_s), survivor_exit_timeout_s(step_s)
        others, stuck = self._leave_attempt(lost_rank=lost_rank, exit_s=exit_s, stuck_after_s=grace_s)
        lost = sorted({lost_rank, *others, *stuck})
        if len(lost) == self.world_size:
            raise RepairError(
                f"every rank of attempt {self.attempt} died or did not leave it "
                f"(stuck: {stuck or 'none'}; waited {exit_s:.0f}s for a first survivor): "
                "no process to keep"
            )
        why = {
            rank: ("with its node: " if _death_cause(err, self.nodes.get(rank, "")) == "node" else "")
            + _first_line(err)
            for rank, err in others.items()
        }
        why.update(
            {
                rank: f"stuck: still inside attempt {self.attempt} {grace_s:.0f}s after another survivor left it, "
                "in a collective waiting on a live peer that left"
                for rank in stuck
            }
        )
        if why and also_lost is not None:
            also_lost(dict(sorted(why.items())))
        if memory_limit is not None:
            plan = dataclasses.replace(plan, memory_resume_limit=memory_limit())
        failed_attempt, self.plan, self.attempt = self.attempt, plan, plan.attempt
        for retry in (False, True):
            # A rank on a node declared dead is lost whatever its run said (a crashed node's ranks may fail
            # their calls as "temporarily unavailable", not as dead actors).
            gone = self._on_dead_nodes(rank for rank in range(self.world_size) if rank not in lost)
            if gone:
                lost = sorted({*lost, *gone})
                if len(lost) == self.world_size:
                    raise RepairError(f"every rank of attempt {failed_attempt} died: no process to keep")
                if also_lost is not None:
                    also_lost({rank: f"with its node: {node} was declared dead" for rank, node in gone.items()})
            for rank in lost:
                _kill(self.actors[rank])  # dead already, or wedged (or a replacement that never started): gone
            bundle_nodes = self._replacement_nodes(lost)
            reading = self._read_bundle_gpu_ids(lost)
            replacements = self._start_ranks(bundle_nodes, reading, plan.attempt)
            for rank, actor in replacements.items():
                self.actors[rank] = actor
            if self._stopped:
                raise RepairError("the group was stopped during the repair")
            try:
                self._rendezvous()
                return
            except Exception as err:
                # A node that crashed is declared dead only after Ray's health checks (seconds), so a rank lost
                # with it was reported as a process fault and first replaced on that node. That start fails
                # once the node is declared dead: the lost ranks are placed again, on the nodes left (once).
                alive = _live_nodes()
                gone = sorted({node for node in bundle_nodes.values() if node not in alive})
                if retry or not gone:
                    raise
                log.warning(
                    "job %s: the replacements' node %s died during the repair (%s); placing them again",
                    self.job_id,
                    ", ".join(gone),
                    _first_line(err),
                )

    def _on_dead_nodes(self, ranks: Iterable[int]) -> dict[int, str]:
        """rank -> its node, for the ``ranks`` whose node the cluster has declared dead."""
        alive = _live_nodes()
        return {rank: node for rank in ranks if (node := self.nodes.get(rank, "")) and node not in alive}

    def _replacement_nodes(self, lost: list[int]) -> dict[int, str]:
        """rank -> the node of its bundle, for the ranks a repair replaces.

        A bundle on a live node stays where it is. Where a lost rank's node died, its bundle is reserved
        again: Ray does not move a bundle pinned to a node (each tp group is pinned to one,
        :meth:`_whole_tp_groups`), so the placement group is replaced, as a resize replaces it: the kept
        ranks' bundles on their own nodes, the lost ranks' tp groups whole on nodes with room. Raises
        :class:`RepairError` when the live nodes' free resources cannot hold the lost ranks (the job then
        waits for the capacity left), when the new group is not reserved in time, or when a kept rank's GPUs
        are not its new bundle's.
        """
        placed = placement_group_table(self.pg).get("bundles_to_node_id", {}) or {}
        alive = _live_nodes()
        nodes = {rank: placed.get(rank) or "" for rank in lost}
        if all(node in alive for node in nodes.values()):  # Ray may have moved an unpinned bundle by itself
            self._bundle_nodes.update(nodes)
            return nodes
        kept = {rank: self.nodes[rank] for rank in range(self.world_size) if rank not in lost}
        # Only the dead nodes' bundles need new room: a lost rank on a live node (a stuck survivor) gets its
        # own bundle's room back when the old group is released.
        homeless = [rank for rank, node in nodes.items() if node not in alive]
        room = self._room_for_bundles(alive)
        if room < len(homeless):
            raise RepairError(
                f"the live nodes have room for {room} of the {len(homeless)} rank(s) lost with their node "
                f"({', '.join(map(str, homeless))})"
            )
        old_gpus = self._kept_gpu_ids({rank: rank for rank in kept})
        self._reserving = True  # capacity checks ask again until the new bundles' nodes are known
        remove_placement_group(self.pg)
        try:
            self._reserve(kept)
        except PlacementTimeout as err:
            raise RepairError(f"the lost ranks could not be placed with the kept ranks on their nodes: {err}") from None
        self._check_kept_gpus(old_gpus, RepairError)
        return {rank: self._bundle_nodes.get(rank, "") for rank in lost}

    def _room_for_bundles(self, alive: set[str]) -> int:
        """How many more bundles (one rank's resources) the live, not excluded nodes' free resources hold."""
        from ray._private.state import available_resources_per_node

        if not any(amount > 0 for amount in self._resources.values()):  # a bundle of nothing fits anywhere
            return self.world_size
        return sum(
            rank_slots(free=free, per_rank=self._resources)
            for node, free in available_resources_per_node().items()
            if node in alive and node not in self._excluded
        )

    def _kept_gpu_ids(self, kept: dict[int, int]) -> dict[int, list[str]]:
        """new rank -> the GPU ids the process of kept old rank runs on (a job without GPUs: none). CUDA keeps
        a process's GPUs for its life, so a kept rank's new bundle must hold exactly these."""
        if not self._resources.get("GPU", 0.0):
            return {}
        answers = ray.get([self.actors[old].devices.remote() for old in kept.values()], timeout=RENDEZVOUS_TIMEOUT_S)
        return {new: list(answer["gpu_ids"]) for new, answer in zip(kept, answers)}

    def _check_kept_gpus(self, old_gpus: dict[int, list[str]], error: type[Exception]) -> None:
        """Raise ``error`` where a kept rank's new bundle holds other GPUs than its process runs on."""
        if not old_gpus:
            return
        bundle_gpu_ids = self._read_bundle_gpu_ids(list(old_gpus))()
        for rank, ids in old_gpus.items():
            if sorted(bundle_gpu_ids[rank]) != sorted(ids):
                raise error(
                    f"rank {rank}'s process runs on GPUs {ids}, but its new bundle holds GPUs {bundle_gpu_ids[rank]} "
                    "(CUDA keeps a process's GPUs for its life)"
                )

    # --- resize in place -------------------------------------------------------------------------

    def resize(self, plan: LaunchPlan, *, from_dp: int, step_s: float | None = None) -> str:
        """Run ``plan`` (the next attempt, at ``plan.config.parallel.dp`` replicas) on the ranks this group
        keeps: stop the current runs at a step boundary, keep every rank whose data-parallel index stays
        below the new dp (its process and memory, renumbered for the new world), release the others,
        replace the placement group (the kept ranks' bundles pinned to their nodes) and add new ranks
        (warm spares where the pool has them). Returns what it did, in words, for the job's events.

        Raises :class:`ResizeError` (the caller relaunches every rank instead) when a run does not leave
        the old attempt within :func:`survivor_exit_timeout_s` (``step_s``: the job's recent step time), a rank died, the new size cannot be placed with
        the kept ranks where they are, or a kept rank's GPUs are not its new bundle's.
        """
        parallel = plan.config.parallel
        old_topology = Topology(pp=parallel.pp, dp=from_dp, tp=parallel.tp, cp=parallel.cp)
        new_topology = Topology(pp=parallel.pp, dp=parallel.dp, tp=parallel.tp, cp=parallel.cp)
        if old_topology.world_size != self.world_size:
            raise ResizeError(f"the group has {self.world_size} ranks, not {old_topology}'s {old_topology.world_size}")
        if self._runs and 0 < len(self.actors):
            self.actors[0].request_stop.remote()  # rank 0 stops every rank at the same step boundary
        exit_s = survivor_exit_timeout_s(step_s)
        died, late = self._leave_attempt(lost_rank=None, exit_s=exit_s)
        if late:
            raise ResizeError(f"ranks {late} did not leave attempt {self.attempt} within {exit_s:.0f}s")
        if died:
            rank, err = min(died.items())
            raise ResizeError(f"rank {rank} died as well: {_first_line(err)}")
        kept = old_topology.kept_on_resize(parallel.dp)  # new rank -> old rank, at the same (pp, cp, tp) place
        leaving = [rank for rank in range(self.world_size) if rank not in kept.values()]
        old_gpus = self._kept_gpu_ids(kept)
        for rank in leaving:
            _kill(self.actors[rank])
        kept_actors = {new: self.actors[old] for new, old in kept.items()}
        self.actors = list(kept_actors.values())  # what stop() kills from here on
        pinned = {new: self.nodes[old] for new, old in kept.items()}
        old_pg, self.world_size = self.pg, new_topology.world_size
        self.plan, self.attempt = plan, plan.attempt
        self._reserving = True  # capacity checks ask again until the new bundles' nodes are known
        if old_pg is not None:
            remove_placement_group(old_pg)
        try:
            self._reserve(pinned)
        except PlacementTimeout as err:
            raise ResizeError(f"the new size could not be placed with the kept ranks on their nodes: {err}") from None
        joining = [rank for rank in range(self.world_size) if rank not in kept_actors]
        joining_gpu_ids = self._read_bundle_gpu_ids(joining)  # started first: it runs beside the check
        self._check_kept_gpus(old_gpus, ResizeError)
        if self._stopped:
            raise ResizeError("the group was stopped during the resize")
        ray.get(
            [actor.renumber.remote(new, self.world_size) for new, actor in kept_actors.items()],
            timeout=RENDEZVOUS_TIMEOUT_S,
        )
        actors = dict(kept_actors)
        actors.update(
            self._start_ranks(
                {rank: self._bundle_nodes.get(rank, "") for rank in joining}, joining_gpu_ids, plan.attempt
            )
        )
        self.actors = [actors[rank] for rank in range(self.world_size)]
        if self._stopped:
            raise ResizeError("the group was stopped during the resize")
        self._rendezvous()
        joined = f"{len(joining)} joined ({self.warm_ranks} from warm spares)" if joining else "none joined"
        return f"{len(kept)} rank(s) kept, {len(leaving)} released, {joined}"

    def _leave_attempt(
        self, *, lost_rank: int | None, exit_s: float, stuck_after_s: float | None = None
    ) -> tuple[dict[int, RayActorError], list[int]]:
        """Wait for the runs of the attempt being left to return (a survivor's failed collective, or a
        stop at a step boundary) and forget them. Returns the ranks other than ``lost_rank`` whose actors
        died meanwhile (rank -> the error) and the ranks whose runs had not returned: by ``exit_s``, or
        ``stuck_after_s`` after the first survivor's returned. The caller decides."""
        old = dict(self._runs)
        died: dict[int, RayActorError] = {}
        late: list[int] = []
        if old:
            refs = list(old)
            if stuck_after_s is None:
                done, pending = ray.wait(refs, num_returns=len(refs), timeout=exit_s)
            else:
                # The grace starts when a survivor's run returns, not the lost rank's own (it fails at once,
                # and its outcome is known: nothing to wait for).
                survivors = [ref for ref in refs if old[ref] != lost_rank]
                returned = [at for rank, at in self._returned.items() if rank != lost_rank]
                done, pending = [], survivors
                if survivors and returned:
                    # A survivor already left (poll collected its run): the grace started then. Waiting for
                    # a "first" survivor among the rest, all of them perhaps stuck, took the whole exit
                    # timeout (15 s where the grace is 5 s: measured on an HSDP repair).
                    remaining_s = max(0.0, min(returned) + stuck_after_s - time.monotonic())
                    done, pending = ray.wait(survivors, num_returns=len(survivors), timeout=remaining_s)
                elif survivors:
                    done, pending = ray.wait(survivors, num_returns=1, timeout=exit_s)
                    if done and pending:
                        more, pending = ray.wait(pending, num_returns=len(pending), timeout=stuck_after_s)
                        done += more
            late = sorted(old[ref] for ref in pending)
            for ref in done:
                rank = old[ref]
                try:
                    ray.get(ref, timeout=10)
                except RayActorError as err:
                    if rank != lost_rank:
                        died[rank] = err
                except Exception:  # the expected collective failure of a survivor
                    pass
        self._runs.clear()
        self._results.clear()
        self._returned.clear()
        self._suspect, self._lost = None, None
        return died, late

    # --- watch ----------------------------------------------------------------------------------

    def poll(self, now: float, *, restarts_left: bool = True) -> GroupOutcome | None:
        """Collect finished ``run`` calls; classify the first failure. Never blocks.

        ``restarts_left``: whether the job could survive a process fault. While it can, a lost rank
        is reported at once (the caller corrects a node loss later); when it cannot, the verdict
        waits for the node's health (a node loss would be free, a process fault would fail the job).
        """
        if self._lost is not None:
            since, outcome = self._lost
            dead = self._dead_rank()
            if dead is not None:
                self._lost = None
                return dataclasses.replace(outcome, rank=dead[0], node=dead[1], cause="node")
            if now - since >= NODE_DEATH_GRACE_S:
                self._lost = None
                return outcome
            return None
        pending = list(self._runs)
        if not pending or self._stopped:
            return None
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        for ref in done:
            # stop() runs on its own thread (runtime._stop) while the control loop may still poll this
            # group: it clears ``_runs`` and kills the ranks, and those deaths are its doing, not failures.
            rank = self._runs.pop(ref, None)
            if rank is None or self._stopped:
                return None
            self._returned.setdefault(rank, time.monotonic())
            outcome = self._classify(ref, rank)
            if self._stopped:
                return None
            if outcome is None:
                continue
            if outcome.kind == "worker_lost":
                return self._lost_rank(outcome, now, restarts_left)
            if outcome.kind == "job_error" and outcome.message.startswith("collective failure"):
                # Maybe the victim of a dead peer: find out who is gone (ping every rank).
                if self._suspect is None:
                    self._suspect = (now, outcome, {actor.ping.remote(): r for r, actor in enumerate(self.actors)})
                continue
            return outcome
        if self._suspect is not None:
            return self._explain_collective_failure(now, restarts_left)
        if not self._runs and len(self._results) == self.world_size:
            final_step = min(result["final_step"] for result in self._results.values())
            self._finished = True
            return GroupOutcome(kind="finished", final_step=final_step)
        return None

    def _lost_rank(self, outcome: GroupOutcome, now: float, restarts_left: bool) -> GroupOutcome | None:
        self._suspect = None
        if outcome.cause == "node" or restarts_left:
            return outcome
        self._lost = (now, outcome)  # the last allowed fault: poll() decides after the node's verdict
        return None

    def _explain_collective_failure(self, now: float, restarts_left: bool) -> GroupOutcome | None:
        """Which rank made the others' collectives fail: a dead node, a dead actor, a silent rank, or none."""
        since, suspect, probe = self._suspect
        if (dead := self._dead_rank()) is not None:
            self._suspect = None  # the peers failed because a node went away
            return GroupOutcome(
                kind="worker_lost",
                rank=dead[0],
                node=dead[1],
                cause="node",
                message=f"node {dead[1]} of rank {dead[0]} died",
            )
        answered, _ = ray.wait(list(probe), num_returns=len(probe), timeout=0)
        for ref in answered:
            rank = probe.pop(ref)
            try:
                ray.get(ref, timeout=1)
            except RayActorError as err:
                node = self.nodes.get(rank, "")
                return self._lost_rank(
                    GroupOutcome(
                        kind="worker_lost",
                        rank=rank,
                        node=node,
                        cause=_death_cause(err, node),
                        message=_first_line(err),
                    ),
                    now,
                    restarts_left,
                )
            except Exception:  # the ping itself failed some other way: no verdict from this rank
                pass
        grace = PROBE_TIMEOUT_S if restarts_left else PEER_FAILURE_GRACE_S
        if probe and now - since < grace:
            return None  # some rank has not answered yet
        self._suspect = None
        if probe:  # silent ranks: gone or wedged, and the collective failed on them
            rank = min(probe.values())
            return GroupOutcome(
                kind="worker_lost",
                rank=rank,
                node=self.nodes.get(rank, ""),
                cause="process",
                message=f"rank {rank} did not answer within {grace:g}s after rank {suspect.rank}'s {suspect.message}",
            )
        # Every rank answered: no peer died, the collective failed on its own (network, timeout).
        # Infrastructure, not the job.
        return GroupOutcome(
            kind="worker_lost", rank=suspect.rank, node=suspect.node, cause="process", message=suspect.message
        )

    def _dead_rank(self) -> tuple[int, str] | None:
        """(rank, node) of the first rank whose node the cluster has declared dead, if any."""
        dead = self._on_dead_nodes(self.nodes)
        return min(dead.items()) if dead else None

    def _classify(self, ref, rank: int) -> GroupOutcome | None:
        node = self.nodes.get(rank, "")
        try:
            self._results[rank] = ray.get(ref, timeout=10)
            return None
        except RayActorError as err:
            return GroupOutcome(
                kind="worker_lost", rank=rank, node=node, cause=_death_cause(err, node), message=_first_line(err)
            )
        except RayTaskError as err:
            inner = err.cause
            if isinstance(inner, UnhealthyRankError):  # every rank raises it, naming the same failing rank
                bad = inner.rank
                return GroupOutcome(
                    kind="unhealthy", rank=bad, node=self.nodes.get(bad, ""), message=inner.message, traceback=str(err)
                )
            if isinstance(inner, EtrainError):
                return GroupOutcome(
                    kind="job_error",
                    rank=rank,
                    node=node,
                    message=str(inner),
                    traceback=str(err),
                    unreadable_checkpoint=isinstance(inner, CheckpointError),
                )
            if _is_collective_failure(inner):
                return GroupOutcome(
                    kind="job_error",
                    rank=rank,
                    node=node,
                    message=f"collective failure on rank {rank}: {_first_line(inner)}",
                    traceback=str(err),
                )
            return GroupOutcome(
                kind="job_error",
                rank=rank,
                node=node,
                message=f"{type(inner).__name__} on rank {rank}: {inner}",
                traceback=str(err),
            )

    # --- control calls --------------------------------------------------------------------------

    def call(self, rank: int, method: str, *args) -> None:
        """Fire-and-forget control call on one rank (chaos, checkpoint request)."""
        if 0 <= rank < len(self.actors):
            getattr(self.actors[rank], method).remote(*args)

    def chaos(self, order: ChaosOrder) -> None:
        self.call(order.rank, "chaos", order)

    def where(self, *, timeout_s: float) -> dict[int, RankWhere | None]:
        """Every rank's answer to ``where`` (its training thread's step and frames), None for a rank that
        did not answer within ``timeout_s`` (all asked at once)."""
        asked = {actor.where.remote(): rank for rank, actor in enumerate(self.actors)}
        done, _ = ray.wait(list(asked), num_returns=len(asked), timeout=timeout_s)
        reports: dict[int, RankWhere | None] = dict.fromkeys(asked.values())
        for ref in done:
            try:
                answer = ray.get(ref, timeout=1)
            except Exception:  # noqa: BLE001 - a dead or failing rank is a silent one here
                continue
            frames = tuple(Frame(str(file), int(line), str(name)) for file, line, name in answer.get("frames", []))
            reports[asked[ref]] = RankWhere(step=answer.get("step"), frames=frames)
        return reports

    def kill_actor(self, rank: int) -> None:
        if 0 <= rank < len(self.actors):
            ray.kill(self.actors[rank], no_restart=True)

    def results(self) -> dict[int, dict]:
        """What each rank's ``run`` returned (complete once the outcome is ``finished``)."""
        return dict(self._results)

    def node_of(self, rank: int) -> str:
        return self.nodes.get(rank, "")

    def bundles_per_node(self) -> dict[str, int] | None:
        """Bundles (one per rank) this group's placement group holds per node, counted from the moment Ray
        reserved them; None while the reservation is under way (its nodes are not known yet: ask again);
        nothing before it, and nothing once stopped (the placement group is released).

        Bundles, not the ranks that rendezvoused: a node's free resources exclude the bundles as soon as
        they are reserved, while the ranks are still being created (seconds for a cold rank on a GPU), and
        a capacity check in that window must count them as the job's own, or a job that holds a whole
        resource sees capacity 0 and reports a spurious ``capacity_low`` once it is up.
        """
        if self._stopped:
            return {}
        if self._reserving:
            return None
        counts: dict[str, int] = {}
        for node in self._bundle_nodes.values():
            counts[node] = counts.get(node, 0) + 1
        return counts

    def _reserved_nodes(self) -> dict[int, str]:
        """Bundle index -> node id of the placement group's bundles (read once Ray reserved it)."""
        placed = placement_group_table(self.pg).get("bundles_to_node_id", {}) or {}
        return {int(index): node for index, node in placed.items() if node}

    # --- teardown -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every rank and release the placement group: a finished group's ranks from the warm pool go
        back to it for the tenant's next jobs (:meth:`_give_back`), every other rank is killed. Idempotent;
        never raises.

        A finished group releases its placement group first: its ranks are idle and hold none of it (they
        run beside their bundles), and the job is already SUCCEEDED in the control plane's store, which
        admits the next job into what this one held; that job pins its tp groups by Ray's free resources
        (``_whole_tp_groups``), which must not still count this group's bundles while its ranks leave.
        """
        self._stopped = True
        given_back: set[str] = set()
        if self._finished and not self._given_back:
            self._given_back = True
            self._remove_placement_group()
            given_back = self._give_back()
        killed = [rank for rank, actor in enumerate(self.actors) if _actor_key(actor) not in given_back]
        for rank in killed:
            _kill(self.actors[rank])
        self._remove_placement_group()
        self._runs.clear()
        self._returned.clear()
        if self._resources.get("GPU"):
            by_node: dict[str, list[int]] = {}
            for rank in killed:
                if rank in self._pids and self.nodes.get(rank):
                    by_node.setdefault(self.nodes[rank], []).append(self._pids[rank])
            _await_exits(by_node, EXIT_TIMEOUT_S)

    def _remove_placement_group(self) -> None:
        if self.pg is not None and not self._pg_removed:
            self._pg_removed = True
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass

    def _give_back(self) -> set[str]:
        """Release this finished group's ranks that came from the pool (each says whether it can serve
        another job: ``SpareRank.release``) and hand the reusable ones back to the pool for this tenant;
        returns the keys of those the pool took. Bounded waits; never raises."""
        ranks = [(rank, actor) for rank, actor in enumerate(self.actors) if _actor_key(actor) in self._from_pool]
        # Ranks on GPUs are never reused (their CUDA context keeps its GPUs); any layout's ranks are.
        if not ranks or not self._gives_back:
            return set()
        try:
            asked = {actor.release.remote(): (rank, actor) for rank, actor in ranks}
            done, _ = ray.wait(list(asked), num_returns=len(asked), timeout=RELEASE_TIMEOUT_S)
            back = []
            for ref in done:
                rank, actor = asked[ref]
                answer = ray.get(ref, timeout=1)
                if answer.get("reusable"):
                    back.append({"actor": actor, "node": self.nodes.get(rank, ""), "pid": int(answer["pid"])})
                else:
                    log.info("job %s: rank %d's process is not reused: %s", self.job_id, rank, answer.get("why"))
            if back and give_back_spares(back, self._tenant):
                return {_actor_key(rank["actor"]) for rank in back}
        except Exception as err:  # noqa: BLE001 - the ranks are killed instead, as before
            log.warning("job %s: ranks not given back to the pool: %s", self.job_id, err)
        return set()


class RepairError(RuntimeError):
    """The in-place repair could not be carried out; the message says why (a RepairFailed event)."""


class ResizeError(RuntimeError):
    """The in-place resize could not be carried out; the message says why (a ResizeFailed event)."""


def _actor_key(actor: Any) -> str:
    """An actor's id, the same in every handle to it (handles themselves are not comparable)."""
    return actor._actor_id.hex()


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already dead
        pass


def _await_exits(pids_by_node: dict[str, list[int]], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` until the killed ranks' processes (``{node id: pids}``) have ended, each node
    asked by a task of its own (EXIT_TIMEOUT_S says why). Never raises: a node that died took its processes
    with it, and one still alive after the timeout is logged."""
    if not pids_by_node:
        return
    asked = {
        _processes_left.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(
            pids, timeout_s
        ): node
        for node, pids in pids_by_node.items()
    }
    done, _ = ray.wait(list(asked), num_returns=len(asked), timeout=timeout_s + 10.0)
    for ref in done:
        try:
            left = ray.get(ref, timeout=1)
        except Exception:  # noqa: BLE001 - its node is gone, and the processes with it
            continue
        if left:
            log.warning(
                "stopped rank processes %s on node %s still run %.0fs after the kill", left, asked[ref], timeout_s
            )


@ray.remote(num_cpus=0, max_retries=0)
def _processes_left(pids: list[int], timeout_s: float) -> list[int]:
    """The processes of ``pids`` (on this node) still running after up to ``timeout_s``; a zombie has ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid in pids if process_runs(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def process_runs(pid: int) -> bool:
    """Whether process ``pid`` of this node still runs: it exists and is not a zombie (which has given back its
    memory, its devices' included, and only waits for its parent to read its status)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: ask the kernel (a zombie then counts as running)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class PlacementTimeout(RuntimeError):
    """The cluster could not hold the group's bundles in time."""


@functools.cache
def _rank_actor_class() -> Any:
    """The rank actor class (``RANK_ACTOR_CLASS``) made a Ray actor class, once per process: named by
    the protocol and loaded here, where ranks are created, so no service module imports the worker
    module (it imports torch only inside the actor)."""
    return ray.remote(load_actor_class(RANK_ACTOR_CLASS))


def _live_nodes() -> set[str]:
    """The ids of the nodes the cluster holds alive now."""
    return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}


def _node_alive(node_id: str) -> bool:
    return node_id in _live_nodes()


@ray.remote(num_cpus=0)
def _gpu_ids_in_bundle() -> list[str]:
    """Run in a bundle with ``num_gpus`` (``.options``): the GPU ids Ray reserved for it, which the bundle keeps."""
    return [str(gpu) for gpu in ray.get_gpu_ids()]


def _death_cause(error: RayActorError, node: str) -> Literal["process", "actor", "node"]:
    """Why a rank actor died, from Ray's own death context (its message) or else the node table.

    The GCS writes "The actor died because its node has died" once it has declared the node dead,
    and marks actors on preempted (drained) nodes; ``ray.kill`` says so in the message.
    """
    text = str(error)
    if getattr(error, "preempted", False) or "its node has died" in text or (node and not _node_alive(node)):
        return "node"
    return "actor" if "ray.kill" in text else "process"


def _is_collective_failure(error: BaseException | None) -> bool:
    """Errors a rank sees when a *peer* fails: gloo/nccl connection resets, store or PG timeouts."""
    # By name, not isinstance: the service does not import torch (DistError, DistBackendError, ...).
    names = {cls.__name__ for cls in type(error).__mro__} if error is not None else set()
    if names & {
        "DistError",
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "TimeoutError",
        "ConnectionError",
    }:
        return True
    text = str(error).lower()
    return any(
        marker in text
        for marker in ("gloo", "nccl", "connection reset", "connection closed", "timed out", "broken pipe")
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
