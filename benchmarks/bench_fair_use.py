"""`make bench` (fair use): one tenant floods the control plane; another tenant's reads must not notice.

Issue #17's load, against a real control plane in its own process (``etrain serve``'s stack: uvicorn, the
FastAPI app with bearer auth and tenants, the real ``JobManager`` and its poller, SQLite in WAL mode; Ray
replaced by the tests' ``FakeRuntime``, whose health report is made to take ``--ray-health-ms`` as a call
to Ray's GCS does) with the server's default caps:

* tenant ``alice`` opens ``--streams`` (200) event streams (``follow=true``) at once and holds every one
  the server accepts for the whole phase;
* ``--plans`` (30) of alice's clients ask ``POST /v1/plan`` for an auto layout (``examples/llama-70b-plan.yaml``,
  the planner's search) in a closed loop;
* ``--health`` (300) anonymous clients each ask ``GET /healthz`` once a second;

while tenant ``bob`` reads his job (``GET /v1/jobs/{id}``, one closed-loop client) and the latency of
each answer is recorded. Phases: ``quiet`` (bob alone), ``flood`` (alice's refused clients wait the
``Retry-After`` the 429 names, as the HTTP spec asks) and ``flood, Retry-After ignored`` (they retry at
once: what caps cannot stop, since each refusal still costs the server a request; reported, not the
target). Target: bob's p99 under 50 ms in the flood on a 2-core machine.

The flood is one asyncio process with a minimal HTTP/1.1 client (bench_api.py's approach) and bob's client
another (sharing the flood's event loop, his timings would include the client's own delays), both on the
same cores as the server; loopback only, every wait bounded. Writes ``<out>/fair_use.md`` (the
table) and ``<out>/fair_use.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.bench_api import HOST, REPO, Connection, example_body, free_port, wait_healthy

REQUEST_TIMEOUT_S = 30.0
VICTIM_TOKEN = "ETRAIN_BENCH_TOKEN"  # how the measuring client gets bob's token (never on a command line)
TARGET_P99_MS = 50.0
TENANTS = ("alice", "bob")  # alice floods, bob is measured


@dataclass
class Latencies:
    answers: int = 0
    errors: int = 0  # answers other than 200
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0

    @classmethod
    def of(cls, seconds: list[float], errors: int) -> Latencies:
        if not seconds:
            return cls(errors=errors)
        ordered = sorted(seconds)
        return cls(
            answers=len(ordered),
            errors=errors,
            p50_ms=1e3 * statistics.median(ordered),
            p99_ms=1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            max_ms=1e3 * ordered[-1],
        )


@dataclass
class Phase:
    name: str
    seconds: float
    victim: Latencies
    load_average: float = 0.0  # the machine's 1-minute load average at the end of the phase
    streams_accepted: int = 0
    streams_refused: int = 0  # 429 with a Retry-After header
    streams_other: int = 0  # anything else (a 429 without Retry-After counts here)
    plans_ok: int = 0
    plans_refused: int = 0  # 429 with Retry-After
    plans_other: int = 0
    health: Latencies = field(default_factory=Latencies)


# -- the server process --------------------------------------------------------------------------------


def serve(port: int, data_dir: Path, ray_health_s: float) -> None:
    """Run the control plane in this process (``--serve``); tokens come from the environment."""
    import uvicorn

    from etrain.api.app import create_app
    from etrain.service.manager import JobManager
    from etrain.service.settings import Settings

    sys.path.insert(0, str(REPO))
    from tests.fakes import FakeRuntime

    settings = Settings.from_env(
        {name: os.environ[name] for name in ("ETRAIN_API_TOKEN", "ETRAIN_API_TOKENS")},
        host=HOST,
        port=port,
        data_dir=data_dir,
    )
    runtime = FakeRuntime(steps_per_update=1)
    fake_health = runtime.health

    def ray_health() -> dict:  # what RayRuntime.health reports, after a GCS round trip's time
        time.sleep(ray_health_s)
        return {**fake_health(), "resources": {"CPU": 2.0, "node:10.0.0.1": 1.0}}

    runtime.health = ray_health
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


# -- a minimal HTTP/1.1 client ---------------------------------------------------------------------------


# -- the load --------------------------------------------------------------------------------------------


async def _victim(port: int, token: str, path: str, *, measure_from: float, stop_at: float) -> Latencies:
    latencies, errors = [], 0
    connection = Connection(port, token)
    try:
        while (sent := time.perf_counter()) < stop_at or not latencies:  # at least one answer in the window
            status, _, _ = await asyncio.wait_for(connection.request("GET", path), REQUEST_TIMEOUT_S)
            if sent >= measure_from:
                latencies.append(time.perf_counter() - sent)
                errors += status != 200
    finally:
        await connection.close()
    return Latencies.of(latencies, errors)


async def _victim_process(port: int, token: str, path: str, *, warmup_s: float, seconds: float) -> Latencies:
    """Bob's client in a process of its own: sharing the flood's event loop, his answers would wait for the
    flood's (hundreds of connections) to be read, and the client's delay would count as the server's."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "benchmarks.bench_fair_use",
        "--victim",
        str(port),
        "--path",
        path,
        "--warmup",
        str(warmup_s),
        "--seconds",
        str(seconds),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            VICTIM_TOKEN: token,
        },
    )
    out, _ = await asyncio.wait_for(child.communicate(), warmup_s + seconds + 2 * REQUEST_TIMEOUT_S)
    if child.returncode != 0:
        raise RuntimeError(f"the measuring client exited with {child.returncode}")
    return Latencies(**json.loads(out))


