"""What people look at while a job runs: the progress bar of ``etrain watch`` / ``submit --watch`` /
``demo`` (``make run``), its plain-line fallback, and Ctrl-C.

The numbers (:class:`JobProgress`) are checked as numbers; the bar by rendering it on a fake terminal
(a StringIO that says it is a tty) and reading the text back without its escape codes; Ctrl-C by
sending this process a real SIGINT while ``watch`` or ``demo`` runs against a real uvicorn server over
the in-memory fake manager (no Ray)."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import sys
import threading
import time
import types

import pytest

from etrain.api import cli
from etrain.api.cli.progress import BarDisplay, JobProgress, PlainDisplay, fmt_duration, make_display
from etrain.api.cli.serve import SHUTDOWN_GRACE_S
from etrain.service.settings import Settings
from etrain.service.store.job_store import JobStore
from tests.api.test_cli import etrain, free_port, serving, submitted_id, write_spec
from tests.fakes import InMemoryManager, simulated_loss

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal(io.StringIO):
    """Output that says it is a terminal (rich then draws a live bar, with cursor moves)."""

    def isatty(self) -> bool:
        return True


def screen_lines(raw: str) -> list[str]:
    """What a terminal shows, line by line: escape codes dropped, each redraw (\\r) a line of its own."""
    return [line.rstrip() for line in re.split(r"[\r\n]+", ANSI.sub("", raw)) if line.strip()]


@pytest.fixture(autouse=True)
def a_real_terminal_type(monkeypatch, tmp_path):
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "140")
    monkeypatch.setenv("ETRAIN_DATA_DIR", str(tmp_path))  # the CLI reads the test server's token there
    monkeypatch.delenv("ETRAIN_API_TOKEN", raising=False)


# -- the numbers ---------------------------------------------------------------------------------------------------


def test_the_eta_comes_from_the_recent_step_rate_and_restarts_after_a_rollback():
    progress = JobProgress()
    progress.on_job({"status": "RUNNING", "step": 0, "restarts": 0, "spec": {"training": {"steps": 100}}})
    assert progress.eta_s() is None and progress.text().endswith("ETA -  restarts 0")
    for step in range(1, 11):  # 2 steps a second
        progress.on_step({"step": step, "ts": 1000.0 + step / 2, "loss": 5.0 - step / 10, "tokens_per_s": 4096.0})
    assert progress.steps_per_s() == pytest.approx(2.0)
    assert progress.eta_s() == pytest.approx(45.0)  # 90 steps left at 2/s
    assert progress.text() == "step 10/100  loss 4.0000  4,096 tok/s  ETA 0:45  restarts 0"

    # a restart resumed from step 5: the old rate says nothing about the new attempt
    progress.on_job({"status": "RECOVERING", "step": 5, "restarts": 1, "spec": {"training": {"steps": 100}}})
    progress.on_step({"step": 6, "ts": 1100.0, "loss": 4.5, "mfu": 0.4123})
    assert progress.eta_s() is None and progress.restarts == 1
    progress.on_step({"step": 8, "ts": 1101.0, "loss": 4.3})  # 2 steps in 1 s: 92 left -> 46 s
    assert progress.eta_s() == pytest.approx(46.0)
    assert progress.text() == "step 8/100  loss 4.3000  4,096 tok/s  MFU 41.2%  ETA 0:46  restarts 1"


@pytest.mark.parametrize(("seconds", "text"), [(7.4, "0:07"), (249, "4:09"), (3909, "1:05:09"), (-3, "0:00")])
def test_durations_read_like_a_clock(seconds, text):
    assert fmt_duration(seconds) == text


def test_an_unknown_total_shows_a_question_mark_and_no_eta():
    progress = JobProgress()
    progress.on_job({"status": "STARTING", "step": 0, "restarts": 0, "spec": {}})
    progress.on_step({"step": 1, "ts": 1.0})
    progress.on_step({"step": 2, "ts": 2.0})
    assert progress.text() == "step 2/?  ETA -  restarts 0"


# -- the displays --------------------------------------------------------------------------------------------------


def test_the_bar_redraws_in_place_with_status_and_events_printed_above_it():
    out = Terminal()
    display = BarDisplay(out, width=140)
    display.job({"status": "RUNNING", "step": 0, "restarts": 2, "spec": {"training": {"steps": 10}}}, changed=True)
    for step in range(1, 6):
        display.step(
            {"step": step, "ts": 10.0 + step, "loss": 3.0 - step / 10, "tokens_per_s": 12345.6, "mfu": 0.25}, shown=True
        )
    display.event({"ts": 0.0, "kind": "checkpoint", "detail": {"message": "committed step 5"}})
    display.close()
    display.step({"step": 6, "ts": 16.0}, shown=True)  # after close: nothing
    display.line("after close")

    lines = screen_lines(out.getvalue())
    assert "\x1b[" in out.getvalue()  # drawn with cursor moves, not appended lines
    assert "status: RUNNING" in lines and any(line.endswith("] checkpoint: committed step 5") for line in lines)
    assert "after close" not in lines and not any("step 6/10" in line for line in lines)
    assert lines[-1].startswith("RUNNING ━")
    assert lines[-1].endswith("step 5/10  loss 2.5000  12,346 tok/s  MFU 25.0%  ETA 0:05  restarts 2")
    # the event was printed above the bar: the bar is drawn again below it
    event_at = max(i for i, line in enumerate(lines) if "checkpoint: committed" in line)
    assert any("step 5/10" in line for line in lines[event_at + 1 :])


def test_a_narrow_terminal_keeps_the_numbers_and_drops_the_bar():
    out = Terminal()
    display = BarDisplay(out, width=70)
    display.job({"status": "RUNNING", "step": 0, "restarts": 0, "spec": {"training": {"steps": 1000}}}, changed=False)
    display.step({"step": 5, "ts": 1.0, "loss": 2.5, "tokens_per_s": 1000.0}, shown=True)
    display.close()
    last = screen_lines(out.getvalue())[-1]
    assert "━" not in last and last.startswith("RUNNING") and "step 5/1000  loss 2.5000" in last


def test_plain_lines_where_the_output_is_not_a_terminal(monkeypatch):
    assert isinstance(make_display(io.StringIO()), PlainDisplay)
    assert isinstance(make_display(Terminal(), plain=True), PlainDisplay)
    monkeypatch.setenv("TERM", "dumb")
    assert isinstance(make_display(Terminal()), PlainDisplay)


# -- the commands -----------------------------------------------------------------------------------------------------


def run_cli(*args: str, out: io.StringIO | None = None) -> tuple[int, str, str]:
    out, err = out if out is not None else io.StringIO(), io.StringIO()
    return cli.main(list(args), out=out, err=err), out.getvalue(), err.getvalue()


@pytest.fixture
def manager(tmp_path):
    with JobStore(tmp_path / "etrain.db") as store:
        yield InMemoryManager(store, base_dir=str(tmp_path), steps_per_poll=4)


def test_watch_on_a_terminal_draws_the_bar_and_prints_only_status_and_events(manager, tmp_path):
    manager.MFU = 0.375
    with serving(manager, tmp_path) as url:
        job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))
        code, out, err = run_cli("--url", url, "watch", job_id, out=Terminal())
    assert code == 0, (out, err)
    lines = screen_lines(out)
    assert not any(line.startswith("step ") for line in lines)  # no line per step: the bar shows them
    assert [line for line in lines if line.startswith("status: ")] == ["status: RUNNING", "status: SUCCEEDED"]
    assert [line.split("] ", 1)[1] for line in lines if line.startswith("[")][-2:] == [
        "checkpoint: committed step 10",
        "succeeded: finished 10 steps",
    ]
    final_bar = [line for line in lines if line.startswith("SUCCEEDED ")][-1]
    assert final_bar.endswith(
        f"step 10/10  loss {simulated_loss(10):.4f}  2,560 tok/s  MFU 37.5%  ETA 0:00  restarts 0"
    )
    assert lines[-1] == f"job {job_id} SUCCEEDED at step 10/10, loss {simulated_loss(10):.4f}"


def test_plain_step_lines_show_the_mfu_when_it_is_known(manager, tmp_path):
    manager.MFU = 0.5
    with serving(manager, tmp_path) as url:
        job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))
        code, out, _ = run_cli("--url", url, "watch", job_id, "--every", "5")
    assert code == 0
    assert [line for line in out.splitlines() if line.startswith("step ")] == [
        f"step {n}/10  loss {simulated_loss(n):.4f}  2,560 tokens/s  MFU 50.0%" for n in (5, 10)
    ]


@pytest.fixture(autouse=True)
def _python_sigint_handler():
    """Python's own SIGINT handler (KeyboardInterrupt), as an interactive ``etrain`` has it. A pytest started
    in the background by a non-interactive shell inherits SIGINT ignored, and Python then keeps it ignored:
    the signal was dropped, and the watch test waited out ``--max-wait`` (exit 124, not 130)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupt_when(condition, *, timeout_s: float = 20.0) -> threading.Thread:
    """Send this process SIGINT (what Ctrl-C sends) once ``condition()`` holds; record when in ``.sent``."""

    def run() -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        thread.sent = time.monotonic()  # type: ignore[attr-defined]
        # To the main thread, which a terminal's Ctrl-C reaches in a one-thread CLI (this process has others).
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    thread = threading.Thread(target=run, daemon=True)
    thread.sent = None  # type: ignore[attr-defined]
    thread.start()
    return thread


