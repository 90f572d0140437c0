"""``deploy/local/common.sh``'s ``alive_pid``, which every local stop (``down.sh``, ``make gpu-check``'s
cleanup) waits on: a PID that is gone must read as gone, in a trap handler too.

A bare ``return`` in a function run from a trap handler returns the status from *before* the trap, so
the old ``alive_pid`` called from an EXIT-trap cleanup said a stopped process was alive: every stop
waited out its grace period and SIGKILLed (on the H100 this read as "etrain serve ignored SIGINT for
5s" and "the Ray head ignored SIGTERM for 5s"; both had gone within 2 s).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

COMMON = Path(__file__).resolve().parents[2] / "deploy" / "local" / "common.sh"


def _bash(script: str) -> str:
    done = subprocess.run(
        ["bash", "-c", f"source {COMMON}; {script}"], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _gone_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()  # exited and reaped: the PID names nothing now (PIDs are not reused this fast)
    return child.pid


def test_a_gone_pid_is_not_alive_anywhere_and_a_live_one_is():
    gone = _gone_pid()
    check = f'alive_pid {gone}; echo "gone $?"; alive_pid $$; echo "live $?"'
    assert _bash(check).splitlines() == ["gone 1", "live 0"]
    # the same from an EXIT-trap handler, where the script's status before the trap is 0
    in_trap = _bash(f"cleanup() {{ {check}; }}; trap cleanup EXIT; true")
    assert in_trap.splitlines() == ["gone 1", "live 0"]
