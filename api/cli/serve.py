"""``etrain serve``: run the API server in this process (it starts a local Ray or joins one).

Also what ``etrain demo`` starts its server with: the settings from the environment and the flags,
an admin token generated on first start when none is configured, and a banner saying where the API,
the Ray dashboard and the data are once everything is up.
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from etrain.api.cli.client import EXIT_OK

#: On Ctrl-C the server waits this long for open requests, then cancels them: an event stream
#: (``watch``) would otherwise hold the shutdown until its job ends.
SHUTDOWN_GRACE_S = 5.0


def cmd_serve(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import uvicorn

    settings, app = server_app(args, out)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    return EXIT_OK


def server_app(args: argparse.Namespace, out: TextIO) -> tuple[Any, Any]:
    """The server's settings and its ASGI app, which prints the banner once it is up (``serve``, ``demo``)."""
    from etrain.api.app import create_app

    settings = _server_settings(args, out)
    return settings, create_app(settings, on_ready=_announce(settings, out))


def _server_settings(args: argparse.Namespace, out: TextIO):
    """Settings from the environment and the flags; with no token configured at all, the admin token
    from ``<data-dir>/api-token`` (generated at the first start, mode 0600), and a line saying where."""
    import dataclasses

    from etrain.service.settings import Settings

    settings = Settings.from_env(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        ray_address=args.ray_address,
        enable_chaos=True if args.enable_chaos else None,
    )
    if settings.auth_configured:
        return settings
    from etrain.service.access.api_token import ensure_api_token

    provisioned = ensure_api_token(settings.data_dir)
    print(
        f"API token:      {provisioned.path.resolve()} ({'generated' if provisioned.created else 'existing'}, "
        "mode 0600; the admin token: `etrain` reads it for a server on this machine when ETRAIN_DATA_DIR "
        "points at this data directory, other clients send it as 'Authorization: Bearer <token>')",
        file=out,
    )
    return dataclasses.replace(settings, api_token=provisioned.token)


def _announce(settings: Any, out: TextIO):
    """``on_ready`` callback: print where everything is once the manager (and Ray) is up."""

    def ready(manager: Any) -> None:
        runtime = getattr(manager, "runtime", None)
        dashboard = getattr(runtime, "dashboard_url", None) or (
            settings.dashboard_url if settings.ray_address is None else f"see the Ray cluster at {settings.ray_address}"
        )
        print(f"etrain API:     {settings.api_url}  (docs: {settings.api_url}/docs)", file=out)
        print(f"Ray dashboard:  {dashboard}", file=out)
        hint = getattr(runtime, "dashboard_token_hint", None)
        if hint:
            print(f"                {hint}", file=out)
        print(f"data directory: {settings.data_dir.resolve()}", file=out)
        if settings.enable_chaos:
            print("fault injection (chaos) is ENABLED", file=out)
        out.flush()

    print(
        f"starting etrain on {settings.api_url} (Ray: {settings.ray_address or 'a new local instance'}) ...", file=out
    )
    out.flush()
    return ready
