"""``etrain``: a thin command-line client of the REST API, plus ``etrain serve`` to run the server.

Every command except ``serve``, ``demo`` and ``prepare-data`` (which tokenizes text here) talks HTTP only
(``ETRAIN_URL``, default http://127.0.0.1:8000, and ``ETRAIN_API_TOKEN``), so it works the same
against a laptop server or a cluster. Without ``--token`` / ``ETRAIN_API_TOKEN``, a command sent to a
server on this machine (loopback URL) uses the token that server generated into
``$ETRAIN_DATA_DIR/api-token`` (default ``./.etrain``); a remote server never gets that file's token.
Server errors are printed as field + message + fix and exit non-zero. Every wait has a timeout
(``--timeout`` per HTTP request, ``--max-wait`` for ``watch`` and ``logs -f``, ``--wait`` for
``cancel``). ``watch`` follows the server's event stream (server-sent events, resumed with
Last-Event-ID when the connection drops); ``logs -f`` follows a rank's log file.

Exit codes: 0 success (``watch``: the job SUCCEEDED; ``plan``: feasible; ``cancel``: CANCELLED), 1 an
error or a job that FAILED / was CANCELLED / an infeasible plan, 2 bad usage, 124 ``watch``, ``logs -f``
or ``cancel`` gave up waiting, 130 ^C (one line, no traceback; ``watch`` and ``demo`` close their
progress bar first).

The modules, one job each: ``client`` (HTTP, errors, token, exit codes), ``parser`` (the grammar),
``output`` (text formats), ``jobs`` (the commands that are API requests), ``watch`` (following a job),
``progress`` (its bar or plain lines), ``plot`` (a job's curves into a PNG), ``serve``, ``demo`` and
``prepare_data``. This module only dispatches.
"""

from __future__ import annotations

import sys
from typing import TextIO

from etrain.api.cli.client import EXIT_FAILED, EXIT_INTERRUPTED, ApiError, Client, CliError, client_token
from etrain.api.cli.jobs import COMMANDS
from etrain.api.cli.output import print_error
from etrain.api.cli.parser import build_parser

__all__ = ["main"]


def main(argv: list[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run one ``etrain`` command line; its exit code (see the module docstring)."""
    out = out or sys.stdout
    err = err or sys.stderr
    for stream in (out, err):
        if hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="replace")  # layout strings use "·"; never crash on a C locale
            except (ValueError, OSError):
                pass
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if args.command in ("serve", "demo"):
        return _run_server(args, out, err)
    if args.command == "prepare-data":
        from etrain.api.cli.prepare_data import cmd_prepare_data

        return cmd_prepare_data(args, out, err)
    try:
        token = client_token(args.url, args.token)
    except CliError as error:
        print_error(error, err)
        return EXIT_FAILED
    client = Client(args.url, token=token, timeout_s=args.timeout)
    try:
        return COMMANDS[args.command](client, args, out, err)
    except (ApiError, CliError) as error:
        print_error(error, err)
        return EXIT_FAILED
    except KeyboardInterrupt:  # (`watch` says more about what goes on, and returns on its own)
        print("interrupted", file=err)
        return EXIT_INTERRUPTED
    finally:
        client.close()


def _run_server(args, out: TextIO, err: TextIO) -> int:
    """``serve`` or ``demo``: a settings error or Ray failing to start is printed, without a traceback."""
    if args.command == "serve":
        from etrain.api.cli.serve import cmd_serve as command
    else:
        from etrain.api.cli.demo import cmd_demo as command
    try:
        return command(args, out, err)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except CliError as error:
        print_error(error, err)
        return EXIT_FAILED
    except Exception as error:
        from etrain.workers.protocol.errors import EtrainError

        if not isinstance(error, EtrainError):
            raise
        print_error(CliError(error.message, error.fix), err)
        return EXIT_FAILED
