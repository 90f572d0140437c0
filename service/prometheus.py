"""Prometheus exposition of job state for the control plane's ``/metrics``.

Built from the SQLite store (not from Ray), so it answers even while the cluster is unreachable.
Per-rank and per-step metrics are exported by the supervisors through Ray's own metrics agent.

``/metrics`` is open (Prometheus scrapes it without secrets), so what it shows depends on the caller:
anonymously only aggregates over all jobs (``etrain_jobs{status}``, ``etrain_active_workers``), never a
job id, job name or tenant; with a bearer token also the per-job gauges (labels ``job_id``, ``name``)
of the jobs that token may see: all of them for the admin, its own for a tenant.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from etrain.service.store.job_store import JobStore
from etrain.service.store.records import JobStatus
from etrain.service.access.tenancy import Principal

#: The Prometheus text exposition format's media type (served by GET /metrics, api/routes/health.py).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _JobCollector:
    def __init__(self, store: JobStore, viewer: Principal | None):
        self._store = store
        self._viewer = viewer

    def collect(self):
        by_status = self._store.count_by_status()
        counts = GaugeMetricFamily("etrain_jobs", "jobs by status", labels=["status"])
        for status in JobStatus:
            counts.add_metric([status.value], by_status.get(status, 0))
        yield counts
        active = self._store.active_jobs()
        yield GaugeMetricFamily("etrain_active_workers", "ranks of unfinished jobs, queued ones included (all tenants)",
                                value=float(sum(job.world_size for job in active)))
        if self._viewer is None:
            return  # anonymous: aggregates only
        gauges = {
            "step": GaugeMetricFamily("etrain_job_step", "optimizer steps completed", labels=["job_id", "name"]),
            "loss": GaugeMetricFamily("etrain_job_loss", "loss at the last step", labels=["job_id", "name"]),
            "tokens_per_s": GaugeMetricFamily("etrain_tokens_per_second", "training throughput", labels=["job_id", "name"]),
            "restarts": GaugeMetricFamily("etrain_restarts_total", "restarts spent", labels=["job_id", "name"]),
            "goodput": GaugeMetricFamily("etrain_goodput", "productive step time / wall time", labels=["job_id", "name"]),
            "world_size": GaugeMetricFamily("etrain_job_world_size", "ranks in the current layout", labels=["job_id", "name"]),
        }
        for job in active:
            if not self._viewer.can_see(job.tenant):
                continue
            for field, gauge in gauges.items():
                value = getattr(job, field)
                if value is not None:
                    gauge.add_metric([job.id, job.name], float(value))
        yield from gauges.values()


def render_job_metrics(store: JobStore, viewer: Principal | None = None) -> str:
    """The exposition for ``viewer`` (None: an anonymous scraper, aggregates only)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_JobCollector(store, viewer))
    return generate_latest(registry).decode()
