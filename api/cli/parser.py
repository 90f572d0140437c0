"""The ``etrain`` command line's grammar: every command, its arguments, their defaults and help.

Kept apart from what the commands do so that ``etrain --help`` and the tests that parse documented
command lines (``tests/deploy``) need nothing but argparse.
"""

from __future__ import annotations

import argparse
import os

from etrain.api.cli.client import DEFAULT_URL


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="etrain", description="Elastic training service client and server.")
    parser.add_argument(
        "--url", default=os.environ.get("ETRAIN_URL", DEFAULT_URL), help="API URL (env ETRAIN_URL; default %(default)s)"
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("ETRAIN_API_TOKEN"),
        help="API token (env ETRAIN_API_TOKEN; default for a server on this machine: "
        "$ETRAIN_DATA_DIR/api-token, ETRAIN_DATA_DIR default ./.etrain; a token "
        "that begins with '-' is given as --token=VALUE)",
    )
    parser.add_argument("--timeout", type=_positive, default=30.0, help="seconds per HTTP request (default 30)")
    parser.add_argument("--json", action="store_true", help="print the server's JSON instead of text")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_server_options(command: argparse.ArgumentParser, *, log_level: str) -> None:
        command.add_argument("--host", help="bind address (env ETRAIN_HOST; default 127.0.0.1)")
        command.add_argument("--port", type=int, help="port (env ETRAIN_PORT; default 8000)")
        command.add_argument(
            "--data-dir", help="jobs database and checkpoints (env ETRAIN_DATA_DIR; default ./.etrain)"
        )
        command.add_argument("--ray-address", help="existing Ray cluster (env ETRAIN_RAY_ADDRESS; default: start one)")
        command.add_argument(
            "--enable-chaos", action="store_true", help="allow fault injection (env ETRAIN_ENABLE_CHAOS=1)"
        )
        command.add_argument(
            "--log-level", default=log_level, choices=["trace", "debug", "info", "warning", "error", "critical"]
        )

    def add_wait_options(command: argparse.ArgumentParser) -> None:
        command.add_argument("--interval", type=_positive, default=1.0, help="seconds between polls (default 1)")
        command.add_argument(
            "--max-wait",
            type=_positive,
            default=24 * 3600.0,
            help="give up (exit 124) after this many seconds (default 86400)",
        )

    def add_display_options(command: argparse.ArgumentParser) -> None:
        command.add_argument(
            "--plain",
            action="store_true",
            help="plain lines instead of the live progress bar (the default when the output is not a terminal)",
        )

    serve = commands.add_parser("serve", help="run the API server (starts or joins Ray)")
    add_server_options(serve, log_level="info")

    demo = commands.add_parser("demo", help="serve (local Ray + API + dashboard) and run one job: `make run`")
    demo.add_argument("file", help="job spec (YAML or JSON)")
    add_server_options(demo, log_level="warning")
    add_wait_options(demo)
    add_display_options(demo)
    demo.add_argument(
        "--start-timeout",
        type=_positive,
        default=300.0,
        help="seconds to wait for the server and Ray to come up (default 300)",
    )
    demo.add_argument(
        "--exit-when-done",
        action="store_true",
        help="stop the server when the job ends (default: keep serving until Ctrl-C)",
    )

    submit = commands.add_parser("submit", help="submit a job spec (YAML or JSON file, '-' for stdin)")
    submit.add_argument("file")
    submit.add_argument("--watch", action="store_true", help="follow the job until it ends (a live progress bar)")
    add_wait_options(submit)
    add_display_options(submit)

    listing = commands.add_parser("list", help="list jobs, newest first")
    listing.add_argument("--status", help="only jobs in this status (e.g. RUNNING)")
    listing.add_argument("--limit", type=int, default=100)
    listing.add_argument("--offset", type=int, default=0)

    commands.add_parser("status", help="show one job").add_argument("job_id")

    watch = commands.add_parser(
        "watch",
        help="follow a job: a live progress bar (step, loss, tokens/s, MFU, ETA, "
        "restarts) under its events; exit 0 on success",
    )
    watch.add_argument("job_id")
    watch.add_argument("--every", type=int, default=1, help="plain output: print every Nth step (default: all)")
    add_wait_options(watch)
    add_display_options(watch)

    plot = commands.add_parser(
        "plot",
        help="draw a job's loss, tokens/s, MFU and goodput over its steps, restarts, "
        "resizes and checkpoints marked, into a PNG",
    )
    plot.add_argument("job_id")
    plot.add_argument("-o", "--out", required=True, help="the image to write (PNG; .svg and .pdf also work)")
    plot.add_argument("--dpi", type=_positive, default=100.0, help="dots per inch (default 100: 1000x1100 pixels)")

    cancel = commands.add_parser("cancel", help="cancel a job and wait until it has stopped")
    cancel.add_argument("job_id")
    cancel.add_argument("--no-wait", action="store_true", help="return once the cancel is requested")
    cancel.add_argument(
        "--wait", type=_positive, default=120.0, help="give up waiting (exit 124) after this many seconds (default 120)"
    )
    cancel.add_argument("--interval", type=_positive, default=0.5, help="seconds between polls (default 0.5)")

    logs = commands.add_parser("logs", help="print a rank's recent log lines (-f: keep following)")
    logs.add_argument("job_id")
    logs.add_argument("--rank", type=int, default=0, help="the rank (default 0)")
    logs.add_argument("--tail", type=int, default=200, help="how many recent lines (default 200, at most 10000)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    add_wait_options(logs)

    scale = commands.add_parser("scale", help="resize a job's data parallelism")
    scale.add_argument("job_id")
    scale.add_argument("--dp", type=int, required=True, help="the new data-parallel degree")

    events = commands.add_parser("events", help="print a job's events")
    events.add_argument("job_id")
    events.add_argument("--since", type=int, default=0, help="only events after this sequence number")

    commands.add_parser("cluster", help="show nodes, free CPUs/GPUs, what each job holds and the queue")

    plan = commands.add_parser("plan", help="check a spec and show the planner's estimate; starts nothing")
    plan.add_argument("file")

    export = commands.add_parser(
        "export", help="write a committed checkpoint as a Hugging Face folder (from_pretrained loads it)"
    )
    export.add_argument("job_id")
    export.add_argument("--step", type=int, help="a committed checkpoint step (default: the newest)")
    export.add_argument("--out", required=True, help="a new or empty folder to write")
    export.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="the weights' dtype (default: the job's checkpoint.export_dtype, float32 unless set)",
    )
    export.add_argument(
        "--max-wait", type=_positive, default=3600.0, help="seconds to wait for the export (default 3600)"
    )

    chaos = commands.add_parser("chaos", help="inject a fault (servers started with --enable-chaos)")
    chaos.add_argument("job_id")
    chaos.add_argument(
        "action",
        choices=[
            "kill_rank",
            "kill_actor",
            "slow_rank",
            "hang_rank",
            "fail_health_check",
            "hold_host_memory",
            "corrupt_checkpoint",
        ],
    )
    chaos.add_argument("--rank", type=int)
    chaos.add_argument("--factor", type=float, help="slow_rank: how many times slower (1 ends it)")
    chaos.add_argument("--gib", type=float, help="hold_host_memory: GiB the rank holds (0 lets go)")
    chaos.add_argument("--step", type=int, help="corrupt_checkpoint: the checkpoint step")
    chaos.add_argument("--at-step", type=int, help="inject when the job reaches this step")

    prepare = commands.add_parser(
        "prepare-data",
        help="tokenize text once with a tokenizer.json into the cache `data: {kind: text, tokenizer: ...}` "
        "reads (runs here; no server)",
    )
    prepare.add_argument("path", help="a UTF-8 text file or a folder of text files (data.path)")
    prepare.add_argument(
        "--tokenizer", required=True, help="a Hugging Face tokenizer.json, or the folder holding one (data.tokenizer)"
    )
    prepare.add_argument(
        "--cache-dir",
        help="the service's token cache, where a job with data.tokenizer finds the corpus (default: the one "
        "`etrain serve` would use with this environment, not its --data-dir flag: ETRAIN_TOKEN_CACHE_DIR, else "
        "<ETRAIN_CHECKPOINT_ROOT or ETRAIN_DATA_DIR/checkpoints>/.token-cache; ETRAIN_DATA_DIR default ./.etrain, "
        "from this directory)",
    )
    prepare.add_argument(
        "--out",
        help="write the .bin here instead of into the token cache, --cache-dir or not (then train on it with "
        "data.kind: tokens)",
    )
    return parser
