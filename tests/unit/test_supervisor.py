"""The supervisor state machine, one transition at a time, then whole stories.

Every test passes the clock explicitly. The config used throughout:
  global_batch=32, micro_batch=2 -> 16 micro-batches -> legal dp in [2, 8]: 2, 4, 8
  tp=2, pp=1 -> world_size = 2 * dp (dp=4 -> 8 ranks)
  backoff: none before restart 1, then 10s, 20s, capped at 25s; max_restarts=2
"""

import math
import random
from dataclasses import fields, replace

import pytest

from etrain.service.decisions.job_policy import JobPolicy
from etrain.service.decisions.job_status import Status
from etrain.service.decisions.stragglers import StragglerConfig
from etrain.service.decisions.supervisor import decide
from etrain.service.decisions.supervisor_events import (
    Abort,
    Cancel,
    CapacityChanged,
    CheckpointFailed,
    CheckpointReported,
    CommitCheckpoint,
    CommitFailed,
    CommitSucceeded,
    DiagnoseHang,
    ExcludeNode,
    ExportCheckpoint,
    Exported,
    ExportFailed,
    Finished,
    GroupReady,
    GroupStopped,
    HangDiagnosed,
    JobError,
    KillRank,
    LaunchGroup,
    MarkTerminal,
    NodeLossConfirmed,
    RankUnhealthy,
    RecordEvent,
    RepairFailed,
    RepairGroup,
    RequestCheckpoint,
    ResizeFailed,
    ResizeGroup,
    ScaleRequested,
    ScheduleWake,
    Start,
    StepReported,
    StopGroup,
    StragglerFlagged,
    Tick,
    WorkerLost,
)
from etrain.service.decisions.supervisor_lifecycle import HANG_DIAGNOSIS_S
from etrain.service.decisions.supervisor_state import (
    GroupPhase,
    SupervisorConfig,
    SupervisorConfigError,
    SupervisorState,
    backoff_delay,
    initial_state,
)

POLICY = JobPolicy(
    min_dp=2,
    max_dp=8,
    max_restarts=2,
    heartbeat_timeout_s=60,
    start_timeout_s=120,
    checkpoint_timeout_s=100,
    capacity_wait_timeout_s=600,
    backoff_base_s=10,
    backoff_max_s=25,
    in_place=False,  # the relaunch path; the in-place repair [9] has its own tests (IN_PLACE)
    collectives_fail_on_peer_loss=True,  # gloo; NCCL's relaunch has its own tests (ON_NCCL)
    elastic_check_interval_s=30,
    stragglers=StragglerConfig(),
    straggler_action="report",
    resources_per_rank={"CPU": 1.0},
    placement_strategy="PACK",
    export=False,
    export_dtype="float32",
)
CONFIG = SupervisorConfig(total_steps=100, global_batch=32, micro_batch=2, tp=2, pp=1, stop_timeout_s=30, policy=POLICY)
_POLICY_FIELDS = {f.name for f in fields(JobPolicy)}


def configured(base: SupervisorConfig = CONFIG, **changes) -> SupervisorConfig:
    """``base`` with ``changes``; the policy's settings (max_restarts, export, ...) change its policy."""
    policy = {name: value for name, value in changes.items() if name in _POLICY_FIELDS}
    own = {name: value for name, value in changes.items() if name not in _POLICY_FIELDS}
    return replace(base, policy=replace(base.policy, **policy), **own)


IN_PLACE = configured(in_place=True)
#: A CUDA job's policy: in place on, NCCL underneath (a survivor's collective never fails with a dead peer).
ON_NCCL = configured(IN_PLACE, collectives_fail_on_peer_loss=False)


# ---------------------------------------------------------------------------------------------
# helpers


def running(**changes) -> SupervisorState:
    """Attempt 1 at dp=4 (8 ranks), up since t=0, at step 10, nothing committed."""
    base = SupervisorState(
        status=Status.RUNNING,
        dp=4,
        attempt=1,
        group=GroupPhase.UP,
        group_since=0.0,
        last_progress_at=0.0,
        step=10,
    )
    return replace(base, **changes)


def stopping(**changes) -> SupervisorState:
    """RECOVERING after a fault at t=100: the old group (attempt 1) is being torn down."""
    base = running(
        status=Status.RECOVERING,
        group=GroupPhase.STOPPING,
        group_since=100.0,
        restarts_used=1,
        backoff_until=110.0,
        last_committed_step=8,
    )
    return replace(base, **changes)


def launching(**changes) -> SupervisorState:
    base = SupervisorState(status=Status.STARTING, dp=4, attempt=1, group=GroupPhase.LAUNCHING, group_since=0.0)
    return replace(base, **changes)


def of(decision, cls):
    return [a for a in decision.actions if isinstance(a, cls)]


def kinds(decision):
    return [a.kind for a in decision.actions if isinstance(a, RecordEvent)]


def types(decision):
    return [type(a).__name__ for a in decision.actions]


def report_all(state, step, now=50.0, config=CONFIG):
    """All ranks of the current world report `step`; returns the last report's decision."""
    decision = None
    for rank in range(config.world_size(state.dp)):
        decision = decide(state, CheckpointReported(attempt=state.attempt, step=step, rank=rank), now, config)
        state = decision.state
    return decision


def commit_all(state, step, now=50.0, config=CONFIG):
    """All ranks report `step` and the adapter writes its manifest; returns the CommitSucceeded decision."""
    reported = report_all(state, step, now, config)
    assert of(reported, CommitCheckpoint) == [CommitCheckpoint(step=step)], reported.reason
    return decide(reported.state, CommitSucceeded(step=step), now, config)


class Story:
    """Replays scripted (now, event) pairs, keeping every decision for assertions."""

    def __init__(self, config=CONFIG, dp=4, **initial):
        self.config = config
        self.state = initial_state(config, dp=dp, **initial)
        self.decisions = []

    def at(self, now, event):
        decision = decide(self.state, event, now, self.config)
        assert decision.reason, f"no reason for {event}"
        self.state = decision.state
        self.decisions.append(decision)
        return decision

    def checkpoint(self, now, step):
        """Every rank reports ``step``; the adapter commits it (the decision of CommitSucceeded)."""
        decision = None
        for rank in range(self.config.world_size(self.state.dp)):
            decision = self.at(now, CheckpointReported(attempt=self.state.attempt, step=step, rank=rank))
        if of(decision, CommitCheckpoint):
            decision = self.at(now, CommitSucceeded(step=step))
        return decision

    @property
    def all_kinds(self):
        return [k for d in self.decisions for k in kinds(d)]


def scaled_at_step_5(config, dp=2):
    """A dp=8 job up at step 5 asked to scale to ``dp``: the story and the decision of its checkpoint's commit."""
    s = Story(config, dp=8)
    s.at(0, Start())
    s.at(1, GroupReady(attempt=1, world_size=16))
    s.at(2, StepReported(attempt=1, step=5, loss=2.0))
    s.at(3, ScaleRequested(dp=dp))
    return s, s.checkpoint(4, 5)


# ---------------------------------------------------------------------------------------------
# status, config, initial state, backoff


class TestStatus:
    def test_terminal_statuses(self):
        assert {s for s in Status if s.terminal} == {Status.SUCCEEDED, Status.FAILED, Status.CANCELLED}

    def test_is_a_string(self):
        assert Status.RUNNING == "RUNNING"


class TestConfig:
    @pytest.mark.parametrize(
        "change,match",
        [
            (dict(total_steps=0), "total_steps=0"),
            (dict(tp=0), "tp=0"),
            (dict(max_restarts=-1), "max_restarts=-1"),
            (dict(heartbeat_timeout_s=0), "heartbeat_timeout_s=0 must be > 0"),
            (dict(stop_timeout_s=-1), "stop_timeout_s=-1"),
            (dict(backoff_base_s=-1), "backoff_base_s=-1"),
            (dict(backoff_max_s=5), "backoff_max_s=5 must be >= backoff_base_s=10"),
            (dict(min_dp=5, max_dp=7), r"no dp in \[min_dp=5, max_dp=7\]"),
            (dict(micro_batch=3), "global_batch=32 is not a multiple of micro_batch=3"),
        ],
    )
    def test_bad_settings_name_the_setting(self, change, match):
        with pytest.raises(SupervisorConfigError, match=match):
            configured(**change)

    def test_world_size(self):
        assert CONFIG.world_size(4) == 8
        assert replace(CONFIG, pp=2).world_size(4) == 16


class TestInitialState:
    def test_queued_at_the_planned_dp(self):
        state = initial_state(CONFIG, dp=4)
        assert (state.status, state.dp, state.attempt, state.group) == (Status.QUEUED, 4, 0, GroupPhase.NONE)
        assert state.last_committed_step is None and state.step == 0

    def test_resumed_job_starts_from_its_committed_step(self):
        state = initial_state(CONFIG, dp=4, last_committed_step=40, restarts_used=1)
        assert (state.step, state.last_committed_step, state.restarts_used) == (40, 40, 1)

    def test_illegal_dp_is_rejected_with_legal_sizes(self):
        with pytest.raises(SupervisorConfigError, match=r"dp=3 is not a legal size .* \[2, 4, 8\]"):
            initial_state(CONFIG, dp=3)


class TestValues:
    def test_state_events_and_actions_pickle(self):
        # The adapter ships these across Ray calls and may persist the state.
        import pickle

        state = running(excluded_nodes=frozenset({"n3"}), checkpoint_reports=frozenset({(10, 1)}))
        d = decide(state, WorkerLost(attempt=1, rank=0, node="n1", cause="process"), 1.0, CONFIG)
        assert pickle.loads(pickle.dumps(d)) == d
        assert pickle.loads(pickle.dumps(CONFIG)) == CONFIG

    def test_errors_pickle_and_share_the_project_base(self):
        import pickle

        from etrain.workers.protocol.errors import EtrainError

        with pytest.raises(SupervisorConfigError) as info:
            replace(CONFIG, total_steps=0)
        err = pickle.loads(pickle.dumps(info.value))
        assert isinstance(err, EtrainError) and isinstance(err, ValueError)
        assert str(err) == "total_steps=0 must be >= 1"


class TestBackoff:
    def test_the_first_restart_waits_for_nothing_then_doubles_then_caps(self):
        assert [backoff_delay(n, CONFIG) for n in range(6)] == [0, 10, 20, 25, 25, 25]

    def test_huge_restart_counts_do_not_overflow(self):
        assert backoff_delay(10_000, CONFIG) == 25


# ---------------------------------------------------------------------------------------------
# one transition at a time


class TestStart:
    def test_launches_attempt_1(self):
        d = decide(initial_state(CONFIG, dp=4), Start(), 5.0, CONFIG)
        assert d.state.status is Status.STARTING
        assert d.state.group is GroupPhase.LAUNCHING and d.state.group_since == 5.0
        assert d.actions == (LaunchGroup(attempt=1, dp=4, world_size=8, resume_step=None),)
        assert "launch attempt 1 at dp=4" in d.reason

    def test_resumed_job_restores_its_checkpoint(self):
        d = decide(initial_state(CONFIG, dp=4, last_committed_step=40), Start(), 0.0, CONFIG)
        assert of(d, LaunchGroup)[0].resume_step == 40

    def test_known_capacity_sets_the_first_size(self):
        state = initial_state(CONFIG, dp=4)
        assert of(decide(replace(state, available_dp=6), Start(), 0, CONFIG), LaunchGroup)[0].dp == 4
        assert of(decide(replace(state, available_dp=20), Start(), 0, CONFIG), LaunchGroup)[0].dp == 8

    def test_waits_when_capacity_is_below_min_dp(self):
        d = decide(replace(initial_state(CONFIG, dp=4), available_dp=1), Start(), 0.0, CONFIG)
        assert d.state.status is Status.STARTING and d.state.group is GroupPhase.NONE
        assert of(d, LaunchGroup) == []
        assert kinds(d) == ["waiting_for_capacity"]
        assert "min_dp=2" in of(d, RecordEvent)[0].detail

    def test_second_start_is_ignored(self):
        d = decide(launching(), Start(), 1.0, CONFIG)
        assert d.ignored and d.actions == () and d.state == launching()


class TestGroupReady:
    def test_starting_becomes_running(self):
        d = decide(launching(), GroupReady(attempt=1, world_size=8), 30.0, CONFIG)
        assert d.state.status is Status.RUNNING and d.state.group is GroupPhase.UP
        assert d.state.last_progress_at == 30.0
        assert kinds(d) == ["started"]
        assert "fresh start" in of(d, RecordEvent)[0].detail

    @pytest.mark.parametrize("status,kind", [(Status.RECOVERING, "restored"), (Status.RESIZING, "resized")])
    def test_event_kind_follows_why_we_launched(self, status, kind):
        state = launching(status=status, attempt=2, last_committed_step=20, step=20)
        d = decide(state, GroupReady(attempt=2, world_size=8), 30.0, CONFIG)
        assert d.state.status is Status.RUNNING
        assert kinds(d) == [kind]
        assert "from step 20" in of(d, RecordEvent)[0].detail

    def test_wrong_world_size_fails_naming_the_numbers(self):
        d = decide(launching(), GroupReady(attempt=1, world_size=6), 30.0, CONFIG)
        assert d.state.status is Status.FAILED
        assert d.state.error == "worker group reported world_size=6, expected pp*dp*tp = 1*4*2 = 8"
        assert types(d) == ["StopGroup", "RecordEvent", "MarkTerminal"]

    def test_when_not_launching_is_ignored(self):
        assert decide(running(), GroupReady(attempt=1, world_size=8), 1.0, CONFIG).ignored

    def test_scale_request_made_during_launch_resizes_right_away(self):
        state = launching(status=Status.RECOVERING, attempt=2, last_committed_step=20, step=20, target_dp=2)
        d = decide(state, GroupReady(attempt=2, world_size=8), 30.0, CONFIG)
        # Nothing trained since the checkpoint, so no new checkpoint is needed: stop now.
        assert d.state.status is Status.RESIZING
        assert kinds(d) == ["restored", "resizing"]
        assert of(d, StopGroup) == [StopGroup(attempt=2, reason="resize dp 4 -> 2")]


