"""A job's status: one enum for the whole service.

The state machine decides it (service/decisions/supervisor.py), the events name it (``MarkTerminal`` in
service/decisions/supervisor_events.py), the store keeps it (``JobStatus`` in service/store/records.py) and users
read it. It lives on its own so that every one of those imports it from here and none imports another for it
(the events and the state machine used to import each other for this enum).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Status"]


class Status(StrEnum):
    """A job's status: what users see, what the store keeps, what the state machine decides."""

    QUEUED = "QUEUED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESIZING = "RESIZING"
    EXPORTING = "EXPORTING"  # every step trained; writing the final weights as a Hugging Face folder
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)

    is_terminal = terminal

    @classmethod
    def _missing_(cls, value: object) -> Status | None:
        """Accept any case ("running"): statuses arrive from query strings and command lines."""
        return cls.__members__.get(value.upper()) if isinstance(value, str) else None
