"""`make bench` (API part): 50 concurrent clients against a real control plane.

The server is a separate process, started as ``etrain serve`` starts it: uvicorn (one worker), the
real FastAPI app with bearer auth on, the real ``JobManager`` with its poller thread and a real SQLite
file (WAL). Ray is replaced by the tests' ``FakeRuntime`` unless ``--ray`` is given: neither measured
request touches Ray (GET /v1/jobs/{id} reads SQLite, POST /v1/plan runs the pure planner), and a local
Ray's daemons would take CPU from a 2-core machine. A job is submitted first and keeps "running"
(the poller writes its steps and events to SQLite every 0.5 s during the measurement, as in production).
With ``--ray`` that job really trains, so it is cancelled before the measurement.

The clients are one asyncio process with ``--clients`` keep-alive HTTP/1.1 connections, each sending
its next request as soon as the previous answer arrives (closed loop), with a minimal hand-written
HTTP client so the load generator costs little CPU next to the server on the same cores. Each
endpoint gets a warm-up, then ``--seconds`` of measurement; every answer must be 200. Bounded: the
loop stops at the deadline and every request has a timeout; only loopback addresses are used.

Writes ``<out>/api.md`` (the table in benchmarks/README.md) and ``<out>/api.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Result:
    endpoint: str
    clients: int
    requests: int
    errors: int
    seconds: float
    throughput: float  # answers per second
    p50_ms: float
    p99_ms: float
    max_ms: float


# -- the server process --------------------------------------------------------------------------------


def serve(port: int, data_dir: Path, token: str, use_ray: bool) -> None:
    """Run the control plane in this process (the benchmark's ``--serve`` mode)."""
    import uvicorn

    from etrain.api.app import create_app
    from etrain.service.manager import JobManager
    from etrain.service.settings import Settings

    settings = Settings(host=HOST, port=port, data_dir=data_dir, api_token=token)
    runtime = None
    if not use_ray:
        sys.path.insert(0, str(REPO))
        from tests.fakes import FakeRuntime

        runtime = FakeRuntime(steps_per_update=1)
    manager = JobManager(settings, runtime=runtime, base_dir=str(REPO))
    manager.warm_planner()  # as `etrain serve` does: plans are measured, not the planner process's start
    try:
        uvicorn.run(
            create_app(settings, manager=manager),
            host=HOST,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    finally:
        manager.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


# -- a minimal keep-alive HTTP/1.1 client ----------------------------------------------------------------


class Connection:
    """One keep-alive connection (bench_fair_use's too); ``token`` None sends no Authorization header (an
    anonymous caller). ``request`` sends and reads one answer (Content-Length bodies)."""

    def __init__(self, port: int, token: str | None):
        self.port, self.token = port, token
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str]]:
        """Send a request and read the answer's status and headers (the body is left to the caller: an
        event stream's never ends)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(HOST, self.port)
        auth = f"Authorization: Bearer {self.token}\r\n" if self.token else ""
        self.writer.write(
            (
                f"{method} {path} HTTP/1.1\r\nHost: {HOST}:{self.port}\r\n{auth}"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        await self.writer.drain()
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip()
        return int(lines[0].split()[1]), headers

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
        status, headers = await self.send(method, path, body)
        return status, headers, await self.reader.readexactly(int(headers.get("content-length", "0")))

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
            self.writer = None


async def wait_healthy(port: int, server: subprocess.Popen, timeout_s: float) -> None:
    """Until the benchmark server answers an anonymous /healthz with 200; RuntimeError when it exits first
    or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the benchmark server exited with {server.returncode}")
        connection = Connection(port, None)
        try:
            if (await connection.request("GET", "/healthz"))[0] == 200:
                return
        except OSError:
            pass
        finally:
            await connection.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the benchmark server did not become healthy within {timeout_s:g}s")
        await asyncio.sleep(0.2)


async def measure(
    port: int,
    token: str,
    endpoint: str,
    method: str,
    path: str,
    body: bytes,
    *,
    clients: int,
    warmup_s: float,
    seconds: float,
) -> Result:
    """``clients`` closed-loop connections on one endpoint; latencies of the answers after the warm-up."""
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + seconds

    async def client() -> None:
        nonlocal errors
        connection = Connection(port, token)
        try:
            while True:
                sent = time.perf_counter()
                if sent >= stop_at and latencies:  # past the window once it holds an answer (a slow one may not)
                    return
                status, _, _ = await asyncio.wait_for(connection.request(method, path, body), REQUEST_TIMEOUT_S)
                done = time.perf_counter()
                if sent >= measure_from:
                    latencies.append(done - sent)
                    errors += status != 200
        finally:
            await connection.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    latencies.sort()
    window = time.perf_counter() - measure_from  # includes the last answers in flight at the deadline

    def pct(q: float) -> float:
        return 1e3 * latencies[min(len(latencies) - 1, int(q * len(latencies)))]

    return Result(
        endpoint=endpoint,
        clients=clients,
        requests=len(latencies),
        errors=errors,
        seconds=window,
        throughput=len(latencies) / window,
        p50_ms=1e3 * statistics.median(latencies),
        p99_ms=pct(0.99),
        max_ms=1e3 * latencies[-1],
    )