class TestSteps:
    def test_higher_step_is_progress(self):
        d = decide(running(), StepReported(attempt=1, step=11, loss=2.5), 42.0, CONFIG)
        assert (d.state.step, d.state.last_progress_at) == (11, 42.0)
        assert d.actions == () and not d.ignored

    def test_same_step_is_not_progress(self):
        d = decide(running(), StepReported(attempt=1, step=10, loss=2.5, rank=3), 42.0, CONFIG)
        assert d.state == running()
        assert "no progress" in d.reason

    @pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
    def test_nonfinite_loss_fails_the_job(self, loss):
        d = decide(running(), StepReported(attempt=1, step=12, loss=loss, rank=0), 42.0, CONFIG)
        assert d.state.status is Status.FAILED
        assert d.state.error == f"loss is {loss} at step 12 (rank 0)"
        assert of(d, MarkTerminal) == [MarkTerminal(status=Status.FAILED, error=d.state.error)]
        assert d.state.restarts_used == 0

    def test_nonfinite_loss_allowed_when_configured(self):
        config = replace(CONFIG, fail_on_nonfinite_loss=False)
        d = decide(running(), StepReported(attempt=1, step=12, loss=math.inf), 42.0, config)
        assert d.state.status is Status.RUNNING and d.state.step == 12

    def test_steps_outside_running_are_ignored(self):
        assert decide(stopping(), StepReported(attempt=1, step=12, loss=1.0), 1.0, CONFIG).ignored
        assert decide(launching(), StepReported(attempt=1, step=1, loss=1.0), 1.0, CONFIG).ignored


class TestCheckpointCommit:
    def test_commits_only_when_every_rank_reported(self):
        state = running()
        for rank in range(7):
            d = decide(state, CheckpointReported(attempt=1, step=10, rank=rank), 5.0, CONFIG)
            assert d.actions == () and d.state.last_committed_step is None
            state = d.state
        assert "7/8 ranks" in d.reason
        d = decide(state, CheckpointReported(attempt=1, step=10, rank=7), 6.0, CONFIG)
        # The last report asks for the manifest; nothing is committed until it is written.
        assert d.actions == (CommitCheckpoint(step=10),)
        assert (d.state.last_committed_step, d.state.committing) == (None, frozenset({10}))
        assert d.state.checkpoint_reports == frozenset()
        d = decide(d.state, CommitSucceeded(step=10), 6.0, CONFIG)
        assert d.actions == (RecordEvent(kind="checkpoint_committed", detail="step 10, 8 ranks"),)
        assert (d.state.last_committed_step, d.state.committing) == (10, frozenset())

    def test_a_rank_reporting_twice_counts_once(self):
        state = running()
        for _ in range(2):
            for rank in range(7):
                state = decide(state, CheckpointReported(attempt=1, step=10, rank=rank), 5.0, CONFIG).state
        assert state.last_committed_step is None

    def test_world_includes_tp_and_pp(self):
        config = replace(CONFIG, pp=2)  # pp=2 * dp=4 * tp=2 = 16 ranks
        assert commit_all(running(), 10, config=config).state.last_committed_step == 10
        state = running()  # the 8 ranks of one pipeline stage are not enough
        for rank in range(8):
            state = decide(state, CheckpointReported(attempt=1, step=10, rank=rank), 5.0, config).state
        assert state.last_committed_step is None

    def test_rank_outside_the_world_is_ignored(self):
        assert decide(running(), CheckpointReported(attempt=1, step=10, rank=8), 5.0, CONFIG).ignored

    def test_old_step_is_ignored(self):
        d = decide(running(last_committed_step=20), CheckpointReported(attempt=1, step=20, rank=0), 5.0, CONFIG)
        assert d.ignored

    def test_newer_commit_drops_older_partial_reports(self):
        state = decide(running(), CheckpointReported(attempt=1, step=10, rank=0), 5.0, CONFIG).state
        d = commit_all(state, 20)
        assert d.state.last_committed_step == 20 and d.state.checkpoint_reports == frozenset()

    def test_commits_while_recovering_when_all_ranks_had_reported(self):
        # The save finished before the failure: every rank reported it, so it is safe to use.
        d = commit_all(stopping(), 9)
        assert d.state.last_committed_step == 9 and d.state.status is Status.RECOVERING


class TestCheckpointFailed:
    """A save the storage failed (issue #16): said why, its reports forgotten, training goes on."""

    def test_a_failed_save_is_recorded_and_the_job_keeps_running_from_its_last_commit(self):
        state = decide(
            running(step=16, last_committed_step=10), CheckpointReported(attempt=1, step=16, rank=0), 45.0, CONFIG
        ).state
        reason = "no space left on device at /ckpt: need ~15,360.0 MiB, 900.0 MiB free"
        d = decide(state, CheckpointFailed(attempt=1, step=16, reason=reason), 46.0, CONFIG)
        assert d.state.status is Status.RUNNING and d.state.group is GroupPhase.UP
        assert d.state.last_committed_step == 10 and d.state.checkpoint_reports == frozenset()
        assert d.actions == (
            RecordEvent(
                kind="checkpoint_failed",
                detail=f"step 16: {reason}; training continues; the last committed checkpoint stays step 10",
            ),
        )
        assert not of(d, StopGroup) and not of(d, RequestCheckpoint)

    def test_a_failed_save_of_an_old_attempt_is_ignored(self):
        d = decide(running(attempt=2), CheckpointFailed(attempt=1, step=16, reason="x"), 46.0, CONFIG)
        assert d.ignored

    def test_a_failed_save_of_the_requested_checkpoint_asks_again_for_a_pending_resize(self):
        state = running(
            step=16,
            last_committed_step=10,
            available_dp=8,
            pending_resize_dp=8,
            checkpoint_requested_at=40.0,
            checkpoint_requested_step=15,
        )
        d = decide(state, CheckpointFailed(attempt=1, step=16, reason="disk quota exceeded at /ckpt"), 46.0, CONFIG)
        assert of(d, RequestCheckpoint) == [
            RequestCheckpoint(attempt=1, reason="retry before the resize: save of step 16 failed")
        ]
        assert kinds(d) == ["checkpoint_failed", "checkpoint_requested"]
        assert d.state.checkpoint_requested_at == 40.0  # the same deadline


class TestCommitOutcome:
    """Only the adapter's answer to CommitCheckpoint (the manifest written, or not) commits a step."""

    def committing(self, step=16, **changes):
        return report_all(running(step=step, last_committed_step=10, **changes), step, now=45.0).state

    def test_a_failed_commit_leaves_the_last_committed_step(self):
        state = self.committing()
        assert state.committing == frozenset({16})
        d = decide(state, CommitFailed(step=16, error="shard of rank 3 is missing"), 46.0, CONFIG)
        assert (d.state.last_committed_step, d.state.committing) == (10, frozenset())
        assert d.actions == (
            RecordEvent(
                kind="checkpoint_commit_failed",
                detail="step 16: shard of rank 3 is missing; the last committed checkpoint stays step 10",
            ),
        )
        # A restart after it resumes from step 10, not from the step that never committed.
        d = decide(d.state, WorkerLost(attempt=1, rank=0, node="n1", cause="process"), 47.0, CONFIG)
        d = decide(replace(d.state, group=GroupPhase.NONE), Tick(), 60.0, CONFIG)
        assert of(d, LaunchGroup) == [LaunchGroup(attempt=2, dp=4, world_size=8, resume_step=10)]

    def test_reports_of_a_step_being_committed_are_not_counted_again(self):
        d = decide(self.committing(), CheckpointReported(attempt=1, step=16, rank=0), 45.5, CONFIG)
        assert d.ignored and "already being committed" in d.reason

    def test_a_failed_commit_can_be_reported_again_and_then_succeed(self):
        state = decide(self.committing(), CommitFailed(step=16, error="disk full"), 46.0, CONFIG).state
        d = commit_all(state, 16, now=47.0)
        assert d.state.last_committed_step == 16 and kinds(d) == ["checkpoint_committed"]

    @pytest.mark.parametrize("event", [CommitSucceeded(step=12), CommitFailed(step=12, error="x")])
    def test_an_answer_for_a_step_not_being_committed_is_ignored(self, event):
        state = self.committing()
        d = decide(state, event, 46.0, CONFIG)
        assert d.ignored and d.state == state

    def test_an_older_commit_answering_after_a_newer_one_does_not_move_the_commit_point_back(self):
        state = report_all(running(step=20), 12).state
        state = report_all(state, 16).state
        assert state.committing == frozenset({12, 16})
        state = decide(state, CommitSucceeded(step=16), 50.0, CONFIG).state
        d = decide(state, CommitSucceeded(step=12), 50.0, CONFIG)
        assert (d.state.last_committed_step, d.state.committing, d.actions) == (16, frozenset(), ())

    def test_a_launch_forgets_commits_in_flight(self):
        state = stopping(group=GroupPhase.NONE, backoff_until=None, committing=frozenset({9}))
        launched = decide(state, Tick(), 120.0, CONFIG)
        assert of(launched, LaunchGroup)[0].resume_step == 8 and launched.state.committing == frozenset()
        d = decide(launched.state, CommitSucceeded(step=9), 121.0, CONFIG)
        assert d.ignored and d.state.last_committed_step == 8

    def test_a_failed_commit_of_the_requested_checkpoint_asks_again_for_a_pending_resize(self):
        # Chosen: retry (the failure may be transient) within the original checkpoint_timeout_s.
        state = self.committing(
            available_dp=8, pending_resize_dp=8, checkpoint_requested_at=40.0, checkpoint_requested_step=15
        )
        d = decide(state, CommitFailed(step=16, error="disk full"), 46.0, CONFIG)
        assert d.state.status is Status.RUNNING and d.state.pending_resize_dp == 8
        assert d.state.checkpoint_requested_at == 40.0 and d.state.last_committed_step == 10
        assert of(d, RequestCheckpoint) == [
            RequestCheckpoint(attempt=1, reason="retry before the resize: commit of step 16 failed")
        ]
        assert kinds(d) == ["checkpoint_commit_failed", "checkpoint_requested"]
        assert not of(d, StopGroup)
        # The retried checkpoint commits: now the resize goes ahead.
        d = commit_all(replace(d.state, step=18), 18, now=50.0)
        assert d.state.status is Status.RESIZING and kinds(d) == ["checkpoint_committed", "resizing"]

    def test_a_pending_resize_whose_commits_keep_failing_is_abandoned_at_the_timeout(self):
        state = self.committing(
            available_dp=8,
            pending_resize_dp=8,
            checkpoint_requested_at=40.0,
            checkpoint_requested_step=15,
            last_progress_at=130.0,
        )
        state = decide(state, CommitFailed(step=16, error="disk full"), 46.0, CONFIG).state
        d = decide(state, Tick(), 141.0, CONFIG)  # 101 s after the first request
        assert kinds(d) == ["resize_abandoned"] and d.state.status is Status.RUNNING and d.state.dp == 4

    def test_a_failed_commit_before_an_eviction_asks_again_then_evicts_from_the_last_commit_at_the_timeout(self):
        flagged = StragglerFlagged(attempt=1, rank=6, node="n3", factor=2.1, evict=True)
        state = decide(running(step=15, last_committed_step=10, last_progress_at=130.0), flagged, 40.0, CONFIG).state
        state = report_all(replace(state, step=16), 16, now=45.0).state
        d = decide(state, CommitFailed(step=16, error="disk full"), 46.0, CONFIG)
        assert of(d, RequestCheckpoint) and not of(d, ExcludeNode) and d.state.pending_evict_node == "n3"
        d = decide(d.state, Tick(), 141.0, CONFIG)
        assert kinds(d) == ["checkpoint_timeout", "straggler_evicted"] and of(d, ExcludeNode)
        assert d.state.last_committed_step == 10

    def test_a_failed_commit_of_an_older_step_does_not_retry(self):
        state = report_all(
            running(
                step=16,
                last_committed_step=10,
                pending_resize_dp=8,
                available_dp=8,
                checkpoint_requested_at=40.0,
                checkpoint_requested_step=15,
            ),
            12,
        ).state
        d = decide(state, CommitFailed(step=12, error="x"), 46.0, CONFIG)
        assert kinds(d) == ["checkpoint_commit_failed"] and not of(d, RequestCheckpoint)
        assert d.state.pending

    def test_an_uncommitted_final_checkpoint_is_not_exported(self):
        config = configured(export=True)
        state = report_all(running(step=100, last_committed_step=90), 100, config=config).state
        state = decide(state, CommitFailed(step=100, error="disk full"), 51.0, config).state
        d = decide(state, Finished(attempt=1, final_step=100), 52.0, config)
        assert d.state.status is Status.FAILED and not of(d, ExportCheckpoint)
        assert "final checkpoint (step 100) was not committed (last committed: step 90)" in d.state.error