def _measure_victim(port: int, path: str, warmup_s: float, seconds: float) -> None:
    """``--victim``: measure ``GET path`` from this process; the numbers as JSON on stdout."""
    start = time.perf_counter()
    latencies = asyncio.run(
        _victim(port, os.environ[VICTIM_TOKEN], path, measure_from=start + warmup_s, stop_at=start + warmup_s + seconds)
    )
    print(json.dumps(asdict(latencies)), flush=True)


async def _streams(port: int, token: str, path: str, count: int, phase: Phase, stop: asyncio.Event) -> None:
    """Open ``count`` streams at once; hold the accepted ones (reading what they send) until ``stop``."""

    async def one() -> None:
        connection = Connection(port, token)
        try:
            status, headers = await asyncio.wait_for(connection.send("GET", path), REQUEST_TIMEOUT_S)
            if status == 200:
                phase.streams_accepted += 1
                while not stop.is_set():  # read the stream (keepalives, events) so the server never blocks
                    try:
                        await asyncio.wait_for(connection.reader.read(65536), 0.25)
                    except TimeoutError:
                        pass
                return
            await connection.reader.readexactly(int(headers.get("content-length", "0")))
            if status == 429 and headers.get("retry-after", "").isdigit():
                phase.streams_refused += 1
            else:
                phase.streams_other += 1
        finally:
            await connection.close()

    await asyncio.gather(*(one() for _ in range(count)))


async def _plans(
    port: int, token: str, body: bytes, count: int, phase: Phase, stop: asyncio.Event, *, polite: bool
) -> None:
    """``count`` closed-loop clients asking for plans; a refused one waits Retry-After when ``polite``."""

    async def one() -> None:
        connection = Connection(port, token)
        try:
            while not stop.is_set():
                status, headers, _ = await asyncio.wait_for(
                    connection.request("POST", "/v1/plan", body), REQUEST_TIMEOUT_S
                )
                if status == 200:
                    phase.plans_ok += 1
                elif status == 429 and headers.get("retry-after", "").isdigit():
                    phase.plans_refused += 1
                    if polite:
                        try:
                            await asyncio.wait_for(stop.wait(), float(headers["retry-after"]))
                        except TimeoutError:
                            pass
                else:
                    phase.plans_other += 1
        finally:
            await connection.close()

    await asyncio.gather(*(one() for _ in range(count)))


async def _health(port: int, count: int, stop: asyncio.Event) -> Latencies:
    """``count`` anonymous probers, each asking /healthz once a second (spread over the second)."""
    latencies: list[float] = []
    errors = 0

    async def one(offset: float) -> None:
        nonlocal errors
        connection = Connection(port, None)
        try:
            await asyncio.sleep(offset)
            while not stop.is_set():
                sent = time.perf_counter()
                status, _, _ = await asyncio.wait_for(connection.request("GET", "/healthz"), REQUEST_TIMEOUT_S)
                latencies.append(time.perf_counter() - sent)
                errors += status != 200
                try:
                    await asyncio.wait_for(stop.wait(), max(0.0, 1.0 - (time.perf_counter() - sent)))
                except TimeoutError:
                    pass
        finally:
            await connection.close()

    await asyncio.gather(*(one(i / max(count, 1)) for i in range(count)))
    return Latencies.of(latencies, errors)


