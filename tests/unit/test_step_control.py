"""The step-boundary control exchange's pure part: the per-rank vector and rank 0's decision rule."""

from __future__ import annotations

import threading

import pytest

from etrain.workers.rank.step_control import (
    FIELDS,
    RANK_TIMINGS,
    SAVE,
    STOP,
    ControlRequests,
    StepBoundaries,
    StepDesyncError,
    decode,
    encode,
    scheduled_save,
    step_record,
)


def metrics(
    step: int,
    *,
    compute_s: float = 0.25,
    comm_wait_s: float = 0.05,
    step_s: float = 0.3,
    synced: bool = True,
    peak: int = 123_456_789,
) -> dict:
    return {
        "step": step,
        "loss": 2.5,
        "lr": 1e-3,
        "compute_s": compute_s,
        "comm_wait_s": comm_wait_s,
        "step_s": step_s,
        "timing_synced": synced,
        "peak_mem_bytes": peak,
        "host_mem_bytes": 3 * 2**30,
    }


class TestVector:
    def test_encode_puts_each_field_in_its_slot(self):
        vector = encode(metrics(7), SAVE | STOP)
        assert len(vector) == len(FIELDS) == 8
        assert dict(zip(FIELDS, vector)) == {
            "step": 7.0,
            "flags": 3.0,
            "compute_s": 0.25,
            "comm_wait_s": 0.05,
            "step_s": 0.3,
            "timing_synced": 1.0,
            "peak_mem_bytes": 123456789.0,
            "host_mem_bytes": 3.0 * 2**30,
        }

    def test_round_trip_over_three_ranks_keeps_every_value_and_rank_zeros_flags(self):
        rows = [
            encode(metrics(4, compute_s=0.1, synced=True, peak=2**40 + 1), SAVE),
            encode(metrics(4, compute_s=0.2, synced=True, peak=5), 0),
            encode(metrics(4, compute_s=0.4, synced=True, peak=0), STOP),
        ]  # not rank 0: ignored
        boundary = decode(rows, step=4)
        assert (boundary.completed, boundary.requested) == (5, SAVE)  # rank 0's flags only
        assert boundary.timings == {
            "compute_s": [0.1, 0.2, 0.4],
            "comm_wait_s": [0.05] * 3,
            "step_s": [0.3] * 3,
            "timing_synced": [True, True, True],
            "peak_mem_bytes": [2**40 + 1, 5, 0],
            "host_mem_bytes": [3 * 2**30, 3 * 2**30, 3 * 2**30],
        }
        assert list(boundary.timings) == list(RANK_TIMINGS)

    def test_peak_memory_stays_exact_at_80_gib(self):
        peak = 80 * 2**30 + 12345
        assert decode([encode(metrics(0, peak=peak))], step=0).timings["peak_mem_bytes"] == [peak]

    def test_a_rank_at_another_step_is_a_desync_naming_every_rank(self):
        rows = [encode(metrics(9)), encode(metrics(10)), encode(metrics(9))]
        with pytest.raises(StepDesyncError, match=r"expected 9; rank 0: 9, rank 1: 10, rank 2: 9"):
            decode(rows, step=9)

    def test_missing_fields_and_bad_flags_are_refused(self):
        with pytest.raises(ValueError, match="rank 1's vector has 7 values, expected 8"):
            decode([encode(metrics(1)), encode(metrics(1))[:-1]], step=1)
        with pytest.raises(ValueError, match="flags=4"):
            encode(metrics(1), 4)
        bad = encode(metrics(1))
        bad[1] = 2.5
        with pytest.raises(ValueError, match="flags 2.5"):
            decode([bad], step=1)
        with pytest.raises(ValueError, match="at least one"):
            decode([], step=1)

    def test_a_missing_metric_encodes_as_zero(self):
        assert encode({"step": 3}) == [3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]

    def test_step_record_is_rank_zeros_metrics_plus_every_ranks_timings(self):
        mine = metrics(2, compute_s=0.1)
        boundary = decode([encode(mine), encode(metrics(2, compute_s=0.3))], step=2)
        record = step_record(mine, boundary)
        assert {k: v for k, v in record.items() if k != "ranks"} == mine
        assert record["ranks"]["compute_s"] == [0.1, 0.3]
        assert record["ranks"]["timing_synced"] == [True, True]