class TestFinished:
    def test_all_steps_done_succeeds(self):
        d = decide(running(step=99), Finished(attempt=1, final_step=100), 70.0, CONFIG)
        assert d.state.status is Status.SUCCEEDED and d.state.error is None and d.state.step == 100
        assert d.actions == (
            StopGroup(attempt=1, reason="job succeeded"),
            RecordEvent(kind="succeeded", detail="finished 100/100 steps"),
            MarkTerminal(status=Status.SUCCEEDED, error=None),
        )

    def test_early_exit_fails(self):
        d = decide(running(), Finished(attempt=1, final_step=50), 70.0, CONFIG)
        assert d.state.status is Status.FAILED
        assert d.state.error == "workers exited at step 50 before total_steps=100"

    def test_outside_running_is_ignored(self):
        assert decide(launching(), Finished(attempt=1, final_step=100), 1.0, CONFIG).ignored


class TestJobError:
    def test_fails_at_once_without_spending_a_restart(self):
        event = JobError(
            attempt=1, rank=3, message="ValueError: token id 70000 >= vocab 50257", traceback="Traceback ..."
        )
        d = decide(running(), event, 80.0, CONFIG)
        assert d.state.status is Status.FAILED
        assert d.state.error == "rank 3: ValueError: token id 70000 >= vocab 50257"
        assert d.state.restarts_used == 0
        assert types(d) == ["StopGroup", "RecordEvent", "MarkTerminal"]
        assert of(d, RecordEvent)[0].kind == "failed"
        assert of(d, RecordEvent)[0].detail.endswith("Traceback ...")
        assert of(d, MarkTerminal)[0].error == d.state.error
        assert of(d, LaunchGroup) == []

    def test_while_launching_fails_too(self):
        d = decide(launching(), JobError(attempt=1, rank=0, message="ImportError"), 3.0, CONFIG)
        assert d.state.status is Status.FAILED

    def test_during_teardown_is_ignored(self):
        assert decide(stopping(), JobError(attempt=1, rank=0, message="NCCL aborted"), 101.0, CONFIG).ignored


class TestWorkerLost:
    @pytest.mark.parametrize("cause", ["process", "actor"])
    def test_restarts_from_the_last_checkpoint_at_once(self, cause):
        state = running(last_committed_step=8)
        d = decide(state, WorkerLost(attempt=1, rank=5, node="n2", cause=cause, detail="exit 137"), 100.0, CONFIG)
        what = f"rank 5 on node n2 lost ({cause}): exit 137"
        assert d.state.status is Status.RECOVERING
        assert d.state.group is GroupPhase.STOPPING and d.state.group_since == 100.0
        assert (d.state.restarts_used, d.state.backoff_until) == (1, None)
        assert d.actions == (
            RecordEvent(kind="worker_failed", detail=what),
            StopGroup(attempt=1, reason=what),
            RecordEvent(kind="restarting", detail="restart 1/2 from step 8 at once"),
        )
        assert d.reason == f"{what}: restart 1/2 at once"
        # ... launched the moment the old group has stopped
        launch = decide(d.state, GroupStopped(attempt=1), 100.5, CONFIG)
        assert of(launch, LaunchGroup) == [LaunchGroup(attempt=2, dp=4, world_size=8, resume_step=8)]

    def test_second_failure_backs_off(self):
        d = decide(running(restarts_used=1), WorkerLost(attempt=1, rank=0, node="n1", cause="process"), 100.0, CONFIG)
        assert (d.state.restarts_used, d.state.backoff_until) == (2, 110.0)
        assert of(d, RecordEvent)[1].detail == "restart 2/2 from scratch in 10s"
        assert of(d, ScheduleWake) == [ScheduleWake(at=110.0)]
        assert d.reason.endswith("restart 2/2 after 10s backoff")

    def test_backoff_is_capped(self):
        config = configured(max_restarts=10)
        d = decide(running(restarts_used=5), WorkerLost(attempt=1, rank=0, node="n1", cause="process"), 100.0, config)
        assert d.state.backoff_until == 125.0

    def test_budget_spent_fails_with_a_clear_reason(self):
        d = decide(running(restarts_used=2), WorkerLost(attempt=1, rank=1, node="n1", cause="actor"), 100.0, CONFIG)
        assert d.state.status is Status.FAILED
        assert d.state.error == "rank 1 on node n1 lost (actor); restarted 2 times, max_restarts=2"
        assert types(d) == ["RecordEvent", "StopGroup", "RecordEvent", "MarkTerminal"]
        assert kinds(d) == ["worker_failed", "failed"]

    def test_zero_restarts_allowed_fails_on_first_loss(self):
        config = configured(max_restarts=0)
        d = decide(running(), WorkerLost(attempt=1, rank=1, node="n1", cause="process"), 1.0, config)
        assert d.state.error.endswith("restarted 0 times, max_restarts=0")

    def test_loss_while_launching_is_a_fault(self):
        state = launching(status=Status.RECOVERING, attempt=2, restarts_used=1)
        d = decide(state, WorkerLost(attempt=2, rank=0, node="n1", cause="process"), 5.0, CONFIG)
        assert (d.state.status, d.state.restarts_used, d.state.backoff_until) == (Status.RECOVERING, 2, 15.0)

    def test_node_loss_spends_no_budget_and_waits_for_capacity(self):
        d = decide(running(), WorkerLost(attempt=1, rank=6, node="n4", cause="node"), 100.0, CONFIG)
        assert d.state.status is Status.RECOVERING
        assert (d.state.restarts_used, d.state.backoff_until, d.state.awaiting_capacity) == (0, None, True)
        assert d.actions == (
            RecordEvent(kind="node_lost", detail="rank 6 on node n4 lost (node)"),
            StopGroup(attempt=1, reason="rank 6 on node n4 lost (node)"),
        )

    def test_more_losses_during_teardown_are_ignored(self):
        d = decide(stopping(), WorkerLost(attempt=1, rank=2, node="n1", cause="process"), 101.0, CONFIG)
        assert d.ignored and d.state.restarts_used == 1


class TestNodeLossConfirmed:
    """[8] A loss classified at once as a process fault is corrected when its node is declared dead."""

    def confirmed(self, available_dp: int) -> NodeLossConfirmed:
        return NodeLossConfirmed(node="n4", failed_attempt=1, available_dp=available_dp)

    def test_refunds_the_restart_while_the_relaunch_fits(self):
        state = launching(status=Status.RECOVERING, attempt=2, restarts_used=1)
        d = decide(state, self.confirmed(available_dp=4), 5.0, CONFIG)
        assert (d.state.restarts_used, d.state.group, d.state.attempt, d.state.available_dp) == (
            0,
            GroupPhase.LAUNCHING,
            2,
            4,
        )
        assert d.actions == (
            RecordEvent(
                kind="restart_refunded",
                detail=(
                    "node n4 of the rank lost in attempt 1 was declared dead: a node loss, not the job's fault; "
                    "restarts used 0/2"
                ),
            ),
        )

    def test_stops_a_relaunch_the_cluster_can_no_longer_hold(self):
        state = launching(status=Status.RECOVERING, attempt=2, restarts_used=1)
        d = decide(state, self.confirmed(available_dp=2), 5.0, CONFIG)
        assert (d.state.status, d.state.restarts_used, d.state.awaiting_capacity) == (Status.RECOVERING, 0, True)
        assert kinds(d) == ["restart_refunded", "node_lost"]
        assert of(d, StopGroup) == [StopGroup(attempt=2, reason="attempt 2 cannot be placed at dp=4 without node n4")]

    def test_a_job_backing_off_relaunches_at_once_at_the_size_that_fits(self):
        state = stopping(group=GroupPhase.NONE, attempt=1, restarts_used=1, backoff_until=110.0)
        d = decide(state, self.confirmed(available_dp=2), 101.0, CONFIG)
        assert d.state.restarts_used == 0 and d.state.backoff_until is None
        assert of(d, LaunchGroup) == [LaunchGroup(attempt=2, dp=2, world_size=4, resume_step=8)]
        assert d.state.status is Status.RESIZING

    def test_a_running_group_keeps_running_and_nothing_goes_below_zero(self):
        d = decide(running(restarts_used=0), self.confirmed(available_dp=4), 50.0, CONFIG)
        assert (d.state.status, d.state.restarts_used) == (Status.RUNNING, 0) and kinds(d) == ["restart_refunded"]

    def test_is_never_stale_but_ignored_once_terminal(self):
        d = decide(running(attempt=7, restarts_used=2), self.confirmed(available_dp=4), 50.0, CONFIG)
        assert not d.ignored and d.state.restarts_used == 1
        assert decide(running(status=Status.FAILED), self.confirmed(available_dp=4), 50.0, CONFIG).ignored

    def test_a_loss_that_would_have_failed_the_job_is_refunded_too_late(self):
        """The adapter waits for the node's verdict when no restart is left (worker_group.poll), because
        a refund cannot revive a job the last charged fault already failed."""
        config = configured(max_restarts=1)
        d = decide(running(restarts_used=1), WorkerLost(attempt=1, rank=1, node="n4", cause="process"), 1.0, config)
        assert d.state.status is Status.FAILED
        assert decide(d.state, self.confirmed(available_dp=4), 2.0, config).ignored


