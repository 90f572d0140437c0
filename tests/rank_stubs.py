"""Stand-ins for what a rank's helpers talk to outside the process: the supervisor's Ray handle and the
rank log. Tests of the rank-side helpers (``RankSaves``, ``CompiledCode``) run them for real against these
and read back what they said."""

from __future__ import annotations


class SupervisorRecorder:
    """A supervisor handle: ``handle.method.remote(*args)`` is recorded as (method, args)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, method: str):
        calls = self.calls

        class _Method:
            @staticmethod
            def remote(*args):
                calls.append((method, args))
                return None

        return _Method()

    def args_of(self, method: str) -> list[tuple]:
        """The arguments of every recorded call of ``method``, in order."""
        return [args for called, args in self.calls if called == method]


class LogLines:
    """A rank log: every line written, in order."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, line: str) -> None:
        self.lines.append(line)
