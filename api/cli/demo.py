"""``etrain demo`` (``make run``): the server (local Ray, API, dashboard) and one job, in one process.

The server runs on the main thread, so Ctrl-C shuts it down the normal way (workers stopped, Ray
shut down); a helper thread waits for it to start, submits the spec and follows the job (a progress
bar on a terminal, ``watch.py``).

Ctrl-C prints one line and exits 130, with nothing after it: the watcher's bar is closed and its event
stream let go first (:class:`~etrain.api.cli.watch.WatchControl`: the server then has no open request
to wait out or cancel), and while the server and Ray shut down, whatever they write to standard error
(uvicorn's cancelled requests, Ray's and absl's C++ logs and stack traces, which write to file
descriptor 2 directly) goes to ``<data-dir>/shutdown.log`` instead of the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from etrain.api.cli.client import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_TIMEOUT, ApiError, Client, CliError
from etrain.api.cli.jobs import load_spec
from etrain.api.cli.output import print_error
from etrain.api.cli.progress import Display, make_display
from etrain.api.cli.serve import SHUTDOWN_GRACE_S, server_app
from etrain.api.cli.watch import WatchControl, watch_job

#: Where the server's and Ray's shutdown output goes, in the data directory.
SHUTDOWN_LOG = "shutdown.log"


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Standard error into ``path`` (appended), at the file-descriptor level as well as ``sys.stderr``:
    Ray's core worker and absl's failure handlers write to descriptor 2 from C++, below Python."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    with open(path, "a", encoding="utf-8") as log:
        saved = os.dup(2)
        try:
            os.dup2(log.fileno(), 2)
            with contextlib.redirect_stderr(log):
                yield
        finally:
            with contextlib.suppress(Exception):
                log.flush()
            os.dup2(saved, 2)
            os.close(saved)


def quiet_until_exit(path: Path) -> None:
    """Standard error into ``path`` for the rest of the process, at the descriptor level too: after a
    Ctrl-C, Ray's core worker still writes a line or two from C++ while the interpreter exits (its GCS
    connection closing), after the shutdown itself was already quiet. Only for a process about to exit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    log = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open until the process exits
    os.dup2(log.fileno(), 2)
    sys.stderr = log


def cmd_demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Serve and run ``args.file``; the job's exit code, the server's failure, or 130 after Ctrl-C."""
    import uvicorn

    spec = load_spec(args.file)  # a broken file fails before Ray starts
    settings, app = server_app(args, out)
    shutdown_log = Path(settings.data_dir) / SHUTDOWN_LOG
    control = WatchControl()
    # The bar starts once the server is up (its banner printed, Ray's start-up lines written), and never
    # after a Ctrl-C: the lock orders its start against the shutdown's close.
    shown: dict[str, Display] = {}
    shown_lock = threading.Lock()

    def close_display() -> None:
        with shown_lock:
            control.stop()
            if "display" in shown:
                shown["display"].close()

    class DemoServer(uvicorn.Server):
        """uvicorn's server, told apart: a Ctrl-C (its signal handler) from a stop the job asked for."""

        interrupted = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.interrupted = True
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            close_display()  # and the watcher lets go of its event stream: nothing for the server to wait out
            if self.interrupted:
                print(
                    f"interrupted: stopping the job's server, its API and Ray (their shutdown messages go to "
                    f"{shutdown_log})",
                    file=err,
                )
                err.flush()
            with stderr_to(shutdown_log):
                await super().shutdown(sockets)

    server = DemoServer(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
    )
    outcome: dict[str, int] = {}

    def drive() -> None:
        deadline = time.monotonic() + args.start_timeout
        while not server.started:
            if server.should_exit or time.monotonic() > deadline:
                if not server.should_exit:
                    print(f"error: the server did not start within {args.start_timeout:g}s", file=err)
                    outcome["code"] = EXIT_TIMEOUT
                    server.should_exit = True
                return
            time.sleep(0.1)
        with shown_lock:
            if control.stopped:
                return
            display = shown["display"] = make_display(out, plain=args.plain)
        client = Client(settings.api_url, token=settings.api_token, timeout_s=args.timeout)
        try:
            job = client.post("/v1/jobs", spec)
            display.line(f"submitted {job['id']}: layout {job.get('layout') or '-'} (world size {job['world_size']})")
            outcome["code"] = watch_job(
                client,
                job["id"],
                interval_s=args.interval,
                max_wait_s=args.max_wait,
                out=out,
                err=err,
                display=display,
                control=control,
            )
            if control.stopped:
                return
            if args.exit_when_done:
                server.should_exit = True
            else:
                print(f"the API ({settings.api_url}) and the Ray dashboard stay up; Ctrl-C stops everything", file=out)
                out.flush()
        except (ApiError, CliError) as error:
            if not server.should_exit:  # errors while shutting down are expected; stay quiet
                display.close()
                print_error(error, err)
                outcome["code"] = EXIT_FAILED
                server.should_exit = True
        finally:
            client.close()

    driver = threading.Thread(target=drive, name="etrain-demo", daemon=True)
    driver.start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shut down cleanly, then re-raised the signal
        pass
    finally:
        server.should_exit = True
        close_display()
        driver.join(timeout=5)
        _close_leftover_manager(app, shutdown_log)
    if server.interrupted:
        if err is sys.__stderr__:  # a real terminal, not a caller's buffer: the process exits next
            quiet_until_exit(shutdown_log)
        return EXIT_INTERRUPTED
    if server.started is False and "code" not in outcome:
        return EXIT_FAILED  # the server never came up (uvicorn has logged why)
    return outcome.get("code", EXIT_INTERRUPTED)


def _close_leftover_manager(app: Any, shutdown_log: Path) -> None:
    """A second Ctrl-C makes uvicorn skip the app's shutdown: stop the job manager (and Ray) here, quietly."""
    manager = getattr(app.state, "manager", None)
    if manager is None:
        return
    app.state.manager = None
    try:
        with stderr_to(shutdown_log):
            manager.close()
    except KeyboardInterrupt:
        pass  # a third Ctrl-C: leave the rest to the process's exit