class TestRepairInPlace:
    """[9] A single lost rank of a running group is replaced; the other ranks' processes are kept."""

    def test_one_lost_rank_is_repaired_in_place_from_the_last_commit(self):
        d = decide(
            running(last_committed_step=8), WorkerLost(attempt=1, rank=3, node="n2", cause="process"), 60.0, IN_PLACE
        )
        assert (d.state.status, d.state.attempt, d.state.group, d.state.restarts_used, d.state.step) == (
            Status.RECOVERING,
            2,
            GroupPhase.LAUNCHING,
            1,
            8,
        )
        assert d.state.backoff_until is None and d.state.group_since == 60.0
        assert d.actions == (
            RecordEvent(kind="worker_failed", detail="rank 3 on node n2 lost (process)"),
            RecordEvent(
                kind="restarting",
                detail="restart 1/2 in place: rank 3 replaced, the other ranks kept, resuming step 8 or a later step "
                "the ranks hold in memory",
            ),
            RepairGroup(attempt=2, lost_rank=3, world_size=8, resume_step=8),
        )
        ready = decide(d.state, GroupReady(attempt=2, world_size=8), 63.0, IN_PLACE)
        assert ready.state.status is Status.RUNNING and kinds(ready) == ["restored"]
        assert ready.state.step == 8 and of(ready, RecordEvent)[0].detail.endswith(", from step 8")
        # The ranks resumed from step 13, which the survivors held in memory: nothing before it is recomputed.
        later = decide(d.state, GroupReady(attempt=2, world_size=8, start_step=13), 63.0, IN_PLACE)
        assert later.state.step == 13
        assert of(later, RecordEvent)[0].detail.endswith(", from step 13 (in memory; step 8 committed)")

    @pytest.mark.parametrize("step_s", [None, 0.3, 20.0, 150.0, 500.0])
    def test_the_start_timeout_of_an_in_place_attempt_allows_for_the_survivors_to_leave_the_last(self, step_s):
        """A repair's launch first waits for the survivors' runs of the failed attempt to return (up to two
        steps, then the grace for stuck ones): its start timeout allows for that on top of its own. Before,
        a job whose steps take minutes had its repair cut off as a failed start while its survivors finished
        their step. A fresh launch's timeout stays the policy's."""
        from etrain.service.decisions.in_place_waits import in_place_leave_allowance_s

        lost = WorkerLost(attempt=1, rank=3, node="n2", cause="process")
        repairing = decide(running(last_committed_step=8), lost, 60.0, IN_PLACE).state
        assert repairing.launched_in_place and repairing.group is GroupPhase.LAUNCHING
        limit = IN_PLACE.start_timeout_s + in_place_leave_allowance_s(step_s)
        assert limit >= IN_PLACE.start_timeout_s + 20.0  # the fixed waits at least
        if step_s:
            assert limit >= IN_PLACE.start_timeout_s + 4 * step_s  # two steps for a first survivor, two of grace
        still = decide(repairing, Tick(step_s=step_s), 60.0 + limit, IN_PLACE)
        assert still.state.status is Status.RECOVERING and kinds(still) == []
        late = decide(repairing, Tick(step_s=step_s), 60.0 + limit + 1.0, IN_PLACE)
        (timed_out,) = [a.detail for a in of(late, RecordEvent) if a.kind == "start_timeout"]
        assert "for the survivors to leave the last attempt" in timed_out, timed_out
        fresh = decide(launching(), Tick(step_s=step_s), IN_PLACE.start_timeout_s + 1.0, IN_PLACE)
        assert kinds(fresh)[0] == "start_timeout"
        relaunched = decide(fresh.state, Tick(step_s=step_s), IN_PLACE.start_timeout_s + 60.0, IN_PLACE).state
        assert not relaunched.launched_in_place  # a relaunch of every rank waits for nobody to leave

    @pytest.mark.parametrize(
        "why, state, event",
        [
            ("nothing committed yet", running(), WorkerLost(attempt=1, rank=3, node="n2", cause="process")),
            (
                "still launching",
                launching(last_committed_step=8),
                WorkerLost(attempt=1, rank=3, node="n2", cause="process"),
            ),
            ("rank unknown", running(last_committed_step=8), WorkerLost(attempt=1, rank=-1, node="", cause="process")),
            (
                "resize pending",
                running(last_committed_step=8, pending_resize_dp=2, checkpoint_requested_at=1.0),
                WorkerLost(attempt=1, rank=3, node="n2", cause="process"),
            ),
            ("node lost, nothing committed", running(), WorkerLost(attempt=1, rank=3, node="n2", cause="node")),
            (
                "node lost, in_place off",
                running(last_committed_step=8),
                WorkerLost(attempt=1, rank=3, node="n2", cause="node"),
            ),
        ],
    )
    def test_otherwise_the_whole_group_is_relaunched(self, why, state, event):
        d = decide(state, event, 60.0, CONFIG if "in_place off" in why else IN_PLACE)
        assert of(d, RepairGroup) == [], why
        assert of(d, StopGroup), why

    def test_the_last_allowed_restart_fails_the_job_as_before(self):
        state = running(last_committed_step=8, restarts_used=2)
        d = decide(state, WorkerLost(attempt=1, rank=3, node="n2", cause="process"), 60.0, IN_PLACE)
        assert d.state.status is Status.FAILED and of(d, RepairGroup) == []

    def test_a_failed_repair_relaunches_every_rank_without_spending_again(self):
        repairing = decide(
            running(last_committed_step=8), WorkerLost(attempt=1, rank=3, node="n2", cause="process"), 60.0, IN_PLACE
        ).state
        d = decide(repairing, RepairFailed(attempt=2, reason="rank 0 did not come back"), 61.0, IN_PLACE)
        assert kinds(d) == ["repair_failed"] and of(d, StopGroup)[0].attempt == 2
        assert (d.state.group, d.state.restarts_used) == (GroupPhase.STOPPING, 1)
        relaunch = decide(d.state, GroupStopped(attempt=2), 62.0, IN_PLACE)
        assert of(relaunch, LaunchGroup) == [LaunchGroup(attempt=3, dp=4, world_size=8, resume_step=8)]
        assert relaunch.state.restarts_used == 1
        assert decide(relaunch.state, RepairFailed(attempt=2, reason="late"), 63.0, IN_PLACE).ignored

    def test_ranks_lost_with_their_node_are_repaired_in_place_without_spending_a_restart(self):
        """Even with no restart left: a node loss is not the job's fault."""
        state = running(last_committed_step=8, restarts_used=2)
        d = decide(state, WorkerLost(attempt=1, rank=3, node="n2", cause="node"), 60.0, IN_PLACE)
        assert (d.state.status, d.state.attempt, d.state.group, d.state.restarts_used, d.state.step) == (
            Status.RECOVERING,
            2,
            GroupPhase.LAUNCHING,
            2,
            8,
        )
        assert d.state.node_loss_repair and d.state.backoff_until is None and not d.state.awaiting_capacity
        assert d.actions == (
            RecordEvent(kind="node_lost", detail="rank 3 on node n2 lost (node)"),
            RecordEvent(
                kind="restarting",
                detail="in place after a node loss (not the job's fault: restarts used 2/2): rank 3 and any rank "
                "lost with it replaced on the nodes left, the other ranks kept, resuming step 8 or a later step "
                "the ranks hold in memory",
            ),
            RepairGroup(attempt=2, lost_rank=3, world_size=8, resume_step=8),
        )
        ready = decide(d.state, GroupReady(attempt=2, world_size=8, start_step=11), 63.0, IN_PLACE)
        assert ready.state.status is Status.RUNNING and not ready.state.node_loss_repair
        assert (ready.state.restarts_used, ready.state.step) == (2, 11)

    def test_a_failed_repair_after_a_node_loss_waits_for_the_capacity_left(self):
        """No room for the lost node's ranks: stop, wait for a capacity report, fit the job to it (here a
        shrink), never relaunch at the old size first; still no restart spent."""
        repairing = decide(
            running(last_committed_step=8), WorkerLost(attempt=1, rank=3, node="n2", cause="node"), 60.0, IN_PLACE
        ).state
        d = decide(repairing, RepairFailed(attempt=2, reason="no room for rank 3"), 66.0, IN_PLACE)
        assert kinds(d) == ["repair_failed"] and of(d, StopGroup)[0].attempt == 2
        assert of(d, RecordEvent)[0].detail == (
            "in-place repair of attempt 2 after a node loss failed: no room for rank 3"
        )
        assert (d.state.group, d.state.restarts_used, d.state.awaiting_capacity) == (GroupPhase.STOPPING, 0, True)
        assert not d.state.node_loss_repair
        stopped = decide(d.state, GroupStopped(attempt=2), 67.0, IN_PLACE)
        assert of(stopped, LaunchGroup) == []  # a capacity report first
        shrunk = decide(stopped.state, CapacityChanged(available_dp=2), 68.0, IN_PLACE)
        assert of(shrunk, LaunchGroup) == [LaunchGroup(attempt=3, dp=2, world_size=4, resume_step=8)]
        assert shrunk.state.restarts_used == 0

    def test_a_process_fault_repair_that_fails_still_relaunches_at_once(self):
        """The flag belongs to the node-loss repair only: a later process-fault repair relaunches as before."""
        after_node = decide(
            running(last_committed_step=8), WorkerLost(attempt=1, rank=3, node="n2", cause="node"), 60.0, IN_PLACE
        ).state
        up = decide(after_node, GroupReady(attempt=2, world_size=8), 61.0, IN_PLACE).state
        repairing = decide(up, WorkerLost(attempt=2, rank=1, node="n1", cause="process"), 70.0, IN_PLACE).state
        assert not repairing.node_loss_repair and repairing.restarts_used == 1
        failed = decide(repairing, RepairFailed(attempt=3, reason="x"), 71.0, IN_PLACE)
        assert not failed.state.awaiting_capacity
        assert of(decide(failed.state, GroupStopped(attempt=3), 72.0, IN_PLACE), LaunchGroup)


class TestRepairOnNccl:
    """[9] Under NCCL the survivors of a lost rank cannot leave the failed attempt (their collectives wait
    for the dead peer until the process group's timeout), so a rank's loss relaunches every rank at once,
    and its event says why; a resize, which stops at a step boundary, still runs in place."""

    NOTE = (
        "; every rank relaunched, not repaired in place: NCCL does not fail the survivors' collectives with a "
        "dead peer, so they cannot leave the failed attempt (they would wait until the process group's timeout)"
    )

    def test_a_lost_rank_relaunches_every_rank_and_says_why(self):
        d = decide(
            running(last_committed_step=8), WorkerLost(attempt=1, rank=3, node="n2", cause="process"), 60.0, ON_NCCL
        )
        assert of(d, RepairGroup) == [] and of(d, StopGroup)[0].attempt == 1
        assert (d.state.status, d.state.restarts_used, d.state.group) == (Status.RECOVERING, 1, GroupPhase.STOPPING)
        assert of(d, RecordEvent)[0] == RecordEvent(
            kind="worker_failed", detail="rank 3 on node n2 lost (process)" + self.NOTE
        )
        relaunch = decide(d.state, GroupStopped(attempt=1), 61.0, ON_NCCL)  # the first restart: no backoff
        assert of(relaunch, LaunchGroup) == [LaunchGroup(attempt=2, dp=4, world_size=8, resume_step=8)]

    def test_a_node_loss_waits_for_the_capacity_left_without_spending_and_says_why(self):
        d = decide(
            running(last_committed_step=8), WorkerLost(attempt=1, rank=3, node="n2", cause="node"), 60.0, ON_NCCL
        )
        assert of(d, RepairGroup) == [] and of(d, StopGroup)
        assert (d.state.restarts_used, d.state.awaiting_capacity) == (0, True)
        assert of(d, RecordEvent)[0].detail == "rank 3 on node n2 lost (node)" + self.NOTE

    def test_a_hung_rank_named_by_the_diagnosis_is_not_killed_alone(self):
        asked = decide(running(last_committed_step=8), Tick(), 61.0, ON_NCCL).state
        d = decide(asked, HangDiagnosed(attempt=1, rank=3, node="n2", detail="rank 3 outside"), 62.0, ON_NCCL)
        assert of(d, KillRank) == [] and of(d, StopGroup)[0].attempt == 1
        assert kinds(d) == ["hang_detected", "restarting"] and of(d, RecordEvent)[0].detail.endswith(self.NOTE)

    @pytest.mark.parametrize(
        "state,event",
        [
            (running(), WorkerLost(attempt=1, rank=3, node="n2", cause="process")),  # nothing committed
            (running(dp=1, last_committed_step=8), WorkerLost(attempt=1, rank=0, node="n1", cause="actor")),
        ],
        ids=["nothing-committed", "one-rank"],
    )
    def test_the_note_is_only_where_the_backend_alone_ruled_the_repair_out(self, state, event):
        d = decide(state, event, 60.0, configured(ON_NCCL, tp=1))
        assert of(d, StopGroup) and self.NOTE not in of(d, RecordEvent)[0].detail

    def test_a_resize_still_runs_in_place(self):
        _, d = scaled_at_step_5(ON_NCCL)
        assert of(d, StopGroup) == [] and of(d, ResizeGroup) == [
            ResizeGroup(attempt=2, dp=2, from_dp=8, world_size=4, resume_step=5)
        ]


class TestGroupStopped:
    def test_waits_out_the_backoff(self):
        d = decide(stopping(), GroupStopped(attempt=1), 104.0, CONFIG)
        assert d.state.group is GroupPhase.NONE and d.state.group_since == 104.0
        assert d.actions == ()
        assert "backing off until t=110" in d.reason

    def test_launches_when_backoff_is_over(self):
        d = decide(stopping(), GroupStopped(attempt=1), 111.0, CONFIG)
        assert d.state.status is Status.RECOVERING
        assert d.actions == (LaunchGroup(attempt=2, dp=4, world_size=8, resume_step=8),)
        assert (d.state.attempt, d.state.group, d.state.step, d.state.backoff_until) == (
            2,
            GroupPhase.LAUNCHING,
            8,
            None,
        )

    def test_waits_for_a_capacity_report_after_node_loss(self):
        state = stopping(restarts_used=0, backoff_until=None, awaiting_capacity=True)
        d = decide(state, GroupStopped(attempt=1), 104.0, CONFIG)
        assert of(d, LaunchGroup) == []
        assert kinds(d) == ["waiting_for_capacity"]
        assert d.state.capacity_wait_since == 104.0

    def test_unasked_stop_is_a_fault(self):
        d = decide(running(), GroupStopped(attempt=1), 100.0, CONFIG)
        assert (d.state.status, d.state.group, d.state.restarts_used) == (Status.RECOVERING, GroupPhase.LAUNCHING, 1)
        assert of(d, StopGroup) == []  # nothing left to stop
        assert of(d, LaunchGroup) == [LaunchGroup(attempt=2, dp=4, world_size=8, resume_step=None)]  # at once
        assert kinds(d) == ["worker_failed", "restarting"]

    def test_with_no_group_is_ignored(self):
        assert decide(stopping(group=GroupPhase.NONE), GroupStopped(attempt=1), 100.0, CONFIG).ignored


