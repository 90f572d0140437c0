"""A real etrain control plane for tests: uvicorn on a free loopback port over a real Ray cluster.

Used by the end-to-end and chaos tests. The caller owns the Ray cluster (``ray.init`` on a local
instance, or ``ray.cluster_utils.Cluster`` for several nodes); the control plane connects to it
exactly as ``etrain serve --ray-address`` would. Every wait has a timeout.

Auth is on, as in production: the server gets an admin token (``ControlPlane.token``; its ``client``
sends it), tenants' tokens via ``tenant_tokens``, and ``ControlPlane.as_token(token)`` is the same
server seen with another token. ``admin_headers(data_dir)`` reads the token an app with no token
configured generated into ``<data_dir>/api-token`` (for in-process ``create_app`` tests).
"""

from __future__ import annotations

import re
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve_app(
    app: Any, port: int | None = None, *, start_timeout_s: float = 10.0, stop_timeout_s: float = 10.0
) -> Iterator[str]:
    """``app`` on a real uvicorn server on loopback (``port``, default a free one) until the block ends;
    yields its URL. Open event streams get 2 s at shutdown; a server that does not stop fails the test."""
    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=2)
    )
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"uvicorn did not start on port {port} within {start_timeout_s:g}s")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=stop_timeout_s)
        assert not thread.is_alive(), "uvicorn did not stop"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def admin_headers(data_dir: Path) -> dict[str, str]:
    """The ``Authorization`` header of the admin token an app without configured tokens generated."""
    from etrain.service.access.api_token import read_api_token, token_path

    return bearer(read_api_token(token_path(data_dir)))


@dataclass
class ControlPlane:
    url: str
    data_dir: Path
    client: httpx.Client
    token: str = ""  # the admin token the client sends

    @contextmanager
    def as_token(self, token: str | None) -> Iterator[ControlPlane]:
        """This server through a client that sends ``token`` (None: no Authorization header)."""
        with httpx.Client(base_url=self.url, timeout=30.0, headers=bearer(token) if token else {}) as client:
            yield ControlPlane(url=self.url, data_dir=self.data_dir, client=client, token=token or "")

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post("/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        return response.json()

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.client.get(f"/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        return response.json()

    def events(self, job_id: str) -> list[dict[str, Any]]:
        response = self.client.get(f"/v1/jobs/{job_id}/events")
        assert response.status_code == 200, response.text
        body = response.json()
        return body["events"] if isinstance(body, dict) else body

    def steps(self, job_id: str) -> list[dict[str, Any]]:
        response = self.client.get(f"/v1/jobs/{job_id}/metrics")
        assert response.status_code == 200, response.text
        body = response.json()
        return body["steps"] if isinstance(body, dict) else body

    def chaos(self, job_id: str, **request: Any) -> dict[str, Any]:
        response = self.client.post(f"/v1/jobs/{job_id}/chaos", json=request)
        assert response.status_code in (200, 201, 202), response.text
        return response.json()

    def wait_until(self, job_id: str, predicate, *, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        job = self.job(job_id)
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if predicate(job):
                return job
            if job["status"] in TERMINAL:
                break
            time.sleep(0.25)
        kinds = [f"{e['kind']}: {e.get('detail')}" for e in self.events(job_id)]
        raise AssertionError(
            f"timed out after {timeout_s}s waiting for {what}; job={job}\nevents:\n" + "\n".join(kinds)
        )

    def wait_terminal(self, job_id: str, *, timeout_s: float) -> dict[str, Any]:
        return self.wait_until(
            job_id, lambda job: job["status"] in TERMINAL, timeout_s=timeout_s, what="a terminal status"
        )


REPO = Path(__file__).resolve().parents[1]


def storage_roots_for(data_dir: Path) -> tuple[Path, ...]:
    """Storage roots for a test server: its data directory, the temp directory, the repository."""
    return (Path(data_dir).resolve(), Path(tempfile.gettempdir()).resolve(), REPO)


@contextmanager
def control_plane(
    data_dir: Path,
    *,
    enable_chaos: bool = True,
    api_token: str | None = None,
    tenant_tokens: dict[str, str] | None = None,
    **settings_overrides: Any,
) -> Iterator[ControlPlane]:
    """Serve the real app (real JobManager, real SQLite, the already-initialised Ray) on a free port.

    ``api_token``: the admin token (default: a random one); ``tenant_tokens``: tenant -> token;
    ``settings_overrides``: any other ``Settings`` field (e.g. ``tenant_max_jobs``). Unless given,
    ``storage_roots`` are the data directory, the temp directory (pytest's ``tmp_path`` data) and the
    repository (specs that train on its source).
    """
    from etrain.api.app import create_app
    from etrain.service.access.api_token import new_api_token
    from etrain.service.settings import Settings

    settings_overrides.setdefault("storage_roots", storage_roots_for(data_dir))
    # One warm spare per node unless a test says otherwise (None: the service's own ``auto``): the tests'
    # clusters are 2-CPU nodes, where ``auto`` keeps two, and each spare's warm-up is seconds of a core.
    settings_overrides.setdefault("warm_spares_per_node", 1)
    port = free_port()
    api_token = api_token or new_api_token(16)
    settings = Settings(
        host="127.0.0.1",
        port=port,
        data_dir=data_dir,
        enable_chaos=enable_chaos,
        api_token=api_token,
        api_tokens=tenant_tokens or {},
        poll_interval_s=0.2,
        **settings_overrides,
    )
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="etrain-test-server", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=url, timeout=30.0, headers=bearer(api_token)) as client:
        deadline = time.monotonic() + 60
        while True:
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or not thread.is_alive():
                server.should_exit = True
                raise AssertionError("the control plane did not become healthy within 60s")
            time.sleep(0.2)
        try:
            yield ControlPlane(url=url, data_dir=data_dir, client=client, token=api_token)
        finally:
            server.should_exit = True
            thread.join(timeout=30)


def event_kinds(events: list[dict[str, Any]]) -> list[str]:
    return [event["kind"] for event in events]


def event_text(event: dict[str, Any]) -> str:
    detail = event.get("detail")
    if isinstance(detail, dict):
        return str(detail.get("message", detail))
    return str(detail)


def placements(events: list[dict]) -> list[dict[int, str]]:
    """Rank -> node id of every launch, from the job's ``placed`` events (what an operator sees)."""
    return [
        {int(rank): node for rank, node in re.findall(r"rank(\d+)=([^\s;]+)", event_text(event))}
        for event in events
        if event["kind"] == "placed"
    ]


#: Ray's node health checks for local multi-node clusters (``ray.cluster_utils.Cluster``): a node that
#: stops answering is declared dead in ~3 s (the chaos tests and the node-loss benchmark).
FAST_NODE_DEATH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
    "health_check_timeout_ms": 1000,
}
