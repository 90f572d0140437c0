"""The control plane's handle on Ray: connect (or start a local cluster) and talk to supervisors.

Every call has a timeout: a slow or dead supervisor must never hang an HTTP request. The manager
depends on the small :class:`Runtime` protocol, so API tests can substitute a named fake while
integration tests use this real implementation against real Ray clusters.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any, Protocol

from etrain.service.decisions.admission import MEMORY, ClusterView, NodeView
from etrain.service.decisions.job_policy import JobPolicy
from etrain.service.errors import ServiceUnavailable
from etrain.service.runtime.hf_export import run_export
from etrain.service.runtime.supervisor_actor import find_supervisor, forget_supervisor, start_supervisor
from etrain.service.runtime.supervisor_spares import SupervisorSpares
from etrain.service.runtime.worker_group import NAMESPACE
from etrain.service.settings import Settings
from etrain.workers.protocol.run_config import ExportDtype, ModelConfig, RunConfig

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0


class Runtime(Protocol):
    @property
    def dashboard_token_hint(self) -> str | None:
        """How to log in to the dashboard when Ray protects it with a token (None: no token needed)."""
        ...

    def start(self, job_id: str, config: RunConfig, policy: JobPolicy) -> None: ...
    def exists(self, job_id: str) -> bool: ...
    def updates(self, job_id: str, since_seq: int, since_step: int) -> dict[str, Any] | None: ...
    def cancel(self, job_id: str, reason: str) -> None: ...
    def scale(self, job_id: str, dp: int) -> None: ...
    def chaos(self, job_id: str, request: dict[str, Any]) -> dict[str, Any]: ...
    def release(self, job_id: str) -> None: ...
    def export(
        self,
        *,
        step_dir: str,
        out_dir: str,
        model: ModelConfig,
        source_dir: str | None,
        expect_digest: str,
        timeout_s: float,
        dtype: ExportDtype,
    ) -> str: ...
    def health(self) -> dict[str, Any]: ...
    def close(self) -> None: ...

    def cluster(self) -> ClusterView:
        """The nodes (alive, total and free resources) and what each job's placement group holds;
        ServiceUnavailable when the cluster cannot be read within the call timeout."""

    def request_capacity(self, bundles: list[dict[str, float]]) -> None:
        """Ask the cluster's autoscaler for room to hold all ``bundles`` at once (what runs counts toward
        it); ``[]`` withdraws the request."""

    def accelerator_memory_gb(self) -> float | None:
        """GiB of memory per GPU the cluster's nodes offer (the smallest type's); None without GPUs or
        when it cannot be measured now (the planner then uses its default)."""


class RayRuntime:
    """Runtime over a real Ray cluster (``settings.ray_address``) or a local one started here."""

    def __init__(self, settings: Settings):
        import ray

        self._ray = ray
        self._owns_cluster = False
        self._gpu_memory_gib: dict[str, float] = {}  # accelerator type -> GiB per GPU, measured once
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None  # reads cluster() off the caller
        self._supervisor_spares: SupervisorSpares | None = None
        if ray.is_initialized():
            self._start_spares(settings)
            return
        try:
            if settings.ray_address:
                ray.init(address=settings.ray_address, namespace=NAMESPACE, log_to_driver=False)
            else:
                # address="local": a new instance even when another Ray runs on this machine. Ray's default
                # (None) joins any local cluster it finds by its processes, silently ignoring the dashboard
                # arguments below: a second `etrain serve` would share the first one's named actors.
                ray.init(
                    address="local",
                    namespace=NAMESPACE,
                    include_dashboard=True,
                    dashboard_host=settings.dashboard_host,
                    dashboard_port=settings.dashboard_port,
                    log_to_driver=False,
                )
                self._owns_cluster = True
        except Exception as err:
            raise ServiceUnavailable(
                f"cannot connect to Ray at {settings.ray_address or 'a new local cluster'}: {err}",
                fix="check ETRAIN_RAY_ADDRESS / --ray-address, or leave it unset to start a local Ray",
            ) from err
        self._start_spares(settings)
        self._probe_gpus_soon()

    def _probe_gpus_soon(self) -> None:
        """Measure the GPUs' memory now, in the background, rather than in the first submit that needs it.

        Why: the probe is a one-GPU Ray task, and the first one on a node starts a worker process with
        CUDA. Measured on an H100 through the service, the first ``POST /v1/jobs`` took 5.9 s, all of it
        this probe, of a 9.7 s submit -> first step. Never fatal: a probe that fails is asked again by
        the next submit, as before.
        """

        def probe() -> None:
            try:
                self.accelerator_memory_gb()
            except Exception as err:  # the cluster may still be starting: the next submit asks again
                log.info("GPU memory probe at start-up gave no answer: %s", err)

        threading.Thread(target=probe, name="etrain-gpu-probe", daemon=True).start()

    def _start_spares(self, settings: Settings) -> None:
        """Warm spare ranks for every job on this cluster (service/runtime/spares.py) and pre-started
        supervisors for this control plane's next jobs (service/runtime/supervisor_spares.py); never fatal."""
        from etrain.service.runtime.spares import ensure_pool

        try:
            ensure_pool(settings.warm_spares_per_node)
        except Exception as err:  # ranks then start cold, as they did before spares existed
            log.warning("warm spare pool not started: %s", err)
        self._supervisor_spares = SupervisorSpares(settings.supervisor_spares)

    @property
    def dashboard_url(self) -> str | None:
        try:  # Ray has no public getter for the dashboard address of the connected cluster
            url = self._ray._private.worker.global_worker.node.address_info.get("webui_url")  # noqa: SLF001
        except Exception:
            url = None
        return f"http://{url}" if url and not url.startswith("http") else url

    @property
    def dashboard_token_hint(self) -> str | None:
        """How to log in to the dashboard when Ray protects it with a token (local clusters, Ray >= 2.59)."""
        import os
        from pathlib import Path

        if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
            return None
        if os.environ.get("RAY_AUTH_TOKEN"):
            return "the dashboard asks for Ray's token: it is in $RAY_AUTH_TOKEN"
        token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        if token_file.exists():
            return (
                f"the dashboard asks for Ray's token: paste the contents of {token_file} "
                "(or run `.venv/bin/ray get-auth-token`)"
            )
        return None

    def start(self, job_id: str, config: RunConfig, policy: JobPolicy) -> None:
        spare = self._supervisor_spares.take() if self._supervisor_spares is not None else None
        handle = start_supervisor(job_id=job_id, config=config, policy=policy, spare=spare)
        self._get(handle.updates.remote(0, 10**12))  # surfaces constructor errors now, with a timeout

    def exists(self, job_id: str) -> bool:
        return find_supervisor(job_id) is not None

    def updates(self, job_id: str, since_seq: int, since_step: int) -> dict[str, Any] | None:
        handle = find_supervisor(job_id)
        if handle is None:
            return None
        try:
            return self._get(handle.updates.remote(since_seq, since_step))
        except self._ray.exceptions.RayActorError:
            return None

    def cancel(self, job_id: str, reason: str) -> None:
        handle = find_supervisor(job_id)
        if handle is not None:
            self._get(handle.cancel.remote(reason))

    def scale(self, job_id: str, dp: int) -> None:
        handle = self._require(job_id)
        self._get(handle.scale.remote(dp))

    def chaos(self, job_id: str, request: dict[str, Any]) -> dict[str, Any]:
        handle = self._require(job_id)
        return self._get(handle.chaos.remote(request))

    def release(self, job_id: str) -> None:
        handle = find_supervisor(job_id)
        if handle is not None:
            try:
                self._ray.kill(handle, no_restart=True)
            except Exception:  # already gone
                pass
        forget_supervisor(job_id)

    #: Run the Hugging Face export task (etrain.service.runtime.hf_export) and wait up to ``timeout_s``.
    export = staticmethod(run_export)

    def accelerator_memory_gb(self) -> float | None:
        """GiB of memory per GPU the cluster offers, for the planner (``resources.device_memory_gb``).

        Ray's resources name how many GPUs there are and their type (``accelerator_type:H100``), not
        their memory, so one probe task per accelerator type reads it on a GPU node
        (:func:`probe_gpu_memory_gib`) and the answer is cached for that type. With several types, the
        smallest (a job may land on any). None when the cluster has no GPU, or when a probe cannot run
        within the call timeout (every GPU busy): not cached, asked again next time.
        """
        try:
            resources = self._ray.cluster_resources()
        except Exception:
            return None
        if resources.get("GPU", 0) < 1:
            return None
        types = sorted(key.split(":", 1)[1] for key in resources if key.startswith("accelerator_type:")) or [""]
        for kind in types:
            if kind not in self._gpu_memory_gib:
                measured = probe_gpu_memory_gib(kind or None, timeout_s=CALL_TIMEOUT_S)
                if measured is None:
                    return None
                self._gpu_memory_gib[kind] = measured
        return min(self._gpu_memory_gib[kind] for kind in types)

    def cluster(self) -> ClusterView:
        """Nodes from ``ray.nodes()``, free resources per node as the GCS accounts them (held placement
        groups already subtracted), and the etrain placement groups that are ``CREATED`` (held), by job.

        Read on a helper thread with the call timeout, so a stalled GCS never hangs the caller.
        """
        return self._off_thread("read the cluster's resources", self._read_cluster)

    def request_capacity(self, bundles: list[dict[str, float]]) -> None:
        """``ray.autoscaler.sdk.request_resources(bundles=...)``: a persistent hint the autoscaler scales
        toward (a no-op without one); each call replaces the last, ``[]`` clears it."""
        from ray.autoscaler.sdk import request_resources

        self._off_thread("take the autoscaler request", lambda: request_resources(bundles=bundles))

    def _off_thread(self, what: str, call):
        """``call()`` on the helper thread, waited for at most the call timeout; ServiceUnavailable
        naming ``what`` when it fails or times out (the thread is left to finish on its own)."""
        if self._reader is None:
            self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="etrain-cluster")
        future = self._reader.submit(call)
        try:
            return future.result(timeout=CALL_TIMEOUT_S)
        except concurrent.futures.TimeoutError as err:
            raise ServiceUnavailable(
                f"Ray did not {what} within {CALL_TIMEOUT_S:.0f}s", fix="check the cluster (ray status) and retry"
            ) from err
        except Exception as err:
            raise ServiceUnavailable(
                f"could not {what}: {err}", fix="check the cluster (ray status) and retry"
            ) from err

    def _read_cluster(self) -> ClusterView:
        from ray._private.state import available_resources_per_node
        from ray.util import placement_group_table

        free = available_resources_per_node()
        nodes = tuple(
            NodeView(
                id=node["NodeID"],
                alive=bool(node.get("Alive")),
                total=_plain(node.get("Resources", {})),
                free=_plain(free.get(node["NodeID"], {})) if node.get("Alive") else {},
            )
            for node in self._ray.nodes()
        )
        holdings: dict[str, dict[str, dict[str, float]]] = {}
        for group in placement_group_table().values():
            job_id = job_of_placement_group(group.get("name", ""))
            if job_id is None or group.get("state") != "CREATED":
                continue
            held = holdings.setdefault(job_id, {})
            for index, bundle in group.get("bundles", {}).items():
                node_id = group.get("bundles_to_node_id", {}).get(index, "")
                on_node = held.setdefault(node_id, {})
                for name, amount in _plain(bundle).items():
                    on_node[name] = on_node.get(name, 0.0) + amount
        return ClusterView(nodes=nodes, holdings=holdings)

    def health(self) -> dict[str, Any]:
        try:
            nodes = [node for node in self._ray.nodes() if node.get("Alive")]
            return {"ray": "ok", "nodes": len(nodes), "resources": self._ray.cluster_resources()}
        except Exception as err:
            return {"ray": f"unavailable: {err}"}

    def close(self) -> None:
        if self._supervisor_spares is not None:
            self._supervisor_spares.close()
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
        if self._owns_cluster and self._ray.is_initialized():
            self._ray.shutdown()

    def _require(self, job_id: str):
        handle = find_supervisor(job_id)
        if handle is None:
            raise ServiceUnavailable(f"the supervisor of job {job_id} is not running", fix="retry in a few seconds")
        return handle

    def _get(self, ref):
        try:
            return self._ray.get(ref, timeout=CALL_TIMEOUT_S)
        except self._ray.exceptions.GetTimeoutError as err:
            raise ServiceUnavailable(
                f"Ray did not answer within {CALL_TIMEOUT_S:.0f}s", fix="check the cluster (ray status) and retry"
            ) from err


