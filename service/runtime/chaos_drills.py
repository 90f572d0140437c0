"""A job's fault drills, supervisor side: loaded by the supervisor actor only when drills are enabled.

Why a module of its own: drills exist to test recovery, never to train. The supervisor imports this
module only for a job whose policy enables them (``JobPolicy.chaos_enabled``, from the server setting
``enable_chaos`` / ``ETRAIN_ENABLE_CHAOS``); otherwise it refuses drill requests and nothing here is
loaded. What a rank does with an order is the rank's plugin (``workers/rank/chaos.py``); the order itself
is a message (``etrain.workers.protocol.messages.ChaosOrder``).

Here: turning a request into an order, keeping the orders armed until their rank reports them fired
(they ride in every launch plan meanwhile, so a restarted group fires them too), delivering them to a
group that is up, and the one drill the supervisor carries out itself, corrupting a committed
checkpoint (after its commit, so that the next restore must detect it and fall back).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from etrain.workers.checkpoints import storage
from etrain.workers.checkpoints.checkpoint_commit import step_dir
from etrain.workers.protocol.manifest import MANIFEST_NAME
from etrain.workers.protocol.messages import ChaosOrder

__all__ = ["CorruptOrder", "JobDrills"]


@dataclass(frozen=True, kw_only=True)
class CorruptOrder:
    """Flip bytes in the largest shard of checkpoint ``step`` once it is committed."""

    id: int
    step: int


class JobDrills:
    """The drills of one job. ``record(kind, detail)`` appends a job event (``chaos_armed``, ``chaos_fired``,
    ``chaos_rejected``). All methods but :meth:`order` run on the supervisor's control thread."""

    def __init__(self, *, root: str, record: Callable[[str, str], None]):
        self._root = root  # the job's checkpoint root: a folder or an s3:// URL
        self._record = record
        self._ids = itertools.count(1)  # next() is atomic: order() runs on Ray's method threads
        self._armed: dict[int, ChaosOrder] = {}  # until the rank reports the order fired
        self._corrupt: dict[int, int] = {}  # order id -> step to corrupt once committed

    def order(self, request: dict[str, Any]) -> tuple[ChaosOrder | CorruptOrder, dict[str, Any]]:
        """A request (``service.ports.ChaosRequest`` as a dict) -> (the order, the answer as recorded)."""
        order_id = next(self._ids)
        action = request["action"]
        if action == "corrupt_checkpoint":
            return (
                CorruptOrder(id=order_id, step=int(request["step"])),
                {"id": order_id, "action": action, "step": request["step"], "armed": True},
            )
        # fail_health_check fires at an attempt's health check (the first starting at or after at_step).
        during = "health_check" if action == "fail_health_check" else request.get("during") or "step"
        order = ChaosOrder(
            id=order_id,
            action=action,
            rank=int(request["rank"]),
            factor=float(request.get("factor") or 1.0),
            gib=float(request.get("gib") or 0.0),
            # A kill inside a save is always armed (never fired on delivery, carried into the next
            # attempt until it fires): with no at_step it lands in the first save.
            at_step=request.get("at_step") if during == "step" else int(request.get("at_step") or 0),
            during=during,
        )
        return order, dataclasses.asdict(order) | {"armed": True}

    def arm(
        self, order: ChaosOrder | CorruptOrder, *, world_size: int, group: Any | None, committed_step: int | None
    ) -> None:
        """Take an order in: ``group`` is the worker group when it is up (None while it starts or is down)."""
        if isinstance(order, CorruptOrder):
            self._corrupt[order.id] = order.step
            self._record("chaos_armed", f"corrupt_checkpoint step {order.step} (order {order.id})")
            self.corrupt_due(committed_step)
            return
        if not 0 <= order.rank < world_size:
            self._record("chaos_rejected", f"rank {order.rank} is outside the world of {world_size} ranks")
            return
        # Armed until its rank reports it fired (``fired`` records chaos_fired then), also when it goes
        # to a running group at once: an order sent that way used to leave no event at all.
        self._armed[order.id] = order
        if order.at_step is None and group is not None:
            when = " now, to the running group"
        elif order.at_step is not None:
            when = f" at step {order.at_step}"
        else:
            when = " when the group is up"
        self._record(
            "chaos_armed",
            f"{order.action} on rank {order.rank}{when}"
            + (f" during {order.during}" if order.during != "step" else ""),
        )
        if group is not None:
            self._send(order, group)

    def arm_requests(
        self, requests: tuple[dict[str, Any], ...], *, world_size: int, committed_step: int | None
    ) -> None:
        """Arm orders posted before the supervisor existed (``JobPolicy.chaos_requests``), in the order they
        came: called before the first launch, with no group, so they ride in its plan."""
        for request in requests:
            order, _ = self.order(request)
            self.arm(order, world_size=world_size, group=None, committed_step=committed_step)

    def deliver(self, group: Any) -> None:
        """Hand armed drills to a group that just came up (orders that arrived while it launched).

        Ranks key orders by id, so one already in the launch plan is not fired twice.
        """
        for order in list(self._armed.values()):
            self._send(order, group)

    def plan_orders(self) -> tuple[ChaosOrder, ...]:
        """The armed orders a new attempt's launch plan carries (those waiting for a step)."""
        return tuple(order for order in self._armed.values() if order.at_step is not None)

    def fired(self, rank: int, order_id: int, step: int | None) -> None:
        """A rank reports an order fired (``report_chaos``): it is no longer armed."""
        order = self._armed.pop(order_id, None)
        if order is not None:
            self._record(
                "chaos_fired",
                f"{order.action} on rank {rank} "
                + (f"at step {step}" if step is not None else "on delivery")
                + (f" during {order.during}" if order.during != "step" else "")
                + f" (order {order_id})",
            )

    def corrupt_due(self, committed_step: int | None) -> None:
        """Carry out the corruptions whose step is committed (called after each commit)."""
        for order_id, step in list(self._corrupt.items()):
            directory = step_dir(self._root, step)
            if (
                committed_step is None
                or step > committed_step
                or not storage.exists(storage.join(directory, MANIFEST_NAME))
            ):
                continue
            del self._corrupt[order_id]
            victim = _largest_shard(directory)
            if victim is None:
                self._record("chaos_rejected", f"corrupt_checkpoint: no shard files in {directory}")
                continue
            _flip_bytes(victim)
            self._record(
                "chaos_fired", f"corrupt_checkpoint flipped bytes in {storage.basename(victim)} of step {step}"
            )

    def _send(self, order: ChaosOrder, group: Any) -> None:
        """Give an order to its rank. An immediate actor kill is done from here: a rank cannot
        ``ray.kill`` itself mid-call as cleanly as its owner can."""
        if order.action == "kill_actor" and order.at_step is None:
            self._armed.pop(order.id, None)
            self._record("chaos_fired", f"kill_actor on rank {order.rank} (order {order.id})")
            group.kill_actor(order.rank)
        else:
            group.chaos(order)