class TestTick:
    def test_progress_within_timeout_is_fine(self):
        d = decide(running(), Tick(), 60.0, CONFIG)
        assert d.state == running() and d.actions == ()

    def test_a_hang_first_asks_the_ranks_where_they_are(self):
        d = decide(running(last_committed_step=8), Tick(), 61.0, CONFIG)
        assert d.state.status is Status.RUNNING and d.state.restarts_used == 0
        assert d.actions == (DiagnoseHang(attempt=1),) and d.state.hang_asked_at == 61.0
        assert d.reason.startswith("no step progress for 61s (heartbeat_timeout_s=60), stuck at step 10")
        waiting = decide(d.state, Tick(), 61.0 + HANG_DIAGNOSIS_S, CONFIG)
        assert waiting.actions == () and waiting.state == d.state  # nothing asked twice

    def test_a_diagnosis_that_never_comes_relaunches_and_spends_budget(self):
        asked = decide(running(last_committed_step=8), Tick(), 61.0, CONFIG).state
        d = decide(asked, Tick(), 61.0 + HANG_DIAGNOSIS_S + 0.5, CONFIG)
        assert d.state.status is Status.RECOVERING and d.state.restarts_used == 1 and d.state.hang_asked_at is None
        assert kinds(d) == ["hang_detected", "restarting"]
        assert of(d, RecordEvent)[0].detail == (
            "no step progress for 72s (heartbeat_timeout_s=60), stuck at step 10; the ranks' diagnosis (or the "
            "culprit's loss) did not come within 10s"
        )
        assert of(d, StopGroup)[0].attempt == 1
        assert of(d, ScheduleWake) == []  # the first restart waits only for the group to stop

    def test_a_named_culprit_is_killed_and_its_loss_repaired_in_place(self):
        asked = decide(running(last_committed_step=8), Tick(), 61.0, CONFIG).state
        answer = HangDiagnosed(attempt=1, rank=3, node="n2", detail="rank 3 stopped at step 11 outside any collective")
        d = decide(asked, answer, 62.0, IN_PLACE)
        assert d.state.status is Status.RUNNING and d.state.restarts_used == 0 and d.state.hang_asked_at == 62.0
        assert kinds(d) == ["hang_detected"]
        assert of(d, RecordEvent)[0].detail == (
            "no step progress for 62s (heartbeat_timeout_s=60), stuck at step 10: rank 3 stopped at step 11 "
            "outside any collective"
        )
        assert of(d, KillRank) == [KillRank(attempt=1, rank=3, reason="rank 3 on node n2 hung")]
        lost = decide(d.state, WorkerLost(attempt=1, rank=3, node="n2", cause="actor"), 62.5, IN_PLACE)
        assert of(lost, RepairGroup) == [RepairGroup(attempt=2, lost_rank=3, world_size=8, resume_step=8)]
        assert lost.state.restarts_used == 1 and lost.state.hang_asked_at is None

    @pytest.mark.parametrize(
        "state,rank",
        [
            (running(last_committed_step=8), None),  # every rank waits: no single culprit
            (running(), 3),  # nothing committed: no repair in place
            (running(last_committed_step=8), 8),  # not a rank of this world
        ],
        ids=["no-culprit", "nothing-committed", "unknown-rank"],
    )
    def test_without_a_culprit_to_repair_every_rank_is_relaunched(self, state, rank):
        asked = decide(state, Tick(), 61.0, IN_PLACE).state
        d = decide(asked, HangDiagnosed(attempt=1, rank=rank, node="", detail="why"), 62.0, IN_PLACE)
        assert d.state.status is Status.RECOVERING and d.state.restarts_used == 1
        assert kinds(d) == ["hang_detected", "restarting"] and of(d, KillRank) == []
        assert of(d, StopGroup)[0].attempt == 1

    def test_a_one_rank_job_has_no_survivor_to_keep_and_is_relaunched(self):
        """Its checkpoint is then verified by the supervisor before the launch (a forged step moved aside),
        where a repair in place would let the replacement refuse it and fail the job."""
        one = configured(IN_PLACE, tp=1)
        state = running(dp=1, last_committed_step=8)
        lost = decide(state, WorkerLost(attempt=1, rank=0, node="n1", cause="actor"), 62.0, one)
        assert of(lost, RepairGroup) == [] and of(lost, StopGroup)[0].attempt == 1
        asked = decide(state, Tick(), 61.0, one).state
        hung = decide(asked, HangDiagnosed(attempt=1, rank=0, node="n1", detail="why"), 62.0, one)
        assert of(hung, KillRank) == [] and kinds(hung) == ["hang_detected", "restarting"]

    def test_progress_clears_the_hang_and_a_late_diagnosis_is_ignored(self):
        asked = decide(running(last_committed_step=8), Tick(), 61.0, CONFIG).state
        moved = decide(asked, StepReported(attempt=1, step=11, loss=2.0), 61.5, CONFIG).state
        assert moved.hang_asked_at is None
        late = decide(moved, HangDiagnosed(attempt=1, rank=3, node="n2", detail="why"), 62.0, CONFIG)
        assert late.ignored and late.actions == ()

    def test_hang_with_budget_spent_fails(self):
        asked = decide(running(restarts_used=2, last_committed_step=8), Tick(), 61.0, CONFIG).state
        d = decide(asked, HangDiagnosed(attempt=1, rank=3, node="n2", detail="why"), 62.0, CONFIG)
        assert d.state.status is Status.FAILED
        assert "restarted 2 times, max_restarts=2" in d.state.error

    def test_start_timeout_is_a_fault(self):
        assert decide(launching(), Tick(), 120.0, CONFIG).state.status is Status.STARTING
        d = decide(launching(), Tick(), 121.0, CONFIG)
        assert d.state.status is Status.RECOVERING and d.state.restarts_used == 1
        assert kinds(d) == ["start_timeout", "restarting"]

    def test_stop_timeout_fails(self):
        assert decide(stopping(), Tick(), 130.0, CONFIG).state.status is Status.RECOVERING
        d = decide(stopping(), Tick(), 131.0, CONFIG)
        assert d.state.status is Status.FAILED
        assert d.state.error == "worker group of attempt 1 did not stop within stop_timeout_s=30"
        assert of(d, StopGroup) == []  # already asked

    def test_backoff_expiry_launches(self):
        state = stopping(group=GroupPhase.NONE)
        assert decide(state, Tick(), 109.0, CONFIG).actions == ()
        d = decide(state, Tick(), 110.0, CONFIG)
        assert of(d, LaunchGroup) == [LaunchGroup(attempt=2, dp=4, world_size=8, resume_step=8)]

    def test_queued_tick_does_nothing(self):
        state = initial_state(CONFIG, dp=4)
        assert decide(state, Tick(), 1e9, CONFIG).state == state

    def test_capacity_wait_gives_up_after_its_timeout(self):
        state = stopping(group=GroupPhase.NONE, backoff_until=None, available_dp=1)
        d = decide(state, Tick(), 200.0, CONFIG)
        assert kinds(d) == ["waiting_for_capacity"]
        state = d.state
        d = decide(state, Tick(), 500.0, CONFIG)
        assert d.actions == () and "300s so far" in d.reason  # silent while nothing changes
        d = decide(state, Tick(), 801.0, CONFIG)
        assert d.state.status is Status.FAILED
        assert d.state.error.startswith("gave up after 601s waiting for capacity for min_dp=2")


class TestCapacity:
    def test_grow_asks_for_a_checkpoint_first(self):
        d = decide(running(step=15, last_committed_step=10), CapacityChanged(available_dp=8), 40.0, CONFIG)
        assert d.state.status is Status.RUNNING
        assert (d.state.pending_resize_dp, d.state.checkpoint_requested_at, d.state.checkpoint_requested_step) == (
            8,
            40.0,
            15,
        )
        assert d.actions == (
            RequestCheckpoint(attempt=1, reason="resize dp 4 -> 8"),
            RecordEvent(kind="checkpoint_requested", detail="before resize dp 4 -> 8, at step 15"),
        )

    def test_commit_of_the_requested_checkpoint_stops_for_the_resize(self):
        state = running(
            step=16,
            last_committed_step=10,
            available_dp=8,
            pending_resize_dp=8,
            checkpoint_requested_at=40.0,
            checkpoint_requested_step=15,
        )
        reported = report_all(state, 16, now=45.0)
        assert reported.state.status is Status.RUNNING and reported.state.pending  # not before the manifest
        assert types(reported) == ["CommitCheckpoint"]
        d = decide(reported.state, CommitSucceeded(step=16), 45.0, CONFIG)
        assert d.state.status is Status.RESIZING and d.state.group is GroupPhase.STOPPING
        assert types(d) == ["RecordEvent", "RecordEvent", "StopGroup"]
        assert kinds(d) == ["checkpoint_committed", "resizing"]
        assert d.state.pending_resize_dp is None and not d.state.pending

    def test_an_older_in_flight_checkpoint_does_not_trigger_the_resize(self):
        state = running(
            step=16,
            last_committed_step=10,
            available_dp=8,
            pending_resize_dp=8,
            checkpoint_requested_at=40.0,
            checkpoint_requested_step=15,
        )
        d = commit_all(state, 12, now=45.0)
        assert d.state.status is Status.RUNNING and d.state.pending
        assert d.state.last_committed_step == 12

    def test_nothing_new_since_the_checkpoint_resizes_at_once(self):
        d = decide(running(step=10, last_committed_step=10), CapacityChanged(available_dp=8), 40.0, CONFIG)
        assert d.state.status is Status.RESIZING
        assert of(d, RequestCheckpoint) == []
        assert of(d, StopGroup) == [StopGroup(attempt=1, reason="resize dp 4 -> 8")]

    def test_same_fit_changes_nothing(self):
        d = decide(running(), CapacityChanged(available_dp=6), 40.0, CONFIG)  # 6 -> legal 4
        assert d.state == running(available_dp=6) and d.actions == ()

    def test_capped_at_max_dp(self):
        d = decide(running(step=15), CapacityChanged(available_dp=100), 40.0, CONFIG)
        assert d.state.pending_resize_dp == 8

    def test_less_capacity_while_running_shrinks_gracefully(self):
        d = decide(running(step=15), CapacityChanged(available_dp=3), 40.0, CONFIG)
        assert d.state.pending_resize_dp == 2 and of(d, RequestCheckpoint)

    def test_capacity_below_min_while_running_keeps_running_and_says_so(self):
        d = decide(running(step=15), CapacityChanged(available_dp=1), 40.0, CONFIG)
        assert d.state.status is Status.RUNNING and d.state.available_dp == 1
        assert kinds(d) == ["capacity_low"]

    def test_pending_resize_follows_newer_capacity(self):
        state = decide(running(step=15), CapacityChanged(available_dp=8), 40.0, CONFIG).state
        d = decide(state, CapacityChanged(available_dp=2), 41.0, CONFIG)
        assert d.state.pending_resize_dp == 2 and d.actions == ()
        d = decide(state, CapacityChanged(available_dp=4), 41.0, CONFIG)
        assert d.state.pending_resize_dp is None and not d.state.pending
        assert "resize dropped" in d.reason

    def test_queued_and_stopping_store_it_for_the_next_launch(self):
        queued = initial_state(CONFIG, dp=4)
        assert decide(queued, CapacityChanged(available_dp=2), 0, CONFIG).state == replace(queued, available_dp=2)
        d = decide(stopping(), CapacityChanged(available_dp=2), 105.0, CONFIG)
        assert d.actions == () and d.state.available_dp == 2

    def test_capacity_report_releases_a_node_loss_wait(self):
        state = stopping(group=GroupPhase.NONE, backoff_until=None, awaiting_capacity=True)
        d = decide(state, CapacityChanged(available_dp=3), 120.0, CONFIG)
        assert d.state.status is Status.RESIZING and not d.state.awaiting_capacity
        assert of(d, LaunchGroup) == [LaunchGroup(attempt=2, dp=2, world_size=4, resume_step=8)]

    def test_negative_capacity_is_ignored(self):
        assert decide(running(), CapacityChanged(available_dp=-1), 1.0, CONFIG).ignored


class TestScaleRequested:
    @pytest.mark.parametrize("dp", [1, 3, 16])
    def test_illegal_sizes_are_rejected_with_the_legal_ones(self, dp):
        d = decide(running(), ScaleRequested(dp=dp), 5.0, CONFIG)
        assert d.state == running()
        assert kinds(d) == ["scale_rejected"]
        assert of(d, RecordEvent)[0].detail == (
            f"dp={dp} rejected: legal sizes for global_batch=32, micro_batch=2 in [min_dp=2, max_dp=8] are [2, 4, 8]"
        )

    def test_more_than_the_cluster_can_place_is_rejected(self):
        d = decide(running(available_dp=4), ScaleRequested(dp=8), 5.0, CONFIG)
        assert d.state == running(available_dp=4)
        assert "only 4 replica(s)" in of(d, RecordEvent)[0].detail

    def test_legal_request_while_running_checkpoints_then_resizes(self):
        d = decide(running(step=15), ScaleRequested(dp=2), 5.0, CONFIG)
        assert d.state.target_dp == 2 and d.state.pending_resize_dp == 2
        assert kinds(d) == ["scale_requested", "checkpoint_requested"]
        assert of(d, RequestCheckpoint) == [RequestCheckpoint(attempt=1, reason="resize dp 4 -> 2")]

    def test_request_for_the_current_size_is_a_no_op(self):
        d = decide(running(), ScaleRequested(dp=4), 5.0, CONFIG)
        assert d.state == running(target_dp=4) and kinds(d) == ["scale_requested"]

    def test_target_pins_the_size_against_more_capacity(self):
        d = decide(running(target_dp=2, dp=2), CapacityChanged(available_dp=8), 5.0, CONFIG)
        assert d.actions == () and d.state.pending_resize_dp is None

    def test_queued_request_sets_the_first_size(self):
        state = decide(initial_state(CONFIG, dp=4), ScaleRequested(dp=8), 0.0, CONFIG).state
        assert of(decide(state, Start(), 1.0, CONFIG), LaunchGroup)[0].dp == 8

    def test_request_while_backing_off_applies_at_launch(self):
        state = decide(stopping(group=GroupPhase.NONE), ScaleRequested(dp=2), 105.0, CONFIG).state
        d = decide(state, Tick(), 110.0, CONFIG)
        assert d.state.status is Status.RESIZING and of(d, LaunchGroup)[0].dp == 2