class TestDecision:
    @pytest.mark.parametrize(
        "completed, expected", [(1, False), (9, False), (10, True), (20, True), (25, True), (26, True)]
    )
    def test_schedule_is_every_n_and_the_last_step(self, completed, expected):
        assert scheduled_save(completed, total_steps=25, every_steps=10) is expected

    def test_no_every_steps_saves_only_the_last(self):
        assert [c for c in range(1, 31) if scheduled_save(c, total_steps=30, every_steps=None)] == [30]
        assert [c for c in range(1, 31) if scheduled_save(c, total_steps=30, every_steps=0)] == [30]

    def test_no_request_decides_nothing(self):
        control = ControlRequests()
        assert [control.decide_requests(c, total_steps=12) for c in range(1, 13)] == [0] * 12

    def test_a_checkpoint_request_saves_the_first_boundary_at_or_past_its_target_once(self):
        control = ControlRequests()
        control.request_checkpoint(7)  # the supervisor knew 6 steps; rank 0 may already be past 7
        assert control.decide_requests(6, total_steps=100) == 0
        assert control.decide_requests(8, total_steps=100) == SAVE  # target passed: saved at once
        assert control.decide_requests(9, total_steps=100) == 0  # consumed
        assert control.pending() == (frozenset(), False)

    def test_a_request_without_a_target_saves_the_next_boundary(self):
        control = ControlRequests()
        control.request_checkpoint()
        assert control.decide_requests(3, total_steps=100) == SAVE
        assert control.decide_requests(4, total_steps=100) == 0

    def test_a_stop_is_decided_once_with_the_save_it_comes_with(self):
        control = ControlRequests()
        control.request_checkpoint(5)
        control.request_stop()
        assert control.pending() == (frozenset({5}), True)
        assert control.decide_requests(5, total_steps=100) == SAVE | STOP
        assert control.decide_requests(6, total_steps=100) == 0  # a new attempt would not stop at once

    def test_a_stop_at_the_last_step_is_a_finish_not_a_stop(self):
        control = ControlRequests()
        control.request_stop()
        assert control.decide_requests(10, total_steps=10) == 0  # the schedule saves the last step anyway

    def test_requests_from_other_threads_land_in_exactly_one_boundary(self):
        control = ControlRequests()
        decided: list[int] = []
        done = threading.Event()

        def request():
            for target in range(1, 2001):
                control.request_checkpoint(target)
            done.set()

        thread = threading.Thread(target=request)
        thread.start()
        completed = 0
        while not done.is_set() or control.pending()[0]:
            completed += 1
            if control.decide_requests(completed, total_steps=10**9) & SAVE:
                decided.append(completed)
        thread.join()
        # Every target was satisfied by some boundary at or past it, and no boundary saved without a target.
        assert decided and len(decided) <= 2000
        assert control.pending() == (frozenset(), False)


class LoopbackExchange:
    """One rank's exchange without peers: ``settle`` gives back what ``start`` sent; counts the waits."""

    def __init__(self, *, completes_at_once: bool = False):
        self.in_flight = None
        self.settled_steps: list[int] = []
        self.completes_at_once = completes_at_once  # as a single rank's exchange; False: peers still sending

    def done(self):
        return self.in_flight is not None and self.completes_at_once

    def start(self, metrics, flags=0):
        assert self.in_flight is None, "one exchange at a time"
        self.in_flight = (encode(metrics, flags), int(metrics["step"]))

    def settle(self):
        if self.in_flight is None:
            return None
        (vector, step), self.in_flight = self.in_flight, None
        self.settled_steps.append(step)
        return decode([vector], step=step)


def run_boundaries(steps: int, *, every: int | None, requests: dict[int, str] | None = None, rank0: bool = True):
    """Drive StepBoundaries over ``steps`` steps; ``requests``: step index -> "checkpoint"/"stop" delivered
    while that step runs. Returns (saves, stop, reported steps, urgent reported steps, exchange)."""
    exchange, control = LoopbackExchange(), ControlRequests()
    boundaries = StepBoundaries(exchange, control=control if rank0 else None, total_steps=steps, every_steps=every)
    saves, stop, reported, urgent = [], None, [], []
    for step in range(steps):
        what = (requests or {}).get(step)
        if what == "checkpoint":
            control.request_checkpoint(step + 1)
        elif what == "stop":
            control.request_stop()
        decision = boundaries.after_step(metrics(step))
        for record, is_urgent in decision.reports:
            reported.append(record["step"] + 1)
            if is_urgent:
                urgent.append(record["step"] + 1)
        if decision.save:
            saves.append(step + 1)
        if decision.stop:
            stop = step + 1
            break
    return saves, stop, reported, urgent, exchange