#: The resources a cluster view keeps (Ray also reports object store, node and bundle labels): a rank's bundle
#: asks for the first three (``memory``: the host memory Ray reserves for it, ``resources.host_memory_gb``).
VIEW_RESOURCES = ("CPU", "GPU", MEMORY)


def _plain(resources: dict[str, Any]) -> dict[str, float]:
    return {name: float(resources.get(name, 0.0)) for name in VIEW_RESOURCES}


def job_of_placement_group(name: str) -> str | None:
    """The job of an etrain placement group's name (``etrain/<job-id>/a<attempt>``, see
    service/runtime/worker_group.py), or None for anyone else's."""
    prefix, _, rest = name.partition("/")
    job_id, _, attempt = rest.rpartition("/")
    if prefix != "etrain" or not job_id or not attempt.startswith("a"):
        return None
    return job_id


def probe_gpu_memory_gib(accelerator_type: str | None, *, timeout_s: float) -> float | None:
    """Total memory of one GPU (of ``accelerator_type``, when given) in GiB, read by a one-GPU Ray task
    running ``etrain.workers.rank.device_info.gpu_memory_bytes`` (torch lives on the workers, not here); None when
    the task cannot be scheduled within ``timeout_s`` (it is then cancelled) or sees no GPU."""
    import ray

    from etrain.workers.rank.device_info import gpu_memory_bytes

    options: dict[str, Any] = {"num_gpus": 1, "num_cpus": 0, "max_retries": 0}
    if accelerator_type:
        options["accelerator_type"] = accelerator_type
    ref = ray.remote(**options)(gpu_memory_bytes).remote()
    try:
        total = ray.get(ref, timeout=timeout_s)
    except Exception as err:  # GetTimeoutError (every GPU busy) or a task failure
        log.info("GPU memory probe (%s) gave no answer: %s", accelerator_type or "any GPU", err)
        try:
            ray.cancel(ref, force=True)
        except Exception:
            pass
        return None
    return None if total is None else total / 2**30