class TestStragglers:
    def flagged(self, evict=True, node="n3", attempt=1):
        return StragglerFlagged(attempt=attempt, rank=6, node=node, factor=2.1, evict=evict, evidence="2 windows")

    def test_report_only(self):
        d = decide(running(), self.flagged(evict=False), 5.0, CONFIG)
        assert d.state == running()
        assert d.actions == (
            RecordEvent(
                kind="straggler_detected", detail="rank 6 on node n3 is 2.10x slower than its peers (2 windows)"
            ),
        )

    def test_evict_checkpoints_first(self):
        d = decide(running(step=15), self.flagged(), 5.0, CONFIG)
        assert (d.state.pending_evict_node, d.state.pending_evict_rank) == ("n3", 6)
        assert kinds(d) == ["straggler_detected", "checkpoint_requested"]
        assert of(d, RequestCheckpoint) == [RequestCheckpoint(attempt=1, reason="evict node n3 (rank 6)")]

    def test_commit_excludes_the_node_and_restarts_without_spending_budget(self):
        state = decide(running(step=15), self.flagged(), 5.0, CONFIG).state
        d = commit_all(state, 15, now=9.0)
        assert d.state.status is Status.RECOVERING and d.state.restarts_used == 0
        assert d.state.excluded_nodes == frozenset({"n3"}) and d.state.awaiting_capacity
        assert types(d) == ["RecordEvent", "RecordEvent", "ExcludeNode", "StopGroup"]
        assert of(d, ExcludeNode) == [ExcludeNode(node="n3", reason="straggler rank 6")]
        assert kinds(d) == ["checkpoint_committed", "straggler_evicted"]

    def test_evict_with_nothing_new_to_save_stops_at_once(self):
        d = decide(running(step=10, last_committed_step=10), self.flagged(), 5.0, CONFIG)
        assert of(d, RequestCheckpoint) == [] and of(d, ExcludeNode) and of(d, StopGroup)

    @pytest.mark.parametrize(
        "state,why",
        [
            (running(checkpoint_requested_at=1.0, pending_resize_dp=8), "another change"),
            (running(excluded_nodes=frozenset({"n3"})), "already excluded"),
            (launching(), "job is STARTING"),
        ],
    )
    def test_evict_refused(self, state, why):
        d = decide(state, self.flagged(), 5.0, CONFIG)
        assert kinds(d) == ["straggler_detected"] and why in d.reason
        assert d.state == state

    def test_failure_during_a_pending_evict_still_excludes_the_node(self):
        state = decide(running(step=15), self.flagged(), 5.0, CONFIG).state
        d = decide(state, WorkerLost(attempt=1, rank=0, node="n1", cause="process"), 6.0, CONFIG)
        assert of(d, ExcludeNode) == [ExcludeNode(node="n3", reason="straggler rank 6")]
        assert d.state.excluded_nodes == frozenset({"n3"}) and d.state.awaiting_capacity
        assert d.state.pending_evict_node is None

    def test_checkpoint_timeout_evicts_anyway(self):
        state = decide(running(step=15, last_progress_at=100.0), self.flagged(), 5.0, CONFIG).state
        d = decide(state, Tick(), 106.0, CONFIG)
        assert kinds(d) == ["checkpoint_timeout", "straggler_evicted"]
        assert of(d, ExcludeNode) and d.state.status is Status.RECOVERING

    def test_checkpoint_timeout_abandons_a_resize(self):
        state = decide(running(step=15, last_progress_at=100.0), CapacityChanged(available_dp=8), 5.0, CONFIG).state
        assert decide(state, Tick(), 105.0, CONFIG).actions == ()
        d = decide(state, Tick(), 106.0, CONFIG)
        assert d.state.status is Status.RUNNING and not d.state.pending
        assert kinds(d) == ["resize_abandoned"]


class TestCancel:
    def test_running_job_is_stopped_and_cancelled(self):
        d = decide(running(), Cancel(), 5.0, CONFIG)
        assert d.state.status is Status.CANCELLED
        assert d.actions == (
            StopGroup(attempt=1, reason="job cancelled"),
            RecordEvent(kind="cancelled", detail="cancelled by user"),
            MarkTerminal(status=Status.CANCELLED, error=None),
        )

    def test_queued_job_has_nothing_to_stop(self):
        d = decide(initial_state(CONFIG, dp=4), Cancel(reason="user alice"), 5.0, CONFIG)
        assert types(d) == ["RecordEvent", "MarkTerminal"]

    def test_stopping_group_is_not_stopped_twice(self):
        d = decide(stopping(), Cancel(), 105.0, CONFIG)
        assert d.state.status is Status.CANCELLED and of(d, StopGroup) == []


EXPORT_CONFIG = configured(export=True, export_timeout_s=300, job_id="demo-1234")


def exporting(**changes) -> SupervisorState:
    """Every step trained and committed at t=70; the group of attempt 1 is stopping before the export."""
    base = running(
        status=Status.EXPORTING,
        group=GroupPhase.STOPPING,
        group_since=70.0,
        step=100,
        last_committed_step=100,
        exporting_step=100,
    )
    return replace(base, **changes)


class TestExport:
    def test_finishing_with_export_stops_the_group_first_and_is_not_yet_succeeded(self):
        d = decide(running(step=100, last_committed_step=100), Finished(attempt=1, final_step=100), 70.0, EXPORT_CONFIG)
        assert d.state.status is Status.EXPORTING and d.state.group is GroupPhase.STOPPING
        assert (d.state.exporting_step, d.state.export_started_at) == (100, None)
        assert d.actions == (
            RecordEvent(kind="training_finished", detail="finished 100/100 steps; exporting checkpoint step 100"),
            StopGroup(attempt=1, reason="training finished; exporting"),
        )

    def test_the_export_starts_once_the_group_stopped(self):
        d = decide(exporting(), GroupStopped(attempt=1), 72.0, EXPORT_CONFIG)
        assert d.state.status is Status.EXPORTING and d.state.group is GroupPhase.NONE
        assert d.state.export_started_at == 72.0
        assert d.actions == (
            RecordEvent(kind="exporting", detail="checkpoint step 100 to Hugging Face format"),
            ExportCheckpoint(step=100),
        )

    def test_exported_succeeds_and_remembers_the_folder(self):
        state = exporting(group=GroupPhase.NONE, export_started_at=72.0)
        d = decide(state, Exported(step=100, path="/ckpt/demo/hf-export"), 90.0, EXPORT_CONFIG)
        assert d.state.status is Status.SUCCEEDED and d.state.error is None
        assert d.state.hf_export == "/ckpt/demo/hf-export"
        assert d.actions == (
            RecordEvent(kind="exported", detail="step 100 -> /ckpt/demo/hf-export"),
            RecordEvent(kind="succeeded", detail="finished 100/100 steps; Hugging Face folder /ckpt/demo/hf-export"),
            MarkTerminal(status=Status.SUCCEEDED, error=None),
        )

    def test_a_failed_export_fails_the_job_naming_the_checkpoint_and_the_retry(self):
        state = exporting(group=GroupPhase.NONE, export_started_at=72.0)
        d = decide(
            state,
            ExportFailed(step=100, checkpoint_dir="/ckpt/demo/step_00000100", error="disk full"),
            90.0,
            EXPORT_CONFIG,
        )
        assert d.state.status is Status.FAILED and d.state.hf_export is None
        assert d.state.error == (
            "training finished but exporting checkpoint step 100 (/ckpt/demo/step_00000100) to Hugging Face "
            "format failed: disk full. The checkpoint is intact; retry with "
            "`etrain export demo-1234 --step 100 --out DIR`"
        )
        assert d.actions[-1] == MarkTerminal(status=Status.FAILED, error=d.state.error)

    def test_an_export_past_its_timeout_fails(self):
        state = exporting(group=GroupPhase.NONE, export_started_at=72.0)
        assert decide(state, Tick(), 72.0 + 300, EXPORT_CONFIG).state.status is Status.EXPORTING
        d = decide(state, Tick(), 72.0 + 301, EXPORT_CONFIG)
        assert d.state.status is Status.FAILED
        assert "did not finish within export_timeout_s=300 (301s)" in d.state.error
        assert "`etrain export demo-1234 --step 100 --out DIR`" in d.state.error

    def test_an_uncommitted_final_checkpoint_fails_at_once(self):
        d = decide(running(step=100, last_committed_step=96), Finished(attempt=1, final_step=100), 70.0, EXPORT_CONFIG)
        assert d.state.status is Status.FAILED and not of(d, ExportCheckpoint)
        assert d.state.error == (
            "finished 100/100 steps but the final checkpoint (step 100) was not committed "
            "(last committed: step 96), so there is no checkpoint to export"
        )

    def test_a_group_that_does_not_stop_does_not_block_the_export(self):
        state = exporting()
        assert of(decide(state, Tick(), 70.0 + 30, EXPORT_CONFIG), ExportCheckpoint) == []
        d = decide(state, Tick(), 70.0 + 31, EXPORT_CONFIG)
        assert d.state.status is Status.EXPORTING and of(d, ExportCheckpoint) == [ExportCheckpoint(step=100)]
        assert "stop_timeout" in kinds(d)
        late = decide(d.state, GroupStopped(attempt=1), 120.0, EXPORT_CONFIG)  # the stop lands after all
        assert late.state.group is GroupPhase.NONE and late.actions == ()

    @pytest.mark.parametrize(
        "event", [Tick(), CapacityChanged(available_dp=8), ScaleRequested(dp=8)], ids=lambda e: type(e).__name__
    )
    def test_nothing_is_launched_while_exporting(self, event):
        state = exporting(group=GroupPhase.NONE, export_started_at=72.0, available_dp=2)
        d = decide(state, event, 80.0, EXPORT_CONFIG)
        assert d.state.status is Status.EXPORTING and not of(d, LaunchGroup) and not of(d, ExportCheckpoint)
        if isinstance(event, ScaleRequested):
            assert kinds(d) == ["scale_rejected"]

    def test_cancel_while_exporting(self):
        d = decide(exporting(group=GroupPhase.NONE, export_started_at=72.0), Cancel(), 80.0, EXPORT_CONFIG)
        assert d.state.status is Status.CANCELLED and d.actions[-1] == MarkTerminal(status=Status.CANCELLED, error=None)

    @pytest.mark.parametrize(
        "state, event",
        [
            (running(), Exported(step=100, path="/x")),
            (exporting(export_started_at=72.0), Exported(step=96, path="/x")),
            (running(), ExportFailed(step=100, checkpoint_dir="/x", error="y")),
        ],
        ids=["not-exporting", "other-step", "failed-not-exporting"],
    )
    def test_stray_export_answers_are_ignored(self, state, event):
        d = decide(state, event, 80.0, EXPORT_CONFIG)
        assert d.ignored and d.state == state

    def test_without_export_finishing_succeeds_at_once(self):
        d = decide(running(step=100, last_committed_step=100), Finished(attempt=1, final_step=100), 70.0, CONFIG)
        assert d.state.status is Status.SUCCEEDED and not of(d, ExportCheckpoint)

    def test_story_train_checkpoint_export(self):
        s = Story(config=EXPORT_CONFIG)
        s.at(0, Start())
        s.at(1, GroupReady(attempt=1, world_size=8))
        s.at(60, StepReported(attempt=1, step=100, loss=1.5))
        s.checkpoint(61, 100)
        s.at(62, Finished(attempt=1, final_step=100))
        assert s.at(63, GroupStopped(attempt=1)).actions[-1] == ExportCheckpoint(step=100)
        s.at(64, Tick())
        s.at(80, Exported(step=100, path="/ckpt/hf-export"))
        assert s.state.status is Status.SUCCEEDED and s.state.hf_export == "/ckpt/hf-export"
        assert s.all_kinds[-4:] == ["training_finished", "exporting", "exported", "succeeded"]


class TestAbort:
    @pytest.mark.parametrize(
        "state",
        [running(), stopping(), launching(), initial_state(CONFIG, dp=4)],
        ids=["running", "stopping", "launching", "queued"],
    )
    def test_fails_from_any_live_state(self, state):
        d = decide(state, Abort(error="supervisor internal error: KeyError 'loss'"), 5.0, CONFIG)
        assert d.state.status is Status.FAILED
        assert d.state.error == "supervisor internal error: KeyError 'loss'"
        assert d.actions[-1] == MarkTerminal(status=Status.FAILED, error=d.state.error)
        assert len(of(d, StopGroup)) == (1 if state.group in (GroupPhase.UP, GroupPhase.LAUNCHING) else 0)


TERMINAL = [
    running(status=Status.SUCCEEDED, group=GroupPhase.STOPPING),
    running(status=Status.FAILED, group=GroupPhase.STOPPING, error="boom"),
    running(status=Status.CANCELLED, group=GroupPhase.STOPPING),
]
EVERY_EVENT = [
    Start(),
    GroupReady(attempt=1, world_size=8),
    StepReported(attempt=1, step=11, loss=1.0),
    CheckpointReported(attempt=1, step=11, rank=0),
    WorkerLost(attempt=1, rank=0, node="n1", cause="process"),
    JobError(attempt=1, rank=0, message="x"),
    Tick(),
    CapacityChanged(available_dp=8),
    ScaleRequested(dp=2),
    StragglerFlagged(attempt=1, rank=0, node="n1", factor=3.0, evict=True),
    Cancel(),
    Abort(error="x"),
    Finished(attempt=1, final_step=100),
    GroupStopped(attempt=1),
    Exported(step=100, path="/ckpt/hf-export"),
    ExportFailed(step=100, checkpoint_dir="/ckpt/step_00000100", error="disk full"),
]


class TestIgnored:
    @pytest.mark.parametrize("state", TERMINAL, ids=lambda s: s.status.value)
    @pytest.mark.parametrize("event", EVERY_EVENT, ids=lambda e: type(e).__name__)
    def test_terminal_states_ignore_everything(self, state, event):
        d = decide(state, event, 1e6, CONFIG)
        assert d.ignored and d.state == state and d.actions == ()
        assert d.reason.startswith(f"ignored: job is {state.status.value}")

    @pytest.mark.parametrize("event", [e for e in EVERY_EVENT if hasattr(e, "attempt")], ids=lambda e: type(e).__name__)
    def test_events_from_an_old_attempt_are_dropped(self, event):
        state = running(attempt=2)
        d = decide(state, event, 5.0, CONFIG)
        assert d.ignored and d.state == state and d.actions == ()
        assert d.reason == f"ignored: stale {type(event).__name__} from attempt 1 (current attempt 2)"

    def test_unknown_event_type_is_ignored(self):
        class Mystery:
            pass

        assert decide(running(), Mystery(), 5.0, CONFIG).ignored


# ---------------------------------------------------------------------------------------------
# stories


