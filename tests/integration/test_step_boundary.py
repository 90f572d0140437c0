"""All ranks save and stop at the same step, whenever the supervisor's request lands (real gloo groups).

Three spawned ranks run 20 trials in one process group. Each step is a real collective on the default
group (standing in for the training step, and checking that every rank is on the same step) followed
by the step-boundary exchange (``etrain.workers.rank.step_exchange.StepExchange``) on its own gloo group. A save is
another collective (as a DCP save is); a stop ends the trial. In every trial, every rank receives a
checkpoint request, and in every other trial a stop request, from a thread at its own random moment
(as a broadcast to all ranks would land), with the target a lagging supervisor would send (the
rank's last completed step + 1). Only rank 0's view counts.

The ranks follow ``etrain.workers.rank.step_control.StepBoundaries``, as the workers do: the exchange begun
after a step is settled at the next boundary, so a request acts one boundary after rank 0 takes it.

Asserted: in every trial every rank saved the same steps and stopped at the same step; rank 0's
request was saved within three boundaries after it landed; the deterministic schedule
(every 10 steps and the last) held; rank 0 saw every rank's exact timings at every step. And, so that
the test has teeth: the ranks' *own* views of the same requests (what each would have done deciding
alone, as before the exchange) disagreed in some trials.
"""

from __future__ import annotations

import random
import threading
import time

import torch
import torch.distributed as dist

from etrain.workers.rank.step_control import SAVE, STOP, ControlRequests, StepBoundaries, scheduled_save
from etrain.workers.rank.step_exchange import StepExchange
from tests.dist_utils import run_distributed

WORLD = 3
TRIALS = 20
STEPS = 30
EVERY = 10
TIMEOUT_S = 120.0