async def _phase(
    port: int,
    tokens: dict[str, str],
    jobs: dict[str, str],
    name: str,
    *,
    flood: bool,
    polite: bool,
    streams: int,
    plans: int,
    health: int,
    seconds: float,
    warmup_s: float,
) -> Phase:
    """One phase: the floods (none when not ``flood``; a count of 0 leaves that one out), bob measured."""
    phase = Phase(name=name, seconds=seconds, victim=Latencies())
    stop = asyncio.Event()
    floods = []
    if flood:
        follow = f"/v1/jobs/{jobs['alice']}/events?follow=true"
        floods = [
            asyncio.create_task(_streams(port, tokens["alice"], follow, streams, phase, stop)),
            asyncio.create_task(
                _plans(port, tokens["alice"], example_body("llama-70b-plan.yaml"), plans, phase, stop, polite=polite)
            ),
        ]
        prober = asyncio.create_task(_health(port, health, stop))
        await asyncio.sleep(0)  # the floods' connections go out before bob's first request
    phase.victim = await _victim_process(
        port, tokens["bob"], f"/v1/jobs/{jobs['bob']}", warmup_s=warmup_s, seconds=seconds
    )
    stop.set()
    if flood:
        await asyncio.wait_for(asyncio.gather(*floods), REQUEST_TIMEOUT_S + 5)
        phase.health = await asyncio.wait_for(prober, REQUEST_TIMEOUT_S + 5)
        await asyncio.sleep(0.5)  # the server notices the closed streams and frees their slots
    phase.load_average = os.getloadavg()[0]
    return phase


async def _start(port: int, tokens: dict[str, str], server: subprocess.Popen, timeout_s: float = 60) -> dict[str, str]:
    """Wait for /healthz; then each tenant submits a long job (bob's is read, alice's is streamed)."""
    await wait_healthy(port, server, timeout_s)
    spec = json.loads(example_body("3d.yaml"))
    spec["training"]["steps"] = 10**6  # keeps running (and the poller writing) through the measurement
    jobs = {}
    for tenant in TENANTS:
        connection = Connection(port, tokens[tenant])
        try:
            body = json.dumps({**spec, "name": tenant}).encode()
            status, _, body = await connection.request("POST", "/v1/jobs", body)
        finally:
            await connection.close()
        if status != 201:
            raise RuntimeError(f"submitting {tenant}'s job failed: HTTP {status} {body[:500]!r}")
        jobs[tenant] = json.loads(body)["id"]
    return jobs


def run(
    *,
    seconds: float,
    warmup_s: float,
    streams: int,
    plans: int,
    health: int,
    ray_health_ms: float,
    hostile: bool = True,
) -> list[Phase]:
    from etrain.service.access.api_token import new_api_token

    tokens = {name: new_api_token(24) for name in ("admin", *TENANTS)}
    port = free_port()
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath,
        "ETRAIN_API_TOKEN": tokens["admin"],
        "ETRAIN_API_TOKENS": ",".join(f"{tenant}={tokens[tenant]}" for tenant in TENANTS),
    }
    with tempfile.TemporaryDirectory(prefix="etrain-bench-fair-") as data_dir:
        # tokens travel in the environment: a command line is readable by every user of the machine
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.bench_fair_use",
                "--serve",
                str(port),
                "--data-dir",
                data_dir,
                "--ray-health-ms",
                str(ray_health_ms),
            ],
            cwd=REPO,
            env=env,
        )
        try:
            jobs = asyncio.run(_start(port, tokens, server))
            kinds = [("quiet (bob alone)", False, True), ("flood", True, True)]
            if hostile:
                kinds.append(("flood, Retry-After ignored", True, False))
            phases = []
            for name, flood, polite in kinds:
                phase = asyncio.run(
                    _phase(
                        port,
                        tokens,
                        jobs,
                        name,
                        flood=flood,
                        polite=polite,
                        streams=streams,
                        plans=plans,
                        health=health,
                        seconds=seconds,
                        warmup_s=warmup_s,
                    )
                )
                print(
                    f"  {name:<28} bob's GET p50 {phase.victim.p50_ms:6.1f} ms  p99 {phase.victim.p99_ms:6.1f} ms "
                    f"({phase.victim.answers} answers, {phase.victim.errors} not 200); streams "
                    f"{phase.streams_accepted} accepted / {phase.streams_refused} refused; plans {phase.plans_ok} "
                    f"/ {phase.plans_refused} refused; /healthz p99 {phase.health.p99_ms:.1f} ms",
                    flush=True,
                )
                phases.append(phase)
            return phases
        finally:
            server.send_signal(signal.SIGINT)  # as Ctrl-C: the server closes its manager (and planner process)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)


