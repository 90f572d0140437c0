"""Which rank a hung job waits for (service/decisions/hangs.py), from the ranks' own reports."""

from __future__ import annotations

import pytest

from etrain.service.decisions.hangs import Frame, RankWhere, find_culprit, format_frames, waits_on_peers

LOOP = Frame("/x/workers/rank/worker.py", 262, "_train")
STEP = Frame("/x/workers/engine/train.py", 310, "train_step")
DRILL = Frame("/x/workers/rank/chaos.py", 125, "on_compute")
BACKWARD = Frame("/usr/lib/python3/site-packages/torch/autograd/graph.py", 824, "_engine_run_backward")
ALL_REDUCE = Frame("/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", 2800, "all_reduce")
EXCHANGE = Frame("/x/workers/rank/step_exchange.py", 88, "wait")
LOADER = Frame("/x/workers/data/text_files.py", 40, "read")
HOST_READ = Frame("/x/workers/engine/host_read.py", 21, "read_on_host")  # an NCCL rank behind its peers' kernels


def at(step, *frames):
    return RankWhere(step=step, frames=(LOOP, STEP, *frames))


@pytest.mark.parametrize(
    "frames,waiting",
    [
        ((BACKWARD,), True),  # DDP / FSDP collectives run inside backward
        ((ALL_REDUCE,), True),
        ((EXCHANGE,), True),  # etrain's step-boundary exchange waits in its own code
        ((HOST_READ,), True),  # on NCCL the host waits for its peers where it reads the loss
        ((Frame("C:\\py\\torch\\distributed\\distributed_c10d.py", 1, "barrier"),), True),
        ((DRILL,), False),
        ((LOADER,), False),
        ((), False),
    ],
)
def test_a_rank_waits_on_peers_only_inside_communication(frames, waiting):
    assert waits_on_peers(frames) is waiting


def test_the_one_rank_outside_any_collective_is_the_culprit_with_its_frames():
    verdict = find_culprit({0: at(6, DRILL), 1: at(6, BACKWARD), 2: at(6, BACKWARD), 3: at(6, ALL_REDUCE)})
    assert verdict.rank == 0 and verdict.frames[-1] == DRILL
    assert verdict.detail == (
        "rank 0 stopped at step 6 outside any collective (3 rank(s) wait in collectives); its stack: "
        "/x/workers/rank/chaos.py:125 in on_compute; /x/workers/engine/train.py:310 in train_step; "
        "/x/workers/rank/worker.py:262 in _train"
    )


def test_on_nccl_the_ranks_behind_the_stopped_one_wait_in_the_host_read_and_it_is_named():
    """An NCCL collective blocks no host thread: the waiting ranks sit in the step's read of the loss. Were
    that counted as stopping, the lowest of them would be named instead of the rank in its data loader."""
    verdict = find_culprit({0: at(6, HOST_READ), 1: at(6, HOST_READ), 2: at(6, LOADER), 3: at(6, HOST_READ)})
    assert verdict.rank == 2 and verdict.detail.startswith("rank 2 stopped at step 6 outside any collective")
    assert find_culprit({0: at(6, HOST_READ), 1: at(6, HOST_READ)}).rank is None  # a device hung in a kernel


def test_the_host_read_the_diagnosis_knows_is_the_one_the_step_calls():
    from etrain.workers.engine import host_read, train

    assert waits_on_peers((Frame(host_read.__file__, 21, host_read.read_on_host.__name__),))
    assert train.read_on_host is host_read.read_on_host


def test_of_several_stopped_ranks_the_one_furthest_behind_then_the_lowest_is_named():
    assert find_culprit({0: at(7, LOADER), 1: at(6, LOADER), 2: at(7, BACKWARD)}).rank == 1
    assert find_culprit({0: at(7, BACKWARD), 1: at(6, LOADER), 2: at(6, DRILL)}).rank == 1
    assert find_culprit({0: RankWhere(step=None, frames=(LOADER,)), 1: at(1, LOADER)}).rank == 0


def test_a_silent_rank_is_the_culprit_when_the_others_wait():
    verdict = find_culprit({0: at(6, BACKWARD), 1: None, 2: at(6, EXCHANGE)})
    assert verdict.rank == 1 and verdict.frames == ()
    assert verdict.detail.startswith("rank 1 did not answer")
    # A stopped rank that answered says more than a silent one.
    assert find_culprit({0: None, 1: at(6, LOADER), 2: at(6, BACKWARD)}).rank == 1


@pytest.mark.parametrize(
    "reports,detail",
    [
        ({0: at(6, BACKWARD), 1: at(6, ALL_REDUCE)}, "all 2 ranks wait in collectives"),
        ({0: None, 1: None}, "no rank answered (2 asked)"),
    ],
)
def test_no_single_culprit_when_every_rank_waits_or_none_answers(reports, detail):
    verdict = find_culprit(reports)
    assert verdict.rank is None and verdict.detail.startswith(detail)


def test_frames_are_shown_innermost_first_and_bounded():
    frames = [Frame(f"f{i}.py", i, f"fn{i}") for i in range(10)]
    assert format_frames(frames, limit=2) == "f9.py:9 in fn9; f8.py:8 in fn8"