class TestOverlappedBoundaries:
    def test_the_schedule_saves_on_time_and_every_step_is_reported_once_in_order(self):
        saves, stop, reported, urgent, exchange = run_boundaries(25, every=10)
        assert saves == [10, 20, 25] and stop is None
        assert reported == list(range(1, 26))
        assert urgent == [10, 20, 25]  # a saving step reaches the supervisor before its checkpoint report
        assert exchange.in_flight is None  # nothing left in flight when the attempt ends

    def test_a_request_acts_one_boundary_later_than_a_waiting_exchange_would(self):
        # Delivered while step index 4 runs (target: 5 completed): rank 0 takes it at boundary 5 and
        # sends it for boundary 6, where every rank reads it.
        saves, stop, *_ = run_boundaries(12, every=None, requests={4: "checkpoint", 7: "stop"})
        assert saves == [6]
        assert stop == 9

    def test_a_stop_settles_its_own_exchange_so_no_rank_leaves_one_in_flight(self):
        saves, stop, reported, urgent, exchange = run_boundaries(20, every=None, requests={2: "stop"})
        assert stop == 4 and reported == [1, 2, 3, 4] and urgent == [4]
        assert exchange.in_flight is None

    def test_a_stop_that_would_land_on_the_last_step_is_no_stop(self):
        saves, stop, *_ = run_boundaries(6, every=None, requests={4: "stop"})
        assert stop is None and saves == [6]

    def test_other_ranks_follow_the_same_schedule_and_report_nothing(self):
        saves, stop, reported, urgent, _ = run_boundaries(25, every=10, rank0=False)
        assert saves == [10, 20, 25] and reported == [] and urgent == []

    def test_between_saves_a_boundary_does_not_wait_for_its_own_exchange(self):
        exchange = LoopbackExchange()
        boundaries = StepBoundaries(exchange, control=ControlRequests(), total_steps=9, every_steps=None)
        in_flight_after = []
        for step in range(9):
            boundaries.after_step(metrics(step))
            in_flight_after.append(exchange.in_flight is not None)
        # Steps 1-8 leave their exchange running through the next step; the last one (a save) settles it.
        assert in_flight_after == [True] * 8 + [False]
        assert exchange.settled_steps == list(range(9))

    def test_an_exchange_complete_at_once_reports_its_step_at_once_and_decides_the_same(self):
        requests = {4: "checkpoint", 7: "stop"}
        exchange = LoopbackExchange(completes_at_once=True)
        control = ControlRequests()
        boundaries = StepBoundaries(exchange, control=control, total_steps=12, every_steps=None)
        saves, stop, reported = [], None, []
        for step in range(12):
            if requests.get(step) == "checkpoint":
                control.request_checkpoint(step + 1)
            elif requests.get(step) == "stop":
                control.request_stop()
            decision = boundaries.after_step(metrics(step))
            reported.append([record["step"] + 1 for record, _ in decision.reports])
            assert exchange.in_flight is None
            saves += [step + 1] if decision.save else []
            if decision.stop:
                stop = step + 1
                break
        assert reported == [[n] for n in range(1, 10)]  # each step in its own boundary's report
        assert (saves, stop) == run_boundaries(12, every=None, requests=requests)[:2] == ([6], 9)

    def test_when_an_attempt_fails_rank_0_still_has_the_last_completed_steps_record(self):
        """The step whose exchange never settled (a peer died during the next step) is handed over without
        the peers' timings, so every step the survivors completed reaches the supervisor."""
        for completed in (1, 4, 7):
            exchange = LoopbackExchange()
            boundaries = StepBoundaries(exchange, control=ControlRequests(), total_steps=9, every_steps=None)
            reported = []
            for step in range(completed):
                reported += [record["step"] + 1 for record, _ in boundaries.after_step(metrics(step)).reports]
            assert reported == list(range(1, completed))  # one boundary late
            (last,) = boundaries.unreported()
            assert last["step"] + 1 == completed and last["ranks"] is None
        other = StepBoundaries(LoopbackExchange(), control=None, total_steps=9, every_steps=None)
        other.after_step(metrics(0))
        assert other.unreported() == []  # only rank 0 reports
        saving = StepBoundaries(LoopbackExchange(), control=ControlRequests(), total_steps=9, every_steps=2)
        saving.after_step(metrics(0))
        saving.after_step(metrics(1))  # a save settles its own exchange: nothing left unreported
        assert saving.unreported() == []

    def test_a_boundary_that_fails_half_way_loses_no_record(self):
        """A save's boundary settles the step before it, then waits for its own exchange, which fails (a peer
        died): both steps are still handed over, in order."""

        class FailingAtStep(LoopbackExchange):
            def settle(self):
                if self.in_flight is not None and self.in_flight[1] == 3:
                    raise RuntimeError("Connection reset by peer")
                return super().settle()

        boundaries = StepBoundaries(FailingAtStep(), control=ControlRequests(), total_steps=9, every_steps=4)
        reported = []
        for step in range(3):
            reported += [record["step"] + 1 for record, _ in boundaries.after_step(metrics(step)).reports]
        with pytest.raises(RuntimeError):
            boundaries.after_step(metrics(3))  # step 4 saves: it settles step 3, then its own exchange fails
        assert reported == [1, 2]
        assert [record["step"] + 1 for record in boundaries.unreported()] == [3, 4]
