"""A job's Prometheus gauges, set by its supervisor actor and exported through Ray's metrics agent.

Kept apart from the actor so the gauges a dashboard reads are listed in one place. Goodput is not here:
it spans supervisor restarts, so the control plane computes it from its store and exports
``etrain_goodput`` on its own ``/metrics`` (service/prometheus.py).
"""

from __future__ import annotations

__all__ = ["JobMetrics"]


class JobMetrics:
    """The gauges of one job (visible in the Ray dashboard), tagged with its id."""

    def __init__(self, job_id: str):
        from ray.util.metrics import Gauge

        self._tags = {"job_id": job_id}
        keys = ("job_id",)
        self._step = Gauge("etrain_job_step", "optimizer steps completed", tag_keys=keys)
        self._loss = Gauge("etrain_job_loss", "training loss of the last step", tag_keys=keys)
        self._tokens = Gauge("etrain_tokens_per_second", "training throughput", tag_keys=keys)
        self._restarts = Gauge("etrain_restarts_total", "restarts spent from the budget", tag_keys=keys)
        self._straggler = Gauge(
            "etrain_straggler_factor", "slow rank's compute / peers' median", tag_keys=("job_id", "rank")
        )
        self._host_memory = Gauge(
            "etrain_host_memory_bytes", "the most host memory a rank holds (anonymous pages)", tag_keys=keys
        )
        self._host_reserved = Gauge(
            "etrain_host_memory_reserved_bytes", "host memory each rank's bundle reserves", tag_keys=keys
        )
        self._done = Gauge(
            "etrain_job_finished", "1 once the job reached a terminal status", tag_keys=("job_id", "status")
        )

    def step(self, step: int, metrics: dict, restarts: int) -> None:
        self._step.set(step, tags=self._tags)
        if metrics.get("loss") is not None:
            self._loss.set(float(metrics["loss"]), tags=self._tags)
        if metrics.get("tokens_per_s") is not None:
            self._tokens.set(float(metrics["tokens_per_s"]), tags=self._tags)
        self._restarts.set(restarts, tags=self._tags)

    def host_memory(self, held: int) -> None:
        self._host_memory.set(held, tags=self._tags)

    def host_memory_reserved(self, reserved: int) -> None:
        self._host_reserved.set(reserved, tags=self._tags)

    def straggler(self, rank: int, factor: float) -> None:
        self._straggler.set(factor, tags=self._tags | {"rank": str(rank)})

    def finish(self, status: str) -> None:
        self._done.set(1, tags=self._tags | {"status": status})
