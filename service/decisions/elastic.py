"""Resize policy: which data-parallel sizes a job may run at, and which one to pick.

Resizing changes DP only. The global batch stays fixed so training is the same run at any
size: each optimizer step still consumes ``global_batch`` samples, split into
``global_batch / micro_batch`` micro-batches, and each of the ``dp`` replicas accumulates
gradients over ``global_batch / (dp * micro_batch)`` of them. A dp is therefore *legal* only when
it divides the number of micro-batches; any other size would change the batch (and the loss
curve) or skip/repeat samples.

Pure functions over ints; the supervisor calls them with numbers from its config. Which sizes are
legal is a layout rule (``etrain.workers.protocol.layout_rules``: ``legal_dp_sizes``, ``is_legal_dp``, found among
the divisors of the micro-batch count, never by scanning ``[min_dp, max_dp]``); this module is the
policy on top (the largest legal size that fits) and reports a broken batch or range as
:class:`ResizeError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.errors import EtrainError
from etrain.workers.protocol.layout_rules import Problem

__all__ = [
    "ElasticPolicy",
    "ResizeError",
    "choose_dp",
    "legal_dp_sizes",
    "num_micro_batches",
]


class ResizeError(EtrainError, ValueError):
    """A batch/size combination that cannot keep the global batch; the message names the numbers and
    ``field`` the number at fault (``global_batch``, ``micro_batch``, ``min_dp``, ``max_dp``, ``dp`` or
    ``dp_replicate``)."""


def _raise(problems: list[Problem]) -> None:
    """The first layout-rule problem as a ResizeError named by the setting alone (``resources.min_dp`` ->
    ``min_dp``): the supervisor's config speaks in those names."""
    for problem in problems:
        raise ResizeError(problem.message, field=problem.field.rsplit(".", 1)[-1], fix=problem.fix)


def num_micro_batches(global_batch: int, micro_batch: int) -> int:
    """Micro-batches per optimizer step: ``global_batch / micro_batch``, which must be whole."""
    _raise(layout_rules.micro_batch_count_problems(global_batch, micro_batch))
    return layout_rules.micro_batch_count(global_batch, micro_batch)


def legal_dp_sizes(global_batch: int, micro_batch: int, min_dp: int, max_dp: int, dp_multiple: int = 1) -> list[int]:
    """Every dp in ``[min_dp, max_dp]`` that divides the micro-batch count, ascending.

    ``dp_multiple`` (HSDP's ``dp_replicate``): dp must stay a multiple of it, since the replicate
    groups each shard over ``dp / dp_replicate`` ranks.

    Empty when no size in the range keeps the global batch (callers decide whether that is an
    error; :class:`ElasticPolicy` treats it as one).
    """
    _raise(
        layout_rules.micro_batch_count_problems(global_batch, micro_batch)
        + layout_rules.dp_range_problems(min_dp, max_dp, dp_multiple)
    )
    return layout_rules.legal_dp_sizes(global_batch, micro_batch, min_dp, max_dp, dp_multiple)


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
        _raise(
            layout_rules.dp_range_problems(min_dp, max_dp)
            + layout_rules.micro_batch_count_problems(global_batch, micro_batch)
        )
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
    dp_multiple: int = 1  # HSDP's dp_replicate and expert parallelism's ep (their lcm: layout_rules.dp_multiple)

    def __post_init__(self) -> None:
        if not self.legal_sizes():
            multiple = (
                f" and is a multiple of {self.dp_multiple} (parallelism.dp_replicate and parallelism.ep)"
                if self.dp_multiple > 1
                else ""
            )
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
        return layout_rules.is_legal_dp(
            dp,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            min_dp=self.min_dp,
            max_dp=self.max_dp,
            dp_multiple=self.dp_multiple,
        )

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
