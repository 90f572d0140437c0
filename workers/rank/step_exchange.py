"""The step-boundary control exchange over torch.distributed: one all-gather per step, on its own gloo group.

The pure part (what the vector holds, how rank 0 decides, how the result is read) is
``workers/rank/step_control.py``; this adapter only moves the vectors. Why a dedicated CPU gloo group,
created once per attempt beside the training groups:

* the vectors are host floats (the step's metrics were read from the device by the step's one host
  read), so an NCCL job exchanging them on a gloo group never makes the host wait for the GPU again;
* a group of its own keeps these collectives from ever pairing up with the training step's (or the
  async checkpointer's, which has its own group too).

One collective per step: ``all_gather`` of ``len(FIELDS)`` float64 values per rank (64 bytes), begun
after a step (:meth:`StepExchange.start`) and waited for at a later boundary (:meth:`StepExchange.settle`).
Rank 0's row carries its requests, so no broadcast is needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from etrain.workers.rank.step_control import FIELDS, Boundary, decode, encode

__all__ = ["StepExchange"]


class StepExchange:
    """Collective construction (``dist.new_group`` over the world) when the world has more than one rank."""

    def __init__(self, *, world_size: int, timeout_s: float | None = None):
        self.world_size = world_size
        self._group: dist.ProcessGroup | None = None
        if world_size > 1:
            if not dist.is_initialized():
                raise RuntimeError(f"StepExchange over {world_size} ranks needs an initialized default process group")
            timeout = timedelta(seconds=timeout_s) if timeout_s else None
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        # Buffers made once per attempt, reused every step: the vector is written in place through
        # its numpy view, and the ranks' rows are views of one (world, FIELDS) tensor, read with one
        # ``tolist()`` (no per-step tensor, no per-rank conversion).
        self._local = torch.zeros(len(FIELDS), dtype=torch.float64)
        self._local_view = self._local.numpy()
        self._gathered = torch.zeros(world_size, len(FIELDS), dtype=torch.float64)
        self._rows = list(self._gathered.unbind(0))
        self._pending: tuple[int, Any] | None = None  # (step, its all-gather's Work) begun by start()

    def start(self, metrics: Mapping[str, Any], flags: int = 0) -> None:
        """Begin exchanging this rank's vector in the background (gloo runs it on its own thread);
        :meth:`settle` waits for it. One exchange at a time: the buffers are reused."""
        if self._pending is not None:
            raise RuntimeError(f"the exchange of step {self._pending[0]} is still in flight: settle it first")
        self._local_view[:] = encode(metrics, flags)
        work = (
            dist.all_gather(self._rows, self._local, group=self._group, async_op=True)
            if self._group is not None
            else None
        )
        self._pending = (int(metrics["step"]), work)

    def done(self) -> bool:
        """Whether the exchange in flight has every rank's vector already (settle would not wait)."""
        if self._pending is None:
            return False
        work = self._pending[1]
        return work is None or work.is_completed()

    def settle(self) -> Boundary | None:
        """The boundary of the exchange :meth:`start` began, once every rank's vector is here (None when
        none is in flight). Bounded: a peer that never joins fails the wait after the group's timeout."""
        if self._pending is None:
            return None
        (step, work), self._pending = self._pending, None
        if work is None:
            return decode([self._local.tolist()], step=step)
        work.wait()
        return decode(self._gathered.tolist(), step=step)
