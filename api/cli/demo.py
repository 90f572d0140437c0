"""``etrain demo`` (``make run``): the server (local Ray, API, dashboard) and one job, in one process.

The server runs on the main thread, so Ctrl-C shuts it down the normal way (workers stopped, Ray
shut down); a helper thread waits for it to start, submits the spec and follows the job.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import TextIO

from etrain.api.cli.client import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_TIMEOUT, ApiError, CliError, Client
from etrain.api.cli.jobs import load_spec
from etrain.api.cli.output import print_error
from etrain.api.cli.serve import SHUTDOWN_GRACE_S, server_app
from etrain.api.cli.watch import watch_job


def cmd_demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Serve and run ``args.file``; the job's exit code (or the server's failure)."""
    import uvicorn

    spec = load_spec(args.file)  # a broken file fails before Ray starts
    settings, app = server_app(args, out)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
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
        client = Client(settings.api_url, token=settings.api_token, timeout_s=args.timeout)
        try:
            job = client.post("/v1/jobs", spec)
            print(f"submitted {job['id']}: layout {job.get('layout') or '-'} (world size {job['world_size']})",
                  file=out)
            outcome["code"] = watch_job(client, job["id"], interval_s=args.interval, max_wait_s=args.max_wait,
                                        out=out, err=err)
            if args.exit_when_done:
                server.should_exit = True
            else:
                print(f"the API ({settings.api_url}) and the Ray dashboard stay up; Ctrl-C stops everything",
                      file=out)
                out.flush()
        except (ApiError, CliError) as error:
            if not server.should_exit:  # errors while shutting down are expected; stay quiet
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
        return outcome.get("code", EXIT_INTERRUPTED)
    finally:
        server.should_exit = True
        driver.join(timeout=5)
    if server.started is False and "code" not in outcome:
        return EXIT_FAILED  # the server never came up (uvicorn has logged why)
    return outcome.get("code", EXIT_INTERRUPTED)