def test_ctrl_c_stops_watching_with_one_line_and_exit_130(tmp_path):
    with JobStore(tmp_path / "still.db") as store:
        still = InMemoryManager(store, base_dir=str(tmp_path))  # never progresses: watch waits until ^C
        with serving(still, tmp_path) as url:
            job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))
            out, err = Terminal(), io.StringIO()
            sender = interrupt_when(lambda: "status: RUNNING" in ANSI.sub("", out.getvalue()))
            code = cli.main(["--url", url, "watch", job_id, "--max-wait", "60"], out=out, err=err)
            sender.join(timeout=5)
            assert still.get(job_id).status.value == "RUNNING"  # following stopped; the job did not
    assert code == 130
    assert err.getvalue().splitlines() == [
        f"interrupted: stopped following job {job_id}; the job goes on (`etrain watch {job_id}` follows it again, "
        f"`etrain cancel {job_id}` stops it)"
    ]
    assert "Traceback" not in out.getvalue() + err.getvalue()
    assert out.getvalue().endswith("\x1b[?25h")  # the bar was closed: the cursor is shown again


def test_ctrl_c_in_the_demo_says_one_line_and_the_shutdown_noise_goes_to_a_log(monkeypatch, tmp_path, capfd):
    """``make run``: Ctrl-C while the job runs. The watcher lets go of its event stream at once (so the
    server has no request to wait 5 s for and cancel, which uvicorn reports with a stack trace), and what
    the manager writes to file descriptor 2 while it stops (as Ray's C++ core and absl do) lands in
    <data-dir>/shutdown.log, not on the terminal."""

    class NoisyManager(InMemoryManager):
        def __init__(self, settings: Settings):
            super().__init__(JobStore(settings.db_path), base_dir=str(tmp_path), steps_per_poll=1)

        def close(self) -> None:
            os.write(2, b"*** SIGTERM received at time=1764160000 on cpu 1 ***\nPC: @ 0x7f00 (unknown) raise\n")
            print('Traceback (most recent call last):\n  File "ray/_private/worker.py"', file=sys.stderr)
            super().close()

    module = types.ModuleType("etrain.service.manager")
    module.JobManager = NoisyManager  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "etrain.service.manager", module)
    port, data_dir = free_port(), tmp_path / "data"
    spec = write_spec(tmp_path, training={"steps": 100000, "global_batch": 4})
    out, err = Terminal(), io.StringIO()
    sender = interrupt_when(lambda: "step 2/100000" in ANSI.sub("", out.getvalue()))

    code = cli.main(
        [
            "demo",
            str(spec),
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
            "--interval",
            "0.05",
            "--start-timeout",
            "30",
        ],
        out=out,
        err=err,
    )
    returned = time.monotonic()

    assert code == 130, (out.getvalue(), err.getvalue())
    assert sender.sent is not None and returned - sender.sent < SHUTDOWN_GRACE_S  # nothing waited out
    assert err.getvalue().splitlines() == [
        f"interrupted: stopping the job's server, its API and Ray (their shutdown messages go to "
        f"{data_dir / 'shutdown.log'})"
    ]
    terminal = capfd.readouterr()
    for noise in ("SIGTERM received", "Traceback", "timeout graceful shutdown exceeded", "Exception in ASGI"):
        assert noise not in terminal.err + terminal.out + out.getvalue()
    log = (data_dir / "shutdown.log").read_text()
    assert "*** SIGTERM received at time=1764160000" in log and 'File "ray/_private/worker.py"' in log
    shown = out.getvalue()
    assert shown.index("etrain API:") < shown.index("━")  # the bar starts under the server's banner
    assert shown.endswith("\x1b[?25h")  # and was closed before the line on Ctrl-C
    assert "Ctrl-C stops everything" not in shown  # the job was still running
    with socket.socket() as sock:  # the server is gone
        assert sock.connect_ex(("127.0.0.1", port)) != 0


def test_after_ctrl_c_the_exiting_process_writes_nothing_more_to_the_terminal(tmp_path):
    """What Ray's core worker writes from C++ while the interpreter exits (after the quiet shutdown) goes to
    the shutdown log too: descriptor 2 and ``sys.stderr`` stay redirected until the process is gone."""
    import subprocess

    log = tmp_path / "data" / "shutdown.log"
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from etrain.api.cli.demo import quiet_until_exit\n"
        "print('before', file=sys.stderr, flush=True)\n"
        f"quiet_until_exit(Path({str(log)!r}))\n"
        "os.write(2, b'[gcs_client.cc] Failed to connect to GCS at exit\\n')\n"
        "import atexit; atexit.register(lambda: print('from atexit', file=sys.stderr))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "before\n"
    assert log.read_text().splitlines() == ["[gcs_client.cc] Failed to connect to GCS at exit", "from atexit"]
