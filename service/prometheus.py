"""Prometheus exposition of job state for the control plane's ``/metrics``.

Built from the SQLite store (not from Ray), so it answers even while the cluster is unreachable: the
job's fields, its last step row (``etrain_mfu``), its straggler findings (``etrain_job_stragglers``,
``etrain_straggler_factor{rank}``) and its ranks' host memory against their reservation
(``etrain_host_memory_bytes``, ``etrain_host_memory_reserved_bytes``). The supervisors also export their
live gauges through Ray's own metrics agent (``ray_etrain_*``). deploy/grafana/etrain-dashboard.json reads
only what is exported here.

``/metrics`` is open (Prometheus scrapes it without secrets), so what it shows depends on the caller:
anonymously only aggregates over all jobs (``etrain_jobs{status}``, ``etrain_active_workers``), never a
job id, job name or tenant; with a bearer token also the per-job gauges (labels ``job_id``, ``name``)
of the jobs that token may see: all of them for the admin, its own for a tenant.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from etrain.service.access.tenancy import Principal
from etrain.service.planning.plan_memory import GiB
from etrain.service.store.job_store import JobStore
from etrain.service.store.records import JobStatus

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
        yield GaugeMetricFamily(
            "etrain_active_workers",
            "ranks of unfinished jobs, queued ones included (all tenants)",
            value=float(sum(job.world_size for job in active)),
        )
        if self._viewer is None:
            return  # anonymous: aggregates only
        gauges = {
            "step": GaugeMetricFamily("etrain_job_step", "optimizer steps completed", labels=["job_id", "name"]),
            "loss": GaugeMetricFamily("etrain_job_loss", "loss at the last step", labels=["job_id", "name"]),
            "tokens_per_s": GaugeMetricFamily(
                "etrain_tokens_per_second", "training throughput", labels=["job_id", "name"]
            ),
            "restarts": GaugeMetricFamily("etrain_restarts_total", "restarts spent", labels=["job_id", "name"]),
            "goodput": GaugeMetricFamily(
                "etrain_goodput", "productive step time / wall time", labels=["job_id", "name"]
            ),
            "world_size": GaugeMetricFamily(
                "etrain_job_world_size", "ranks in the current layout", labels=["job_id", "name"]
            ),
        }
        mfu = GaugeMetricFamily(
            "etrain_mfu",
            "model FLOPs utilisation of the last step, 0..1 (jobs whose device has a known peak FLOP/s)",
            labels=["job_id", "name"],
        )
        stragglers = GaugeMetricFamily(
            "etrain_job_stragglers", "ranks flagged as stragglers so far", labels=["job_id", "name"]
        )
        lost = GaugeMetricFamily(
            "etrain_goodput_seconds",
            "wall time since submit by cause (productive included; the causes sum to the wall time)",
            labels=["job_id", "name", "cause"],
        )
        host_held = GaugeMetricFamily(
            "etrain_host_memory_bytes",
            "the most host memory a rank held at the latest sample (its anonymous pages)",
            labels=["job_id", "name"],
        )
        host_reserved = GaugeMetricFamily(
            "etrain_host_memory_reserved_bytes",
            "host memory each rank's bundle reserves (resources.host_memory_gb)",
            labels=["job_id", "name"],
        )
        factor = GaugeMetricFamily(
            "etrain_straggler_factor",
            "a flagged rank's compute time / its peers' median, at its latest finding",
            labels=["job_id", "name", "rank"],
        )
        for job in active:
            if not self._viewer.can_see(job.tenant):
                continue
            for field, gauge in gauges.items():
                value = getattr(job, field)
                if value is not None:
                    gauge.add_metric([job.id, job.name], float(value))
            row = self._store.step_at_or_before(job.id, job.step) if job.step else None
            if row is not None and row.mfu is not None:
                mfu.add_metric([job.id, job.name], float(row.mfu))
            if job.host_memory_gib is not None:
                host_held.add_metric([job.id, job.name], job.host_memory_gib * GiB)
            reserved = (job.spec.get("resources") or {}).get("host_memory_gb")
            if isinstance(reserved, (int, float)) and reserved > 0:
                host_reserved.add_metric([job.id, job.name], float(reserved) * GiB)
            for cause, seconds in (job.goodput_breakdown or {}).items():
                lost.add_metric([job.id, job.name, cause], float(seconds))
            latest = _straggler_factors(job.stragglers)
            stragglers.add_metric([job.id, job.name], float(len(latest)))
            for rank, value in sorted(latest.items()):
                factor.add_metric([job.id, job.name, str(rank)], value)
        yield from gauges.values()
        yield from (mfu, stragglers, factor, lost, host_held, host_reserved)


def _straggler_factors(findings: list) -> dict[int, float]:
    """Rank -> factor of its latest finding (the job's ``stragglers`` field, oldest first)."""
    latest: dict[int, float] = {}
    for finding in findings:
        if isinstance(finding, dict) and isinstance(finding.get("rank"), int):
            latest[finding["rank"]] = float(finding.get("factor") or 0.0)
    return latest


def render_job_metrics(store: JobStore, viewer: Principal | None = None) -> str:
    """The exposition for ``viewer`` (None: an anonymous scraper, aggregates only)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_JobCollector(store, viewer))
    return generate_latest(registry).decode()
