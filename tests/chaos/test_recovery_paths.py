"""Issue #9 acceptance: the chaos suite on the new recovery paths ends where the clean run ends.

A kill during a checkpoint write, a kill during the commit, two failures in a row, a failure of the
replacement itself, the processes of a whole replica dying at once and a killed rank of a context-parallel job, each on a real multi-node Ray cluster through the chaos API (``during`` moves a kill
into a save: workers/rank/worker.py ``TrainWorker._save``). Every run is repaired in place (the default) and
must end exactly where the uninterrupted run ends: the same loss at every step (fp32, deterministic)
and the same final parameters on every rank (the ``ranks_finished`` digests). Each test also pins the
number of restarts, the step every attempt resumed from and where each rank's state came from: the
survivor's live state at the step it completed last (DDP: nothing recomputed), which the replacement
receives from it.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.chaos.conftest import (
    assert_only_committed_steps_left,
    assert_repaired_in_place,
    clean_run,
    fired,
    losses,
    param_digests,
    recover,
    restored,
    resumed_from,
    spec,
)
from tests.service_harness import event_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def clean(shared_plane):
    """The uninterrupted DP2 run (24 steps, a checkpoint every 4): losses by step and final digests."""
    run = clean_run(shared_plane, spec("clean-dp2"))
    assert sorted(run.digests) == [0, 1] and len(set(run.digests.values())) == 1, run.digests  # DP replicas agree
    return run


def assert_ends_like_clean(plane, job: dict, clean) -> None:
    recovered = losses(plane, job["id"])
    assert sorted(recovered) == sorted(clean.losses) == list(range(1, 25))
    worst = max(abs(recovered[s] - clean.losses[s]) for s in clean.losses)
    assert worst <= 1e-6, f"max |loss - clean loss| = {worst:.3g}"
    assert param_digests(plane, job["id"]) == clean.digests


def committed(events: list[dict]) -> list[int]:
    """Committed steps in the order their commits were recorded."""
    return [int(event_text(e).split()[1].rstrip(",")) for e in events if e["kind"] == "checkpoint_committed"]


def test_kill_during_a_checkpoint_write_resumes_from_memory_and_saves_that_step_again(shared_plane, clean):
    plane = shared_plane
    # Rank 1 dies inside step 12's save, its shards written but never reported: rank 0 reported, the
    # step can never commit. Rank 0 holds step 12 in memory, so the repair resumes there (the last
    # commit, step 8, is only the floor) and the new attempt makes step 12's save again first.
    final, events = recover(
        plane, spec("write-kill-dp2"), {"action": "kill_rank", "rank": 1, "at_step": 10, "during": "checkpoint_write"}
    )
    kinds = assert_repaired_in_place(final, events, times=1)
    assert fired(events) == ["kill_rank on rank 1 at step 12 during checkpoint_write (order 1)"]
    assert resumed_from(events) == [None, 8]  # the floor the repair was planned from
    # Step 12 was committed once, after the repair, by attempt 2 (never from attempt 1's partial save).
    before = committed(events[: kinds.index("repairing")])
    assert before == [4, 8], before
    assert committed(events) == [4, 8, 12, 16, 20, 24]
    assert restored(events) == ["attempt 2, step 12: ranks 0 from own memory; ranks 1 from rank 0's memory"]
    # Both ranks write step 12 again from the copy they resumed from, in the background (the replacement from
    # the copy it received), not from a blocking save of the live state.
    for rank in (0, 1):
        lines = plane.client.get(f"/v1/jobs/{final['id']}/logs", params={"rank": rank, "tail": 1000}).json()["lines"]
        again = [line for line in lines if "checkpoint step 12 " in line and "(again, after the repair)" in line]
        assert len(again) == 1 and "save started from the copy in memory" in again[0], (rank, again)
    assert [row["step"] for row in plane.steps(final["id"])] == list(range(1, 25))  # none run twice
    assert_ends_like_clean(plane, final, clean)
    assert assert_only_committed_steps_left(plane, final["id"]) == [16, 20, 24]  # keep_last 3


def test_kill_during_the_commit_resumes_from_the_step_it_reported(shared_plane, clean):
    plane = shared_plane
    # Rank 0 dies right after the supervisor accepted its report of step 12. Rank 1 (one shard file to
    # hash against rank 0's three) has reported by then, so the report completes the step: the commit
    # happens around a dead rank, and the repair resumes from step 12 with nothing recomputed.
    final, events = recover(
        plane, spec("commit-kill-dp2"), {"action": "kill_rank", "rank": 0, "at_step": 10, "during": "checkpoint_commit"}
    )
    kinds = assert_repaired_in_place(final, events, times=1)
    assert fired(events) == ["kill_rank on rank 0 at step 12 during checkpoint_commit (order 1)"]
    assert committed(events[: kinds.index("repairing")]) == [4, 8, 12]
    assert resumed_from(events) == [None, 12]
    assert committed(events) == [4, 8, 12, 16, 20, 24]
    # The replacement rank 0 gets step 12 from its data-parallel replica's memory.
    assert restored(events) == ["attempt 2, step 12: ranks 0 from rank 1's memory; ranks 1 from own memory"]
    # Step 12 is reported once by attempt 1; attempt 2 starts at step 13.
    steps = [row["step"] for row in plane.steps(final["id"])]
    assert steps == list(range(1, 25)), steps
    assert_ends_like_clean(plane, final, clean)


def test_two_failures_in_a_row_are_each_repaired_in_place(shared_plane, clean):
    plane = shared_plane
    final, events = recover(
        plane,
        spec("two-kills-dp2"),
        {"action": "kill_rank", "rank": 1, "at_step": 10},
        {"action": "kill_rank", "rank": 0, "at_step": 18},
    )
    kinds = assert_repaired_in_place(final, events, times=2)  # never a full relaunch
    assert fired(events) == ["kill_rank on rank 1 at step 10 (order 1)", "kill_rank on rank 0 at step 18 (order 2)"]
    assert kinds.count("worker_failed") == 2
    assert resumed_from(events) == [None, 8, 16]
    # The first repair resumes where the kill stopped the survivor (step 10, past the commit at 8). The second
    # kill takes rank 0, which reports the steps: the survivor holds step 18, but the repair resumes no later
    # than the last step whose report reached the supervisor (16 to 18: rank 0 sends its reports in batches),
    # so no step goes unrecorded. It draws on the first repair's replacement: rank 0 is restored from rank 1.
    first, second = restored(events)
    assert first == "attempt 2, step 10: ranks 0 from own memory; ranks 1 from rank 0's memory"
    assert re.fullmatch(r"attempt 3, step 1[678]: ranks 0 from rank 1's memory; ranks 1 from own memory", second), (
        second
    )
    assert_ends_like_clean(plane, final, clean)


def test_the_processes_of_a_whole_replica_dying_at_once_are_all_replaced_in_one_repair(shared_plane, clean):
    """A GPU fault, the OOM killer or a crashed host agent takes several processes of a node at once while the
    node stays up: here both ranks of one replica of a dp2·tp2 job (ranks 2 and 3, one tp group, one node) die
    at the same step. Both are replaced in the same in-place repair, each from the memory of its replica in
    the other tp group (rank 0 serves rank 2, rank 1 serves rank 3), and nothing is recomputed. Before, the
    second death failed the repair over to a relaunch of every rank from the last commit."""
    plane = shared_plane
    final, events = recover(
        plane,
        spec("replica-dies-dp2-tp2", tp=2),
        {"action": "kill_rank", "rank": 2, "at_step": 10},
        {"action": "kill_rank", "rank": 3, "at_step": 10},
    )
    kinds = assert_repaired_in_place(final, events, times=1)  # one restart for the one fault, no relaunch
    assert "repair_failed" not in kinds, kinds
    assert sorted(fired(events)) == [
        "kill_rank on rank 2 at step 10 (order 1)",
        "kill_rank on rank 3 at step 10 (order 2)",
    ]
    failed = [event_text(e) for e in events if e["kind"] == "worker_failed"]
    assert len(failed) == 2 and "lost as well" in failed[1] and "replaced in the same in-place repair" in failed[1]
    assert {int(re.match(r"rank (\d+)", text).group(1)) for text in failed} == {2, 3}, failed
    assert restored(events) == [
        "attempt 2, step 10: ranks 0,1 from own memory; ranks 2 from rank 0's memory; ranks 3 from rank 1's memory"
    ]
    assert [row["step"] for row in plane.steps(final["id"])] == list(range(1, 25))  # none run twice
    recovered = losses(plane, final["id"])
    assert sorted(recovered) == sorted(clean.losses)
    worst = max(abs(recovered[s] - clean.losses[s]) for s in clean.losses)
    assert worst <= 1e-5, f"max |loss - clean loss| = {worst:.3g}"  # tp2 against DDP: another reduction order


def test_a_killed_rank_of_a_context_parallel_job_is_repaired_in_place_from_a_replicas_memory(shared_plane, clean):
    """Context parallelism (dp2·cp2: each replica's sequences split over a cp pair whose ring runs between
    them): rank 1, the second cp rank of the first replica, is SIGKILLed. The repair replaces it in place
    from the memory of a rank with the same state (DDP keeps the parameters whole on every dp·cp rank:
    before, only its dp peer, rank 3, counted as its replica), nothing is recomputed, and the run ends on the
    clean run's losses (within the tolerance of another reduction order). A survivor left waiting in the
    ring on a cp peer that has left the attempt (rank 3 on rank 2: on gloo such a wait never fails) is
    replaced as stuck in the same repair and gets its state from memory too."""
    plane = shared_plane
    final, events = recover(
        plane, spec("kill-dp2-cp2", parallelism={"cp": 2}), {"action": "kill_rank", "rank": 1, "at_step": 10}
    )
    assert_repaired_in_place(final, events, times=1)
    (source,) = restored(events)
    found = re.fullmatch(
        r"attempt 2, step 10: ranks ([\d,]+) from own memory; ranks ([\d,]+) from rank \d's memory", source
    )
    assert found, source
    own, received = ({int(rank) for rank in ranks.split(",")} for ranks in found.groups())
    assert 1 in received and own | received == {0, 1, 2, 3} and {0, 2} <= own, source
    assert [row["step"] for row in plane.steps(final["id"])] == list(range(1, 25))  # none run twice
    recovered = losses(plane, final["id"])
    worst = max(abs(recovered[s] - clean.losses[s]) for s in clean.losses)
    assert worst <= 1e-5, f"max |loss - clean loss| = {worst:.3g}"


def test_a_failure_of_the_replacement_itself_is_repaired_again(shared_plane, clean):
    plane = shared_plane
    # Both orders armed up front: the first kills rank 1 at step 10; the second, still pending, travels
    # in the repair's launch plan to the replacement and kills it at step 11, one step after it resumed.
    final, events = recover(
        plane,
        spec("replacement-kill-dp2"),
        {"action": "kill_rank", "rank": 1, "at_step": 10},
        {"action": "kill_rank", "rank": 1, "at_step": 11},
    )
    kinds = assert_repaired_in_place(final, events, times=2)
    assert fired(events) == ["kill_rank on rank 1 at step 10 (order 1)", "kill_rank on rank 1 at step 11 (order 2)"]
    # The second order fired in the replacement: after the first repair's group was up again.
    second_fired = [i for i, kind in enumerate(kinds) if kind == "chaos_fired"][1]
    assert kinds.index("restored") < second_fired, kinds
    assert resumed_from(events) == [None, 8, 8]  # no commit after step 8 before the replacement died
    assert restored(events) == [
        "attempt 2, step 10: ranks 0 from own memory; ranks 1 from rank 0's memory",
        "attempt 3, step 11: ranks 0 from own memory; ranks 1 from rank 0's memory",
    ]
    assert_ends_like_clean(plane, final, clean)


def test_a_replacement_loads_shared_compiled_code_only_as_its_writer_reported_it(shared_plane, clean):
    """``training.compile``: the supervisor names each stage's compiled code, as its writer reported it, in
    every later plan, and a replacement rank reads it before its first step. Here the set named for stage 0
    was replaced in the checkpoint folder after it was reported: the replacement refuses it (a file only the
    job's tenant can write there is never run), compiles instead, and the job ends like the clean run. The
    sharing with real inductor code is in tests/integration/test_throughput_options.py; the rank and
    supervisor ends are joined here."""
    import hashlib

    import ray

    from etrain.service.runtime.supervisor_actor import find_supervisor

    plane = shared_plane
    job = plane.submit(spec("compile-share-dp2", training={"compile": True}))
    plane.chaos(job["id"], action="kill_rank", rank=1, at_step=12)
    deadline = time.monotonic() + 60
    # The supervisor exists once the job is admitted, seconds before its ranks start.
    while (supervisor := find_supervisor(job["id"])) is None:
        assert time.monotonic() < deadline, "no supervisor within 60 s"
        time.sleep(0.05)
    reported, planted = b"the set rank 0 wrote", b"what the tenant put in its place"
    digest = hashlib.sha256(reported).hexdigest()
    folder = plane.data_dir / "checkpoints" / job["id"] / "compile-cache"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{digest}.bin").write_bytes(planted)
    ray.get(supervisor.report_compile_artifacts.remote(1, 0, {"stage": 0, "sha256": digest, "size": len(reported)}))
    # A malformed report is dropped, not kept for a later plan.
    ray.get(supervisor.report_compile_artifacts.remote(1, 0, {"stage": 0, "sha256": "../x", "size": 1}))

    final = plane.wait_terminal(job["id"], timeout_s=300)
    assert final["status"] == "SUCCEEDED" and final["restarts"] == 1, final
    lines = plane.client.get(f"/v1/jobs/{job['id']}/logs", params={"rank": 1, "tail": 1000}).json()["lines"]
    refused = [line for line in lines if "attempt 2: compile cache not loaded (compiling instead)" in line]
    assert len(refused) == 1 and "is not the set its writer reported" in refused[0], lines
    assert digest[:12] in refused[0] and hashlib.sha256(planted).hexdigest()[:12] in refused[0], refused
    recovered = losses(plane, job["id"])
    assert sorted(recovered) == list(range(1, 25))
    worst = max(abs(recovered[s] - clean.losses[s]) for s in clean.losses)
    assert worst <= 1e-5, f"max |loss - clean loss| = {worst:.3g}"  # aot_eager runs eager's aten ops
    # each attempt's compile is a job event: rank 0's seconds, its first step, and how the blocks compiled
    compiled = [event_text(e) for e in plane.events(job["id"]) if e["kind"] == "compiled"]
    assert len(compiled) == 2 and all(
        text.startswith("rank 0: compile ") and "each block is one compiled graph" in text for text in compiled
    ), compiled
