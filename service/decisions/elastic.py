"""Resize policy: which data-parallel sizes a job may run at, and which one to pick.

Resizing changes DP only. The global batch stays fixed so training is the same run at any
size: each optimizer step still consumes ``global_batch`` samples, split into
``global_batch / micro_batch`` micro-batches, and each of the ``dp`` replicas accumulates
gradients over ``global_batch / (dp * micro_batch)`` of them. A dp is therefore *legal* only when
it divides the number of micro-batches; any other size would change the batch (and the loss
curve) or skip/repeat samples.

Pure functions over ints; the supervisor calls them with numbers from its config. The legal sizes
are found among the divisors of the micro-batch count (``etrain.service.planning.bounds.divisors``, O(sqrt(n))),
never by scanning ``[min_dp, max_dp]``, so a huge range or batch costs microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from etrain.service.planning.bounds import divisors
from etrain.workers.protocol.errors import EtrainError

__all__ = [
    "ElasticPolicy",
    "ResizeError",
    "choose_dp",
    "grad_accum_steps",
    "legal_dp_sizes",
    "num_micro_batches",
]


class ResizeError(EtrainError, ValueError):
    """A batch/size combination that cannot keep the global batch; the message names the numbers and
    ``field`` the number at fault (``global_batch``, ``micro_batch``, ``min_dp``, ``max_dp`` or ``dp``)."""


def num_micro_batches(global_batch: int, micro_batch: int) -> int:
    """Micro-batches per optimizer step: ``global_batch / micro_batch``, which must be whole."""
    if global_batch < 1 or micro_batch < 1:
        raise ResizeError(
            f"global_batch={global_batch} and micro_batch={micro_batch} must both be >= 1",
            field="global_batch" if global_batch < 1 else "micro_batch",
        )
    if global_batch % micro_batch:
        raise ResizeError(
            f"global_batch={global_batch} is not a multiple of micro_batch={micro_batch}; "
            f"choose a global_batch that is (e.g. {global_batch - global_batch % micro_batch or micro_batch})",
            field="global_batch",
        )
    return global_batch // micro_batch


def _check_range(min_dp: int, max_dp: int) -> None:
    if min_dp < 1:
        raise ResizeError(f"min_dp={min_dp} must be >= 1", field="min_dp")
    if max_dp < min_dp:
        raise ResizeError(f"max_dp={max_dp} must be >= min_dp={min_dp}", field="max_dp")


def legal_dp_sizes(global_batch: int, micro_batch: int, min_dp: int, max_dp: int, dp_multiple: int = 1) -> list[int]:
    """Every dp in ``[min_dp, max_dp]`` that divides the micro-batch count, ascending.

    ``dp_multiple`` (HSDP's ``dp_replicate``): dp must stay a multiple of it, since the replicate
    groups each shard over ``dp / dp_replicate`` ranks.

    Empty when no size in the range keeps the global batch (callers decide whether that is an
    error; :class:`ElasticPolicy` treats it as one).
    """
    micro_batches = num_micro_batches(global_batch, micro_batch)
    _check_range(min_dp, max_dp)
    if dp_multiple < 1:
        raise ResizeError(f"dp_multiple={dp_multiple} (dp_replicate) must be >= 1", field="dp")
    return [dp for dp in divisors(micro_batches) if min_dp <= dp <= max_dp and dp % dp_multiple == 0]


def _legal(dp: int, micro_batches: int, min_dp: int, max_dp: int, dp_multiple: int) -> bool:
    return min_dp <= dp <= max_dp and micro_batches % dp == 0 and dp % dp_multiple == 0


def grad_accum_steps(global_batch: int, micro_batch: int, dp: int) -> int:
    """Micro-batches each replica accumulates per step: ``global_batch / (dp * micro_batch)``."""
    micro_batches = num_micro_batches(global_batch, micro_batch)
    if dp < 1:
        raise ResizeError(f"dp={dp} must be >= 1", field="dp")
    if micro_batches % dp:
        raise ResizeError(
            f"dp={dp} does not divide global_batch/micro_batch = {global_batch}/{micro_batch} = "
            f"{micro_batches} micro-batches, so grad accumulation {global_batch}/({dp}*{micro_batch}) "
            f"is not whole; use a dp that divides {micro_batches}",
            field="dp",
        )
    return micro_batches // dp


def choose_dp(
    available_dp: int,
    current_dp: int | None,
    *,
    global_batch: int,
    micro_batch: int,
    min_dp: int,
    max_dp: int,
    dp_multiple: int = 1,
) -> int | None:
    """The dp to run at: the largest legal dp ``<= min(available_dp, max_dp)`` and ``>= min_dp``.

    ``available_dp`` is how many replicas the cluster can place for this job (its own current
    replicas included). ``current_dp`` is the size running now (None before the first launch);
    the answer does not depend on it (the biggest legal fit is always best for throughput), it is
    taken so a caller can read ``choose_dp(...) != current_dp`` as "resize", and it is checked so
    a job that somehow runs at an illegal size is reported, not silently compared.

    Returns None when no legal dp fits (capacity below ``min_dp``, or no divisor in range):
    the caller waits for capacity.
    """
    if current_dp is not None and current_dp < 1:
        raise ResizeError(f"current_dp={current_dp} must be >= 1", field="dp")
    if available_dp < 0:
        raise ResizeError(f"available_dp={available_dp} must be >= 0", field="dp")
    ceiling = min(available_dp, max_dp)
    if ceiling < min_dp:
        _check_range(min_dp, max_dp)
        num_micro_batches(global_batch, micro_batch)
        return None
    fits = legal_dp_sizes(global_batch, micro_batch, min_dp, ceiling, dp_multiple)
    return fits[-1] if fits else None


@dataclass(frozen=True, kw_only=True)
class ElasticPolicy:
    """The numbers a resize decision needs, bundled so they are validated once.

    Raises :class:`ResizeError` at construction when no dp in ``[min_dp, max_dp]`` is legal.
    """

    global_batch: int
    micro_batch: int
    min_dp: int
    max_dp: int
    dp_multiple: int = 1  # HSDP's dp_replicate

    def __post_init__(self) -> None:
        if not self.legal_sizes():
            multiple = f" and is a multiple of dp_replicate={self.dp_multiple}" if self.dp_multiple > 1 else ""
            raise ResizeError(
                f"no dp in [min_dp={self.min_dp}, max_dp={self.max_dp}] divides "
                f"global_batch/micro_batch = {self.global_batch}/{self.micro_batch} = "
                f"{num_micro_batches(self.global_batch, self.micro_batch)}{multiple}; widen the range or "
                f"change the batch sizes",
                field="min_dp",
            )

    def legal_sizes(self) -> list[int]:
        return legal_dp_sizes(self.global_batch, self.micro_batch, self.min_dp, self.max_dp, self.dp_multiple)

    def is_legal(self, dp: int) -> bool:
        micro_batches = num_micro_batches(self.global_batch, self.micro_batch)
        return isinstance(dp, int) and _legal(dp, micro_batches, self.min_dp, self.max_dp, self.dp_multiple)

    def check(self, dp: int) -> None:
        """Raise :class:`ResizeError` naming the legal sizes unless ``dp`` is one of them."""
        if not self.is_legal(dp):
            legal = self.legal_sizes()
            shown = ", ".join(map(str, legal[:16])) + (f", ... ({len(legal)} in all)" if len(legal) > 16 else "")
            raise ResizeError(
                f"dp={dp} is not a legal size for global_batch={self.global_batch}, "
                f"micro_batch={self.micro_batch}, min_dp={self.min_dp}, max_dp={self.max_dp}; "
                f"legal sizes: [{shown}]",
                field="dp",
            )

    def choose(self, available_dp: int, current_dp: int | None = None) -> int | None:
        return choose_dp(
            available_dp,
            current_dp,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            min_dp=self.min_dp,
            max_dp=self.max_dp,
            dp_multiple=self.dp_multiple,
        )

    def grad_accum(self, dp: int) -> int:
        return grad_accum_steps(self.global_batch, self.micro_batch, dp)