def _largest_shard(directory: str) -> str | None:
    if storage.is_url(directory):
        sizes = {
            rel: size
            for rel, size in storage.file_sizes(directory).items()
            if "/" not in rel and rel.endswith(".distcp")
        }
        return storage.join(directory, max(sizes, key=sizes.get)) if sizes else None
    shards = [path for path in Path(directory).iterdir() if path.is_file() and path.suffix == ".distcp"]
    return str(max(shards, key=lambda path: path.stat().st_size)) if shards else None


def _flip_bytes(path: str) -> None:
    """Corrupt a file in place: invert 64 bytes in its middle, keeping its size. An object is
    rewritten whole with the same bytes flipped (an object store has no in-place writes)."""
    if storage.is_url(path):
        data = bytearray(storage.read_bytes(path))
        offset = max(0, len(data) // 2 - 32)
        data[offset : offset + 64] = bytes(b ^ 0xFF for b in data[offset : offset + 64])
        storage.write_bytes(path, bytes(data))
        return
    size = os.path.getsize(path)
    offset = max(0, size // 2 - 32)
    with open(path, "r+b") as handle:
        handle.seek(offset)
        chunk = handle.read(64)
        handle.seek(offset)
        handle.write(bytes(b ^ 0xFF for b in chunk))
        handle.flush()
        os.fsync(handle.fileno())
