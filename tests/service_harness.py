"""A real etrain control plane for tests: uvicorn on a free loopback port over a real Ray cluster.

Used by the end-to-end and chaos tests. The caller owns the Ray cluster (``ray.init`` on a local
instance, or ``ray.cluster_utils.Cluster`` for several nodes); the control plane connects to it
exactly as ``etrain serve --ray-address`` would. Every wait has a timeout.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import uvicorn

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ControlPlane:
    url: str
    data_dir: Path
    client: httpx.Client

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
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; job={job}\nevents:\n" + "\n".join(kinds))

    def wait_terminal(self, job_id: str, *, timeout_s: float) -> dict[str, Any]:
        return self.wait_until(job_id, lambda job: job["status"] in TERMINAL, timeout_s=timeout_s, what="a terminal status")


@contextmanager
def control_plane(data_dir: Path, *, enable_chaos: bool = True, api_token: str | None = None) -> Iterator[ControlPlane]:
    """Serve the real app (real JobManager, real SQLite, the already-initialised Ray) on a free port."""
    from api.app import create_app
    from service.settings import Settings

    port = free_port()
    settings = Settings(host="127.0.0.1", port=port, data_dir=data_dir, enable_chaos=enable_chaos,
                        api_token=api_token, poll_interval_s=0.2)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="etrain-test-server", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
    with httpx.Client(base_url=url, timeout=30.0, headers=headers) as client:
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
            yield ControlPlane(url=url, data_dir=data_dir, client=client)
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
