"""The control queue (service/runtime/control.py): cancel/scale delivered off the request thread, with retries;
and the chaos hand-over: orders for a job whose supervisor has not started are kept for its start."""

from __future__ import annotations

import threading
import time

import pytest

from etrain.service.errors import ServiceUnavailable
from etrain.service.runtime.control import ChaosHandOver, ControlQueue, ControlRequest, NotYet


class Recorder:
    """A ``deliver`` that fails (or says "not yet") a scripted number of times per job, then succeeds."""

    def __init__(self, failures: int = 0, not_yet: int = 0):
        self.failures, self.not_yet = failures, not_yet
        self.calls: list[ControlRequest] = []
        self.delivered = threading.Event()
        self.given_up: list[tuple[ControlRequest, str]] = []
        self.gave_up = threading.Event()

    def deliver(self, request: ControlRequest) -> None:
        self.calls.append(request)
        if self.not_yet:
            self.not_yet -= 1
            raise NotYet(request.job_id)
        if self.failures:
            self.failures -= 1
            raise TimeoutError("Ray did not answer within 10s")
        self.delivered.set()

    def give_up(self, request: ControlRequest, err: BaseException) -> None:
        self.given_up.append((request, str(err)))
        self.gave_up.set()


@pytest.fixture
def queue_of():
    queues = []

    def make(recorder: Recorder, **options) -> ControlQueue:
        options = {"retry_delay_s": 0.01, "defer_delay_s": 0.01, **options}
        queue = ControlQueue(recorder.deliver, on_give_up=recorder.give_up, **options)
        queues.append(queue)
        return queue

    yield make
    for queue in queues:
        queue.close(timeout_s=5)


def test_a_request_is_delivered_once_off_the_callers_thread(queue_of):
    recorder = Recorder()
    callers = []
    original = recorder.deliver

    def deliver(request):
        callers.append(threading.current_thread().name)
        original(request)

    recorder.deliver = deliver
    started = time.monotonic()
    queue_of(recorder).put(ControlRequest(job_id="j", action="cancel"))
    assert time.monotonic() - started < 0.05  # put never waits on the delivery
    assert recorder.delivered.wait(5)
    assert callers == ["etrain-control"] and recorder.given_up == []


def test_failures_are_retried_with_backoff_then_delivered(queue_of):
    recorder = Recorder(failures=2)
    queue_of(recorder).put(ControlRequest(job_id="j", action="scale", dp=4))
    assert recorder.delivered.wait(5)
    assert [call.tries for call in recorder.calls] == [0, 1, 2]
    assert {call.dp for call in recorder.calls} == {4} and recorder.given_up == []


def test_a_request_that_keeps_failing_is_given_up_and_reported(queue_of):
    recorder = Recorder(failures=10)
    queue_of(recorder, max_tries=3).put(ControlRequest(job_id="j", action="cancel"))
    assert recorder.gave_up.wait(5)
    assert len(recorder.calls) == 3
    assert [(request.job_id, request.tries, error) for request, error in recorder.given_up] == [
        ("j", 2, "Ray did not answer within 10s")
    ]


def test_not_yet_waits_without_spending_tries_but_not_forever(queue_of):
    recorder = Recorder(not_yet=5)
    queue_of(recorder, max_tries=1).put(ControlRequest(job_id="j", action="cancel"))
    assert recorder.delivered.wait(5)
    assert [call.deferrals for call in recorder.calls] == [0, 1, 2, 3, 4, 5]
    stuck = Recorder(not_yet=1000)
    queue_of(stuck, max_deferrals=3).put(ControlRequest(job_id="k", action="cancel"))
    assert stuck.gave_up.wait(5) and len(stuck.calls) == 4


def test_one_slow_job_does_not_stop_the_thread_from_serving_the_next(queue_of):
    recorder = Recorder(failures=1)  # the first job's delivery fails once and is retried later
    queue = queue_of(recorder, retry_delay_s=0.2)
    queue.put(ControlRequest(job_id="slow", action="cancel"))
    queue.put(ControlRequest(job_id="fast", action="cancel"))
    deadline = time.monotonic() + 5
    while len(recorder.calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [call.job_id for call in recorder.calls] == ["slow", "fast", "slow"]


def test_close_stops_the_thread(queue_of):
    queue = queue_of(Recorder())
    queue.close(timeout_s=5)
    assert not queue._thread.is_alive()


# --- the chaos hand-over ------------------------------------------------------------------------------------------


def test_kept_orders_go_to_the_start_in_order_and_only_once():
    hand_over = ChaosHandOver(wait_s=5)
    for rank in (1, 0):
        with hand_over.settled("job") as kept:
            kept.append({"action": "kill_rank", "rank": rank})
    with hand_over.handing_over("job") as requests:
        assert requests == ({"action": "kill_rank", "rank": 1}, {"action": "kill_rank", "rank": 0})
    with hand_over.handing_over("job") as requests:  # a second start (a lost supervisor's) gets nothing again
        assert requests == ()


def test_an_order_during_the_hand_over_waits_for_its_end():
    """So it sees the supervisor the start made instead of being kept for a start that already took the list."""
    hand_over = ChaosHandOver(wait_s=5)
    seen: list[float] = []

    def post() -> None:
        with hand_over.settled("job"):
            seen.append(time.monotonic())

    with hand_over.handing_over("job"):
        thread = threading.Thread(target=post)
        thread.start()
        time.sleep(0.2)
        assert seen == []  # blocked while the supervisor is being started
        ended_at = time.monotonic()
    thread.join(timeout=5)
    assert len(seen) == 1 and seen[0] >= ended_at


def test_a_hand_over_that_does_not_end_is_a_503_that_says_what_to_do():
    hand_over = ChaosHandOver(wait_s=0.1)
    with hand_over.handing_over("job"):
        with hand_over.settled("other-job") as kept:  # other jobs never wait for it
            assert kept == []
        with pytest.raises(ServiceUnavailable) as refused:
            with hand_over.settled("job"):
                pass
    assert refused.value.message == "the supervisor of job job is still starting after 0s; the order was not taken"
    assert refused.value.fix == "retry in a few seconds; if it persists, check the cluster (ray status)"


def test_dropped_orders_never_reach_a_start():
    hand_over = ChaosHandOver(wait_s=5)
    with hand_over.settled("job") as kept:
        kept.append({"action": "hang_rank", "rank": 0})
    hand_over.drop("job")
    with hand_over.handing_over("job") as requests:
        assert requests == ()