def table(phases: list[Phase], *, streams: int, plans: int, health: int, ray_health_ms: float) -> str:
    lines = [
        f"Tenant alice opens {streams} event streams at once (holding the accepted ones), runs {plans} closed-loop "
        f"clients of `POST /v1/plan` (auto layout, examples/llama-70b-plan.yaml) and {health} anonymous clients ask "
        f"`/healthz` once a second each; tenant bob reads `GET /v1/jobs/{{id}}` (one closed-loop client). One uvicorn "
        f"worker, the real JobManager (Ray replaced by FakeRuntime, its health report taking {ray_health_ms:g} ms), "
        f"the server's default caps. {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
        f"shared by the server, the flood and bob's client (and whatever else runs: the machine's load average "
        f"is in the last column); {phases[0].seconds:g} s measured per phase.",
        "",
        "| phase | bob's GETs | not 200 | p50 (ms) | p99 (ms) | max (ms) | streams accepted / refused (429) | "
        "plans 200 / refused (429) | `/healthz` answers | `/healthz` p50 / p99 (ms) | load average |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in phases:
        flood = p.streams_accepted + p.streams_refused + p.streams_other > 0
        streams_cell = (
            (f"{p.streams_accepted} / {p.streams_refused}" + (f" ({p.streams_other} other)" if p.streams_other else ""))
            if flood
            else "–"
        )
        plans_cell = (
            (f"{p.plans_ok} / {p.plans_refused}" + (f" ({p.plans_other} other)" if p.plans_other else ""))
            if flood
            else "–"
        )
        health_cell = f"{p.health.answers} ({p.health.errors} not 200)" if flood else "–"
        health_ms = f"{p.health.p50_ms:.1f} / {p.health.p99_ms:.1f}" if flood else "–"
        lines.append(
            f"| {p.name} | {p.victim.answers} | {p.victim.errors} | {p.victim.p50_ms:.1f} | "
            f"{p.victim.p99_ms:.1f} | {p.victim.max_ms:.1f} | {streams_cell} | {plans_cell} | {health_cell} | "
            f"{health_ms} | {p.load_average:.1f} |"
        )
    flood = next((p for p in phases if p.name == "flood"), None)
    if flood is not None:
        met = (
            "met"
            if flood.victim.answers and flood.victim.p99_ms < TARGET_P99_MS and flood.victim.errors == 0
            else "NOT met"
        )
        lines += [
            "",
            f"Target (bob's p99 < {TARGET_P99_MS:g} ms under the flood, every answer 200): **{met}** "
            f"({flood.victim.p99_ms:.1f} ms).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per phase")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of flood before measuring")
    parser.add_argument("--streams", type=int, default=200, help="event streams alice opens at once")
    parser.add_argument("--plans", type=int, default=30, help="alice's concurrent plan clients")
    parser.add_argument("--health", type=int, default=300, help="anonymous /healthz clients (one probe a second each)")
    parser.add_argument("--ray-health-ms", type=float, default=50.0, help="how long the fake Ray's health takes")
    parser.add_argument("--no-hostile", action="store_true", help="skip the phase whose clients ignore Retry-After")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the server process
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--victim", type=int, metavar="PORT", help=argparse.SUPPRESS)  # bob's measuring client
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.victim is not None:
        _measure_victim(args.victim, args.path, args.warmup, args.seconds)
        return
    if args.serve is not None:
        serve(args.serve, args.data_dir, args.ray_health_ms / 1e3)
        return
    print(
        f"fair use: {args.streams} streams, {args.plans} plan clients, {args.health} /healthz probers; "
        f"{args.seconds:g} s per phase",
        flush=True,
    )
    phases = run(
        seconds=args.seconds,
        warmup_s=args.warmup,
        streams=args.streams,
        plans=args.plans,
        health=args.health,
        ray_health_ms=args.ray_health_ms,
        hostile=not args.no_hostile,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(phases, streams=args.streams, plans=args.plans, health=args.health, ray_health_ms=args.ray_health_ms)
    (args.out / "fair_use.md").write_text(text)
    (args.out / "fair_use.json").write_text(json.dumps([asdict(p) for p in phases], indent=2))
    print(f"\n{text}", flush=True)


if __name__ == "__main__":
    main()