def _check_collective(value: float, world_size: int, what: str) -> None:
    """A collective every rank must enter with the same value: a rank at another step shows here."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    assert tensor.item() == value * world_size, f"{what}: ranks disagree (sum {tensor.item()}, mine {value})"


def _run_trials(rank: int, world_size: int, seed: int) -> list[dict]:
    exchange = StepExchange(world_size=world_size, timeout_s=TIMEOUT_S)
    out = []
    for trial in range(TRIALS):
        rng = random.Random(seed * 10_000 + trial * 100 + rank)  # this rank's pacing and delivery moments
        control = ControlRequests()  # what this rank received; acted on only on rank 0
        own_view = ControlRequests()  # the same requests, decided by this rank alone (never acted on)
        last_completed = [0]
        delivered: dict[str, int] = {}
        stop_trial = trial % 2 == 1

        def deliver(delay_s: float, what: str) -> None:
            time.sleep(delay_s)
            target = last_completed[0] + 1  # the supervisor's (lagging) view, + 1
            delivered[what] = last_completed[0]
            if what == "checkpoint":
                control.request_checkpoint(target)
                own_view.request_checkpoint(target)
            else:
                control.request_stop()
                own_view.request_stop()

        dist.barrier()
        threads = [threading.Thread(target=deliver, args=(rng.uniform(0.0, 0.08), "checkpoint"))]
        if stop_trial:
            threads.append(threading.Thread(target=deliver, args=(rng.uniform(0.02, 0.12), "stop")))
        for thread in threads:
            thread.start()
        saves, own_saves, stopped_at, own_stop, timings_checked = [], [], None, None, 0
        boundaries = StepBoundaries(
            exchange, control=control if rank == 0 else None, total_steps=STEPS, every_steps=EVERY
        )
        for step in range(STEPS):
            time.sleep(rng.uniform(0.001, 0.004))  # ranks run at different paces
            _check_collective(float(step), world_size, f"training step {step}")
            completed = step + 1
            metrics = {
                "step": step,
                "compute_s": rank + completed / 1000,
                "comm_wait_s": 0.001 * rank,
                "step_s": 0.004,
                "timing_synced": True,
                "peak_mem_bytes": 1000 * rank + completed,
                "host_mem_bytes": 2**30 * rank + completed,
            }
            # What this rank would do deciding alone on its own view of the same requests (never acted on).
            mine = own_view.decide_requests(completed, total_steps=STEPS) | (
                SAVE if scheduled_save(completed, total_steps=STEPS, every_steps=EVERY) else 0
            )
            decision = boundaries.after_step(metrics)
            records = [record for record, _ in decision.reports]
            last_completed[0] = completed
            for record in records:  # rank 0: every step's record, each with every rank's exact timings
                done = record["step"] + 1
                assert done == timings_checked + 1, (done, timings_checked)
                assert record["ranks"]["compute_s"] == [r + done / 1000 for r in range(world_size)]
                assert record["ranks"]["peak_mem_bytes"] == [1000 * r + done for r in range(world_size)]
                assert record["ranks"]["host_mem_bytes"] == [2**30 * r + done for r in range(world_size)]
                timings_checked += 1
            if rank == 0:
                mine = (SAVE if decision.save else 0) | (STOP if decision.stop else 0)
            if mine & SAVE:
                own_saves.append(completed)
            if mine & STOP and own_stop is None:
                own_stop = completed
            if decision.save:
                _check_collective(completed + 0.5, world_size, f"save at {completed}")
                saves.append(completed)
            if decision.stop:
                stopped_at = completed
                break
        for thread in threads:
            thread.join()
        out.append(
            {
                "saves": saves,
                "stopped_at": stopped_at,
                "own_saves": own_saves,
                "own_stop": own_stop,
                "delivered": dict(delivered),
                "timings_checked": timings_checked,
            }
        )
    return out


def test_every_rank_saves_and_stops_at_rank_zeros_step_in_20_random_trials():
    started = time.monotonic()
    by_rank = run_distributed(_run_trials, WORLD, 11, timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - started
    disagreements_own_view = 0
    acted, stops, saved_at = 0, 0, set()
    for trial in range(TRIALS):
        results = [by_rank[rank][trial] for rank in range(WORLD)]
        zero = results[0]
        # One decision for all ranks: the same saves and the same stop, on every rank.
        assert all(r["saves"] == zero["saves"] for r in results), (trial, [r["saves"] for r in results])
        assert all(r["stopped_at"] == zero["stopped_at"] for r in results), (trial, [r["stopped_at"] for r in results])
        end = zero["stopped_at"] or STEPS
        scheduled = [c for c in range(1, end + 1) if c % EVERY == 0 or c == STEPS]
        assert set(scheduled) <= set(zero["saves"]), (trial, zero["saves"])
        # Rank 0's checkpoint request: saved at the first or second boundary after it landed.
        landed = zero["delivered"]["checkpoint"]
        if landed + 3 <= end:
            # Taken by rank 0 at the first or second boundary after it landed, acted on at the next one.
            # (A trial a stop ends before landed + 3 may end first: the stop is not held for the save.)
            assert {landed + 2, landed + 3} & set(zero["saves"]), (trial, landed, zero["saves"])
            acted += 1
            saved_at.add(landed)
        extra = set(zero["saves"]) - set(scheduled)
        assert len(extra) <= 1, (trial, zero["saves"])
        if trial % 2 == 1 and zero["stopped_at"] is not None:
            stops += 1
            assert zero["stopped_at"] in (zero["delivered"]["stop"] + 2, zero["delivered"]["stop"] + 3)
        if trial % 2 == 0:
            assert zero["stopped_at"] is None
        assert zero["timings_checked"] == end
        # What each rank would have done alone, acting on its own view of the same requests.
        if any(r["own_saves"] != zero["saves"] or r["own_stop"] != zero["stopped_at"] for r in results[1:]):
            disagreements_own_view += 1
    assert acted >= 15, acted  # requests landed mid-run in most trials...
    assert len(saved_at) >= 5, saved_at  # ...at many different steps
    assert stops >= 7, stops
    assert disagreements_own_view >= 3, disagreements_own_view  # deciding alone, ranks would have split
    assert elapsed < TIMEOUT_S
