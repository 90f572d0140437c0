"""How long an in-place repair or resize may wait for the ranks to leave the old attempt (pure).

An in-place attempt ([9] a repair, [11] a resize in ``service/decisions/supervisor.py``) keeps the
survivors' processes, so before the new attempt can start, each survivor's run of the old one must return:
at a step boundary (a resize), or where its collective with the dead peer fails (a repair). That takes up
to two of the job's steps, and the worker group (``service/runtime/worker_group.py``) bounds it with these
waits. The supervisor's start timeout for such an attempt allows for them on top of its own start-up
(:func:`in_place_leave_allowance_s`): a job whose steps take minutes would otherwise have its repair or
resize cut off as a failed start while its survivors were still finishing their step.
"""

from __future__ import annotations

__all__ = [
    "STUCK_SURVIVOR_GRACE_S",
    "SURVIVOR_EXIT_TIMEOUT_S",
    "in_place_leave_allowance_s",
    "stuck_survivor_grace_s",
    "survivor_exit_timeout_s",
]

# An in-place repair waits this long for the survivors' failed ``run`` calls to return, and a resize for every
# run to stop at a step boundary, plus two of the job's steps (survivor_exit_timeout_s).
SURVIVOR_EXIT_TIMEOUT_S = 15.0
# Once one survivor's run of the failed attempt has returned, an in-place repair gives the others this long
# more (or two steps: stuck_survivor_grace_s), then counts those still out as stuck and replaces them too. Why: on gloo a pending collective fails
# only when a peer's process is gone, not when a live peer has left the attempt (measured with three gloo
# processes: neither the peer's destroy_process_group() nor ProcessGroup.abort() unblocked it, only its
# exit, 21 s later). In a 2-D layout a survivor can wait on such a peer (HSDP with shard groups of two:
# rank 0 waits on ranks 1 and 2, which left after their own collectives with the dead rank 3 failed), and
# it would wait for good. The survivors of one fault return within a second of each other (their
# collectives with the dead rank fail at once), so this is seconds of margin, not of waiting.
STUCK_SURVIVOR_GRACE_S = 5.0


def survivor_exit_timeout_s(step_s: float | None) -> float:
    """How long a resize waits for every run to stop at a step boundary, and an in-place repair for a first
    survivor to leave the failed attempt: SURVIVOR_EXIT_TIMEOUT_S plus two steps (``step_s``: the job's recent
    step time). Why two steps: a run stops, or reaches the collective that fails with a dead peer, only where
    its current step ends, and rank 0 asks the others to stop at the boundary after the one it is in. A fixed
    wait failed every resize of a job whose steps outlast it (an 8B model's, tens of seconds), and each
    failure relaunches every rank cold."""
    return SURVIVOR_EXIT_TIMEOUT_S + 2.0 * step_s if step_s else SURVIVOR_EXIT_TIMEOUT_S


def stuck_survivor_grace_s(step_s: float | None) -> float:
    """How long an in-place repair gives the survivors after the first one left the failed attempt before it
    replaces those still inside: STUCK_SURVIVOR_GRACE_S, or two steps where steps are longer (a survivor in
    the middle of a long step's compute reaches its failing collective only at the end of it)."""
    return max(STUCK_SURVIVOR_GRACE_S, 2.0 * step_s) if step_s else STUCK_SURVIVOR_GRACE_S


def in_place_leave_allowance_s(step_s: float | None) -> float:
    """What an in-place attempt's launch may spend leaving the old attempt, beyond the start timeout: the
    longest the worker group waits, for a first survivor and then for the stuck ones (a resize waits only
    the first of these)."""
    return survivor_exit_timeout_s(step_s) + stuck_survivor_grace_s(step_s)