class TestStories:
    def test_worker_lost_restart_then_finish(self):
        s = Story()
        assert of(s.at(0, Start()), LaunchGroup)[0].attempt == 1
        s.at(20, GroupReady(attempt=1, world_size=8))
        for step in range(1, 31):
            s.at(20 + step, StepReported(attempt=1, step=step, loss=3.0 - step / 100))
        s.checkpoint(51, 30)
        s.at(55, StepReported(attempt=1, step=31, loss=2.7))
        d = s.at(60, WorkerLost(attempt=1, rank=3, node="n2", cause="process", detail="SIGKILL"))
        assert of(d, ScheduleWake) == []  # no backoff before the first restart
        s.at(61, StepReported(attempt=1, step=32, loss=2.6))  # in flight from the dying group
        assert s.decisions[-1].ignored
        d = s.at(62, GroupStopped(attempt=1))
        assert of(d, LaunchGroup) == [LaunchGroup(attempt=2, dp=4, world_size=8, resume_step=30)]
        s.at(72, StepReported(attempt=1, step=33, loss=2.5))  # a straggling report from attempt 1
        assert s.decisions[-1].ignored
        s.at(80, GroupReady(attempt=2, world_size=8))
        assert s.state.step == 30  # resumed from the checkpoint, not from the lost progress
        for step in range(31, 101):
            s.at(80 + step, StepReported(attempt=2, step=step, loss=2.0))
        d = s.at(181, Finished(attempt=2, final_step=100))
        assert s.state.status is Status.SUCCEEDED and s.state.restarts_used == 1
        assert s.all_kinds == [
            "started",
            "checkpoint_committed",
            "worker_failed",
            "restarting",
            "restored",
            "succeeded",
        ]

    def test_node_lost_shrink_then_capacity_back_grow(self):
        s = Story(dp=8)
        s.at(0, CapacityChanged(available_dp=8))
        s.at(0, Start())
        s.at(10, GroupReady(attempt=1, world_size=16))
        s.at(20, StepReported(attempt=1, step=20, loss=2.0))
        s.checkpoint(21, 20)
        s.at(25, StepReported(attempt=1, step=25, loss=1.9))
        s.at(30, WorkerLost(attempt=1, rank=14, node="n4", cause="node"))
        s.at(31, WorkerLost(attempt=1, rank=15, node="n4", cause="node"))  # same node, ignored
        s.at(35, GroupStopped(attempt=1))
        assert s.state.status is Status.RECOVERING and s.state.restarts_used == 0
        d = s.at(36, CapacityChanged(available_dp=6))  # 6 replicas left: largest legal is 4
        assert s.state.status is Status.RESIZING
        assert of(d, LaunchGroup) == [LaunchGroup(attempt=2, dp=4, world_size=8, resume_step=20)]
        s.at(40, GroupReady(attempt=2, world_size=8))
        s.at(50, StepReported(attempt=2, step=30, loss=1.8))
        d = s.at(60, CapacityChanged(available_dp=8))  # the node is back
        assert of(d, RequestCheckpoint) and s.state.status is Status.RUNNING
        s.at(61, StepReported(attempt=2, step=31, loss=1.8))
        d = s.checkpoint(62, 31)
        assert s.state.status is Status.RESIZING and of(d, StopGroup)
        d = s.at(64, GroupStopped(attempt=2))
        assert of(d, LaunchGroup) == [LaunchGroup(attempt=3, dp=8, world_size=16, resume_step=31)]
        s.at(70, GroupReady(attempt=3, world_size=16))
        assert s.state.status is Status.RUNNING and s.state.dp == 8 and s.state.restarts_used == 0
        assert s.all_kinds == [
            "started",
            "checkpoint_committed",
            "node_lost",
            "waiting_for_capacity",
            "resized",
            "checkpoint_requested",
            "checkpoint_committed",
            "resizing",
            "resized",
        ]

    def test_launches_that_keep_failing_to_place_give_up_at_the_capacity_deadline(self):
        s = Story()
        s.at(0, Start())
        now, launches = 0.0, 0
        while not s.state.status.terminal:
            s.at(now + 5, WorkerLost(attempt=s.state.attempt, rank=-1, node="", cause="node", detail="placement"))
            s.at(now + 6, GroupStopped(attempt=s.state.attempt))
            launches += len(of(s.at(now + 7, CapacityChanged(available_dp=4)), LaunchGroup))
            now += 60
        assert s.state.restarts_used == 0  # capacity trouble never spends the budget...
        # ...but it is bounded in time: the wait began at t=6 and is not reset by launches that
        # never become ready; at t=666 it is over the 600s deadline.
        assert s.state.error == (
            "gave up after 660s waiting for a capacity report after losing or excluding a node "
            "(capacity_wait_timeout_s=600)"
        )
        assert launches == 11

    def test_capacity_below_min_waits_then_recovers(self):
        s = Story()
        s.at(0, Start())
        s.at(10, GroupReady(attempt=1, world_size=8))
        s.at(20, WorkerLost(attempt=1, rank=0, node="n1", cause="node"))
        s.at(21, GroupStopped(attempt=1))
        s.at(22, CapacityChanged(available_dp=1))
        s.at(100, Tick())
        assert s.state.status is Status.RECOVERING and s.state.group is GroupPhase.NONE
        d = s.at(200, CapacityChanged(available_dp=4))
        assert of(d, LaunchGroup)[0].dp == 4 and s.state.status is Status.RECOVERING
        assert s.all_kinds == ["started", "node_lost", "waiting_for_capacity", "waiting_for_capacity"]
        assert "cluster can place 1" in s.decisions[4].actions[0].detail

    def test_hang_detected_then_restart(self):
        s = Story()
        s.at(0, Start())
        s.at(10, GroupReady(attempt=1, world_size=8))
        s.at(20, StepReported(attempt=1, step=1, loss=3.0))
        for t in (30, 50, 70):
            s.at(t, StepReported(attempt=1, step=1, loss=3.0))  # a stale report while stuck in a collective
            s.at(t, Tick())
        assert s.state.status is Status.RUNNING
        assert s.at(81, Tick()).actions == (DiagnoseHang(attempt=1),)
        d = s.at(82, HangDiagnosed(attempt=1, rank=None, node="", detail="all 8 ranks wait in collectives"))
        assert kinds(d) == ["hang_detected", "restarting"] and s.state.restarts_used == 1
        d = s.at(82, GroupStopped(attempt=1))
        assert of(d, LaunchGroup) == [LaunchGroup(attempt=2, dp=4, world_size=8, resume_step=None)]

    def test_max_restarts_exceeded(self):
        s = Story()
        s.at(0, Start())
        now = 0.0
        for attempt in (1, 2, 3):
            s.at(now + 1, GroupReady(attempt=attempt, world_size=8))
            s.at(now + 2, WorkerLost(attempt=attempt, rank=1, node="n1", cause="process"))
            if s.state.status.terminal:
                break
            s.at(now + 3, GroupStopped(attempt=attempt))
            now = s.state.backoff_until or now + 3
            s.at(now, Tick())
        assert s.state.status is Status.FAILED
        assert s.state.error == "rank 1 on node n1 lost (process); restarted 2 times, max_restarts=2"
        backoffs = [a.at for d in s.decisions for a in of(d, ScheduleWake)]
        assert backoffs == [3.0 + 2 + 10]  # none before restart 1, 10s before restart 2
        assert s.decisions[-1].actions[-1] == MarkTerminal(status=Status.FAILED, error=s.state.error)
        assert s.at(1e4, Tick()).ignored

    def test_stale_events_from_an_old_attempt_change_nothing(self):
        s = Story()
        s.at(0, Start())
        s.at(1, GroupReady(attempt=1, world_size=8))
        s.at(2, WorkerLost(attempt=1, rank=0, node="n1", cause="actor"))
        s.at(3, GroupStopped(attempt=1))
        s.at(12, Tick())
        s.at(13, GroupReady(attempt=2, world_size=8))
        before = s.state
        for event in [
            WorkerLost(attempt=1, rank=2, node="n1", cause="process"),
            JobError(attempt=1, rank=2, message="RuntimeError: NCCL communicator aborted"),
            Finished(attempt=1, final_step=100),
            CheckpointReported(attempt=1, step=50, rank=0),
            GroupStopped(attempt=1),
            StragglerFlagged(attempt=1, rank=0, node="n1", factor=3.0, evict=True),
        ]:
            assert s.at(14, event).ignored
        assert s.state == before and s.state.status is Status.RUNNING

    def test_straggler_eviction_story(self):
        s = Story()
        s.at(0, CapacityChanged(available_dp=4))
        s.at(0, Start())
        s.at(5, GroupReady(attempt=1, world_size=8))
        s.at(10, StepReported(attempt=1, step=20, loss=2.0))
        s.at(11, StragglerFlagged(attempt=1, rank=6, node="n3", factor=2.0, evict=True))
        s.at(12, StepReported(attempt=1, step=21, loss=2.0))
        s.checkpoint(13, 21)
        s.at(14, GroupStopped(attempt=1))
        assert of(s.decisions[-1], LaunchGroup) == []  # waits for the capacity without n3
        d = s.at(15, CapacityChanged(available_dp=3))
        assert of(d, LaunchGroup) == [
            LaunchGroup(attempt=2, dp=2, world_size=4, resume_step=21, excluded_nodes=frozenset({"n3"}))
        ]
        assert s.state.status is Status.RESIZING and s.state.restarts_used == 0

    def test_user_scales_down_then_up(self):
        s = Story(dp=8)
        s.at(0, Start())
        s.at(1, GroupReady(attempt=1, world_size=16))
        s.at(2, StepReported(attempt=1, step=5, loss=2.0))
        s.at(3, ScaleRequested(dp=2))
        s.checkpoint(4, 5)
        s.at(5, GroupStopped(attempt=1))
        s.at(6, GroupReady(attempt=2, world_size=4))
        assert (s.state.status, s.state.dp) == (Status.RUNNING, 2)
        s.at(7, ScaleRequested(dp=8))  # nothing trained since step 5: immediate
        s.at(8, GroupStopped(attempt=2))
        s.at(9, GroupReady(attempt=3, world_size=16))
        assert (s.state.status, s.state.dp, s.state.last_committed_step) == (Status.RUNNING, 8, 5)
        assert s.all_kinds.count("resized") == 2 and s.state.restarts_used == 0


class TestGrowLimit:
    """A tenant's worker quota starts a job with its grant as the ``scale`` target: capacity alone never
    grows it past that, a ``scale`` (checked against the quota by the manager) does."""

    def test_capacity_returning_grows_back_to_the_grant_and_no_further(self):
        state = initial_state(CONFIG, dp=4, target_dp=4)
        s = Story(dp=4)
        s.state = state
        s.at(0, Start())
        s.at(1, GroupReady(attempt=1, world_size=8))
        d = s.at(2, CapacityChanged(available_dp=8))
        assert of(d, RequestCheckpoint) == [] and s.state.pending_resize_dp is None  # max_dp is 8: capped at 4
        s.at(3, StepReported(attempt=1, step=5, loss=2.0))
        d = s.at(4, CapacityChanged(available_dp=2))  # shrinks when capacity goes
        assert s.state.pending_resize_dp == 2
        s.checkpoint(5, 5)
        s.at(6, GroupStopped(attempt=1))
        s.at(7, GroupReady(attempt=2, world_size=4))
        s.at(8, StepReported(attempt=2, step=7, loss=2.0))
        d = s.at(9, CapacityChanged(available_dp=8))  # grows back to the grant, not to max_dp
        assert s.state.pending_resize_dp == 4
        s.at(10, ScaleRequested(dp=8))  # a scale the manager let through moves the ceiling
        assert s.state.target_dp == 8 and s.state.pending_resize_dp == 8


class TestHealthChecks:
    """[12] A rank that fails its health check has its node excluded, like an evicted straggler's."""

    def test_a_failed_check_excludes_the_node_and_relaunches_without_it_spending_nothing(self):
        s = Story(dp=4)
        s.at(0, Start())
        d = s.at(1, RankUnhealthy(attempt=1, rank=5, node="n3", reason="cannot allocate on cuda:0"))
        assert kinds(d) == ["health_check_failed"], kinds(d)
        assert "rank 5 on node n3 failed its health check: cannot allocate on cuda:0" in d.actions[0].detail
        assert of(d, ExcludeNode) == [ExcludeNode(node="n3", reason="rank 5 failed its health check")]
        assert of(d, StopGroup) and s.state.status is Status.RECOVERING and s.state.restarts_used == 0
        assert s.state.excluded_nodes == frozenset({"n3"}) and s.state.awaiting_capacity
        d = s.at(2, GroupStopped(attempt=1))
        assert of(d, LaunchGroup) == []  # waits for the capacity left without n3
        d = s.at(3, CapacityChanged(available_dp=4))
        assert of(d, LaunchGroup) == [
            LaunchGroup(attempt=2, dp=4, world_size=8, resume_step=None, excluded_nodes=frozenset({"n3"}))
        ]

    def test_a_failed_check_while_running_or_repairing_is_handled_the_same(self):
        d = decide(
            running(step=12, last_committed_step=10),
            RankUnhealthy(attempt=1, rank=0, node="n1", reason="x"),
            5.0,
            IN_PLACE,
        )
        assert of(d, ExcludeNode) and of(d, StopGroup) and d.state.excluded_nodes == frozenset({"n1"})

    def test_an_unknown_or_already_excluded_node_is_an_ordinary_fault(self):
        for node, excluded in (("", frozenset()), ("n1", frozenset({"n1"}))):
            state = running(excluded_nodes=excluded)
            d = decide(state, RankUnhealthy(attempt=1, rank=0, node=node, reason="x"), 5.0, CONFIG)
            assert kinds(d)[0] == "health_check_failed" and d.state.restarts_used == 1
            assert of(d, ExcludeNode) == []

    def test_a_stale_or_late_report_is_ignored(self):
        assert decide(running(), RankUnhealthy(attempt=0, rank=0, node="n1", reason="x"), 5.0, CONFIG).ignored
        s = Story(dp=4)
        s.at(0, Start())
        s.at(1, RankUnhealthy(attempt=1, rank=0, node="n1", reason="x"))
        assert s.at(2, RankUnhealthy(attempt=1, rank=1, node="n2", reason="y")).ignored  # the group is stopping


