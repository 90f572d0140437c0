"""Gang admission (pure): which queued jobs start now, at which dp, and why the others wait.

The control plane keeps a job ``QUEUED`` (in SQLite, no supervisor) until this module says its whole
*minimum* layout can be placed at once; only then is its supervisor started, so a job never holds
half a cluster while it waits for the other half (no partial start, no placement-group timeout).

The rules, each a test in tests/unit/test_admission.py:

* **Order.** Higher ``priority`` first, then FIFO (older ``created_at``), then the id (a total order,
  so a restarted control plane admits the same jobs in the same order from the same rows).
* **Gang.** A job needs ``dp * tp * pp`` identical ranks (one Ray bundle each) for some legal ``dp``
  of its own (``Gang.dp_sizes``; the first is the elastic minimum). Every tensor-parallel group of
  ``tp`` ranks must sit on one node (as :mod:`etrain.service.decisions.capacity` counts for the supervisor's resizes:
  its all-reduces run every layer), so a node contributes ``rank_slots // tp`` groups and a job fits
  when the nodes' groups add up to ``dp * pp`` of them. For identical bundles this per-node count is
  exactly what Ray's ``PACK``/``SPREAD`` placement needs, never only the cluster's totals. The job
  starts at the largest of its legal dps (up to the planned one) that fits now; the supervisor's
  elastic policy grows it later when capacity frees up.
* **Head-of-line blocking with safe backfill.** A job that cannot start *closes* every node that
  could ever hold one of its tp groups (judged on the node's total resources) to every job after it
  in the order. A later job may still start on the nodes left open (say, a CPU job on CPU-only nodes
  while a GPU job waits for GPUs): there it cannot delay the blocked job, which could never use those
  nodes. It may not start on a closed node, even when it would fit there now, because it would then
  hold resources the higher-priority job is waiting for, for as long as it runs (job durations are
  unknown, so no "it will be done in time" backfill). Lower priority never starves a higher one.
* **Claims.** A job already started whose placement group Ray does not yet hold (its supervisor is
  being created, or it is between two attempts) keeps a claim on its ranks: claims are placed on the
  free resources before any queued job, so one pass never admits two jobs into the same hole.
* **Never fits.** :func:`refusal` compares a job's minimum layout with the cluster's *total*
  resources (per node): a rank no node can hold, a tp group no node can hold, or more replicas than
  the nodes can ever hold is refused at submit with both numbers.

Nothing here talks to Ray: the adapter builds a :class:`ClusterView`, the manager builds the
:class:`Gang` of each job, and :func:`decide` answers with :class:`Admit` / :class:`Wait` values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from etrain.service.decisions.capacity import rank_slots
from etrain.service.planning.plan_memory import GiB

__all__ = [
    "Admit",
    "Claim",
    "ClusterView",
    "Gang",
    "MEMORY",
    "NodeView",
    "Plan",
    "QueuedJob",
    "Refusal",
    "SPEC_FIELDS",
    "Wait",
    "decide",
    "describe",
    "free_summary",
    "queue_order",
    "refusal",
    "tp_group_nodes",
    "tp_groups_across_nodes",
]

#: Ray's logical host-memory resource (bytes): a rank's bundle asks for ``resources.host_memory_gb`` of it
#: (service/planning/plan_host.py).
MEMORY = "memory"
#: The spec field behind each resource a rank asks for.
SPEC_FIELDS = {
    "CPU": "resources.cpus_per_worker",
    "GPU": "resources.gpus_per_worker",
    MEMORY: "resources.host_memory_gb",
}

#: Set this on an autoscaling cluster to queue jobs larger than the cluster is now (named in fixes).
BEYOND_CLUSTER_SETTING = "ETRAIN_ADMIT_BEYOND_CLUSTER=1"
_EPS = 1e-9


# --- inputs ------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class NodeView:
    """One Ray node: whether it is alive, and its total and free resources (``CPU``, ``GPU``, ...)."""

    id: str
    alive: bool
    total: Mapping[str, float]
    free: Mapping[str, float]


@dataclass(frozen=True, kw_only=True)
class ClusterView:
    """The cluster now: its nodes, and what each job's placement group holds (job -> node -> resources)."""

    nodes: tuple[NodeView, ...]
    holdings: Mapping[str, Mapping[str, Mapping[str, float]]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Gang:
    """What a job must get at once: ``dp * pp * cp`` tensor-parallel groups of ``tp`` ranks of ``per_rank``.

    ``dp_sizes``: the legal dps it may start at, ascending (the elastic policy's, capped at the planned
    dp); ``dp_sizes[0]`` is the minimum layout. ``dp_field`` names the spec field that sets that
    minimum (``resources.min_dp`` when given, else ``parallelism.dp``), for refusals.
    """

    per_rank: Mapping[str, float]
    dp_sizes: tuple[int, ...]
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: each replica is pp * cp tensor-parallel groups
    strategy: str = "PACK"
    dp_field: str = "parallelism.dp"

    def __post_init__(self) -> None:
        if not self.dp_sizes or any(dp < 1 for dp in self.dp_sizes) or list(self.dp_sizes) != sorted(self.dp_sizes):
            raise ValueError(f"dp_sizes={self.dp_sizes} must be positive and ascending, at least one")
        if self.tp < 1 or self.pp < 1 or self.cp < 1:
            raise ValueError(f"tp={self.tp}, pp={self.pp} and cp={self.cp} must be >= 1")
        if not any(amount > 0 for amount in self.per_rank.values()):
            raise ValueError(f"per_rank={dict(self.per_rank)} asks for nothing")

    @property
    def min_dp(self) -> int:
        return self.dp_sizes[0]

    def ranks(self, dp: int) -> int:
        return dp * self.tp * self.pp * self.cp

    @property
    def min_ranks(self) -> int:
        return self.ranks(self.min_dp)


@dataclass(frozen=True, kw_only=True)
class QueuedJob:
    id: str
    priority: int
    created_at: float
    gang: Gang


@dataclass(frozen=True, kw_only=True)
class Claim:
    """A started job whose ranks Ray does not hold yet (see the module's "Claims")."""

    id: str
    per_rank: Mapping[str, float]
    ranks: int
    tp: int = 1


# --- outputs -----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Admit:
    """Start ``job_id`` now at ``dp`` (``ranks`` ranks); ``placement``: node -> ranks it was counted on."""

    job_id: str
    dp: int
    ranks: int
    placement: Mapping[str, int]


@dataclass(frozen=True, kw_only=True)
class Wait:
    """``job_id`` stays queued at ``position`` (1-based, in queue order); ``reason`` says for what.

    ``behind``: the higher-ordered job holding it back by head-of-line blocking, when that is why
    (it would fit the free resources otherwise); ``beyond_cluster``: its minimum layout exceeds the
    cluster's total resources (only queued when the operator allows it). ``reason`` names ``behind``;
    ``anonymous_reason`` is the same without naming it, for a reader who may not see that job
    (:meth:`reason_for`: another tenant's job is "1 job of another tenant").
    """

    job_id: str
    position: int
    reason: str
    behind: str | None = None
    beyond_cluster: bool = False
    anonymous_reason: str | None = None

    def reason_for(self, *, sees_behind: bool) -> str:
        """The reason as a reader sees it: ``behind`` named only if ``sees_behind``."""
        return self.reason if sees_behind or self.anonymous_reason is None else self.anonymous_reason


@dataclass(frozen=True, kw_only=True)
class Plan:
    admit: tuple[Admit, ...]
    wait: tuple[Wait, ...]

    def waiting(self, job_id: str) -> Wait | None:
        return next((w for w in self.wait if w.job_id == job_id), None)


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """Why a job can never run on this cluster: the spec field, the numbers (need vs cluster), the fix."""

    field: str
    message: str
    fix: str


# --- the decision ------------------------------------------------------------------------------------


def queue_order(jobs: Iterable[QueuedJob]) -> list[QueuedJob]:
    """Priority (higher first), then FIFO, then id: a total order, stable across restarts."""
    return sorted(jobs, key=lambda job: (-job.priority, job.created_at, job.id))


def decide(queued: Iterable[QueuedJob], nodes: Sequence[NodeView], claims: Iterable[Claim] = ()) -> Plan:
    """Which ``queued`` jobs start now and where they were counted; why each other one waits.

    ``nodes``' free resources are what Ray reports (placement groups already held are subtracted);
    ``claims`` are placed on them first. Jobs admitted in this pass are subtracted as they are
    admitted, so the answer never puts two jobs in one hole.
    """
    state = _Pass(nodes)
    for claim in claims:
        placed = _place(state.free, claim.per_rank, claim.tp, claim.ranks // claim.tp, "PACK", set(state.free))
        if placed is not None:  # a claim that does not fit waits in Ray's own queue, not ours
            _take(state.free, placed, claim.per_rank, claim.tp)
    admit: list[Admit] = []
    wait: list[Wait] = []
    for position, job in enumerate(queue_order(queued), start=1):
        gang, shape = job.gang, _shape(job.gang)
        dp = state.remember(("fit", shape), lambda: _largest_fit(state.free, state.open, gang))
        if dp is not None:
            placed = _place(state.free, gang.per_rank, gang.tp, dp * gang.pp * gang.cp, gang.strategy, state.open)
            assert placed is not None  # _largest_fit counted the same groups
            _take(state.free, placed, gang.per_rank, gang.tp)
            state.changed()
            admit.append(
                Admit(
                    job_id=job.id,
                    dp=dp,
                    ranks=gang.ranks(dp),
                    placement={node: groups * gang.tp for node, groups in sorted(placed.items())},
                )
            )
            continue
        reason, anonymous, behind, beyond = state.remember(("why", shape), lambda: _why(gang, state))
        where = f"; position {position} in the queue"
        wait.append(
            Wait(
                job_id=job.id,
                position=position,
                behind=behind,
                beyond_cluster=beyond,
                reason=reason + where,
                anonymous_reason=anonymous + where if anonymous else None,
            )
        )
        state.close(job, state.remember(("usable", shape), lambda: _usable(gang, state.totals), static=True))
    return Plan(admit=tuple(admit), wait=tuple(wait))


class _Pass:
    """One :func:`decide` call's working state. A long queue has few distinct job shapes, and what a
    shape fits only changes when a job is admitted or nodes are closed, so answers are remembered
    per shape until then: thousands of queued jobs cost one computation per shape, not per job."""

    def __init__(self, nodes: Sequence[NodeView]):
        self.nodes = list(nodes)
        self.free = {node.id: dict(node.free) for node in nodes if node.alive}
        self.totals = {node.id: node.total for node in nodes if node.alive}
        self.open = set(self.free)  # nodes no blocked job has closed
        self.closed: dict[str, QueuedJob] = {}  # node -> the first blocked job that can use it
        self._version = 0
        self._memo: dict[tuple, object] = {}

    def remember(self, key: tuple, compute, *, static: bool = False):
        key = (key, None if static else self._version)
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def changed(self) -> None:
        self._version += 1

    def close(self, job: QueuedJob, usable: frozenset[str]) -> None:
        """Head-of-line: ``job``'s nodes are closed to the jobs after it."""
        newly = usable - self.closed.keys()
        for node in newly:
            self.closed[node] = job
        if newly:
            self.open -= newly
            self.changed()


def _shape(gang: Gang) -> tuple:
    return (
        tuple(sorted(gang.per_rank.items())),
        gang.tp,
        gang.pp,
        gang.cp,
        gang.dp_sizes,
        gang.strategy,
        gang.dp_field,
    )


def _usable(gang: Gang, totals: Mapping[str, Mapping[str, float]]) -> frozenset[str]:
    """Nodes that could ever hold one of ``gang``'s tp groups (judged on their total resources)."""
    return frozenset(
        node for node, total in totals.items() if rank_slots(free=total, per_rank=gang.per_rank) >= gang.tp
    )


def refusal(gang: Gang, nodes: Sequence[NodeView]) -> Refusal | None:
    """Why ``gang``'s minimum layout can never be placed on these nodes' *total* resources, or None.

    None too when no node is alive (nothing to judge by: the job queues until one is).
    """
    alive = [node for node in nodes if node.alive]
    if not alive:
        return None
    beyond = f"or, on an autoscaling cluster, set {BEYOND_CLUSTER_SETTING} on the server to queue it anyway"
    slots = {node.id: rank_slots(free=node.total, per_rank=gang.per_rank) for node in alive}
    best = max(slots.values())
    if best == 0:
        short = [
            (name, amount)
            for name, amount in sorted(gang.per_rank.items())
            if amount > 0 and max(node.total.get(name, 0.0) for node in alive) + _EPS < amount
        ]
        if not short:  # each resource exists somewhere, never all of them on one node
            return Refusal(
                field="resources",
                message=f"one rank needs {describe(gang.per_rank)} on one node, but none of the {len(alive)} "
                f"node(s) has all of it (for example: {describe(alive[0].total)}).",
                fix="lower what one rank asks for (resources.cpus_per_worker / gpus_per_worker; its host memory: "
                f"POST /v1/plan's host_memory says what holds it), or add such nodes ({beyond})",
            )
        name, amount = short[0]
        most = max(node.total.get(name, 0.0) for node in alive)
        spec_field = SPEC_FIELDS.get(name, "resources")
        lower = f"lower {spec_field} to at most {most:g}"
        if name == MEMORY:  # the planner's figure: what the rank holds, which lowering the field would not change
            lower = (
                "hold less state per rank in host memory (parallelism.zero: 3 or a larger parallelism.dp shard it; "
                "checkpoint.async: false drops the staging copy, fault_tolerance.in_place: false the snapshots; "
                "POST /v1/plan shows the parts as host_memory)"
            )
        return Refusal(
            field=spec_field,
            message=f"one rank needs {describe(gang.per_rank)}, but no node has {_amount(amount, name)}: "
            f"the most any of the {len(alive)} node(s) has is {_amount(most, name)}.",
            fix=f"{lower}, or add nodes with {_amount(amount, name)} ({beyond})",
        )
    if best < gang.tp:
        group = {name: amount * gang.tp for name, amount in gang.per_rank.items()}
        return Refusal(
            field="parallelism.tp",
            message=f"a tensor-parallel group of tp={gang.tp} ranks ({describe(group)}) must sit on one node, "
            f"but the largest node holds {best} rank(s) of {describe(gang.per_rank)}.",
            fix=f"lower parallelism.tp to at most {best}, or use nodes that hold {gang.tp} ranks ({beyond})",
        )
    groups = sum(count // gang.tp for count in slots.values())
    replicas = groups // (gang.pp * gang.cp)
    if replicas < gang.min_dp:
        need = {name: amount * gang.min_ranks for name, amount in gang.per_rank.items()}
        total = _sum(node.total for node in alive)
        have = {name: total.get(name, 0.0) for name in gang.per_rank}
        lower = (
            f"lower {gang.dp_field} to at most {replicas}"
            if replicas >= 1
            else "lower parallelism.tp * parallelism.pp * parallelism.cp or the resources per worker"
        )
        return Refusal(
            field=gang.dp_field,
            message=f"the minimum layout needs {gang.min_ranks} ranks (dp={gang.min_dp} x tp={gang.tp} x "
            f"pp={gang.pp}{f' x cp={gang.cp}' if gang.cp > 1 else ''}) of {describe(gang.per_rank)} = "
            f"{describe(need)}, but the cluster has {describe(have)} on {len(alive)} node(s), room for at most "
            f"{replicas} replica(s) of {gang.tp * gang.pp * gang.cp} rank(s) (tp groups node-local).",
            fix=f"{lower}, or add nodes ({beyond})",
        )
    return None


def describe(resources: Mapping[str, float], *, zeros: bool = False) -> str:
    """``{"CPU": 2, "GPU": 0.5}`` -> ``"2 CPUs + 0.5 GPU"`` (zero entries left out unless ``zeros``: what is free
    of each resource a job asks for; nothing -> ``"0 CPUs"``)."""
    parts = [_amount(amount, name) for name, amount in sorted(resources.items()) if zeros or amount > _EPS]
    return " + ".join(parts) if parts else "0 CPUs"


# --- helpers -----------------------------------------------------------------------------------------


def _amount(amount: float, name: str) -> str:
    if name == MEMORY:
        return f"{amount / GiB:.2f} GiB of host memory"
    shown = round(amount, 3)
    return f"{shown:g} {name}{'s' if name in ('CPU', 'GPU') and not 0 < shown <= 1 else ''}"


def _sum(resources: Iterable[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for entry in resources:
        for name, amount in entry.items():
            out[name] = out.get(name, 0.0) + amount
    return out


def _groups(free: Mapping[str, float], per_rank: Mapping[str, float], tp: int) -> int:
    return rank_slots(free=free, per_rank=per_rank) // tp


def _largest_fit(free: Mapping[str, Mapping[str, float]], nodes: set[str], gang: Gang) -> int | None:
    groups = sum(_groups(free[node], gang.per_rank, gang.tp) for node in nodes)
    fitting = [dp for dp in gang.dp_sizes if dp * gang.pp <= groups]
    return fitting[-1] if fitting else None


def _place(
    free: Mapping[str, Mapping[str, float]],
    per_rank: Mapping[str, float],
    tp: int,
    groups: int,
    strategy: str,
    nodes: set[str],
) -> dict[str, int] | None:
    """node -> tp groups for ``groups`` groups on ``nodes``, or None when they do not fit.

    PACK fills the roomiest node first (fewest nodes used); SPREAD deals one group per node in turn.
    Either way the feasibility answer is the same (identical bundles); only which node is counted as
    taken differs, which matters only to the jobs after it in the same pass.
    """
    room = {node: _groups(free[node], per_rank, tp) for node in sorted(nodes)}
    if sum(room.values()) < groups:
        return None
    order = sorted((node for node in room if room[node] > 0), key=lambda node: (-room[node], node))
    placed: dict[str, int] = {}
    remaining = groups
    if strategy.upper().endswith("SPREAD"):
        while remaining:
            for node in order:
                if remaining and placed.get(node, 0) < room[node]:
                    placed[node] = placed.get(node, 0) + 1
                    remaining -= 1
    else:
        for node in order:
            take = min(room[node], remaining)
            if take:
                placed[node] = take
                remaining -= take
    return placed


def tp_group_nodes(
    free: Mapping[str, Mapping[str, float]],
    per_rank: Mapping[str, float],
    *,
    tp: int,
    groups: int,
    strategy: str = "PACK",
    excluded: Iterable[str] = (),
    held: Mapping[str, int] | None = None,
) -> list[str] | None:
    """The node for each of ``groups`` tensor-parallel groups, in group order, every group whole on its node
    (``_place``: the placement admission counted on); None where ``free`` holds no such placement.
    ``held``: node -> ranks that take their share of ``free`` first (a resize's kept ranks, pinned there).

    Why: Ray's ``PACK`` places a placement group bundle by bundle, so where a node has room for an odd number
    of ranks a tp group straddles two nodes and each of its per-layer all-reduces crosses the network.
    Pinning each bundle to its group's node (``WorkerGroup._reserve``) keeps every group on one.
    """
    if tp < 1 or groups < 1:
        raise ValueError(f"tp={tp} and groups={groups} must be >= 1")
    room = {node: dict(have) for node, have in free.items()}
    _take(room, {node: count for node, count in (held or {}).items() if node in room}, per_rank, 1)
    placed = _place(room, per_rank, tp, groups, strategy, set(room) - set(excluded))
    if placed is None:
        return None
    return [node for node, count in placed.items() for _ in range(count)]


def tp_groups_across_nodes(nodes: Mapping[int, str], *, tp: int, ranks: int) -> list[tuple[int, int]]:
    """The (first, last) ranks of every tp group whose ranks are on more than one node (``nodes``: rank ->
    node; a rank missing from it counts as on a node of its own): what a job's ``placed`` event names."""
    if tp <= 1:
        return []
    return [
        (first, first + tp - 1)
        for first in range(0, ranks - ranks % tp, tp)
        if len({nodes.get(rank, f"?{rank}") for rank in range(first, first + tp)}) > 1
    ]


def _take(free: dict[str, dict[str, float]], placed: Mapping[str, int], per_rank: Mapping[str, float], tp: int) -> None:
    for node, groups in placed.items():
        for name, amount in per_rank.items():
            free[node][name] = free[node].get(name, 0.0) - amount * groups * tp


def _why(gang: Gang, state: _Pass) -> tuple[str, str | None, str | None, bool]:
    """(reason without the position, the same without naming the job it waits behind, that job, whether
    it is beyond the cluster)."""
    need = {name: amount * gang.min_ranks for name, amount in gang.per_rank.items()}
    wanted = (
        f"{describe(need)} ({gang.min_ranks} rank(s) of {describe(gang.per_rank)}: dp={gang.min_dp} "
        f"tp={gang.tp} pp={gang.pp}{', each tp group on one node' if gang.tp > 1 else ''})"
    )
    too_big = state.remember(("refusal", _shape(gang)), lambda: refusal(gang, state.nodes), static=True)
    if too_big is not None:
        return (
            f"larger than the cluster today, waiting for nodes to be added: {too_big.message.rstrip('.')}",
            None,
            None,
            True,
        )
    if _largest_fit(state.free, set(state.free), gang) is not None:
        usable = [
            node
            for node in sorted(state.closed)
            if rank_slots(free=state.totals[node], per_rank=gang.per_rank) >= gang.tp
        ]
        blocker = min((state.closed[node] for node in usable), key=lambda j: (-j.priority, j.created_at, j.id))
        because = "which waits for the same nodes: starting this job first could delay it"
        return (
            f"fits the free resources but waits behind {blocker.id} (priority {blocker.priority}), {because}",
            f"fits the free resources but waits behind 1 job of another tenant, {because}",
            blocker.id,
            False,
        )
    have = _sum(state.free.values())
    free_now = {name: max(0.0, have.get(name, 0.0)) for name in gang.per_rank}
    return (
        f"waiting for {wanted}; free now: {describe(free_now, zeros=True)} on {len(state.free)} node(s)",
        None,
        None,
        False,
    )


def free_summary(nodes: Sequence[NodeView]) -> dict[str, float]:
    """Free resources summed over the alive nodes (for the API's totals)."""
    return _sum(node.free for node in nodes if node.alive)
