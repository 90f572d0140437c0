"""Rank arithmetic for 3D parallelism: the one home for "which rank is where".

A job's world is ``pp × dp × cp × tp`` ranks laid out in Megatron order: the tensor-parallel (TP)
coordinate varies fastest, then context-parallel (CP), then data-parallel (DP), then pipeline-parallel
(PP)::

    rank = ((pp_idx * dp + dp_idx) * cp + cp_idx) * tp + tp_idx

With ``cp = 1`` (every layout but a context-parallel one) this is ``(pp_idx * dp + dp_idx) * tp +
tp_idx``: adding the axis renumbered no existing layout.

Why this order: TP exchanges activations inside every layer, so its ranks must share a node and
its fast interconnect (NVLink). Keeping a TP group's ranks adjacent means that packing consecutive
ranks onto a node keeps every TP group on one node. DP (gradient all-reduce once per step) is
next, and PP (point-to-point between neighbouring stages) is the axis most tolerant of crossing
nodes, so it varies slowest. Context parallelism (``parallelism.cp``: each rank holds a slice of every
sequence and ring attention passes K/V blocks around the cp group in every attention layer) talks far
more often than DP but less than TP, so it sits between them, where torchtitan and Megatron put it
(``pp, dp, cp, tp``): a cp group is ``cp`` ranks ``tp`` apart, on one node where the node holds them.
For parameters cp is one more data dimension: they are replicated over cp and their gradients averaged
over the ``dp · cp`` ranks of one (pp, tp) coordinate.

Everything here is pure standard-library code (plus the pure ``etrain.workers.protocol.errors`` and
``etrain.workers.protocol.layout_rules``, whose degree rule and world size it uses): the planner,
the supervisor and the placement logic import it without torch or Ray, and ``workers/engine/mesh.py``
builds the torch ``DeviceMesh`` with the same ``(pp, dp[, cp], tp)`` shape so the process groups equal
the groups computed here.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Final

from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.errors import ConfigError

__all__ = ["ALL_AXES", "AXES", "Coords", "Topology", "TopologyError", "parse_topology"]

#: The axes every layout has, slowest-varying first.
AXES: Final[tuple[str, str, str]] = ("pp", "dp", "tp")
#: Every axis, context parallelism's included, slowest-varying first (rank order).
ALL_AXES: Final[tuple[str, str, str, str]] = ("pp", "dp", "cp", "tp")

_SEPARATORS = re.compile(r"[.·]")
_TOKEN = re.compile(r"^(pp|dp|cp|tp)([0-9]+)$")


class TopologyError(ConfigError, ValueError):
    """A parallel layout, rank, coordinate or axis that does not exist.

    A ``ConfigError`` (the project's one family of user errors, picklable across Ray actors) and a
    ``ValueError``, so plain-Python callers can catch it the usual way.
    """


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `dp=True` is a bug, not a degree of 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_axis(axis: str) -> None:
    if axis not in ALL_AXES:
        raise TopologyError(f"axis must be one of {ALL_AXES}, got {axis!r}")


@dataclass(frozen=True, kw_only=True)
class Coords:
    """A rank's position on the (pp, dp, cp, tp) mesh; each index counts from 0 (``cp`` is 0 without
    context parallelism)."""

    pp: int
    dp: int
    tp: int
    cp: int = 0

    def __str__(self) -> str:
        cp = f", cp={self.cp}" if self.cp else ""
        return f"(pp={self.pp}, dp={self.dp}{cp}, tp={self.tp})"


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A ``pp × dp × cp × tp`` layout of ranks in Megatron order (TP fastest, then CP, DP, PP).

    Groups are returned as tuples of global ranks in ascending order, which is also the order of
    ranks inside the matching DeviceMesh process group (group rank i is the i-th element).
    """

    pp: int
    dp: int
    tp: int
    cp: int = 1

    def __post_init__(self) -> None:
        layout_rules.check(layout_rules.degree_problems(pp=self.pp, dp=self.dp, tp=self.tp, cp=self.cp), TopologyError)

    # -- shape ---------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return layout_rules.world_size(pp=self.pp, dp=self.dp, tp=self.tp, cp=self.cp)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The layout's shape in rank order: ``(pp, dp, tp)``, or ``(pp, dp, cp, tp)`` with cp > 1."""
        if self.cp == 1:
            return (self.pp, self.dp, self.tp)
        return (self.pp, self.dp, self.cp, self.tp)

    def degree(self, axis: str) -> int:
        """The number of ranks in one group along ``axis``."""
        _check_axis(axis)
        return getattr(self, axis)

    def _stride(self, axis: str) -> int:
        """Rank distance between neighbours along ``axis`` (the mixed-radix place value)."""
        if axis == "tp":
            return 1
        if axis == "cp":
            return self.tp
        if axis == "dp":
            return self.cp * self.tp
        return self.dp * self.cp * self.tp

    # -- coordinates ---------------------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank!r} is out of range for {self}: valid ranks are 0..{self.world_size - 1}")

    def coords(self, rank: int) -> Coords:
        """The (pp, dp, cp, tp) position of ``rank``."""
        self._check_rank(rank)
        return Coords(
            pp=rank // (self.dp * self.cp * self.tp),
            dp=(rank // (self.cp * self.tp)) % self.dp,
            cp=(rank // self.tp) % self.cp,
            tp=rank % self.tp,
        )

    def rank(
        self,
        coords: Coords | None = None,
        /,
        *,
        pp: int | None = None,
        dp: int | None = None,
        tp: int | None = None,
        cp: int | None = None,
    ) -> int:
        """The global rank at ``coords``, or at the keyword coordinates (pp, dp and tp required; cp
        defaults to 0)."""
        keywords = {"pp": pp, "dp": dp, "tp": tp}
        if coords is None:
            missing = [axis for axis, value in keywords.items() if value is None]
            if missing:
                raise TopologyError(f"rank() needs a Coords or all of pp=, dp=, tp=; missing {', '.join(missing)}")
            coords = Coords(pp=pp, dp=dp, tp=tp, cp=0 if cp is None else cp)  # type: ignore[arg-type]
        elif any(value is not None for value in (*keywords.values(), cp)):
            raise TopologyError("rank() takes a Coords or keyword coordinates, not both")
        elif not isinstance(coords, Coords):
            raise TopologyError(f"rank() needs a Coords, got {coords!r}")
        for axis in ALL_AXES:
            index = getattr(coords, axis)
            degree = getattr(self, axis)
            if not _is_int(index) or not 0 <= index < degree:
                raise TopologyError(
                    f"{axis} coordinate {index!r} is out of range for {self}: valid "
                    f"{axis} coordinates are 0..{degree - 1}"
                )
        return ((coords.pp * self.dp + coords.dp) * self.cp + coords.cp) * self.tp + coords.tp

    # -- groups --------------------------------------------------------------------------------

    def group(self, rank: int, axis: str) -> tuple[int, ...]:
        """The ranks that share every coordinate with ``rank`` except the one along ``axis``."""
        _check_axis(axis)
        index = getattr(self.coords(rank), axis)
        stride = self._stride(axis)
        first = rank - index * stride
        return tuple(range(first, first + self.degree(axis) * stride, stride))

    def tp_group(self, rank: int) -> tuple[int, ...]:
        return self.group(rank, "tp")

    def dp_group(self, rank: int) -> tuple[int, ...]:
        return self.group(rank, "dp")

    def pp_group(self, rank: int) -> tuple[int, ...]:
        return self.group(rank, "pp")

    def cp_group(self, rank: int) -> tuple[int, ...]:
        return self.group(rank, "cp")

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Every group along ``axis``: a partition of the world, ordered by first rank."""
        _check_axis(axis)
        return self._strided_groups(self._stride(axis), self.degree(axis))

    def _strided_groups(self, stride: int, size: int) -> tuple[tuple[int, ...], ...]:
        """The groups of ``size`` ranks ``stride`` apart: a group starts at each of the first ``stride`` ranks
        of every block of ``stride · size`` consecutive ranks."""
        span = stride * size
        return tuple(
            tuple(range(first, first + span, stride))
            for block in range(0, self.world_size, span)
            for first in range(block, block + stride)
        )

    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        return self.groups("tp")

    def dp_groups(self) -> tuple[tuple[int, ...], ...]:
        return self.groups("dp")

    def pp_groups(self) -> tuple[tuple[int, ...], ...]:
        return self.groups("pp")

    def data_groups(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each pipeline stage and tp index that split the data, dp and cp together (the
        parameters' data dimension: DDP replicates over it, FSDP2 shards over it), each in (dp, cp) order:
        index ``dp · cp_degree + cp``. Without context parallelism, the dp groups."""
        return self._strided_groups(self.tp, self.dp * self.cp)  # dp and cp are adjacent, cp the faster

    # -- pipeline stages -----------------------------------------------------------------------

    def is_first_stage(self, rank: int) -> bool:
        """Whether ``rank`` holds the first pipeline stage (it reads the input batch)."""
        return self.coords(rank).pp == 0

    def is_last_stage(self, rank: int) -> bool:
        """Whether ``rank`` holds the last pipeline stage (it computes the loss)."""
        return self.coords(rank).pp == self.pp - 1

    # -- elasticity and placement --------------------------------------------------------------

    def with_dp(self, new_dp: int) -> Topology:
        """This layout with ``new_dp`` data-parallel replicas.

        Elastic resizes change DP only: TP and PP shard the model itself, so changing them would
        reshard every parameter, while a DP replica can be added or dropped whole.
        """
        return dataclasses.replace(self, dp=new_dp)

    def kept_on_resize(self, new_dp: int) -> dict[int, int]:
        """Which ranks an in-place resize to ``new_dp`` keeps: new rank -> old rank.

        A rank stays when its data-parallel index is below both sizes, at the same (pp, cp, tp) place, so
        it keeps the very shard of the model its process holds (pipeline stage, context chunk, tensor
        slice) and is only renumbered; the other old ranks leave and the other new ranks join. Why not
        keep more: a rank whose (pp, cp, tp) place changed would hold the wrong slice of the model.
        """
        resized = self.with_dp(new_dp)
        kept: dict[int, int] = {}
        for old_rank in range(self.world_size):
            place = self.coords(old_rank)
            if place.dp < new_dp:
                kept[resized.rank(place)] = old_rank
        return kept

    def bundle_order(self, ranks_per_node: int) -> list[list[int]]:
        """How to pack ranks onto nodes so that every TP group stays on one node.

        Returns one list of ranks per node, in rank order. Because TP groups are runs of ``tp``
        adjacent ranks, each node takes ``ranks_per_node // tp`` whole TP groups; when
        ``ranks_per_node`` is not a multiple of ``tp`` the leftover slots stay empty rather than
        split a TP group across nodes. The last node may be partly filled.
        """
        if not _is_int(ranks_per_node) or ranks_per_node < 1:
            raise TopologyError(f"ranks_per_node must be an integer >= 1, got {ranks_per_node!r}")
        if self.tp > ranks_per_node:
            raise TopologyError(
                f"tp={self.tp} does not fit on a node with {ranks_per_node} ranks: a "
                f"tensor-parallel group must share one node; lower tp to at most "
                f"{ranks_per_node} or use nodes with at least {self.tp} devices"
            )
        ranks_used_per_node = (ranks_per_node // self.tp) * self.tp
        return [
            list(range(first, min(first + ranks_used_per_node, self.world_size)))
            for first in range(0, self.world_size, ranks_used_per_node)
        ]

    def __str__(self) -> str:
        cp = f"·cp{self.cp}" if self.cp > 1 else ""
        return f"pp{self.pp}·dp{self.dp}{cp}·tp{self.tp}"


def parse_topology(text: str) -> Topology:
    """Parse the compact form, e.g. ``"pp2.dp2.tp2"`` or ``str(topology)`` (``"pp2·dp2·tp2"``).

    Axes may come in any order; an axis left out has degree 1 (``"dp8"`` is ``pp1·dp8·tp1``).
    """
    degrees: dict[str, int] = {}
    for token in _SEPARATORS.split(text.strip()):
        match = _TOKEN.match(token)
        if match is None:
            raise TopologyError(
                f"cannot parse topology {text!r}: expected tokens like 'pp2', 'dp4', 'tp8' joined by '.', got {token!r}"
            )
        axis, degree = match.group(1), int(match.group(2))
        if axis in degrees:
            raise TopologyError(f"cannot parse topology {text!r}: {axis} is given twice")
        degrees[axis] = degree
    return Topology(**{axis: degrees.get(axis, 1) for axis in ALL_AXES})