class TestResizeInPlace:
    """[11] With ``in_place`` a resize keeps the ranks' processes: no StopGroup, no relaunch."""

    def _scaled(self, dp=2):
        return scaled_at_step_5(IN_PLACE, dp)

    def test_scale_down_then_up_resizes_in_place_without_a_stop(self):
        s, d = self._scaled()
        assert of(d, StopGroup) == [] and of(d, LaunchGroup) == []
        assert of(d, ResizeGroup) == [ResizeGroup(attempt=2, dp=2, from_dp=8, world_size=4, resume_step=5)]
        assert (s.state.status, s.state.group, s.state.dp, s.state.step) == (
            Status.RESIZING,
            GroupPhase.LAUNCHING,
            2,
            5,
        )
        d = s.at(5, GroupReady(attempt=2, world_size=4))
        (resized,) = [a for a in d.actions if isinstance(a, RecordEvent) and a.kind == "resized"]
        assert resized.detail.endswith("; in place"), resized.detail
        assert s.state.resize_note is None and s.state.status is Status.RUNNING
        d = s.at(7, ScaleRequested(dp=8))  # nothing trained since step 5: at once
        assert of(d, ResizeGroup) == [ResizeGroup(attempt=3, dp=8, from_dp=2, world_size=16, resume_step=5)]
        s.at(8, GroupReady(attempt=3, world_size=16))
        assert (s.state.status, s.state.dp, s.state.restarts_used) == (Status.RUNNING, 8, 0)
        assert s.all_kinds.count("resized") == 2

    def test_a_failed_in_place_resize_relaunches_at_the_new_size_and_says_why(self):
        s, _ = self._scaled()
        d = s.at(5, ResizeFailed(attempt=2, reason="rank 3 did not leave"))
        assert kinds(d) == ["resize_failed"] and of(d, StopGroup) == [StopGroup(attempt=2, reason=d.reason)]
        d = s.at(6, GroupStopped(attempt=2))
        assert of(d, LaunchGroup) == [LaunchGroup(attempt=3, dp=2, world_size=4, resume_step=5)]
        assert s.state.status is Status.RESIZING
        d = s.at(7, GroupReady(attempt=3, world_size=4))
        (resized,) = [a for a in d.actions if isinstance(a, RecordEvent) and a.kind == "resized"]
        assert "relaunched: in place failed (rank 3 did not leave)" in resized.detail
        assert s.state.restarts_used == 0

    def test_a_late_resize_failure_is_ignored(self):
        s, _ = self._scaled()
        s.at(5, GroupReady(attempt=2, world_size=4))
        assert s.at(6, ResizeFailed(attempt=2, reason="late")).ignored

    def test_a_fault_while_resizing_in_place_is_an_ordinary_restart(self):
        s, _ = self._scaled()
        d = s.at(5, WorkerLost(attempt=2, rank=1, node="n1", cause="process"))
        assert s.state.status is Status.RECOVERING and s.state.resize_note is None
        assert s.state.restarts_used == 1 and of(d, StopGroup)
        s.at(20, GroupStopped(attempt=2))
        d = s.at(21, GroupReady(attempt=3, world_size=4))
        assert kinds(d) == ["restored"]

    def test_without_in_place_the_resized_event_says_it_relaunched(self):
        s, d = scaled_at_step_5(CONFIG)
        assert of(d, ResizeGroup) == [] and of(d, StopGroup)
        s.at(5, GroupStopped(attempt=1))
        d = s.at(6, GroupReady(attempt=2, world_size=4))
        (resized,) = [a for a in d.actions if isinstance(a, RecordEvent) and a.kind == "resized"]
        assert resized.detail.endswith("; relaunched: fault_tolerance.in_place is off"), resized.detail


# ---------------------------------------------------------------------------------------------
# invariants under random event streams


FUZZ_CONFIG = configured(max_restarts=8)
TERMINAL_STATUSES = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)


def random_event(rng, state, config=FUZZ_CONFIG):
    """A plausible event, mostly from the current attempt, sometimes late from the one before."""
    attempt = max(0, state.attempt - (rng.random() < 0.1))
    world = config.world_size(state.dp)
    total = config.total_steps

    def next_rank():
        """Half the time a rank that has not reported this step yet, so whole checkpoints happen."""
        step = min(state.step, total)
        missing = [r for r in range(world) if (step, r) not in state.checkpoint_reports]
        return missing[0] if missing and rng.random() < 0.5 else rng.randrange(world)

    makers = [
        (5, lambda: Start()),
        (3, lambda: GroupReady(attempt=attempt, world_size=world)),
        (8, lambda: StepReported(attempt=attempt, step=state.step + rng.choice([0, 1, 2]), loss=2.0)),
        (8, lambda: CheckpointReported(attempt=attempt, step=min(state.step, total), rank=next_rank())),
        (3, lambda: CommitSucceeded(step=rng.choice(sorted(state.committing) or [state.step]))),
        (1, lambda: CommitFailed(step=rng.choice(sorted(state.committing) or [state.step]), error="x")),
        (1, lambda: WorkerLost(attempt=attempt, rank=0, node="n1", cause=rng.choice(["process", "actor", "node"]))),
        (6, lambda: Tick()),
        (2, lambda: CapacityChanged(available_dp=rng.choice([0, 1, 2, 3, 4, 6, 8, 12]))),
        (1, lambda: ScaleRequested(dp=rng.choice([1, 2, 3, 4, 8]))),
        (
            1,
            lambda: StragglerFlagged(
                attempt=attempt, rank=1, node=rng.choice(["n1", "n2"]), factor=2.0, evict=rng.random() < 0.5
            ),
        ),
        (3, lambda: GroupStopped(attempt=attempt)),
        (0.5, lambda: ResizeFailed(attempt=attempt, reason="x")),
        (0.5, lambda: RankUnhealthy(attempt=attempt, rank=0, node=rng.choice(["n1", "n2", ""]), reason="x")),
        (0.3, lambda: Finished(attempt=attempt, final_step=rng.choice([total // 2, total]))),
        (0.5, lambda: Exported(step=rng.choice([state.exporting_step or total, total // 2]), path="/hf")),
        (0.2, lambda: ExportFailed(step=state.exporting_step or total, checkpoint_dir="/c", error="x")),
        (0.1, lambda: Cancel()),
        (0.05, lambda: Abort(error="adapter bug")),
    ]
    weights = [w for w, _ in makers]
    return rng.choices([m for _, m in makers], weights=weights)[0]()


@pytest.mark.parametrize("seed", range(40))
def test_random_event_streams_keep_the_invariants(seed):
    rng = random.Random(seed)
    config = FUZZ_CONFIG if seed % 2 else configured(FUZZ_CONFIG, in_place=True)
    state = initial_state(config, dp=4)
    now = 0.0
    terminal_marks = 0
    for _ in range(400):
        now += rng.choice([0.0, 0.5, 2.0, 5.0, 12.0, 40.0, 70.0])
        event = random_event(rng, state, config)
        before = state
        d = decide(state, event, now, config)
        state = d.state
        assert d.reason
        assert (state.status is Status.RUNNING) == (state.group is GroupPhase.UP) or state.status.terminal
        assert state.attempt >= before.attempt
        assert state.restarts_used <= config.policy.max_restarts
        assert config.policy.min_dp <= state.dp <= config.policy.max_dp and config.elastic.is_legal(state.dp)
        if before.last_committed_step is not None:
            assert state.last_committed_step >= before.last_committed_step
        if state.last_committed_step != before.last_committed_step:  # only the manifest's answer commits
            assert isinstance(event, CommitSucceeded) and event.step in before.committing
        for launch in of(d, LaunchGroup):
            assert launch.attempt == before.attempt + 1 and launch.resume_step == before.last_committed_step
            assert launch.world_size == config.world_size(launch.dp)
            # ... only once the old group is known to be gone (it stopped, as asked or not)
            assert before.group is GroupPhase.NONE or isinstance(event, GroupStopped)
        for resize in of(d, ResizeGroup):
            # From a running group, or one that just became ready (a resize that arrived during its launch).
            assert before.group is GroupPhase.UP or isinstance(event, GroupReady)
            assert resize.attempt == before.attempt + 1
            assert resize.resume_step == state.last_committed_step and resize.from_dp == before.dp != resize.dp
            assert resize.world_size == config.world_size(resize.dp) and state.status is Status.RESIZING
        for stop in of(d, StopGroup):
            assert stop.attempt == before.attempt and before.group in (GroupPhase.LAUNCHING, GroupPhase.UP)
        if of(d, RequestCheckpoint):
            assert state.status is Status.RUNNING and state.pending
        assert not of(d, ExportCheckpoint) and state.hf_export is None  # FUZZ_CONFIG does not export
        terminal_marks += len(of(d, MarkTerminal))
        if state.status.terminal:
            assert terminal_marks == 1
            break


@pytest.mark.parametrize("seed", range(30))
def test_random_events_after_the_last_step_export_exactly_once_and_never_relaunch(seed):
    """From the moment a job with export finishes its last step, whatever arrives (late reports,
    capacity, scale requests, stops, ticks, export answers, cancels), the job never launches again,
    exports at most once, and is SUCCEEDED only with the folder it exported."""
    rng = random.Random(seed)
    config = configured(FUZZ_CONFIG, export=True, total_steps=100, export_timeout_s=300)
    state = decide(running(step=100, last_committed_step=100), Finished(attempt=1, final_step=100), 70.0, config).state
    now, exports = 70.0, 0
    for _ in range(200):
        now += rng.choice([0.0, 1.0, 5.0, 20.0, 60.0])
        event = random_event(rng, state, config)
        before = state
        d = decide(state, event, now, config)
        state = d.state
        assert not of(d, LaunchGroup) and not of(d, RequestCheckpoint)
        assert state.status in (Status.EXPORTING, *TERMINAL_STATUSES)
        exports += len(of(d, ExportCheckpoint))
        assert exports <= 1
        if of(d, ExportCheckpoint):
            assert before.export_started_at is None and state.export_started_at == now
        if state.status is Status.SUCCEEDED:
            assert isinstance(event, Exported) and exports == 1 and state.hf_export == event.path
        if state.status.terminal:
            break
    assert exports == 1 or state.status is not Status.SUCCEEDED


# ---------------------------------------------------------------------------------------------
# CheckpointFallback: the launch restores an older checkpoint than the commit it was told about


def test_checkpoint_fallback_moves_commit_point_and_progress_back():
    from etrain.service.decisions.supervisor_events import CheckpointFallback

    state = launching(status=Status.RECOVERING, attempt=2, last_committed_step=20, step=20)
    decision = decide(state, CheckpointFallback(attempt=2, step=10, reason="sha256 mismatch"), 50.0, CONFIG)
    assert decision.state.last_committed_step == 10
    assert decision.state.step == 10
    assert kinds(decision) == ["checkpoint_fallback"]
    assert "step 20 failed verification; restoring step 10 (sha256 mismatch)" in decision.reason
    # Re-running steps 11..20 now counts as progress (no false hang).
    up = replace(decision.state, status=Status.RUNNING, group=GroupPhase.UP, last_progress_at=50.0)
    progressed = decide(up, StepReported(attempt=2, step=11, loss=2.0), 51.0, CONFIG)
    assert progressed.state.step == 11 and progressed.state.last_progress_at == 51.0


def test_checkpoint_fallback_to_fresh_start():
    from etrain.service.decisions.supervisor_events import CheckpointFallback

    state = launching(status=Status.RECOVERING, attempt=2, last_committed_step=5, step=5)
    decision = decide(state, CheckpointFallback(attempt=2, step=None), 1.0, CONFIG)
    assert decision.state.last_committed_step is None and decision.state.step == 0
    assert "restoring a fresh start" in decision.reason


@pytest.mark.parametrize(
    "state, step, why",
    [
        (running(last_committed_step=20), 10, "while the group is up"),
        (launching(attempt=1, last_committed_step=20), 20, "not older"),
        (launching(attempt=1, last_committed_step=20), 30, "not older"),
    ],
)
def test_checkpoint_fallback_ignored_when_not_launching_or_not_older(state, step, why):
    from etrain.service.decisions.supervisor_events import CheckpointFallback

    decision = decide(state, CheckpointFallback(attempt=state.attempt, step=step), 1.0, CONFIG)
    assert decision.ignored and decision.state == state
    assert why in decision.reason


def test_checkpoint_fallback_from_a_stale_attempt_is_ignored():
    from etrain.service.decisions.supervisor_events import CheckpointFallback

    state = launching(attempt=3, last_committed_step=20)
    assert decide(state, CheckpointFallback(attempt=2, step=10), 1.0, CONFIG).ignored


def test_straggler_at_the_last_step_is_reported_not_evicted():
    """Evicting when every step is done would relaunch a finished job for nothing."""
    state = running(step=CONFIG.total_steps)
    event = StragglerFlagged(attempt=1, rank=1, node="n1", factor=2.0, evict=True)
    decision = decide(state, event, 5.0, CONFIG)
    assert kinds(decision) == ["straggler_detected"]
    assert not of(decision, RequestCheckpoint) and not of(decision, StopGroup)
    assert decision.state.pending_evict_node is None
    assert "every step is done" in decision.reason