# -- the benchmark ----------------------------------------------------------------------------------------


def example_body(name: str) -> bytes:
    """``examples/<name>`` (YAML) as a JSON request body."""
    import yaml

    return json.dumps(yaml.safe_load((REPO / "examples" / name).read_text())).encode()


def plan_body() -> bytes:
    return example_body("3d.yaml")


def run(*, clients: int, seconds: float, warmup_s: float, use_ray: bool) -> list[Result]:
    from etrain.service.access.api_token import new_api_token

    token = new_api_token(16)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="etrain-bench-api-") as data_dir:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.bench_api",
                "--serve",
                str(port),
                "--data-dir",
                data_dir,
                *(["--ray"] if use_ray else []),
            ],
            # the token travels in the environment: a command line is readable by every user of the machine
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "ETRAIN_API_TOKEN": token},
        )
        try:
            job_id = asyncio.run(_start(port, token, server, use_ray=use_ray, timeout_s=180 if use_ray else 60))
            results = []
            for name, method, path, body in (
                ("GET /v1/jobs/{id}", "GET", f"/v1/jobs/{job_id}", b""),
                ("POST /v1/plan (examples/3d.yaml)", "POST", "/v1/plan", plan_body()),
            ):
                result = asyncio.run(
                    measure(port, token, name, method, path, body, clients=clients, warmup_s=warmup_s, seconds=seconds)
                )
                print(
                    f"  {name:<34} {result.throughput:8.0f} req/s  p50 {result.p50_ms:6.1f} ms  "
                    f"p99 {result.p99_ms:6.1f} ms  ({result.requests} answers, {result.errors} errors)",
                    flush=True,
                )
                results.append(result)
            return results
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)


async def _start(port: int, token: str, server: subprocess.Popen, *, use_ray: bool, timeout_s: float) -> str:
    """Wait for /healthz, then submit the job the GETs read; its id. Over Ray the job really trains (8
    ranks), so it is cancelled once it runs: its ranks would otherwise take the cores being measured."""
    await wait_healthy(port, server, timeout_s)
    spec = json.loads(plan_body())
    spec["training"]["steps"] = 10**6  # keeps running (and the poller writing) through the measurement
    connection = Connection(port, token)
    try:
        status, _, body = await connection.request("POST", "/v1/jobs", json.dumps(spec).encode())
    finally:
        await connection.close()
    if status != 201:
        raise RuntimeError(f"submitting the benchmark job failed: HTTP {status} {body[:500]!r}")
    job_id = json.loads(body)["id"]
    if use_ray:
        connection = Connection(port, token)
        try:
            await connection.request("POST", f"/v1/jobs/{job_id}/cancel")
            deadline = time.monotonic() + timeout_s
            while json.loads((await connection.request("GET", f"/v1/jobs/{job_id}"))[2])["status"] != "CANCELLED":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the benchmark job was not CANCELLED within {timeout_s:g}s")
                await asyncio.sleep(0.2)
        finally:
            await connection.close()
    return job_id


def table(results: list[Result], *, use_ray: bool) -> str:
    manager = (
        "the real JobManager over a local Ray (its daemons running), the job cancelled before the measurement"
        if use_ray
        else "the real JobManager (Ray replaced by FakeRuntime), one running job "
        "whose updates the poller writes every 0.5 s"
    )
    lines = [
        f"{results[0].clients} concurrent keep-alive clients (closed loop) against one uvicorn worker: bearer auth, "
        f"{manager}, SQLite in WAL mode. "
        f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), shared by the server and the "
        f"load generator; {results[0].seconds:.0f} s per endpoint after a warm-up.",
        "",
        "| endpoint | clients | answers | errors | throughput (req/s) | p50 (ms) | p99 (ms) | max (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| `{r.endpoint}` | {r.clients} | {r.requests} | {r.errors} | {r.throughput:.0f} | "
            f"{r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.max_ms:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per endpoint")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per endpoint")
    parser.add_argument("--ray", action="store_true", help="the server's manager runs over a local Ray")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the server process
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.data_dir, os.environ["ETRAIN_API_TOKEN"], args.ray)
        return
    print(f"API: {args.clients} clients, {args.seconds:g} s per endpoint", flush=True)
    results = run(clients=args.clients, seconds=args.seconds, warmup_s=args.warmup, use_ray=args.ray)
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(results, use_ray=args.ray)
    (args.out / "api.md").write_text(text)
    (args.out / "api.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    print(f"\n{text}", flush=True)


if __name__ == "__main__":
    main()
